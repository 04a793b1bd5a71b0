"""How good a draft is for its target: teacher-forced agreement and a short speculative run.

- held-out greedy agreement: on continuations the target produced for prompts the draft never saw
  in training, the fraction of positions where the draft's argmax is the target's token
  (teacher-forced, so one miss does not derail the rest; it predicts acceptance of greedy drafts).
- mean accepted length (1 + accepted / verification steps, core/stats.py) and decode tokens/s of
  the target with the draft, one prompt at a time; decode = after the first token, so the prompt's
  prefill, identical with and without a draft, does not dilute the comparison.
- cost per token: the draft's own decode time per token over the target's (both plain decoding).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from specfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from specfleet.distill.data import Sequence, collate, make_batches
from specfleet.distill.student import causal_forward
from specfleet.engine.engine import Engine
from specfleet.runtime.model.decoder import DecoderLM
from specfleet.sampling_params import SamplingParams
from specfleet.drafting.draft_model import DraftModelConfig, DraftModelProposer

logger = logging.getLogger(__name__)


@torch.no_grad()
def greedy_labels(model: DecoderLM, seqs: list[Sequence], batch_tokens: int = 4096) -> list[torch.Tensor]:
    """The argmax of `model` at the loss positions of `seqs`, per batch of make_batches(seqs, ..., 0, 0)."""
    out = []
    for batch in make_batches(seqs, batch_tokens, 0, 0):
        ids, _, mask = collate([seqs[i] for i in batch])
        hidden = causal_forward(model, ids)[mask]
        out.append(torch.cat([model.compute_logits(h).argmax(-1) for h in hidden.split(256)]))
    return out


def agreement(model: DecoderLM, seqs: list[Sequence], batch_tokens: int = 4096,
              reference: list[torch.Tensor] | None = None) -> float:
    """Greedy top-1 agreement of a runtime model with the continuation tokens of `seqs`, or with the
    `reference` model's argmax (greedy_labels) when the continuations came from another teacher."""
    preds = greedy_labels(model, seqs, batch_tokens)
    if reference is None:
        reference = []
        for batch in make_batches(seqs, batch_tokens, 0, 0):
            _, labels, mask = collate([seqs[i] for i in batch])
            reference.append(labels[mask])
    correct = sum(int((p == r).sum()) for p, r in zip(preds, reference))
    return correct / max(1, sum(r.numel() for r in reference))


def num_params(model: DecoderLM) -> int:
    return sum(p.numel() for p in model.parameters())


def decode_run(target: DecoderLM, prompts: list[list[int]], max_tokens: int, draft: DecoderLM | None = None,
               draft_name: str = "draft", spec_len: int = 4) -> dict:
    """Greedy generation of each prompt alone (batch 1); figures of the decode phase."""
    proposer = None
    if draft is not None:
        proposer = DraftModelProposer(draft, draft_name, DraftModelConfig(spec_len, kv_cache_bytes=64 << 20),
                                      target.config.vocab_size)
    engine = Engine(target, None, EngineConfig(CacheConfig(16, 256 << 20), SchedulerConfig(max_num_seqs=1)), proposer)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens, seconds, outputs = 0, 0.0, []
    for ids in prompts:
        req = engine.add_request(ids, params)
        first = None
        while engine.has_unfinished():
            engine.step()
            if first is None and req.output_token_ids:
                first = time.perf_counter()  # the prefill (and its first token) ends here
        seconds += time.perf_counter() - first
        tokens += len(req.output_token_ids) - 1
        outputs.append(list(req.output_token_ids))
    stats = engine.stats
    row = {"decode_tok_s": tokens / seconds if seconds else 0.0, "s_per_token": seconds / max(1, tokens),
           "outputs": outputs}
    if draft is not None:
        row |= {"mean_accepted_length": stats.mean_accepted_length, "acceptance_rate": stats.acceptance_rate}
    return row


def compare_drafts(target: DecoderLM, drafts: dict[str, Callable[[], DecoderLM]], heldout: list[Sequence],
                   prompts: list[list[int]], max_tokens: int, spec_len: int, batch_tokens: int = 4096,
                   target_labels: bool = False) -> dict:
    """Figures of every draft beside the plain target (same prompts, same run). Drafts are loaded one
    at a time by their loader and released after, so only one sits in memory beside the target.
    `target_labels`: measure agreement against the target's argmax instead of the stored tokens."""
    reference = greedy_labels(target, heldout, batch_tokens) if target_labels else None
    logger.info("evaluating: the target alone on %d prompts", len(prompts))
    plain = decode_run(target, prompts, max_tokens) if prompts else None
    rows = []
    for name, load in drafts.items():
        logger.info("evaluating draft %s", name)
        model = load()
        row = {"draft": name, "params": num_params(model), "layers": model.config.num_layers,
               "hidden": model.config.hidden_size, "heldout_agreement": agreement(model, heldout, batch_tokens, reference)}
        if plain is not None:
            alone = decode_run(model, prompts, max_tokens)
            spec = decode_run(target, prompts, max_tokens, model, name, spec_len)
            row |= {"mean_accepted_length": spec["mean_accepted_length"], "acceptance_rate": spec["acceptance_rate"],
                    "decode_tok_s": spec["decode_tok_s"], "speedup": spec["decode_tok_s"] / plain["decode_tok_s"],
                    "cost_per_token": alone["s_per_token"] / plain["s_per_token"],
                    "same_output_as_plain": spec["outputs"] == plain["outputs"]}
        rows.append(row)
        del model
    target_row = {"params": num_params(target), "layers": target.config.num_layers}
    if plain is not None:
        target_row |= {"decode_tok_s": plain["decode_tok_s"], "s_per_token": plain["s_per_token"]}
    return {"target": target_row, "drafts": rows, "num_prompts": len(prompts), "max_tokens": max_tokens,
            "spec_len": spec_len}
