"""Modules over weights kept in a GGUF block format (runtime/formats/qtensor.py): the linear layers, the
embedding lookup and the output head of a model run "as the file is" on the CPU.

Activations are fp32 [rows, features]; every product goes through `qtensor.qlinear`, whose result
for a row does not depend on how many rows share the call, so verifying k+1 drafted tokens gives
each row exactly what decoding it alone would (speculation stays lossless on these weights).

A fused projection (q/k/v, gate/up) keeps one product per run of parts with the same format:
llama.cpp's Q4_K_M files mix Q4_K and Q6_K (v and down of some layers are Q6_K), and only
same-format blocks can be concatenated. A part stored dense in the file (F32/F16/BF16 weights of
a type the kernels do not take) stays a dense fp32 tensor and goes through the CPU linear routes.
None of these modules hold parameters: their weights often wrap the file's read-only memory map,
which `nn.Module.to(...)` must never copy.
"""
from __future__ import annotations

import torch
from torch import nn

from specfleet.runtime.backends.native import kernels as native_backend

from specfleet.runtime.formats import qtensor
from specfleet.runtime.backends.cpu import cpu_linear
from specfleet.runtime.formats.qtensor import QTensor, qlinear

Weight = QTensor | torch.Tensor


def weight_nbytes(w: Weight) -> int:
    return int(w.nbytes) if isinstance(w, QTensor) else w.numel() * w.element_size()


def fuse(parts: list[Weight]) -> list[Weight]:
    """Concatenate neighbouring parts of the same format: [Q4_K, Q4_K, Q6_K] -> [Q4_K (both), Q6_K]."""
    runs: list[list[Weight]] = []
    for w in parts:
        if runs and _same_format(runs[-1][-1], w):
            runs[-1].append(w)
        else:
            runs.append([w])
    return [run[0] if len(run) == 1 else _cat(run) for run in runs]


def _same_format(a: Weight, b: Weight) -> bool:
    if isinstance(a, QTensor) and isinstance(b, QTensor):
        return a.qtype == b.qtype
    return not isinstance(a, QTensor) and not isinstance(b, QTensor)


def _cat(run: list[Weight]) -> Weight:
    return QTensor.cat(run) if isinstance(run[0], QTensor) else torch.cat([w.float() for w in run])


def _product(x: torch.Tensor, w: Weight, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(w, QTensor):
        return qlinear(x, w, bias)
    return cpu_linear(x, w, bias, 0, True)


class QLinear(nn.Module):
    """y [rows, out] = x [rows, in] @ W^T + bias, W the concatenation of `parts` (fp32 in, fp32 out)."""

    def __init__(self, parts: list[Weight], bias: torch.Tensor | None = None):
        super().__init__()
        fused = fuse([w if isinstance(w, QTensor) else w.float().contiguous() for w in parts])
        widths = [int(w.shape[0]) for w in fused]
        self.in_features = int(fused[0].shape[1])
        self.out_features = sum(widths)
        biases = [None] * len(fused) if bias is None else list(bias.float().contiguous().split(widths))
        self.parts = list(zip(fused, biases))  # plain attributes: see the module docstring
        self._single = self.parts[0] if len(self.parts) == 1 else None
        self._head_rows: dict[int, Weight] = {}
        # every part in a block format: one native call computes them all (csrc/fused_linear.c), through the
        # library taken here, when the layer is made (None where no native path runs: a product per part)
        self.all_quantized = all(isinstance(w, QTensor) for w, _ in self.parts)
        self.lib = native_backend.library() if self.all_quantized else None
        self._cparts = None

    @property
    def weight_nbytes(self) -> int:
        return sum(weight_nbytes(w) for w, _ in self.parts)

    @property
    def formats(self) -> list[str]:
        return [w.qtype.name if isinstance(w, QTensor) else "F32" for w, _ in self.parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] fp32 -> [rows, out] fp32
        lib = self.lib
        if (lib is not None and x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu"
                and x.shape[1] == self.in_features):
            # one call for every part, bit for bit what the per-part products and the cat give
            return self.fused(lib, x.contiguous(), torch.empty((x.shape[0], self.out_features), dtype=torch.float32))
        if self._single is not None:
            return _product(x, *self._single)
        return torch.cat([_product(x, w, b) for w, b in self.parts], dim=-1)

    def native_parts(self):
        """The ctypes array of this layer's parts for the native calls (made once; see `fused`)."""
        if self._cparts is None:
            self._cparts = qtensor.fused_parts(self.parts)
        return self._cparts

    def fused(self, lib, x: torch.Tensor, y: torch.Tensor, pre: int = native_backend.PRE_NONE,
              pre_weight: torch.Tensor | None = None, eps: float = 0.0, accumulate: bool = False) -> torch.Tensor:
        """`qtensor.run_fused` over this layer's parts (all QTensors; `lib` from `native_backend.library()`): y
        [rows, out_features] (=, or += with `accumulate`) pre(x) @ W^T + bias. No checks: the caller
        (runtime/model/decoder.py's native layer path) has made them."""
        if self._cparts is None:
            self._cparts = qtensor.fused_parts(self.parts)
        return qtensor.run_fused(lib, self._cparts, len(self.parts), self.in_features, x, y, pre, pre_weight, eps,
                                 accumulate)

    def matmul(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """The head's logits [n, out], or over only the first `rows` outputs (a draft's reduced vocabulary)."""
        if rows is None or rows >= self.out_features:
            return self.forward(x)
        if self._single is None or self._single[1] is not None:
            raise ValueError("a reduced head needs a single weight without bias")
        w = self._head_rows.get(rows)
        if w is None:
            w = self._single[0]
            w = w.select_rows(torch.arange(rows)) if isinstance(w, QTensor) else w[:rows]
            self._head_rows[rows] = w
        return _product(x, w, None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, formats={self.formats}"


class QEmbedding(nn.Module):
    """Token embeddings kept in the file's format; a lookup dequantizes only the rows it reads."""

    def __init__(self, weight: QTensor):
        super().__init__()
        self.weight_q = weight
        self.num_embeddings, self.embedding_dim = (int(d) for d in weight.shape)

    @property
    def weight_nbytes(self) -> int:
        return weight_nbytes(self.weight_q)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [n] int64 -> [n, hidden] fp32
        return self.weight_q.dequantize_rows(ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.weight_q.qtype.name}"
