"""The feature-conditioned draft head (drafting/head.py, distill/head_data.py, distill/head_train.py).

On the native SmolLM2-135M: features extracted from Python standard-library sources, a head trained for
a few seconds beats the unigram baseline on held-out code (first-position acceptance against the
target's greedy tokens); as a proposer, alone and in a fleet, greedy output equals plain decoding and
every verified row equals its decode step (the per-row checker), with drafts sometimes right and
sometimes wrong. On a tiny random target: sampled proposals (q over the reduced vocabulary, 0 outside
it) keep the target's distribution (chi-square), and a control that verifies the same draws against a
wrong q is caught.
"""
import json
import random

import pytest
import torch

from specfleet.bench.rowcheck import check_engine_run
from specfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from specfleet.core.features import FeatureLog
from specfleet.core.tree import DraftTree
from specfleet.distill.head_data import extract, load_shards, stdlib_files
from specfleet.distill.head_train import TrainConfig, evaluate, train
from specfleet.drafting.head import HeadDraftConfig, HeadProposer, init_from_target, load_head, save_head
from specfleet.engine.engine import Engine
from specfleet.runtime.backends.native import kernels as native_backend
from specfleet.runtime.formats import qtensor
from specfleet.sampling_params import SamplingParams
from specfleet.strategies.factory import SpecConfig, build_proposer

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_feature_log_keeps_positions():
    log = FeatureLog()
    log.put(0, torch.arange(6.)[:, None])
    log.put(4, torch.tensor([[40.], [50.], [60.]]))  # a step that recomputes from 4 on
    assert (log.start, log.end) == (0, 7)
    assert log.rows(3, 7)[:, 0].tolist() == [3, 40, 50, 60]
    log.discard_before(5)
    assert log.rows(5, 7)[:, 0].tolist() == [50, 60]
    log.put(9, torch.ones(2, 1))  # a gap (a prefix the target never computed here): the log restarts
    assert (log.start, log.end) == (9, 11)
    log.put(0, torch.zeros(3, 1))  # a recompute from the start (preemption)
    assert (log.start, log.end) == (0, 3)


# -- SmolLM2: training and the engine ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    if not native_backend.available():
        pytest.skip(f"native kernels: {native_backend.unavailable_reason()}")
    from tests.conftest import real_model_path
    from specfleet.runtime.loading.load import load_model

    model, tok = load_model(str(real_model_path("smollm2-135m-instruct")), torch.float32, torch.device("cpu"),
                            quantization="auto")
    return model, tok


def _windows(tok, files, window, limit):
    out = []
    for f in files:
        ids = tok.encode(f.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
        out += [ids[s:s + window] for s in range(0, len(ids) - window, window)]
        if sum(map(len, out)) >= limit:
            break
    return out[:max(1, limit // window)]  # whole files would overshoot the limit 3x (and the extraction's time)


@pytest.fixture(scope="module")
def trained(smollm2, tmp_path_factory):
    model, tok = smollm2
    root = tmp_path_factory.mktemp("head")
    files = [f for f in stdlib_files() if 8_000 < f.stat().st_size < 60_000]
    random.Random(3).shuffle(files)
    train_w = _windows(tok, files[:60], 128, 5_000)
    eval_w = _windows(tok, files[-8:], 128, 1_200)
    extract(model, tok, root / "train", 10 ** 9, window=128, windows=iter(train_w), progress=False)
    extract(model, tok, root / "eval", 10 ** 9, window=128, windows=iter(eval_w), progress=False)
    manifest = json.loads((root / "eval" / "manifest.json").read_text())
    manifest["continuation_starts"] = [1] * manifest["windows"]
    (root / "eval" / "manifest.json").write_text(json.dumps(manifest))
    cfg = TrainConfig(draft_vocab=4096, intermediate=512, lr=1e-3, batch_windows=8, max_len=128, depth=2,
                      time_budget_s=120, max_steps=60, eval_every_s=1e9, save_every_s=1e9)
    head = train(model, root / "train", root / "out", cfg, progress=False, log=lambda *a: None)
    path = root / "head.pt"
    save_head(head, path, None)
    return path, root


def test_trained_head_beats_the_unigram_baseline(smollm2, trained):
    model, _ = smollm2
    path, root = trained
    head, _ = load_head(path)
    train_labels = load_shards(root / "train")["labels"]
    top = int(torch.bincount(train_labels.long()).argmax())
    ev = load_shards(root / "eval")
    baseline = float((ev["labels"].long() == top).float().mean())
    starts = json.loads((root / "eval" / "manifest.json").read_text())["continuation_starts"]
    r = evaluate(head, model, ev, starts)
    untrained = evaluate(init_from_target(model, head.token_map.clone(), 512), model, ev, starts)
    print(f"first-position acceptance {r['acc'][1]:.3f} (untrained {untrained['acc'][1]:.3f}, unigram {baseline:.3f})")
    assert r["acc"][1] > max(baseline, untrained["acc"][1]) + 0.05
    assert r["mean_accepted"] > 0.2


def _engine(model, tok, draft, batch=4, budget=512, kv_tokens=None):
    from specfleet.runtime.kv.cache import bytes_per_token

    proposer = build_proposer(draft, SpecConfig(), model.config.vocab_size, torch.float32, torch.device("cpu"),
                              quantization="auto", target_tokenizer=tok, target_model=model)
    block = 4 if kv_tokens else 16
    cache = CacheConfig(block, bytes_per_token(model.config, torch.float32) * (kv_tokens or batch * 512))
    return Engine(model, tok, EngineConfig(cache, SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=budget,
                                                                  mixed_step_factor=None)), proposer)


@pytest.fixture(scope="module")
def code_prompts(smollm2):
    _, tok = smollm2
    files = [f for f in stdlib_files() if 8_000 < f.stat().st_size < 60_000]
    random.Random(4).shuffle(files)
    out = []
    for f in files[:6]:
        ids = tok.encode(f.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
        out.append(ids[200:200 + 96])
    return out


@pytest.mark.real_model
@pytest.mark.parametrize("draft", ["head[path={p}]", "fleet(head[path={p}],suffix)"])
def test_head_greedy_equals_plain_and_rows_are_exact(smollm2, trained, code_prompts, draft):
    model, tok = smollm2
    path, _ = trained
    plain, rep0 = check_engine_run(_engine(model, tok, None), code_prompts, GREEDY)
    spec = draft.format(p=path)
    accepted = drafted = 0
    # a small budget chunks the prompts beside verification; a tight cache preempts and recomputes
    for budget, kv_tokens in ((48, None), (512, max(map(len, code_prompts)) + GREEDY.max_tokens + 96)):
        engine = _engine(model, tok, spec, 4, budget, kv_tokens)
        outs, rep = check_engine_run(engine, code_prompts, GREEDY)
        assert rep.rows_differing == 0, rep.as_dict()
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        assert engine.runner.keep_hidden
        accepted += engine.stats.num_accepted
        drafted += engine.stats.num_drafted
    # over both runs. The head alone keeps some of its drafts and loses others, so both verification paths
    # were checked row by row above. The fleet's choices follow the engine's measured step costs (timing), and
    # with a head this weak it drafts little: CI runs drew 7 and 15 drafted tokens with none kept, so for it
    # the check is only that it drafted (its rows were verified and compared); acceptance is the head's test.
    if draft.startswith("head"):
        assert 0 < accepted < drafted, (accepted, drafted)
    else:
        assert drafted > 0 and accepted <= drafted, (accepted, drafted)


def test_head_needs_the_target(smollm2, trained):
    from specfleet.errors import InvalidRequestError

    model, _ = smollm2
    with pytest.raises(InvalidRequestError):
        build_proposer(f"head[path={trained[0]}]", SpecConfig(), model.config.vocab_size, torch.float32,
                       torch.device("cpu"))


# -- a tiny random target: the sampled proposals' distribution ---------------------------------------------
from tests.engine.test_distribution import ALPHA, PARAMS, exact_joint, generate, one_thread, p_values, setup  # noqa: E402,F401

NUM_REQUESTS = 1500


class WrongQHead(HeadProposer):
    """Control: the same sampled draws, verified against a q that is not the one they were drawn from (uniform
    over the reduced vocabulary). (Dropping q altogether would not do: a draw verified as a point mass is a
    mixture of deterministic proposals, each lossless.)"""

    def propose(self, requests):
        trees = super().propose(requests)
        out = {}
        for k, t in trees.items():
            support = (t.draft_probs > 0).float()
            out[k] = DraftTree(t.token_ids, t.parents, t.origins, support / support.sum(-1, keepdim=True))
        return out


def _tiny_head(target, cls=HeadProposer):
    g = torch.Generator().manual_seed(2)
    head = init_from_target(target, torch.tensor([0, 1, 2, 3, 5, 6]), 48)  # 4 and 7 never proposed: q = 0 there
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return cls(head, target, HeadDraftConfig(num_speculative_tokens=2, min_prob=0.0, min_first_prob=0.0,
                                             quantize=False))


@pytest.mark.parametrize("setting,seed0", [("t1", 3_000_000), ("t0.7-k3", 4_000_000)])
def test_head_sampled_output_follows_the_target(setup, setting, seed0):  # noqa: F811
    hf, target, _, prompt = setup
    joint = exact_joint(hf, prompt, SamplingParams(**PARAMS[setting]))
    proposer = _tiny_head(target)
    samples, stats = generate(target, proposer, prompt, PARAMS[setting], NUM_REQUESTS, seed0)
    assert stats.num_drafted > NUM_REQUESTS
    assert 0.0 < stats.acceptance_rate < 1.0, stats.as_dict()
    p12, p123 = p_values(samples, joint)
    print(f"head/{setting}: acceptance {stats.acceptance_rate:.3f}, p12 {p12:.4g}, p123 {p123:.4g}")
    assert p12 > ALPHA and p123 > ALPHA


def test_head_control_with_a_wrong_q_is_caught(setup):  # noqa: F811
    hf, target, _, prompt = setup
    joint = exact_joint(hf, prompt, SamplingParams(**PARAMS["t1"]))
    samples, _ = generate(target, _tiny_head(target, WrongQHead), prompt, PARAMS["t1"], NUM_REQUESTS, 5_000_000)
    p12, p123 = p_values(samples, joint)
    assert min(p12, p123) < ALPHA


class _RunsOnLoad:
    """An object whose unpickling would call a function: what a hostile head file could hold."""

    def __reduce__(self):
        return (print, ("code from a data file ran",))


def test_a_head_file_holding_objects_is_refused_unloaded(tmp_path, capsys):
    """load_head unpickles tensors, numbers and plain dicts only (torch.load weights_only): a file holding any
    other object is an InvalidRequestError that names it, and nothing in it runs. A plain dict loads (control)."""
    from specfleet.errors import InvalidRequestError

    bad = tmp_path / "bad.pt"
    torch.save({"format": 0, "config": {}, "state": {}, "evil": _RunsOnLoad()}, bad)
    with pytest.raises(InvalidRequestError, match="not a draft head file specfleet can load safely"):
        load_head(bad)
    assert "code from a data file ran" not in capsys.readouterr().out
    plain = tmp_path / "plain.pt"
    torch.save({"format": -1, "config": {}, "state": {}}, plain)
    with pytest.raises(InvalidRequestError, match="head format -1"):  # read fine, refused for its format only
        load_head(plain)
