"""The backoff n-gram model, its files and CLI, and staged drafting (n-gram -> draft model -> target)."""
import pytest
import torch

from specfleet.engine.request import Request
from specfleet.errors import InvalidRequestError
from specfleet.sampling_params import SamplingParams
from specfleet.drafting.draft_model import DraftModelConfig, DraftModelProposer
from specfleet.cli.ngram import run_ngram_args
from specfleet.drafting.ngram_model import NgramModel
from specfleet.drafting.staged import StagedConfig, StagedProposer
from tiny_engines import make_engine, repetitive_prompts
from tiny_models import ours_from_hf, perturbed_copy, run_to_completion, tiny_hf_model

A, B, C, D, X = 1, 2, 3, 4, 9


def trained(order=3, min_count=1):
    m = NgramModel(order, min_count)
    m.add([A, B, C, A, B, D, A, B, C])
    return m


def test_backoff_falls_from_trigram_to_bigram_to_unigram():
    m = trained()
    assert m.backoff_order([A, B]) == 3  # (a, b) was seen
    assert m.candidates([A, B], 3) == [(C, pytest.approx(2 / 3)), (D, pytest.approx(1 / 3))]
    assert m.backoff_order([X, B]) == 2  # (x, b) unknown: the bigram context (b,)
    assert m.candidates([X, B], 1) == [(C, pytest.approx(2 / 3))]
    assert m.backoff_order([X]) == 1  # (x,) unknown: unigrams, most frequent first, lower id on ties
    assert m.candidates([X], 4) == [(A, pytest.approx(3 / 9)), (B, pytest.approx(3 / 9)), (C, pytest.approx(2 / 9)),
                                    (D, pytest.approx(1 / 9))]
    assert NgramModel().backoff_order([A]) == 0 and NgramModel().candidates([A], 2) == []


def test_min_count_skips_rare_contexts():
    m = trained(min_count=2)
    assert m.backoff_order([B, D]) == 1  # (b, d) seen once, (d,) once: both too rare -> unigrams
    assert m.backoff_order([C, A]) == 2  # (c, a) seen once -> the bigram (a,), seen 3 times


def test_adding_in_pieces_counts_each_ngram_once():
    whole, pieces = NgramModel(), NgramModel()
    seq = [A, B, C, A, B, D, A, B, C]
    whole.add(seq)
    pieces.add(seq[:4])
    pieces.add(seq, start=4)
    assert whole.tables == pieces.tables


def test_learning_counts_each_requests_tokens_once():
    once, learned = NgramModel(), NgramModel()
    once.add([A, B, C, D])
    learned.learn("r", [A, B])
    learned.learn("r", [A, B, C, D])
    learned.learn("r", [A, B, C, D])  # a second proposer sharing the tables, or a preempted request
    assert learned.tables == once.tables


def test_propose_tree_is_best_first_and_respects_limits():
    m = trained()
    tree = m.propose_tree([C, A, B], depth=2, width=2, max_nodes=3, min_prob=0.0, origin="ngram")
    # after "a b": c (2/3), d (1/3); after "b c": a (1.0) -> c a (2/3) beats d (1/3)
    assert tree.token_ids == [C, A, D] and tree.parents == [-1, 0, -1] and tree.origins == ["ngram"] * 3
    assert len(m.propose_tree([C, A, B], 2, 2, 8, min_prob=0.5, origin="n")) == 2  # d (1/3) is below 0.5
    assert max(m.propose_tree([A], 3, 2, 16, 0.0, "n").depths()) <= 3


@pytest.mark.parametrize("suffix", ["t.json", "t.json.gz"])
def test_tables_round_trip_through_a_file(tmp_path, suffix):
    m = trained()
    m.save(tmp_path / suffix)
    back = NgramModel.load(tmp_path / suffix)
    assert back.tables == m.tables and back.order == 3
    assert back.candidates([A, B], 2) == m.candidates([A, B], 2)


def test_bad_table_files_are_clear_errors(tmp_path):
    with pytest.raises(InvalidRequestError, match="cannot read"):
        NgramModel.load(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text('{"format": "other"}')
    with pytest.raises(InvalidRequestError, match="specfleet ngram build"):
        NgramModel.load(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("not json")
    with pytest.raises(InvalidRequestError, match="not an n-gram table"):
        NgramModel.load(tmp_path / "y.json")


def test_cli_builds_tables_from_token_ids(tmp_path):
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2 3 1 2 4\n1 2 3\n")
    out = tmp_path / "tables.json"
    assert run_ngram_args(["build", "--token-ids-file", str(ids), "--out", str(out), "--order", "2"]) == 0
    m = NgramModel.load(out)
    assert m.order == 2 and m.candidates([2], 1) == [(3, pytest.approx(2 / 3))]


# -- staged drafting ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models():
    target = ours_from_hf(tiny_hf_model("qwen2"))
    return target, perturbed_copy(target, 0.15)


def test_staged_greedy_chain_is_the_plain_drafts_chain_in_fewer_forwards(models):
    _, draft = models
    cfg = DraftModelConfig(6, kv_cache_bytes=64 << 10)
    plain = DraftModelProposer(draft, "d", cfg)
    staged = StagedProposer(DraftModelProposer(draft, "d", DraftModelConfig(6, kv_cache_bytes=64 << 10)),
                            NgramModel(), StagedConfig(ngram_width=2))
    reqs = [Request(f"r{i}", p, SamplingParams(temperature=0)) for i, p in enumerate(repetitive_prompts([12, 20, 9]))]
    for r in reqs:  # teach the n-gram model the draft's own continuation, as `ngram build` would
        chain = plain.propose([r])[r.request_id].token_ids
        plain.release(r.request_id)  # a draft cache drafts once per committed step
        staged.ngram.add(r.all_token_ids + chain)
    a, b = plain.propose(reqs), staged.propose(reqs)
    assert {k: t.token_ids for k, t in a.items()} == {k: t.token_ids for k, t in b.items()}
    assert staged.num_rounds < 6  # one forward per round for all requests, fewer than k plain steps
    assert any(o == "ngram" for t in b.values() for o in t.origins)
    for r in reqs:
        assert staged.draft.blocks.num_tokens(r.request_id) == r.num_tokens  # rolled back to the committed
        staged.release(r.request_id)
    assert staged.draft.blocks.num_free_blocks == staged.draft.blocks.num_blocks


def test_staged_marks_each_tokens_origin_in_the_output(models):
    target, draft = models
    staged = StagedProposer(DraftModelProposer(draft, "d", DraftModelConfig(4, kv_cache_bytes=64 << 10)), NgramModel())
    eng = make_engine(target, staged)
    out = run_to_completion(eng, repetitive_prompts([16, 24]), SamplingParams(temperature=0, max_tokens=40,
                                                                                ignore_eos=True))
    origins = {o for r in out for o in r.token_origins}
    assert origins == {"target", "d", "ngram"}


def test_staged_rejects_a_tree_shaped_draft(models):
    _, draft = models
    with pytest.raises(InvalidRequestError, match="tree width"):
        StagedProposer(DraftModelProposer(draft, "d", DraftModelConfig(3, top_children=2)), NgramModel())


def test_sampled_staged_chain_records_a_draft_row_per_token(models):
    _, draft = models
    staged = StagedProposer(DraftModelProposer(draft, "d", DraftModelConfig(5, kv_cache_bytes=64 << 10)), NgramModel())
    reqs = [Request("s", repetitive_prompts([20])[0], SamplingParams(temperature=1.0, seed=3))]
    tree = staged.propose(reqs)["s"]
    assert len(tree) == 5 and tree.draft_probs.shape == (5, 97)
    assert torch.allclose(tree.draft_probs.sum(-1), torch.ones(5))
    assert all(tree.draft_probs[i, t] > 0 for i, t in enumerate(tree.token_ids))


# ---- bounded memory: online learning forgets the oldest tokens beyond max_entries ----

def fresh_stream(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 5000, (n,), generator=g).tolist()


def motif_stream(n, motifs, seed=0):
    import random

    rng, out = random.Random(seed), []
    while len(out) < n:
        out.extend(rng.choice(motifs))
    return out[:n]


def learn_as_requests(model, stream, per_request=500, step=3, first=0):
    """Learn `stream` as an engine would: requests of `per_request` tokens growing `step` tokens a step
    (named after their first token's place in the whole stream, which `stream` starts at `first`)."""
    for r in range(0, len(stream), per_request):
        seq = stream[r:r + per_request]
        for end in range(step, len(seq) + step, step):
            model.learn(f"r{first + r}", seq[:end])


def what_it_counts(model):
    """A model that counted exactly the tokens `model` still remembers learning (its reference)."""
    ref = NgramModel(model.order)
    for learned in model._learned.values():
        toks = list(learned.tokens)
        c = len(toks) - learned.num_counted
        ref.add(toks, start=c)
    return ref


def test_learning_stays_within_max_entries_and_forgets_the_oldest_first():
    import tracemalloc

    model = NgramModel(3, max_entries=3000)
    stream = fresh_stream(40_000)
    tracemalloc.start()
    learn_as_requests(model, stream[:10_000])
    early, _ = tracemalloc.get_traced_memory()
    learn_as_requests(model, stream[10_000:], first=10_000)
    late, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert model.num_entries <= 3000 and model.num_learned_tokens <= 3000
    assert late < early * 1.2, f"memory grew from {early:,} to {late:,} bytes"
    # what is left is the newest stream, counted exactly as if only it had been learned
    assert model.tables == what_it_counts(model).tables
    assert set(model._learned) <= {f"r{r}" for r in range(35_000, 40_000, 500)}
    assert sum(model.totals[0].values()) == model.num_learned_tokens


def test_one_request_longer_than_the_bound_is_a_sliding_window():
    model = NgramModel(3, max_entries=1000)
    stream = fresh_stream(5000, seed=1)
    for end in range(1, len(stream) + 1, 7):
        model.learn("long", stream[:end])
    model.learn("long", stream)
    learned = model._learned["long"]
    assert learned.end == len(stream) and model.num_entries <= 1000
    ref = NgramModel(3)
    ref.add(stream, start=learned.first)
    assert model.tables == ref.tables
    model.learn("long", stream)  # nothing new: nothing counted again
    assert model.tables == ref.tables


def test_a_bounded_model_still_predicts_a_repetitive_stream():
    """Acceptance stays useful: on a stream of recurring motifs, the top guess of tables bounded to a few
    thousand entries and tokens is right about as often as that of tables that kept everything."""
    import random

    rng = random.Random(3)
    motifs = [[rng.randrange(5000) for _ in range(rng.randint(5, 30))] for _ in range(40)]
    stream = motif_stream(60_000, motifs)
    bounded, unbounded = NgramModel(3, max_entries=3000), NgramModel(3, max_entries=10**9)
    hits = {"bounded": 0, "unbounded": 0}
    for model, name in ((bounded, "bounded"), (unbounded, "unbounded")):
        learn_as_requests(model, stream[:50_000])
        for i in range(50_000, 60_000):
            guess = model.candidates(stream[i - 2:i], 1)
            hits[name] += bool(guess) and guess[0][0] == stream[i]
    assert bounded.num_entries < unbounded.num_entries / 2  # (5868 kept by the unbounded tables here)
    assert hits["bounded"] >= 0.97 * hits["unbounded"] and hits["bounded"] > 0.9 * 10_000, hits


def test_loaded_tables_are_kept_and_the_bound_comes_on_top_of_them():
    """Tables from a file (here: built with add) are never forgotten, and learning still has max_entries
    of room beyond them, even when the file alone is larger than that."""
    model = NgramModel(3, max_entries=1000)
    model.add(fresh_stream(3000, seed=5))
    built = {n: {ctx: dict(row) for ctx, row in t.items()} for n, t in enumerate(model.tables)}
    base = model.num_entries
    learn_as_requests(model, fresh_stream(10_000, seed=6))
    assert base < model.num_entries <= base + 1000 and 0 < model.num_learned_tokens <= 1000
    for n, table in built.items():
        for ctx, row in table.items():
            assert all(model.tables[n][ctx][tok] >= c for tok, c in row.items())


def test_max_entries_is_a_table_setting_of_the_draft_spec():
    from specfleet.strategies.factory import SpecConfig, build_proposer

    proposer = build_proposer("ngram[max_entries=1234]", SpecConfig(4, 1, 16), 97, torch.float32, torch.device("cpu"))
    assert proposer.model.max_entries == 1234
    with pytest.raises(InvalidRequestError, match="max_entries"):
        build_proposer("ngram[max_entries=0]", SpecConfig(4, 1, 16), 97, torch.float32, torch.device("cpu"))
