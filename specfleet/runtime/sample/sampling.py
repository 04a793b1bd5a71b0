"""Turning logits into the distribution a request samples from, and sampling it.

`target_probs` is the single definition of "the target's distribution" under temperature, top-k and
top-p; plain decoding samples from it and speculative verification accepts or rejects against it,
which is what makes speculative sampling lossless.
"""
from __future__ import annotations

import secrets

import torch

from specfleet.core.verify import KeyedUniforms
from specfleet.sampling_params import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] logits -> [n, vocab] probabilities after temperature, top-k, then top-p.

    Greedy (temperature 0) is the point mass on the argmax (first index on ties, like torch.argmax).
    """
    logits = logits.float()
    if params.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # shift by the row maximum first (softmax is unchanged): a tiny temperature then sends the other
    # logits towards -inf instead of overflowing the top one to +inf, which made the row nan; the
    # clamp keeps a subnormal temperature (0 in float32) from giving 0 / 0
    logits = logits - logits.amax(-1, keepdim=True)
    logits = logits / max(params.temperature, torch.finfo(torch.float32).tiny)
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def request_uniforms(seed: int | None) -> KeyedUniforms:
    """The target's uniforms for one sampled request: keyed by its seed, or by 64 fresh random bits
    (from the OS, not torch's global generator, so unseeded requests differ whatever the caller seeded)."""
    return KeyedUniforms(secrets.randbits(64) if seed is None else seed)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


class GeneratorStore:
    """One seeded generator per request for a draft's own sampling. The seed is derived from the
    request's with a per-proposer `salt`, so a draft's random stream never repeats the target's."""

    def __init__(self, device: torch.device, salt: int):
        self.device, self.salt = device, salt
        self._generators: dict[str, torch.Generator] = {}

    def get(self, req) -> torch.Generator:
        g = self._generators.get(req.request_id)
        if g is None:
            seed = None if req.params.seed is None else (req.params.seed * 1_000_003 + self.salt) % (2**63)
            g = self._generators[req.request_id] = make_generator(seed, self.device)
        return g

    def pop(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
