"""The real SmolLM2-135M (from PyPI): logits and greedy generation against transformers, and
speculative greedy equality with a derived draft (the same model cut to fewer layers)."""
import pytest
import torch

from specfleet.config import CacheConfig, EngineConfig
from specfleet.runtime.kv.blocks import BlockManager
from specfleet.engine.engine import Engine
from specfleet.runtime.loading.build import build_model
from specfleet.runtime.kv.cache import KVCache
from specfleet.runtime.step.runner import ForwardItem, ModelRunner
from specfleet.sampling_params import SamplingParams
from specfleet.drafting.draft_model import DraftModelConfig, DraftModelProposer
from specfleet.drafting.prompt_lookup import PromptLookupProposer
from tiny_models import run_to_completion

pytestmark = pytest.mark.real_model
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,",
           "List three colors: red,"]


@pytest.fixture(scope="module")
def models(smollm2_checkpoint):
    transformers = pytest.importorskip("transformers")
    ckpt = smollm2_checkpoint
    ours = build_model(ckpt.config, ckpt.weights, torch.float32, torch.device("cpu"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt.folder), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(ckpt.tokenizer_dir))
    return ckpt, ours, ref, tok


def test_prefill_decode_and_ragged_logits_match_transformers(models):
    ckpt, ours, ref, tok = models
    ids = [tok.encode(p) for p in PROMPTS[:3]]
    kv = KVCache.allocate(ours.config, 64, 16, torch.float32, torch.device("cpu"))
    runner, blocks = ModelRunner(ours, kv, torch.device("cpu")), BlockManager(64, 16)
    # request 0 prefilled whole, request 1 prefilled minus its last token then decoded in the batch,
    # request 2 prefilled in the same batch
    blocks.allocate("b", len(ids[1]) - 1)
    runner.execute([ForwardItem("b", ids[1][:-1], 0, [])], blocks)
    blocks.allocate("a", len(ids[0]))
    blocks.append("b", 1)
    blocks.allocate("c", len(ids[2]))
    out = runner.execute([ForwardItem("a", ids[0], 0, list(range(len(ids[0])))),
                          ForwardItem("b", ids[1][-1:], len(ids[1]) - 1, [0]),
                          ForwardItem("c", ids[2], 0, [len(ids[2]) - 1])], blocks)
    with torch.no_grad():
        want = [ref(torch.tensor([x])).logits[0].float() for x in ids]
    expected = torch.cat([want[0], want[1][-1:], want[2][-1:]])
    torch.testing.assert_close(out, expected, atol=2e-4, rtol=1e-4)


def test_greedy_generation_is_token_identical_to_transformers(models):
    ckpt, ours, ref, tok = models
    eng = Engine(ours, tok, EngineConfig(CacheConfig(16, 64 << 20)))
    ids = [tok.encode(p) for p in PROMPTS]
    outs = run_to_completion(eng, ids, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for x, o in zip(ids, outs):
        with torch.no_grad():
            want = ref.generate(torch.tensor([x]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                                pad_token_id=tok.pad_token_id or 0)[0, len(x):].tolist()
        assert o.token_ids == want


@pytest.mark.parametrize("shape", ["chain", "tree", "lookup"])
def test_speculative_greedy_with_derived_draft_equals_plain(models, shape):
    ckpt, ours, ref, tok = models
    from dataclasses import replace

    draft = build_model(replace(ckpt.config, num_layers=20), ckpt.weights, torch.float32, torch.device("cpu"))
    ids = [tok.encode(p) for p in PROMPTS[:3]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = run_to_completion(Engine(ours, tok, EngineConfig(CacheConfig(16, 64 << 20))), ids, params)
    if shape == "lookup":
        proposer = PromptLookupProposer()
    else:
        cfg = DraftModelConfig(4, kv_cache_bytes=32 << 20) if shape == "chain" else \
            DraftModelConfig(3, top_children=3, max_nodes=8, kv_cache_bytes=32 << 20)
        proposer = DraftModelProposer(draft, "smollm2@20", cfg, ours.config.vocab_size)
    eng = Engine(ours, tok, EngineConfig(CacheConfig(16, 64 << 20)), proposer)
    spec = run_to_completion(eng, ids, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.text for o in spec] == [o.text for o in plain]
    if shape != "lookup":
        assert 0 < eng.stats.num_accepted < eng.stats.num_drafted
