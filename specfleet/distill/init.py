"""Choosing the student's shape and its starting weights.

With a 151,936-token vocabulary most of a small draft's parameters sit in the embeddings and the
head, and they are the part a short CPU run can least afford to learn, so they come from a trained
model of the same tokenizer: the target (d=1536 for the 1.5B) or the 0.5B (d=896), and the draft
takes that model's width unless told to project.
- Same width as the source: embeddings, final norm and head are copied; the transformer layers are
  copied from `layer_ids` of the source (spread over its depth by default, which keeps the last
  layer, whose output space the head reads), MLPs optionally pruned to the `intermediate_size`
  neurons with the largest weight norms. A few copied layers of a deep model rarely agree with it
  before training (the distill report's untrained baseline shows by how much), so copied layers are
  a starting point for training, not a draft by themselves.
- Narrower than the source: embeddings and head are projected onto the top principal directions
  of the source's embedding table (the final-norm gain folded into the head first); layers start
  random. `init_from="none"`: everything random (for tests and ablations).
"""
from __future__ import annotations

import torch

from specfleet.distill.student import Student, StudentSpec
from specfleet.errors import SpecfleetError
from specfleet.runtime.loading.weights import load_weights
from specfleet.runtime.model.config import ModelConfig

INIT_STD = 0.02


def spread_layers(num_source_layers: int, num_layers: int) -> tuple[int, ...]:
    """`num_layers` source layer indices spread evenly from the first to the last.

    Example: spread_layers(24, 3) == (0, 12, 23); spread_layers(24, 1) == (0,).
    """
    if num_layers == 1:
        return (0,)
    step = (num_source_layers - 1) / (num_layers - 1)
    return tuple(round(i * step) for i in range(num_layers))


def parse_layer_ids(text: str, num_source_layers: int, num_layers: int) -> tuple[int, ...]:
    if text == "spread":
        return spread_layers(num_source_layers, num_layers)
    if text == "first":
        return tuple(range(num_layers))
    try:
        ids = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise SpecfleetError(f"--init-layers must be 'spread', 'first' or comma-separated layer indices, "
                             f"got {text!r}") from None
    if len(ids) != num_layers or not all(0 <= i < num_source_layers for i in ids):
        raise SpecfleetError(f"--init-layers {text!r}: need {num_layers} indices in [0, {num_source_layers})")
    return ids


def make_spec(target: ModelConfig, source: ModelConfig | None, init_from: str, num_layers: int,
              layer_choice: str = "spread", hidden_size: int | None = None, intermediate_size: int | None = None,
              num_heads: int | None = None, num_kv_heads: int | None = None, vocab_size: int = 0,
              freeze_embeddings: bool = True, freeze_head: bool = False) -> StudentSpec:
    """The student's architecture: the source's where widths match, otherwise derived from the target's."""
    if num_layers < 1:
        raise SpecfleetError(f"--layers must be at least 1, got {num_layers}")
    if any(c is not None and c.is_gemma3 for c in (target, source)):
        raise SpecfleetError("distilling with a Gemma-3 target or source is not supported: the student's "
                             "training forward (distill/student.py) is the Llama/Qwen layer")
    if source is not None and source.vocab_size != target.vocab_size:
        raise SpecfleetError(f"--init-from model has a vocabulary of {source.vocab_size} tokens, the target "
                             f"{target.vocab_size}: the draft must share the target's tokenizer")
    hidden = hidden_size or (source.hidden_size if source else target.hidden_size)
    if source is not None and hidden == source.hidden_size:
        base, layer_ids = source, parse_layer_ids(layer_choice, source.num_layers, num_layers)
        if intermediate_size and intermediate_size > source.intermediate_size:
            raise SpecfleetError(f"--intermediate {intermediate_size} exceeds the source's {source.intermediate_size}")
        heads, kv_heads, head_dim = source.num_heads, source.num_kv_heads, source.head_dim
    else:
        base, layer_ids = target, ()
        head_dim = target.head_dim if hidden % target.head_dim == 0 else 64
        heads = num_heads or max(1, hidden // head_dim)
        kv_heads = num_kv_heads or heads
        head_dim = hidden // heads
    ffn = intermediate_size or max(64, base.intermediate_size * hidden // base.hidden_size)
    cfg = ModelConfig(
        arch=base.arch, vocab_size=target.vocab_size, hidden_size=hidden, intermediate_size=ffn,
        num_layers=num_layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=base.rms_norm_eps, rope_theta=base.rope_theta,
        max_position_embeddings=target.max_position_embeddings, tie_word_embeddings=False,
        attention_bias=base.attention_bias, qk_norm=base.qk_norm, bos_token_id=target.bos_token_id,
        eos_token_ids=target.eos_token_ids)
    k = vocab_size if 0 < vocab_size < target.vocab_size else target.vocab_size
    return StudentSpec(init_from, layer_ids, cfg.as_dict(), k, freeze_embeddings, freeze_head)


def build_student(spec: StudentSpec, vocab_ids: torch.Tensor | None, source_weights: dict[str, torch.Tensor] | None,
                  source: ModelConfig | None, seed: int = 0) -> Student:
    """A Student with its initial weights; deterministic for a given spec, vocabulary, source and seed."""
    torch.manual_seed(seed)
    student = Student(spec, vocab_ids)
    _random_init(student)
    if source_weights is not None:
        embed, head = _source_embed_head(source_weights, source)
        width = spec.model_config().hidden_size
        if width != source.hidden_size:  # the student's final norm starts at 1: fold the source's gain
            proj = _principal_directions(embed, width)
            embed, head = embed @ proj, (head * source_weights["model.norm.weight"].float()) @ proj
        with torch.no_grad():
            student.body.embed_tokens.weight.copy_(embed)
            student.head.copy_(head[student.vocab_ids])
        if spec.layer_ids:
            _copy_layers(student, source_weights, spec.layer_ids)
    student.configure_trainable()
    return student


def _random_init(student: Student) -> None:
    with torch.no_grad():
        for name, p in student.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, INIT_STD)


def _source_embed_head(weights: dict[str, torch.Tensor], source: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Source embeddings and head in fp32 (a tied source uses its embeddings as head)."""
    embed = weights["model.embed_tokens.weight"].float()
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).float()
    return embed, head


def _principal_directions(embed: torch.Tensor, width: int) -> torch.Tensor:
    """[d, width] orthonormal columns: the top eigenvectors of the embedding table's covariance."""
    cov = embed.T @ embed  # [d, d]; cheap even for 151,936 rows
    _, vecs = torch.linalg.eigh(cov)  # ascending eigenvalues
    return vecs[:, -width:].flip(-1)


def _copy_layers(student: Student, weights: dict[str, torch.Tensor], layer_ids: tuple[int, ...]) -> None:
    cfg = student.spec.model_config()
    hf = {"model.embed_tokens.weight": student.body.embed_tokens.weight.detach(),
          "model.norm.weight": weights["model.norm.weight"].float()}
    for new, old in enumerate(layer_ids):
        src, dst = f"model.layers.{old}.", f"model.layers.{new}."
        for name, t in weights.items():
            if name.startswith(src):
                hf[dst + name[len(src):]] = t.float()
        _prune_mlp(hf, dst, cfg.intermediate_size)
    load_weights(student.body, hf)


def _prune_mlp(hf: dict[str, torch.Tensor], prefix: str, keep: int) -> None:
    """Keep the `keep` MLP neurons whose gate, up and down weights have the largest norms."""
    gate, up, down = (hf[prefix + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
    if gate.shape[0] == keep:
        return
    score = gate.norm(dim=1) * up.norm(dim=1) * down.norm(dim=0)
    idx = score.topk(keep).indices.sort().values
    hf[prefix + "mlp.gate_proj.weight"], hf[prefix + "mlp.up_proj.weight"] = gate[idx], up[idx]
    hf[prefix + "mlp.down_proj.weight"] = down[:, idx]
