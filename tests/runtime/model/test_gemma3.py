"""Gemma-3 (arch gemma3): the model, its sliding-window attention, its GGUF files, speculation with it.

1. A tiny random Gemma-3 (4 layers: sliding and global, a window of 5 keys, far shorter than the
   contexts) against transformers' Gemma3ForCausalLM in fp32: prefill, chunked prefill and decode
   past the window, a ragged batch over scattered cache blocks, tree verification and a draft tree's
   level with hidden context, linear rope scaling of the global layers.
2. Sliding-window paged attention against a dense reference masked by token positions.
3. GGUF files written as llama.cpp writes gemma3 (norms stored as 1 + weight, its tensor names and
   metadata keys), loaded dense and in block formats; clear errors for what is not implemented.
4. Greedy speculation equals plain greedy with the tiny Gemma as target and as draft (same vocabulary),
   dense and native; as a cross-vocabulary draft whose tokenizer starts a text with BOS.
5. The real Gemma-3-270M when installed (`specfleet models install gemma-3-270m`; skipped otherwise):
   logits against transformers' own GGUF loader, next-token quality on plain English (which also pins
   the +1 that llama.cpp adds to the norms), and as a cross-tokenizer draft of the installed Qwen
   target: greedy output equal to the target's own, token for token, with no KV left behind.
"""
from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import processors

import specfleet.runtime.model.attention as attention
from specfleet.runtime.backends.native import kernels as native_backend
from tests.conftest import optional_model_path
from specfleet.errors import UnsupportedModelError
from specfleet.runtime.kv.blocks import BlockManager
from specfleet.runtime.loading.build import build_model
from specfleet.runtime.kv.cache import KVCache
from specfleet.runtime.loading.checkpoint import load_checkpoint
from specfleet.runtime.model.config import FULL, SLIDING, ModelConfig
from specfleet.runtime.step.runner import ForwardItem, ModelRunner
from specfleet.runtime.backends.native.forward import native_lib
from specfleet.sampling_params import SamplingParams
from specfleet.drafting.cross_vocab import CrossVocabProposer
from specfleet.drafting.draft_model import DraftModelConfig, DraftModelProposer
from specfleet.drafting.prompt_lookup import PromptLookupConfig, PromptLookupProposer
from tests.runtime.loading.test_checkpoint import tiny_vocab, write_tiny_shape, write_tiny_tokenizer
from tiny_engines import make_engine
from tiny_models import GEMMA3, ours_from_hf, perturbed_copy, random_prompts, run_to_completion, tiny_hf_model

ATOL = 1e-4
WINDOW = GEMMA3["sliding_window"]


def make_runner(model, num_blocks=64, block_size=4, dtype=torch.float32):
    kv = KVCache.allocate(model.config, num_blocks, block_size, dtype, torch.device("cpu"))
    return ModelRunner(model, kv, torch.device("cpu")), BlockManager(num_blocks, block_size)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def rand_ids(n, seed, vocab=97):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("gemma3")


@pytest.fixture(scope="module")
def ours(hf):
    return ours_from_hf(hf)


# ------------------------------------------------------------------------------------------------
# 1. the tiny model against transformers
# ------------------------------------------------------------------------------------------------
def test_config_from_transformers_and_back(hf):
    cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
    assert cfg.arch == "gemma3" and cfg.is_gemma3 and cfg.tie_word_embeddings and cfg.qk_norm
    assert cfg.layer_types == (SLIDING, FULL, SLIDING, SLIDING) and cfg.sliding_window == WINDOW
    assert [cfg.layer_window(i) for i in range(4)] == [WINDOW, None, WINDOW, WINDOW]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling_factor) == (1e6, 1e4, 1.0)
    assert cfg.attention_scale == 24 ** -0.5 and cfg.embed_scale == 64 ** 0.5
    assert cfg.hidden_act == "gelu_pytorch_tanh"
    import transformers

    again = transformers.Gemma3TextConfig(**{k: v for k, v in cfg.to_hf_dict().items() if k != "model_type"})
    assert ModelConfig.from_hf_dict(again.to_dict()) == cfg
    # transformers 4's flat keys, and a config that only names the pattern
    old = dict(model_type="gemma3_text", vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=7,
               num_attention_heads=4, num_key_value_heads=2, rope_theta=5e5, rope_local_base_freq=2e4,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=7)
    c = ModelConfig.from_hf_dict(old)
    assert c.layer_types == (SLIDING,) * 5 + (FULL, SLIDING) and c.head_dim == 256
    assert (c.rope_theta, c.rope_local_theta, c.rope_scaling_factor, c.query_pre_attn_scalar) == (5e5, 2e4, 8.0, 256)


def test_the_reference_uses_its_window(hf):
    """The comparisons below can fail: a wider window changes the reference's logits by far more than ATOL."""
    ids = rand_ids(23, 3)
    wide = tiny_hf_model("gemma3", sliding_window=512)
    diff = (hf_logits(hf, ids) - hf_logits(wide, ids)).abs().amax(-1)
    assert diff[:WINDOW].max() < 1e-5 and diff[WINDOW:].min() > 100 * ATOL


@pytest.mark.parametrize("block", [128, 3])
def test_prefill_logits_match_reference(hf, ours, block, monkeypatch):
    """One prompt of 4.6 windows, its windowed rows in one block of queries or in many."""
    monkeypatch.setattr(attention, "WINDOW_BLOCK", block)
    runner, blocks = make_runner(ours)
    ids = rand_ids(23, 3)
    blocks.allocate("a", len(ids))
    out = runner.execute([ForwardItem("a", ids, 0, list(range(len(ids))))], blocks)
    torch.testing.assert_close(out, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_chunked_prefill_and_decode_match_reference(hf, ours):
    """Chunks of 7 (no context), 19 (a long chunk after context: the banded path) and 3 (verification
    sized: row by row), then one token at a time to 4x past the window, each against a full recomputation."""
    runner, blocks = make_runner(ours)
    ids = rand_ids(45, 4)
    ref = hf_logits(hf, ids)
    done = 0
    for n in (7, 19, 3):
        blocks.allocate("a", n) if done == 0 else blocks.append("a", n)
        out = runner.execute([ForwardItem("a", ids[done:done + n], done, list(range(n)))], blocks)
        torch.testing.assert_close(out, ref[done:done + n], atol=ATOL, rtol=0)
        done += n
    for t in range(done, len(ids)):
        blocks.append("a", 1)
        out = runner.execute([ForwardItem("a", [ids[t]], t, [0])], blocks)
        torch.testing.assert_close(out[0], ref[t], atol=ATOL, rtol=0)


def test_ragged_batch_over_scattered_blocks_matches_reference(hf, ours):
    """Two prompts prefilled side by side, then a fresh prefill, a decode and a multi-token extend in
    one forward; two requests' blocks are scattered, so their rows are gathered, not viewed."""
    runner, _ = make_runner(ours)
    seqs = {"a": rand_ids(17, 5), "b": rand_ids(22, 6), "c": rand_ids(14, 7)}
    tables = {"a": [20, 21, 22, 23, 24], "b": [10, 3, 7, 0, 12, 5], "c": [1, 8, 2, 15]}
    ref = {k: hf_logits(hf, v) for k, v in seqs.items()}
    out = runner.execute([ForwardItem("b", seqs["b"][:21], 0, list(range(21)), block_ids=tables["b"]),
                          ForwardItem("c", seqs["c"][:9], 0, list(range(9)), block_ids=tables["c"])])
    torch.testing.assert_close(out, torch.cat([ref["b"][:21], ref["c"][:9]]), atol=ATOL, rtol=0)
    out = runner.execute([ForwardItem("a", seqs["a"], 0, list(range(17)), block_ids=tables["a"]),
                          ForwardItem("b", seqs["b"][21:], 21, [0], block_ids=tables["b"]),
                          ForwardItem("c", seqs["c"][9:], 9, list(range(5)), block_ids=tables["c"])])
    torch.testing.assert_close(out, torch.cat([ref["a"], ref["b"][21:], ref["c"][9:]]), atol=ATOL, rtol=0)


def test_tree_verification_past_the_window_matches_reference(hf, ours):
    """Branches of depth 3 and 1 below a root after 16 cached tokens, verified in one forward: each
    node's window covers its own ancestors and the context just before the root."""
    runner, blocks = make_runner(ours)
    prefix = rand_ids(17, 8)
    a, b = [40, 41, 42], [50]
    blocks.allocate("t", 16)
    runner.execute([ForwardItem("t", prefix[:16], 0, [])], blocks)
    blocks.append("t", 5)
    mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 1]],
                        dtype=torch.bool)
    r = 16
    out = runner.execute([ForwardItem("t", [prefix[-1]] + a + b, r, list(range(5)), [r, r + 1, r + 2, r + 3, r + 1],
                                      mask)], blocks)
    torch.testing.assert_close(out[:4], hf_logits(hf, prefix + a)[-4:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[4], hf_logits(hf, prefix + b)[-1], atol=ATOL, rtol=0)


def test_draft_tree_level_with_hidden_context_matches_reference(hf, ours):
    """A tree drafted level by level: the second level's nodes see the committed tokens and their own
    parent among the first level's nodes, which sit in the cache as hidden context."""
    runner, blocks = make_runner(ours)
    committed = rand_ids(14, 9)
    level1, level2 = [30, 31, 32], [60, 61]  # level-2 node 0 below level-1 node 2, node 1 below node 0
    parents = [2, 0]
    blocks.allocate("d", len(committed))
    runner.execute([ForwardItem("d", committed, 0, [])], blocks)
    blocks.append("d", 3)  # the first level: siblings at one position, each seeing the committed tokens
    c = len(committed)
    runner.execute([ForwardItem("d", level1, c, [], [c] * 3, torch.eye(3, dtype=torch.bool))], blocks)
    blocks.append("d", 2)
    ctx = len(committed) + 3
    mask = torch.zeros(2, ctx + 2, dtype=torch.bool)
    mask[:, :len(committed)] = True
    for i, p in enumerate(parents):
        mask[i, len(committed) + p] = True
        mask[i, ctx + i] = True
    pos = len(committed) + 1
    out = runner.execute([ForwardItem("d", level2, ctx, [0, 1], [pos, pos], mask)], blocks)
    for i, p in enumerate(parents):
        torch.testing.assert_close(out[i], hf_logits(hf, committed + [level1[p], level2[i]])[-1], atol=ATOL, rtol=0)


def test_linear_rope_scaling_of_the_global_layers_matches_reference():
    rope = {FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            SLIDING: {"rope_type": "default", "rope_theta": 1e4}}
    hf = tiny_hf_model("gemma3", rope_parameters=rope)
    ours = ours_from_hf(hf)
    assert ours.config.rope_scaling_factor == 4.0
    runner, blocks = make_runner(ours)
    ids = rand_ids(20, 10)
    blocks.allocate("a", len(ids))
    out = runner.execute([ForwardItem("a", ids, 0, list(range(len(ids))))], blocks)
    torch.testing.assert_close(out, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_bf16_forward_is_close_to_fp32(ours):
    ids = rand_ids(16, 11)
    outs = []
    for m, dt in ((ours, torch.float32), (ours_from_hf(tiny_hf_model("gemma3")).to(torch.bfloat16), torch.bfloat16)):
        m.init_rotary("cpu")
        runner, blocks = make_runner(m, dtype=dt)
        blocks.allocate("a", len(ids))
        outs.append(runner.execute([ForwardItem("a", ids, 0, list(range(len(ids))))], blocks))
    assert (outs[0] - outs[1]).abs().max() < 0.05


def test_native_fused_decode_is_not_used_for_gemma(ours):
    kv = KVCache.allocate(ours.config, 4, 4, torch.float32, torch.device("cpu"))
    assert native_lib(ours, torch.tensor([1]), kv) is None


# ------------------------------------------------------------------------------------------------
# 2. sliding-window paged attention against a dense reference masked by positions
# ------------------------------------------------------------------------------------------------
def positions_reference(q, k, v, visible, q_pos, k_pos, window, scale):
    """Dense attention, visible keys restricted to positions (q_pos - window, q_pos]."""
    near = (q_pos[:, None] - k_pos[None, :]) < window
    group = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(group, 1).transpose(0, 1), v.repeat_interleave(group, 1).transpose(0, 1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), kr, vr, attn_mask=visible & near,
                                          scale=scale).transpose(0, 1)


def chain_tree(n):
    """A tree mask over n nodes (node 0 the root) with branches, and each node's depth."""
    parents = [-1, 0, 1, 0, 3, 4, 2, 6][:n]
    mask, depth = torch.eye(n, dtype=torch.bool), []
    for i in range(n):
        j, d = parents[i], 0
        while j >= 0:
            mask[i, j], j, d = True, parents[j], d + 1
        depth.append(d)
    return mask, torch.tensor(depth)


@pytest.mark.parametrize("window", [1, 3, 6, 50])
def test_windowed_paged_attention_equals_position_reference(window):
    torch.manual_seed(0)
    heads, kvh, d, bs = 4, 2, 16, 4
    k_cache, v_cache = torch.randn(64 * bs, kvh, d), torch.randn(64 * bs, kvh, d)
    tree, depth = chain_tree(8)
    hidden = torch.zeros(3, 16 + 3, dtype=torch.bool)  # a draft level: 16 committed + 3 earlier nodes
    hidden[:, :16] = True
    hidden[0, 16], hidden[1, 16], hidden[2, 18] = True, True, True
    cases = [  # (context, new, new_mask, context_mask, positions of the context, positions of the new rows)
        (0, 21, None, None, None, None),  # a prompt chunk
        (13, 20, None, None, None, None),  # a long chunk after context
        (11, 5, None, None, None, None),  # verification of a chain
        (30, 1, None, None, None, None),  # decode
        (9, 8, tree, None, None, 9 + depth),  # verification of a tree
        (0, 8, tree, None, None, depth),  # a tree without context
        (19, 3, torch.eye(3, dtype=torch.bool), hidden, torch.tensor(list(range(16)) + [16] * 3), torch.tensor([17] * 3)),
    ]
    for scattered in (False, True):
        seqs, qs, expected, start = [], [], [], 0
        for c, n, new_mask, context_mask, ctx_pos, new_pos in cases:
            nb = -(-(c + n) // bs)
            ids = list(range(start, start + nb))[::-1 if scattered else 1]
            start += nb
            slots = (torch.tensor(ids)[:, None] * bs + torch.arange(bs)).flatten()[:c + n]
            kv = slots if scattered else slice(ids[0] * bs, ids[0] * bs + c + n)
            if new_mask is None and context_mask is None:
                visible = torch.ones(n, c + n, dtype=torch.bool).tril(c)
            else:
                visible = torch.ones(n, c + n, dtype=torch.bool)
                visible[:, c:] = new_mask if new_mask is not None else torch.ones(n, n, dtype=torch.bool).tril()
                if context_mask is not None:
                    visible[:, :c] = context_mask
            ctx_pos = torch.arange(c) if ctx_pos is None else ctx_pos
            new_pos = torch.arange(c, c + n) if new_pos is None else new_pos
            seqs.append(attention.SeqAttention(n, c, kv, new_mask, context_mask))
            q = torch.randn(n, heads, d)
            qs.append(q)
            expected.append(positions_reference(q, k_cache[slots], v_cache[slots], visible, new_pos,
                                                torch.cat([ctx_pos, new_pos]), window, 0.3))
        batch = attention.AttentionBatch(torch.zeros(0, dtype=torch.long), seqs)
        got = attention.paged_attention(torch.cat(qs), k_cache, v_cache, batch, 0.3, window=window)
        torch.testing.assert_close(got, torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_verification_rows_equal_their_decode_steps_bit_for_bit():
    """A sliding-window layer's verification row attends to exactly the keys (and in the order) its
    one-token decode step does, so speculation stays exact, not only close."""
    torch.manual_seed(1)
    k, v = torch.randn(40, 2, 16), torch.randn(40, 2, 16)
    q = torch.randn(6, 4, 16)
    c = 30
    batch = attention.AttentionBatch(torch.zeros(0, dtype=torch.long), [attention.SeqAttention(6, c, slice(4, 40))])
    rows = attention.paged_attention(q, k, v, batch, 0.25, window=7)
    for i in range(6):
        one = attention.AttentionBatch(torch.zeros(0, dtype=torch.long),
                                       [attention.SeqAttention(1, c + i, slice(4, 4 + c + i + 1))])
        assert torch.equal(rows[i], attention.paged_attention(q[i:i + 1], k, v, one, 0.25, window=7)[0])


# ------------------------------------------------------------------------------------------------
# 3. GGUF files as llama.cpp writes them
# ------------------------------------------------------------------------------------------------
GGUF_NAMES = {  # HF suffix -> llama.cpp's gemma3 tensor name, written out independently of gguf_loader
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
Q = gguf.GGMLQuantizationType


def gemma_gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"


def tiny_vocab_gemma(**overrides):
    """The tiny Gemma over test_loader's byte-level vocabulary, with what a gemma3 GGUF can say: an
    attention scale of head_dim ** -0.5 (the file has no key for it) and an eps exact in float32."""
    tokens, _ = tiny_vocab()
    return tiny_hf_model("gemma3", vocab_size=len(tokens), bos_token_id=tokens.index("<|endoftext|>"),
                         eos_token_id=tokens.index("<|im_end|>"), query_pre_attn_scalar=16, rms_norm_eps=2 ** -20,
                         **overrides)


def write_gemma_gguf(path, model, *, quantized=False, pattern="array", extra=None):
    """`model` as llama.cpp's converter writes a gemma3 file: norms + 1, its names and metadata (the
    layer pattern as a per-layer array, as an int, or left out), matrices F32 or Q8_0/Q4_0."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    write_tiny_shape(w, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters[FULL]["rope_theta"])
    w.add_rope_freq_base_swa(cfg.rope_parameters[SLIDING]["rope_theta"])
    w.add_sliding_window(cfg.sliding_window)
    if pattern == "array":
        w.add_sliding_window_pattern([t == SLIDING for t in cfg.layer_types])
    elif isinstance(pattern, int):
        w.add_sliding_window_pattern(pattern)
    for key, value in (extra or {}).items():
        w.add_float32(key, value)
    write_tiny_tokenizer(w, cfg)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        x = t.float().numpy()
        if name.endswith("norm.weight"):
            x = x + 1.0  # llama.cpp's Gemma converter stores 1 + weight
        if quantized and x.ndim == 2:
            kind = Q.Q4_0 if (".v_proj." in name or ".down_proj." in name) else Q.Q8_0
            w.add_tensor(gemma_gguf_name(name), gguf.quants.quantize(np.ascontiguousarray(x), kind), raw_dtype=kind)
        else:
            w.add_tensor(gemma_gguf_name(name), np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFLEET_CACHE", str(tmp_path / "cache"))


def test_gguf_loads_to_the_reference_weights_and_logits(tmp_path, tmp_cache):
    model = tiny_vocab_gemma(rope_parameters={FULL: {"rope_type": "default", "rope_theta": 5e5},
                                              SLIDING: {"rope_type": "default", "rope_theta": 2e4}})
    path = tmp_path / "tiny-gemma.gguf"
    write_gemma_gguf(path, model)
    ckpt = load_checkpoint(path)
    # the file's EOS, then the control token <|endoftext|> (gguf_loader.END_OF_TEXT: it ends a generation too)
    from tests.runtime.loading.test_checkpoint import tiny_vocab

    eos = [model.config.eos_token_id, tiny_vocab()[0].index("<|endoftext|>")]
    assert ckpt.config == ModelConfig.from_hf_dict({**model.config.to_dict(), "eos_token_id": eos})
    state = model.state_dict()
    assert set(ckpt.weights) == set(state) - {"lm_head.weight"}
    for name, t in ckpt.weights.items():
        torch.testing.assert_close(t, state[name].float(), atol=1e-6, rtol=0, msg=name)  # the +1 taken back
    ours = build_model(ckpt.config, ckpt.weights, torch.float32, torch.device("cpu"))
    runner, blocks = make_runner(ours)
    ids = rand_ids(19, 12, vocab=ckpt.config.vocab_size)
    blocks.allocate("a", len(ids))
    out = runner.execute([ForwardItem("a", ids, 0, list(range(len(ids))))], blocks)
    torch.testing.assert_close(out, hf_logits(model.eval(), ids), atol=ATOL, rtol=0)
    # the converted folder is a Gemma3ForCausalLM checkpoint transformers reads as it is
    import transformers

    again = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt.folder), dtype=torch.float32).eval()
    torch.testing.assert_close(hf_logits(again, ids), hf_logits(model.eval(), ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("pattern,expected", [(None, (SLIDING,) * 5 + (FULL, SLIDING)), (3, (SLIDING, SLIDING, FULL) * 2 + (SLIDING,)),
                                              (0, (SLIDING,) * 7)])
def test_gguf_layer_pattern(tmp_path, tmp_cache, pattern, expected):
    """Without the key every 6th layer is global (llama.cpp's gemma3 default); an int is that period."""
    types = [SLIDING] * 5 + [FULL, SLIDING]
    model = tiny_vocab_gemma(num_hidden_layers=7, layer_types=types)
    path = tmp_path / "pattern.gguf"
    write_gemma_gguf(path, model, pattern=pattern)
    from specfleet.runtime.loading.gguf import config_from_metadata, open_gguf

    assert config_from_metadata(open_gguf(path), path).layer_types == expected


def test_gguf_in_block_formats_runs_natively(tmp_path, tmp_cache):
    from specfleet.runtime.formats import qtensor

    if not native_backend.available():
        pytest.skip(f"native kernels: {native_backend.unavailable_reason()}")
    from specfleet.runtime.formats.qlinear import QEmbedding, QLinear

    model = tiny_vocab_gemma()
    path = tmp_path / "tiny-gemma-q.gguf"
    write_gemma_gguf(path, model, quantized=True)
    native = load_checkpoint(path, quantization="gguf")
    m = build_model(native.config, native.weights, torch.float32, torch.device("cpu"))
    assert isinstance(m.embed_tokens, QEmbedding) and isinstance(m.head_q, QLinear)
    assert m.layers[0].self_attn.qkv_proj.formats == ["Q8_0", "Q4_0"]
    assert not any(p.ndim == 2 for p in m.parameters())
    dense = load_checkpoint(path)  # the same file dequantized
    d = build_model(dense.config, dense.weights, torch.float32, torch.device("cpu"))
    ids = rand_ids(21, 13, vocab=native.config.vocab_size)
    outs = []
    for mm in (m, d):
        runner, blocks = make_runner(mm)
        blocks.allocate("a", len(ids))
        outs.append(runner.execute([ForwardItem("a", ids, 0, list(range(len(ids))))], blocks))
    assert (outs[0] - outs[1]).abs().max() < 0.05 * outs[1].abs().max()  # activations go through Q8 blocks too
    assert (outs[0].argmax(-1) == outs[1].argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("key", ["gemma3.final_logit_softcapping", "gemma3.attn_logit_softcapping"])
def test_gguf_with_softcapping_is_refused(tmp_path, tmp_cache, key):
    path = tmp_path / "capped.gguf"
    write_gemma_gguf(path, tiny_vocab_gemma(), extra={key: 30.0})
    with pytest.raises(UnsupportedModelError, match=rf"capped\.gguf.*{key.split('.')[1]}"):
        load_checkpoint(path)


def test_unsupported_gemma_configs_are_refused():
    base = tiny_hf_model("gemma3").config.to_dict()
    for change, message in [({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
                            ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
                            ({"use_bidirectional_attention": True}, "bidirectional"),
                            ({"hidden_activation": "gelu"}, "activation"),
                            ({"rope_parameters": {FULL: {"rope_type": "yarn", "factor": 4.0}}}, "rope scaling"),
                            ({"model_type": "gemma3", "text_config": {}}, "multimodal"),
                            ({"model_type": "gemma2"}, "gemma2")]:
        with pytest.raises(UnsupportedModelError, match=message):
            ModelConfig.from_hf_dict(base | change)


# ------------------------------------------------------------------------------------------------
# 4. speculation with the tiny Gemma
# ------------------------------------------------------------------------------------------------
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
LENGTHS = {1: [13], 3: [4, 19, 9]}


def prompts_for(batch):
    out = []
    for i, p in enumerate(random_prompts(LENGTHS[batch], seed=7)):
        out.append((p[:3] * 10)[:len(p)] if i % 2 else p)  # some repeat themselves, for prompt lookup
    return out


def gemma_proposers(draft):
    small = 64 << 10
    return {
        "chain": lambda: DraftModelProposer(draft, "draft", DraftModelConfig(4, kv_cache_bytes=small)),
        "tree": lambda: DraftModelProposer(draft, "draft", DraftModelConfig(3, top_children=3, max_nodes=8,
                                                                            kv_cache_bytes=small)),
        "lookup": lambda: PromptLookupProposer(PromptLookupConfig(4, min_ngram=1, num_branches=3)),
    }


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("kind", ["chain", "tree", "lookup"])
def test_speculative_greedy_equals_plain_with_gemma_target_and_draft(ours, kind, batch, chunked):
    """Target and draft tiny Gemmas (the draft a noisy copy); prompts and outputs run far past the window."""
    # chunked: prompts go in pieces of a few tokens, each after context (a tree of 8 nodes still fits a step)
    sched = dict(max_num_batched_tokens=12, max_num_prefills=2) if chunked else {}
    draft = perturbed_copy(ours, 0.15)
    prompts = prompts_for(batch)
    plain = run_to_completion(make_engine(ours, **sched), prompts, GREEDY)
    proposer = gemma_proposers(draft)[kind]()
    eng = make_engine(ours, proposer, **sched)
    spec = run_to_completion(eng, prompts, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert eng.stats.num_drafted > 0
    if kind != "lookup":
        assert 0 < eng.stats.num_accepted < eng.stats.num_drafted
        assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_speculative_greedy_equals_plain_on_native_gemma_weights(hf, kind):
    from specfleet.runtime.formats import qtensor

    if not native_backend.available():
        pytest.skip(f"native kernels: {native_backend.unavailable_reason()}")
    from tiny_quant_models import quantized_model

    target = quantized_model(hf)
    noisy = tiny_hf_model("gemma3")
    with torch.no_grad():
        for p_draft, p_base in zip(noisy.parameters(), hf.parameters()):
            p_draft.copy_(p_base + torch.randn_like(p_base) * 0.15 * p_base.abs().mean())
    proposer = gemma_proposers(quantized_model(noisy))[kind]()
    prompts = prompts_for(3)
    plain = run_to_completion(make_engine(target), prompts, GREEDY)
    eng = make_engine(target, proposer)
    assert [o.token_ids for o in run_to_completion(eng, prompts, GREEDY)] == [o.token_ids for o in plain]
    assert 0 < eng.stats.num_accepted < eng.stats.num_drafted
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_cross_vocab_gemma_draft_reads_the_text_after_its_bos():
    """A Qwen-like target over one tokenizer and a Gemma draft over another whose tokenizer starts every
    text with BOS (as Gemma's does): the draft cache starts with BOS, greedy output is the target's."""
    from tests.drafting.test_cross_vocab import CORPUS, PROMPTS, draft_tokenizer_from, trained_bpe

    tok = trained_bpe(CORPUS, 300)
    target = ours_from_hf(tiny_hf_model("qwen2", seed=7, vocab_size=tok.get_vocab_size()))
    dtok, _ = draft_tokenizer_from(tok, drop_every=3)
    bos = dtok.get_vocab_size()
    dtok.add_special_tokens(["<bos>"])
    dtok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    assert dtok.encode("the cat").ids[0] == bos
    draft = ours_from_hf(tiny_hf_model("gemma3", vocab_size=bos + 1))
    inner = DraftModelProposer(draft, "gemma", DraftModelConfig(4, kv_cache_bytes=256 << 10))
    proposer = CrossVocabProposer(inner, dtok, tok)
    assert proposer.start_ids == [bos]
    fed = []
    execute = inner.runner.execute

    def spy(items, blocks):
        fed.extend((it.context_len, it.token_ids[0]) for it in items)
        return execute(items, blocks)

    inner.runner.execute = spy
    prompts = [tok.encode(p).ids for p in PROMPTS]
    plain = run_to_completion(make_engine(target), prompts, GREEDY)
    eng = make_engine(target, proposer)
    assert [o.token_ids for o in run_to_completion(eng, prompts, GREEDY)] == [o.token_ids for o in plain]
    assert eng.stats.num_drafted > 0  # (this random draft is never right: the test is about its cache)
    assert all(t == bos for c, t in fed if c == 0) and any(c == 0 for c, _ in fed)
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert inner.blocks.num_free_blocks == inner.blocks.num_blocks and not proposer._states


# ------------------------------------------------------------------------------------------------
# 5. the real Gemma-3-270M
# ------------------------------------------------------------------------------------------------
TEXT = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
        "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889.")


@pytest.fixture(scope="module")
def gemma_path():
    return optional_model_path("gemma-3-270m")


@pytest.fixture(scope="module")
def gemma_native(gemma_path):
    from specfleet.runtime.loading.load import load_model

    return load_model(str(gemma_path), torch.float32, torch.device("cpu"), quantization="auto")


def real_logits(model, ids):
    runner, blocks = make_runner(model, num_blocks=8, block_size=32)
    blocks.allocate("a", len(ids))
    return runner.execute([ForwardItem("a", ids, 0, list(range(len(ids))))], blocks)


@pytest.mark.real_model
def test_real_gemma_next_token_quality_and_bos(gemma_native):
    """Teacher-forced on plain English, the model is sure of most next tokens: the norms' +1 was taken
    back once (not at all, or twice, and the model reads noise). Its tokenizer starts with BOS."""
    model, tok = gemma_native
    assert model.config.is_gemma3
    assert model.config.layer_types.count(FULL) == 3 and model.config.sliding_window == 512
    ids = tok(TEXT)["input_ids"]
    assert ids[0] == tok.bos_token_id == model.config.bos_token_id == 2
    logits = real_logits(model, ids)
    target = torch.tensor(ids[1:])
    nll = -torch.log_softmax(logits[:-1], -1).gather(1, target[:, None]).mean()
    top1 = (logits[:-1].argmax(-1) == target).float().mean()
    print(f"gemma-3-270m on TEXT: nll {float(nll):.3f}, top-1 {float(top1):.3f}")
    assert nll < 2.5 and top1 > 0.5


@pytest.mark.real_model
def test_real_gemma_logits_match_transformers(gemma_path, gemma_native, monkeypatch):
    """Our dense fp32 model (the converted folder) against transformers' own GGUF loader, and our native
    model (the file's Q4_K/Q5_0/Q6_K/Q8_0 blocks as they are) against both, on a short prompt."""
    required = os.environ.get("SPECFLEET_REQUIRE_REAL") == "1"
    try:
        import accelerate  # noqa: F401 - transformers needs it to load a GGUF itself
    except ImportError:
        if required:
            pytest.fail("the reference check needs `pip install accelerate`")
        pytest.skip("accelerate not installed")
    import transformers

    native, tok = gemma_native
    ckpt = load_checkpoint(gemma_path, torch.float32)
    dense = build_model(ckpt.config, ckpt.weights, torch.float32, torch.device("cpu"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name,
                                                            dtype=torch.float32).eval()
    ids = tok("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")["input_ids"]
    want = hf_logits(ref, ids)
    got = real_logits(dense, ids)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # the native model's products round activations to 8-bit blocks, as llama.cpp does: close, and its
    # top-1 differs from the reference's only where the reference itself nearly ties
    fast = real_logits(native, ids)
    top = fast.argmax(-1)
    margin = want.amax(-1) - want.gather(1, top[:, None])[:, 0]  # 0 where the top-1 agree
    print(f"native vs transformers: max |diff| {float((fast - want).abs().max()):.3f} of max |logit| "
          f"{float(want.abs().max()):.1f}; top-1 agree {float((margin == 0).float().mean()):.3f}, "
          f"largest reference margin where not {float(margin.max()):.3f}")
    assert (margin == 0).float().mean() >= 0.9 and margin.max() < 0.5
    assert F.cosine_similarity(fast, want, dim=-1).min() > 0.99
    assert (fast - want).abs().max() < 0.1 * want.abs().max()  # the bound SmolLM2's native test uses


@pytest.mark.real_model
def test_real_gemma_drafts_for_qwen_losslessly():
    """Gemma-3-270M drafting through text for the installed Qwen target (GGUF weights as they are):
    greedy output equals the target's own, token for token; drafts are accepted; no KV is left behind."""
    from specfleet.llm import LLM
    from specfleet import registry

    optional_model_path("gemma-3-270m")
    target = next((n for n in ("qwen-0.5b", "qwen-1.5b") if registry.is_installed(n)), None)
    if target is None:
        optional_model_path("qwen-0.5b")  # skips
    base = LLM(target, draft=None, dtype="float32")
    llm = LLM.from_model(base.model, base.tokenizer, "gemma-3-270m", name=target, dtype="float32")
    proposer = llm.engine.proposer
    assert isinstance(proposer, CrossVocabProposer) and proposer.start_ids == [2]
    prompts = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
               "The capital of France is", "import numpy as np\n\ndef mean_of(xs):\n"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = base.generate(prompts, params, use_tqdm=False)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = llm.engine.stats
    print(f"gemma-3-270m drafting for {target}: {stats.as_dict()}")
    assert 0 < stats.num_accepted < stats.num_drafted
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks and not proposer._states
