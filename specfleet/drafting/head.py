"""A feature-conditioned draft head (EAGLE-style): one decoder layer over the target's own features.

The target's final hidden state f_i (after its final norm, the row its head reads; the executor hands
these rows on at no extra forward, core/features.py) knows far more about what comes next than any
token-level draft. The head reads (f_i, embedding of t_{i+1}) and predicts the target's next feature
f_{i+1} and its greedy token y_{i+1} (= t_{i+2} under greedy decoding):

    x = fc([embed(t_{i+1}), f_i])                      2H -> H
    x = x + attn(norm1(x))   (its own small KV cache, causal over the request's positions)
    x = x + mlp(norm2(x))    (an intermediate width of its own)
    f^ = final_norm(x)       (initialised from the target's final norm: f^ lives where f lives)
    logits = lm(f^)          (a reduced vocabulary: the most frequent target tokens, rows copied from
                              the target's head; token_map takes them back to target ids)

Drafting a chain: the first token comes from the last committed position's real feature; deeper tokens
feed the head's own f^ back as the feature (trained for that with EAGLE-3's "training-time test",
distill/head_train.py). The chain stops where the head's path probability falls below `min_prob`.

At inference every matrix is requantized to Q8_0 and runs through the runtime's block-format kernels
(a decode-sized product there reads a quarter of the fp32 bytes); norms, rotary and attention are torch.
The artifact (distill/head_train.py writes it) is cached under `cache_root()/heads/` keyed like the GGUF
tokenizer cache and carries the target file's sha256, checked when it is found (`find_head`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import pickle
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specfleet.core.features import features_of
from specfleet.core.proposer import Feedback, RequestView
from specfleet.core.tree import DraftTree
from specfleet.core.verify import draw
from specfleet.errors import InvalidRequestError
from specfleet.runtime.sample.sampling import GeneratorStore, target_probs

logger = logging.getLogger(__name__)
FORMAT_VERSION = 1


@dataclass
class HeadConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    vocab_size: int  # the target's
    draft_vocab: int  # rows of the reduced head

    @classmethod
    def from_dict(cls, d: dict) -> "HeadConfig":
        return cls(**{f.name: d[f.name] for f in fields(cls)})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class FeatureHead(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.norm1 = RMSNorm(h, cfg.rms_norm_eps)
        self.qkv = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o = nn.Linear(self.q_size, h, bias=False)
        self.norm2 = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.final_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm = nn.Linear(h, cfg.draft_vocab, bias=False)
        self.register_buffer("token_map", torch.zeros(cfg.draft_vocab, dtype=torch.long))
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    # -- pieces ------------------------------------------------------------------------------------
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., D] of `positions`, from a table grown on demand (not a buffer: not saved)."""
        need = int(positions.max()) + 1 if positions.numel() else 1
        table = getattr(self, "_rope_table", None)
        if table is None or table[0].shape[0] < need or table[0].device != positions.device:
            size = max(need, 4096, 2 * (0 if table is None else table[0].shape[0]))
            freqs = torch.arange(size, dtype=torch.float32, device=positions.device)[:, None] * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            table = self._rope_table = (emb.cos(), emb.sin())
        return table[0][positions], table[1][positions]

    def project(self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor):
        """Input rows [..., H] -> (residual x, q [..., heads, D], k, v [..., kv_heads, D])."""
        cfg = self.config
        x = self.fc(torch.cat([emb, feat], dim=-1))
        q, k, v = self.qkv(self.norm1(x)).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.unflatten(-1, (cfg.num_heads, cfg.head_dim))
        k = k.unflatten(-1, (cfg.num_kv_heads, cfg.head_dim))
        v = v.unflatten(-1, (cfg.num_kv_heads, cfg.head_dim))
        cos, sin = self.rope(positions)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return x, rotate(q, cos, sin), rotate(k, cos, sin), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor,
               lm_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual x and attention output [..., heads, D] -> (predicted feature f^, reduced logits, or
        with `lm_rows` only those rows' logits: training's candidate softmax)."""
        x = x + self.o(attn.flatten(-2))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        x = x + self.down(F.silu(gate) * up)
        f = self.final_norm(x)
        return f, self.lm(f) if lm_rows is None else F.linear(f, self.lm.weight[lm_rows])

    # -- training: parallel over sequences, with EAGLE-3's training-time test ----------------------
    def forward_passes(self, emb: torch.Tensor, feats: torch.Tensor, depth: int = 1, noise: float = 0.0,
                       lm_rows: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """emb, feats [B, T, H] (row j: t_{j+1} and f_j). Pass 1 reads the real features; pass m > 1
        reads at row j the feature pass m-1 predicted at row j-1 and attends to the real keys up to
        j-m+1 and to pass p's key at row j-(m-p): exactly what drafting the m-th token of a chain sees.
        Returns per pass (f^ [B, T, H], logits [B, T, V]); row j of pass m predicts y_{j+m}... see
        distill/head_train.py for the targets."""
        cfg = self.config
        b, t, _ = emb.shape
        g = cfg.num_heads // cfg.num_kv_heads
        pos = torch.arange(t, device=emb.device)
        scale = cfg.head_dim ** -0.5
        ks, vs, outs = [], [], []
        feat_in = feats if noise <= 0 else feats + (torch.rand_like(feats) - 0.5) * (2 * noise)
        for m in range(1, depth + 1):
            x, q, k, v = self.project(emb, feat_in, pos)
            ks.append(k.repeat_interleave(g, dim=-2))
            vs.append(v.repeat_interleave(g, dim=-2))
            qh = q.transpose(1, 2)  # [B, heads, T, D]
            k1, v1 = ks[0].transpose(1, 2), vs[0].transpose(1, 2)
            s1 = qh @ k1.transpose(-1, -2) * scale  # [B, heads, T, T]
            allowed = torch.ones(t, t, dtype=torch.bool, device=emb.device).tril_(-(m - 1))
            s1 = s1.masked_fill(~allowed, float("-inf"))
            extra, extra_v = [], []
            for p in range(2, m + 1):
                shift = m - p
                kp = ks[p - 1].transpose(1, 2).roll(shift, dims=2)  # row j sees pass p's key at j - shift
                vp = vs[p - 1].transpose(1, 2).roll(shift, dims=2)
                extra.append((qh * kp).sum(-1, keepdim=True) * scale)
                extra_v.append(vp)
            scores = torch.cat([s1] + extra, dim=-1)
            # a row whose every key is masked (j < m - 1) is never scored; keep its softmax finite
            scores = torch.nan_to_num(scores, nan=0.0, neginf=-1e30) if m > 1 else scores
            w = scores.softmax(-1)
            o = w[..., :t] @ v1
            for i, vp in enumerate(extra_v):
                o = o + w[..., t + i:t + i + 1] * vp
            f, logits = self.finish(x, o.transpose(1, 2), lm_rows)
            outs.append((f, logits))
            feat_in = torch.cat([torch.zeros_like(f[:, :1]), f[:, :-1]], dim=1)
        return outs

    # -- inference ---------------------------------------------------------------------------------
    def step(self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor, caches: list["HeadCache"],
             counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """New rows of several requests (request r owns `counts[r]` consecutive rows, appended to
        caches[r]) -> (f^, reduced logits) of every row; all rows of a request are causal among
        themselves after the cached ones."""
        cfg = self.config
        x, q, k, v = self.project(emb, feat, positions)
        outs = []
        row = 0
        kvh, d = cfg.num_kv_heads, cfg.head_dim
        g = cfg.num_heads // kvh
        scale = d ** -0.5
        for cache, n in zip(caches, counts):
            cache.append(k[row:row + n], v[row:row + n])
            kk, vv = cache.view()  # [kv_heads, T, D]
            total = kk.shape[1]
            # grouped-query attention without copying the keys: the g query heads of a key head side by side
            qg = q[row:row + n].view(n, kvh, g, d).permute(1, 2, 0, 3).reshape(kvh, g * n, d)
            scores = torch.bmm(qg, kk.transpose(1, 2)) * scale  # [kv_heads, g * n, T]
            if n > 1:
                mask = torch.ones(n, total, dtype=torch.bool).tril_(total - n).repeat(g, 1)
                scores = scores.masked_fill(~mask, float("-inf"))
            o = torch.bmm(scores.softmax(-1), vv)  # [kv_heads, g * n, D]
            outs.append(o.view(kvh, g, n, d).permute(2, 0, 1, 3).reshape(n, kvh * g, d))
            row += n
        return self.finish(x, torch.cat(outs) if len(outs) > 1 else outs[0])


class HeadCache:
    """One request's keys and values for the head's single layer ([kv_heads, T, D]), grown by doubling."""

    def __init__(self, kv_heads: int, head_dim: int, capacity: int = 256):
        self.k = torch.empty(kv_heads, capacity, head_dim)
        self.v = torch.empty(kv_heads, capacity, head_dim)
        self.n = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:  # k, v [n, kv_heads, D]
        need = self.n + k.shape[0]
        if need > self.k.shape[1]:
            cap = max(need, 2 * self.k.shape[1])
            for name in ("k", "v"):
                old = getattr(self, name)
                new = torch.empty(old.shape[0], cap, old.shape[2])
                new[:, :self.n] = old[:, :self.n]
                setattr(self, name, new)
        self.k[:, self.n:need] = k.transpose(0, 1)
        self.v[:, self.n:need] = v.transpose(0, 1)
        self.n = need

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :self.n], self.v[:, :self.n]

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)


# -- the artifact: where it lives, what it holds ---------------------------------------------------
def target_sha256(path: str | Path) -> str:
    """The target file's sha256: the registry's for a registered, verified file, else computed (and
    remembered beside the head cache, keyed by path, size and mtime)."""
    from specfleet.registry import MODELS, _has_valid_stamp, cache_root

    path = Path(path).resolve()
    for m in MODELS.values():
        if m.file_name == path.name and _has_valid_stamp(m, path):  # hashed and matched at install
            return m.sha256
    st = path.stat()
    memo = cache_root() / "heads" / "sha256.json"
    key = f"{path}:{st.st_size}:{st.st_mtime_ns}"
    known = json.loads(memo.read_text()) if memo.is_file() else {}
    if key not in known:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                digest.update(chunk)
        known[key] = digest.hexdigest()
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.write_text(json.dumps(known))
    return known[key]


def head_path(target_path: str | Path) -> Path:
    """Where the head trained for this target file is cached."""
    from specfleet.registry import cache_root

    source = Path(target_path).resolve()
    st = source.stat()
    key = hashlib.sha256(json.dumps({"path": str(source), "size": st.st_size}).encode()).hexdigest()[:12]
    return cache_root() / "heads" / f"{source.stem}-{key}" / "head.pt"


def save_head(head: FeatureHead, path: Path, target_sha: str | None, meta: dict | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"format": FORMAT_VERSION, "config": asdict(head.config), "state": head.state_dict(),
                "target_sha256": target_sha, "meta": meta or {}}, tmp)
    tmp.replace(path)


def load_head(path: Path, expect_sha: str | None = None) -> tuple[FeatureHead, dict]:
    # weights_only: a head file holds tensors, numbers and plain dicts; unpickling anything else could run
    # code from a data file, so such a file is refused, not loaded
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise InvalidRequestError(f"{path} is not a draft head file specfleet can load safely (tensors, numbers and "
                                  f"plain dicts only): {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(blob, dict):
        raise InvalidRequestError(f"{path} is not a draft head file: it holds a {type(blob).__name__}")
    if blob.get("format") != FORMAT_VERSION:
        raise InvalidRequestError(f"{path}: head format {blob.get('format')}, expected {FORMAT_VERSION}")
    if expect_sha is not None and blob.get("target_sha256") not in (None, expect_sha):
        raise InvalidRequestError(f"{path} was trained for a target with sha256 {blob.get('target_sha256')}, "
                                  f"not this one ({expect_sha}); retrain with `specfleet draft train`")
    head = FeatureHead(HeadConfig.from_dict(blob["config"]))
    head.load_state_dict(blob["state"])
    return head.eval(), blob.get("meta", {})


def find_head(target) -> Path | None:
    """The cached head of a loaded target (its `source_path`, set by runtime/loading/load.py), if one exists."""
    src = getattr(target, "source_path", None)
    if src is None:
        return None
    p = head_path(src)
    return p if p.is_file() else None


# -- target helpers (init and embeddings) ----------------------------------------------------------
def dense_linear(module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of a runtime linear layer as dense fp32, whatever its format."""
    from specfleet.runtime.formats.qlinear import QLinear
    from specfleet.runtime.formats.qtensor import QTensor

    if isinstance(module, QLinear):
        ws = [w.dequantize() if isinstance(w, QTensor) else w.float() for w, _ in module.parts]
        bs = [b for _, b in module.parts]
        bias = None if all(b is None for b in bs) else torch.cat(
            [b if b is not None else torch.zeros(w.shape[0]) for w, b in zip(ws, bs)])
        return torch.cat(ws), bias
    return module.weight.detach().float(), None if module.bias is None else module.bias.detach().float()


def target_head_rows(target, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the target's output head, dense fp32."""
    from specfleet.runtime.formats.qtensor import QTensor

    if target.head_q is not None:
        w = target.head_q.parts[0][0] if len(target.head_q.parts) == 1 else dense_linear(target.head_q)[0]
        return w.dequantize_rows(ids).float() if isinstance(w, QTensor) else w[ids].float()
    if target.lm_head is not None:
        return target.lm_head.weight.detach()[ids].float()
    return target_embed(target, ids)


def target_embed(target, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        e = target.embed_tokens(ids).float()
    return e.clone()


def init_from_target(target, draft_ids: torch.Tensor, intermediate: int | None = None) -> FeatureHead:
    """A head shaped after the target's layers (its width, heads and rotary), with the target's final norm
    and head rows. The layer starts as a no-op (its output projections zero), so the untrained head is
    lm(norm(fc([e, f]))), a linear guess that training improves from the first step. (Measured on
    SmolLM2 features, 60 steps: 0.22 first-token accuracy from this start, 0.19 from a random layer, 0.12
    from the target's own last layer behind an identity fc, which first repeats the given token.)"""
    tc = target.config
    if tc.is_gemma3 or tc.qk_norm:
        raise InvalidRequestError("the draft head supports Llama/Qwen2-style targets")
    inter = intermediate or tc.intermediate_size
    cfg = HeadConfig(tc.hidden_size, tc.num_heads, tc.num_kv_heads, tc.head_dim, inter, tc.rms_norm_eps,
                     tc.rope_theta, tc.attention_bias, tc.vocab_size, int(draft_ids.numel()))
    head = FeatureHead(cfg)
    with torch.no_grad():
        head.o.weight.zero_()
        head.down.weight.zero_()
        head.final_norm.weight.copy_(target.norm.weight.float())
        head.lm.weight.copy_(target_head_rows(target, draft_ids))
        head.token_map.copy_(draft_ids)
    return head


class _QHead:
    """The head's matrices in Q8_0 through the runtime's kernels (inference only)."""

    @staticmethod
    def quantize(head: FeatureHead) -> FeatureHead:
        from specfleet.runtime.backends.native import kernels as native_backend
        from specfleet.runtime.formats import qtensor
        from specfleet.runtime.formats.qlinear import QLinear

        if not native_backend.available():
            return head
        for name in ("fc", "qkv", "o", "gate_up", "down", "lm"):
            lin = getattr(head, name)
            q = QLinear([qtensor.quantize(lin.weight.detach(), qtensor.T.Q8_0)], None if lin.bias is None else lin.bias.detach())
            setattr(head, name, q)
        return head


# -- the proposer ------------------------------------------------------------------------------------
@dataclass
class HeadDraftConfig:
    num_speculative_tokens: int = 6  # the longest chain
    min_prob: float = 0.3  # stop the chain where the head's path probability falls below this
    min_first_prob: float = 0.05  # draft nothing when even the first token is this unlikely
    quantize: bool = True  # Q8_0 matrices through the block-format kernels (CPU)
    path: str | None = None  # a head file (default: the one cached for the target)

    def validate(self) -> None:
        if self.num_speculative_tokens < 1 or not 0 <= self.min_prob <= 1 or not 0 <= self.min_first_prob <= 1:
            raise InvalidRequestError(f"invalid head settings {self}")


@dataclass
class _State:
    cache: HeadCache
    start: int  # position of the cache's first entry (entry i reads f_i and t_{i+1})


class HeadProposer:
    """Drafts chains with a FeatureHead from the target's features (see the module doc)."""

    def __init__(self, head: FeatureHead, target, config: HeadDraftConfig | None = None, name: str = "head"):
        self.config = config or HeadDraftConfig()
        self.config.validate()
        self.name = name
        self.head = _QHead.quantize(head) if self.config.quantize else head
        self.model = self.head
        self.target = target
        self.vocab_size = head.config.vocab_size
        self.token_map = head.token_map
        self.generators = GeneratorStore(torch.device("cpu"), salt=29)
        self.states: dict[str, _State] = {}

    @classmethod
    def for_target(cls, target, config: HeadDraftConfig | None = None, name: str = "head") -> "HeadProposer":
        config = config or HeadDraftConfig()
        path = Path(config.path).expanduser() if config.path else find_head(target)
        if path is None or not path.is_file():
            raise InvalidRequestError(
                "no trained draft head for this target; train one with `specfleet draft train --target MODEL` "
                "(or name a file with head[path=...])")
        src = getattr(target, "source_path", None)
        head, _ = load_head(path, target_sha256(src) if src and not config.path else None)
        if head.config.hidden_size != target.config.hidden_size or head.config.vocab_size != target.config.vocab_size:
            raise InvalidRequestError(f"{path} does not fit this target (hidden size or vocabulary differ)")
        return cls(head, target, config, name)

    # -- capabilities ------------------------------------------------------------------------------
    def reads_target_features(self) -> bool:
        return True

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    def set_num_speculative_tokens(self, n: int) -> None:
        self.config.num_speculative_tokens = max(1, int(n))

    def observe(self, feedback: list[Feedback]) -> None:
        pass  # the head's cache holds committed entries only; features arrive through the request

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self.generators.pop(request_id)

    def free_kv(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    # -- drafting ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: list[RequestView]) -> dict[str, DraftTree]:
        ready, feeds = [], []
        for r in requests:
            feed = self._catch_up(r)
            if feed is not None:
                ready.append(r)
                feeds.append(feed)
        if not ready:
            return {}
        cfg = self.head.config
        # catch up: every committed entry not yet in a request's cache, in one batched step
        embs, feats, poss, counts = [], [], [], []
        for r, (a, rows) in zip(ready, feeds):
            toks = r.all_token_ids
            n = rows.shape[0]
            embs.append(torch.tensor(toks[a + 1:a + 1 + n], dtype=torch.long))
            feats.append(rows.float())
            poss.append(torch.arange(a, a + n))
            counts.append(n)
        emb = target_embed(self.target, torch.cat(embs))
        f, logits = self.head.step(emb, torch.cat(feats), torch.cat(poss),
                                   [self.states[r.request_id].cache for r in ready], counts)
        last = torch.tensor(counts).cumsum(0) - 1
        f, logits = f[last], logits[last]
        k = self.config.num_speculative_tokens
        tokens = [[] for _ in ready]
        probs = [[] for _ in ready]
        path_p = [1.0] * len(ready)
        alive = list(range(len(ready)))
        committed = [s.cache.n for s in (self.states[r.request_id] for r in ready)]
        try:
            for depth in range(k):
                nxt = []
                for row, i in enumerate(alive):
                    # whether to go on is decided before the draw: a rule that looked at the drawn token
                    # would propose from q conditioned on it, and rejection sampling needs q itself
                    q_small, conf = self._dist(ready[i], logits[row])
                    limit = self.config.min_first_prob if depth == 0 else self.config.min_prob
                    if path_p[i] * conf < limit:
                        continue
                    path_p[i] *= conf
                    tok, q = self._draw(ready[i], q_small)
                    tokens[i].append(tok)
                    if q is not None:
                        probs[i].append(q)
                    nxt.append((row, i))
                if not nxt or depth == k - 1:
                    break
                rows = torch.tensor([row for row, _ in nxt])
                alive = [i for _, i in nxt]
                emb = target_embed(self.target, torch.tensor([tokens[i][-1] for i in alive]))
                pos = torch.tensor([self.states[ready[i].request_id].start + self.states[ready[i].request_id].cache.n
                                    for i in alive])
                f, logits = self.head.step(emb, f[rows], pos, [self.states[ready[i].request_id].cache for i in alive],
                                           [1] * len(alive))
        finally:
            for i, r in enumerate(ready):  # keep only committed entries
                self.states[r.request_id].cache.truncate(committed[i])
        out = {}
        for i, r in enumerate(ready):
            if tokens[i]:
                q = torch.stack(probs[i]) if probs[i] else None
                out[r.request_id] = DraftTree.chain(tokens[i], self.name, q)
        return out

    def _dist(self, r: RequestView, logits: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(the head's distribution over its reduced vocabulary under the request's sampling settings,
        the probability of its most likely token: the chance the chain goes on)."""
        q = torch.softmax(logits.float(), -1) if r.params.is_greedy else target_probs(logits[None].float(), r.params)[0]
        return q, float(q.max())

    def _draw(self, r: RequestView, q_small: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """(target token id, q over the full target vocabulary, 0 outside the reduced one; None for greedy)."""
        if r.params.is_greedy:
            return int(self.token_map[int(q_small.argmax())]), None
        j = draw(q_small, self.generators.get(r))
        q = torch.zeros(self.vocab_size, dtype=torch.float32)
        q.index_add_(0, self.token_map, q_small.float())
        return int(self.token_map[j]), q

    def _catch_up(self, r: RequestView) -> tuple[int, torch.Tensor] | None:
        """(first position to feed, its feature rows) so the cache ends with entry N - 1 (N the last
        committed token's position: entry N - 1 predicts the first draft token), or None when the
        request has no features for it yet."""
        log = features_of(r)
        n_last = r.num_tokens - 1
        if log is None or log.end < n_last or n_last < 1:
            return None
        st = self.states.get(r.request_id)
        if st is None or st.start + st.cache.n < log.start or st.start + st.cache.n > n_last:
            cfg = self.head.config
            st = _State(HeadCache(cfg.num_kv_heads, cfg.head_dim), max(log.start, 0))
            self.states[r.request_id] = st
        a = st.start + st.cache.n
        if a >= n_last:
            return None  # nothing new (cannot happen after a step; a repeated propose)
        rows = log.rows(a, n_last)
        log.discard_before(a)
        return a, rows
