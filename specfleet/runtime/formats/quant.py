"""Weight-only int8 quantization of a built model (opt-in: `LLM(..., quantization="int8")`).

Why: on CPUs without native bf16 matrix instructions (AVX2-only, no AVX512-BF16/AMX) a bf16 linear
layer is memory-bound for one row but compute-bound from a few rows on, so verifying k+1 draft tokens
costs nearly k+1 single-token steps and speculation cannot pay. PyTorch's packed int8 x float
kernel (`aten._weight_int8pack_mm`) reads half the bytes of bf16 and keeps several rows far cheaper
(measured in benchmarks/results/). Activations, norms, attention, the KV cache and the embeddings stay
in the model's dtype.

Scheme: symmetric per-output-channel int8, scale = max|w_row| / 127, w ~= q * scale. A quantized
model is a different model from the bf16 one, so speculative decoding with it is lossless against
*its own* autoregressive output (that is what the tests check), not against the unquantized target.
The head is quantized too (for tied embeddings a separate int8 copy is made; the embedding lookup
keeps the full-precision table).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specfleet.errors import InvalidRequestError
from specfleet.runtime.backends.cpu import sliced_upcast_linear

# auto: "gguf" for a GGUF file on the CPU, else "none". gguf: a GGUF file's block formats kept as they are
# (runtime/formats/qlinear.py, fp32 activations). none: dense weights in the model's dtype. int8: this module.
# q4_0/q8_0/q4_k: every matrix requantized into that GGUF format at load, then run like "gguf".
QUANTIZATIONS = ("auto", "gguf", "none", "int8", "q4_0", "q8_0", "q4_k")
BLOCK_FORMATS = ("gguf", "q4_0", "q8_0", "q4_k")  # the modes that run on runtime/formats/qtensor.py's kernels


def parse_quantization(value: str | None) -> str | None:
    """The canonical mode: None for "none" (dense), else one of QUANTIZATIONS; None in -> None out."""
    if value is None or value == "none":
        return None
    if not isinstance(value, str) or value.lower() not in QUANTIZATIONS:
        raise InvalidRequestError(f"unknown quantization {value!r}; choose one of {', '.join(QUANTIZATIONS)}")
    return value.lower()


def resolve_quantization(mode: str | None, is_gguf: bool, device: torch.device) -> str | None:
    """What `mode` (from parse_quantization; "auto" when the user chose nothing) means for one model:
    None (dense), "int8", or a block-format mode, which needs the CPU and the native kernels.
    Where those kernels cannot run, a block-format mode falls back to dense weights with the reason logged."""
    import logging

    if mode == "auto":
        mode = "gguf" if is_gguf and device.type == "cpu" else None
    if mode not in BLOCK_FORMATS:
        return mode
    if mode == "gguf" and not is_gguf:
        raise InvalidRequestError("quantization 'gguf' keeps a GGUF file's formats, but this model is not a .gguf "
                                  "file; use none, int8 or one of q4_0, q8_0, q4_k")
    if device.type != "cpu":
        raise InvalidRequestError(f"quantization {mode!r} runs on the CPU only; on {device.type} use 'none' "
                                  "(dense weights in --dtype) or 'int8'")
    try:
        from specfleet.runtime.backends.native import kernels as native_backend

        reason = None if native_backend.available() else native_backend.unavailable_reason()
    except ImportError as e:  # gguf-py missing from the environment
        reason = f"the native backend cannot be imported: {e}"
    if reason is not None:
        logging.getLogger(__name__).warning(
            "quantization %r: the native GGUF kernels are unavailable (%s); loading dense weights instead",
            mode, reason)
        return None
    return mode


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in], fp32 scales [out]), symmetric per row; all-zero rows get scale 1."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    return q, scale


# rows from which the sliced fp32 product (runtime/backends/cpu.py) beats the packed kernel: measured cost
# against one int8 row, packed -> sliced: 8 rows 3.5 -> 4.6, 16 rows 6.7 -> 5.9, 32 rows 13.5 -> 9.2
INT8_SLICED_ROWS = 16


def _has_packed_kernel(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")


class Int8Linear(nn.Module):
    """y = x @ (q * scale)^T + bias with q int8; same call signature as nn.Linear."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.qweight = nn.Parameter(qweight.contiguous(), requires_grad=False)
        self.scale = nn.Parameter(scale.to(dtype).contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.packed = _has_packed_kernel(qweight.device)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        q, s = quantize_rows(linear.weight)
        return cls(q, s, linear.bias, linear.weight.dtype)

    def dequantized(self) -> torch.Tensor:
        return self.qweight.to(self.scale.dtype) * self.scale[:, None]

    def matmul(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out] (or only the first `rows` output channels, for a draft's reduced head)."""
        q, s = (self.qweight, self.scale) if rows is None else (self.qweight[:rows], self.scale[:rows])
        shape = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != s.dtype:
            x2 = x2.to(s.dtype)
        if self.packed and x2.shape[0] >= INT8_SLICED_ROWS:  # prefill chunks, big trees and batches
            y = (sliced_upcast_linear(x2, q, None) * s.float()).to(s.dtype)
        elif self.packed and x2.shape[0] > 0:
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), q, s)
        else:  # other devices: dequantize on the fly (correct, not the fast path)
            y = F.linear(x2, q.to(s.dtype)) * s
        return y.reshape(*shape, q.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def quantize_model(model: nn.Module, mode: str | None) -> nn.Module:
    """Replace the transformer's linear layers (and the head) by int8 ones, in place; returns the model."""
    mode = parse_quantization(mode)
    if mode != "int8" or getattr(model, "quantization", None) == mode:  # other modes act at load
        return model
    if getattr(model, "quantization", None):
        raise InvalidRequestError(f"model is already quantized as {model.quantization}")
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = Int8Linear.from_linear(attn.qkv_proj)
        attn.o_proj = Int8Linear.from_linear(attn.o_proj)
        mlp.gate_up_proj = Int8Linear.from_linear(mlp.gate_up_proj)
        mlp.down_proj = Int8Linear.from_linear(mlp.down_proj)
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    q, s = quantize_rows(head)
    model.head_q = Int8Linear(q, s, None, head.dtype)
    model.lm_head = None  # tied or not, logits now come from head_q
    model.quantization = mode
    return model
