"""Verification rows get bit for bit the attention output their own decode step would: with the
batch-invariant GGUF kernels this is what makes speculative greedy output equal plain greedy output
exactly on native weights (on the real 1.5B, the split flash path diverged from plain decoding on 1 of
4 HumanEval prompts within 64 tokens)."""
import torch

from tiny_models import tree_mask

from specfleet.runtime.model.attention import SeqAttention, _attend


def decode_alone(q_row, k, v, upto: torch.Tensor, kvh: int, scale: float) -> torch.Tensor:
    """One token decoded alone: its keys are `upto` (cache rows in order), no mask."""
    seq = SeqAttention(1, len(upto) - 1, slice(None))
    return _attend(q_row, k[upto], v[upto], seq, kvh, scale)


def test_chain_rows_equal_their_decode_steps():
    g = torch.Generator().manual_seed(0)
    c, n, h, kvh, d = 37, 5, 6, 2, 16
    k = torch.randn(c + n, kvh, d, generator=g)
    v = torch.randn(c + n, kvh, d, generator=g)
    q = torch.randn(n, h, d, generator=g)
    out = _attend(q, k, v, SeqAttention(n, c, slice(None)), kvh, d ** -0.5)
    for i in range(n):
        alone = decode_alone(q[i:i + 1], k, v, torch.arange(c + i + 1), kvh, d ** -0.5)
        assert torch.equal(out[i:i + 1], alone)


def test_tree_rows_equal_their_decode_steps():
    g = torch.Generator().manual_seed(1)
    c, h, kvh, d = 29, 4, 2, 8
    parents = [-1, 0, 0, 1, 2]  # a root, two children, a grandchild under each
    n = len(parents)
    mask = tree_mask(parents)
    k = torch.randn(c + n, kvh, d, generator=g)
    v = torch.randn(c + n, kvh, d, generator=g)
    q = torch.randn(n, h, d, generator=g)
    out = _attend(q, k, v, SeqAttention(n, c, slice(None), mask), kvh, d ** -0.5)
    for i in range(n):
        upto = torch.cat([torch.arange(c), mask[i].nonzero().flatten() + c])
        alone = decode_alone(q[i:i + 1], k, v, upto, kvh, d ** -0.5)
        assert torch.equal(out[i:i + 1], alone)
