"""Retrieval drafting from a datastore (drafting/datastore.py): the suffix array and the lookup against brute
force, the trees, the files and their checks, the draft spec, the CLI, and losslessness in the engine (greedy
equality; the sampled distribution by the chi-square harness)."""
import json

import numpy as np
import pytest

from specfleet.drafting import datastore as ds
from specfleet.drafting.datastore import Datastore, DatastoreConfig, DatastoreProposer, grow, suffix_array
from specfleet.errors import InvalidRequestError
from specfleet.sampling_params import SamplingParams
from specfleet.strategies.factory import SpecConfig, build
from tests.engine.test_distribution import ALPHA, PARAMS, VOCAB, exact_joint, generate, p_values, setup  # noqa: F401
from tiny_engines import count_shapes, make_engine, repetitive_prompts, steady_fleets
from tiny_models import ours_from_hf, run_to_completion, tiny_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


# -- the suffix array and the lookup ---------------------------------------------------------------
@pytest.mark.parametrize("depth", [1, 2, 4, 64])
def test_suffix_array_sorts_by_the_first_tokens_then_position(depth):
    rng = np.random.default_rng(depth)
    for _ in range(60):
        a = rng.integers(-1, 3, int(rng.integers(1, 50))).astype(np.int32)
        # past the end sorts before every token, a file boundary (-1) before every token id
        key = lambda i: ([int(x) + 2 for x in a[i:i + depth]] + [0] * max(0, i + depth - len(a)), i)  # noqa: E731
        assert suffix_array(a, depth).tolist() == sorted(range(len(a)), key=key), a


def brute_match(seqs, context, max_match, min_count=1):
    """(length, sorted forward positions of the next tokens) of the longest suffix of `context` occurring at
    least min_count times within one sequence."""
    flat, starts, pos = [], [], 0
    for s in seqs:
        starts.append(pos)
        flat += list(s) + [-1]
        pos += len(s) + 1
    best = (0, [])
    for m in range(1, min(max_match, len(context)) + 1):
        pat = list(context[-m:])
        hits = [i + m for i in range(len(flat) - m + 1) if flat[i:i + m] == pat]
        if len(hits) < min_count:
            break
        best = (m, sorted(hits))
    return best


def test_longest_match_and_its_continuations_match_brute_force():
    rng = np.random.default_rng(0)
    for trial in range(150):  # every third corpus long enough that ranges over 64 suffixes are bisected
        size = 200 if trial % 3 == 0 else 30
        seqs = [rng.integers(0, 3, int(rng.integers(1, size))).tolist() for _ in range(int(rng.integers(1, 4)))]
        store = Datastore.build(seqs)
        context = rng.integers(0, 3, int(rng.integers(1, 10))).tolist()
        min_count = int(rng.integers(1, 3))
        length, lo, hi = store.longest_match(context, 8, min_count)
        want_len, want_pos = brute_match(seqs, context, 8, min_count)
        assert length == want_len, (seqs, context)
        if length:
            got = sorted(store.continuation_positions(lo, hi, length, 10_000).tolist())
            assert got == want_pos, (seqs, context)


def test_a_large_range_is_sampled_evenly():
    store = Datastore.build([[1, 2] * 500])
    length, lo, hi = store.longest_match([1], 4)
    assert (length, hi - lo) == (1, 500)
    pos = store.continuation_positions(lo, hi, length, 50)
    assert len(pos) == len(set(pos.tolist())) == 50 and (np.asarray(store.tokens[pos]) == 2).all()


def test_tree_worked_example():
    # after "... 7 1 2 3" the corpus continued with 4 twice (then 6 once and 8 once) and with 5 once
    store = Datastore.build([[1, 2, 3, 4, 6], [1, 2, 3, 5], [9, 1, 2, 3, 4, 8]])
    p = DatastoreProposer(store, DatastoreConfig(min_match=2, min_prob=0.2, max_nodes=8, factor=2.0))
    tree = p.draft([7, 1, 2, 3])  # a 3-token match: a budget of 6 nodes
    # scores: 4 (2/3), 5 (1/3), 4->6 and 4->8 (1/3 each); the ends of files (-1) are never proposed
    assert tree.token_ids == [4, 5, 6, 8] and tree.parents == [-1, -1, 0, 0]
    assert set(tree.origins) == {"datastore"}
    assert DatastoreProposer(store, DatastoreConfig(min_match=2, min_prob=0.5)).draft([7, 1, 2, 3]).token_ids == [4]
    assert p.draft([7, 7, 3]) is None  # a one-token match is below min_match
    # the budget follows the match (factor 1): 3 nodes for the 3-token match, 2 for a 2-token one
    one = DatastoreConfig(min_match=2, min_prob=0.0)
    assert DatastoreProposer(store, one).draft([7, 1, 2, 3]).token_ids == [4, 5, 6]
    assert len(DatastoreProposer(store, one).draft([2, 3])) == 2


def test_grow_spends_its_budget_best_first():
    # after 5: 1 three times in four, then 1 (twice) or 2; 3 once
    store = Datastore.build([[5, 1, 1], [5, 1, 1], [5, 1, 2], [5, 3]])
    after5 = np.array([1, 5, 9, 13])
    tree, score = grow(store, after5, 2, 4, 0.0, "x")
    assert tree.token_ids == [1, 1] and tree.parents == [-1, 0] and score == pytest.approx(3 / 4 + 2 / 4)
    tree, score = grow(store, after5, 8, 4, 0.0, "x")  # ties (3 and 1->2 at 1/4) in the order they were offered
    assert tree.token_ids == [1, 1, 3, 2] and tree.parents == [-1, 0, -1, 0] and score == pytest.approx(1.75)
    assert grow(store, after5, 8, 1, 0.0, "x")[0].token_ids == [1, 3]  # depth 1: no grandchildren


# -- files -------------------------------------------------------------------------------------------
class FakeTokenizer:
    """Characters as token ids (a byte-level tokenizer), with a vocabulary for the fingerprint."""

    def __init__(self, shift=0):
        self.shift = shift

    def get_vocab(self):
        return {chr(i + self.shift): i for i in range(128)}

    def encode(self, text, add_special_tokens=False):
        return [min(ord(c), 127) for c in text]


def test_save_load_and_corrupt_or_foreign_files_are_refused(tmp_path):
    store = Datastore.build([[1, 2, 3], [4, 5]], {"tokenizer": ds.tokenizer_fingerprint(FakeTokenizer())})
    store.save(tmp_path / "s")
    back = Datastore.load(tmp_path / "s")
    assert back.tokens.tolist() == [1, 2, 3, -1, 4, 5, -1] and back.sa.tolist() == store.sa.tolist()
    ds.check_tokenizer(back, FakeTokenizer(), "s")
    with pytest.raises(InvalidRequestError, match="another tokenizer"):
        ds.check_tokenizer(back, FakeTokenizer(shift=1), "s")
    with pytest.raises(InvalidRequestError, match="no meta.json"):
        Datastore.load(tmp_path / "missing")
    meta = json.loads((tmp_path / "s" / "meta.json").read_text())
    (tmp_path / "s" / "meta.json").write_text(json.dumps({**meta, "num_tokens": 99}))
    with pytest.raises(InvalidRequestError, match="corrupt"):
        Datastore.load(tmp_path / "s")
    (tmp_path / "s" / "meta.json").write_text("{not json")
    with pytest.raises(InvalidRequestError, match="corrupt"):
        Datastore.load(tmp_path / "s")
    with pytest.raises(InvalidRequestError, match=">= 0"):
        Datastore.build([[1, -3]])


def test_the_default_store_is_built_once_from_the_standard_library(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFLEET_CACHE", str(tmp_path))
    files = [f for f in ds.python_sources() if f.name in ("bisect.py", "colorsys.py")]
    assert len(files) == 2 and not any("site-packages" in str(f) or "/test/" in str(f) for f in ds.python_sources())
    monkeypatch.setattr(ds, "python_sources", lambda: files)
    tok, logs = FakeTokenizer(), []
    store = ds.stdlib_datastore(tok, log=logs.append)
    folder = ds.default_folder(tok)
    assert folder.parent == tmp_path / "datastores" and (folder / "meta.json").is_file() and len(logs) == 1
    text = "".join(f.read_text() for f in files)
    assert len(store) == len(text) + 2 and store.meta["num_files"] == 2
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".build-")]  # the private folder is gone
    again = ds.stdlib_datastore(tok, log=logs.append)
    assert len(logs) == 1 and len(again) == len(store)  # loaded, not rebuilt
    # a cache that cannot be written (here a file where the folder would go): the store is kept in memory
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    monkeypatch.setenv("SPECFLEET_CACHE", str(blocked))
    mem = ds.stdlib_datastore(tok, log=logs.append)
    assert len(mem) == len(store) and "keeping the store in memory" in logs[-1]


# -- the draft spec and the CLI -------------------------------------------------------------------------
def test_spec_options_paths_and_errors(tmp_path):
    Datastore.build([[1, 2, 3, 4]] * 2).save(tmp_path / "s")
    load = {}.__getitem__
    p = build(f"datastore[path={tmp_path / 's'},k=3,nodes=5,min_match=2]", SpecConfig(), load, 97)
    assert isinstance(p, DatastoreProposer) and (p.config.max_depth, p.config.max_nodes, p.config.min_match) == (3, 5, 2)
    assert p.draft([1, 2]).token_ids == [3, 4]
    with pytest.raises(InvalidRequestError, match="target's tokenizer"):
        build("datastore", SpecConfig(), load, 97)
    with pytest.raises(InvalidRequestError, match="no meta.json"):
        build(f"datastore[path={tmp_path / 'nothing'}]", SpecConfig(), load, 97)
    with pytest.raises(InvalidRequestError, match="beyond the target's vocabulary of 3"):
        build(f"datastore[path={tmp_path / 's'}]", SpecConfig(), load, 3)
    with pytest.raises(InvalidRequestError, match="min_match <= max_match"):
        build(f"datastore[path={tmp_path / 's'},min_match=30]", SpecConfig(), load, 97)
    with pytest.raises(InvalidRequestError, match="must follow a model name"):
        build("datastore+ngram", SpecConfig(), load, 97)


def test_cli_builds_from_a_folder_and_reports(tmp_path, monkeypatch, capsys):
    from specfleet.cli.main import main

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("def f(x):\n    return x + 1\n")
    monkeypatch.setattr("specfleet.drafting.cross_vocab.load_tokenizer", lambda name: FakeTokenizer())
    assert main(["datastore", "build", "--model", "m", "--no-stdlib", "--dir", str(src), "--out",
                 str(tmp_path / "s")]) == 0
    assert len(Datastore.load(tmp_path / "s")) == len("def f(x):\n    return x + 1\n") + 1
    assert main(["datastore", "info", str(tmp_path / "s")]) == 0
    assert "num_files 1" in capsys.readouterr().out
    assert main(["datastore", "build", "--model", "m", "--no-stdlib", "--out", str(tmp_path / "t")]) == 2


# -- losslessness in the engine -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def target():
    return ours_from_hf(tiny_hf_model("qwen2"))


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("spec", ["datastore[path={p},min_match=2]",
                                  "fleet[margin=0.001](datastore[path={p},min_match=2],prompt-lookup)"])
def test_speculative_greedy_equals_plain_greedy(target, tmp_path, spec, batch):
    prompts = repetitive_prompts({1: [13], 3: [4, 19, 9]}[batch])
    plain = run_to_completion(make_engine(target), prompts, GREEDY)
    # a corpus that holds the outputs of other prompts (and these outputs shifted), so drafts are sometimes
    # right and sometimes wrong
    others = run_to_completion(make_engine(target), repetitive_prompts([7, 11, 5, 16]), GREEDY)
    Datastore.build([o.token_ids for o in others] + [o.token_ids[5:] for o in plain]).save(tmp_path / "s")
    proposer = steady_fleets(build(spec.format(p=tmp_path / "s"), SpecConfig(), {}.__getitem__, 97))
    eng = make_engine(target, proposer)
    out = run_to_completion(eng, prompts, GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    name = next(n for n in eng.stats.drafted_by if n.startswith("datastore"))
    assert 0 < eng.stats.accepted_by.get(name, 0) < eng.stats.drafted_by[name], eng.stats.as_dict()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_sampled_output_follows_the_target(setup):  # noqa: F811
    hf, target, _, prompt = setup
    params = SamplingParams(**PARAMS["t1"])
    joint = exact_joint(hf, prompt, params)
    # a corpus of every two-token string followed by a skewed choice of next tokens: every context has
    # continuations, most branched
    store = Datastore.build([[a, b, (a + b + k * k) % VOCAB] for a in range(VOCAB) for b in range(VOCAB) for k in range(3)])
    proposer = DatastoreProposer(store, DatastoreConfig(min_match=1, min_prob=0.0, max_nodes=4, factor=4.0))
    shapes = count_shapes(proposer)
    samples, stats = generate(target, proposer, prompt, PARAMS["t1"], 1500, 14_000_000)
    assert stats.num_drafted > 1500 // 4 and 0.0 < stats.acceptance_rate < 1.0, stats.as_dict()
    assert shapes["branched"] > 0, shapes
    p12, p123 = p_values(samples, joint)
    assert p12 > ALPHA and p123 > ALPHA, (p12, p123)


def test_installing_the_default_model_builds_its_store(tmp_path, monkeypatch, capsys):
    from specfleet.cli.models import _default_datastore
    from specfleet.llm import DEFAULT_DRAFT, DEFAULT_MODEL

    assert "datastore" in DEFAULT_DRAFT["cpu"]
    monkeypatch.setenv("SPECFLEET_CACHE", str(tmp_path))
    files = [f for f in ds.python_sources() if f.name == "colorsys.py"]
    monkeypatch.setattr(ds, "python_sources", lambda: files)
    monkeypatch.setattr("specfleet.drafting.cross_vocab.load_tokenizer", lambda name: FakeTokenizer())
    _default_datastore("smollm2-135m-instruct")  # another model's default draft holds no datastore
    assert not (tmp_path / "datastores").exists()
    _default_datastore(DEFAULT_MODEL)
    assert (ds.default_folder(FakeTokenizer()) / "meta.json").is_file()
    assert "standard-library tokens" in capsys.readouterr().out
