"""Draft specs: the grammar, its errors, and what the factory builds from them."""
import re

import pytest
import torch

import specfleet.llm
import specfleet.runtime.loading.load
from specfleet.errors import InvalidRequestError
from specfleet.core.proposer import describe
from specfleet.strategies.spec_language import parse
from specfleet.drafting.draft_model import DraftModelProposer
from specfleet.strategies.factory import DEFAULT_HEAD_VOCAB, DEFAULT_P_MIN, ModelCache, SpecConfig, build, build_proposer, layer_cut
from specfleet.strategies.length import LengthController
from specfleet.drafting.ngram_model import NgramProposer
from specfleet.drafting.prompt_lookup import PromptLookupProposer
from specfleet.strategies.selector import SelectorProposer
from specfleet.drafting.staged import StagedProposer
from specfleet.strategies.vote import VoteProposer
from tiny_models import ours_from_hf, perturbed_copy, tiny_hf_model

FULL = "select(vote(qwen-0.5b,qwen-0.5b@18,prompt-lookup),qwen-0.5b,prompt-lookup)+adaptive"


@pytest.fixture(scope="module")
def drafts():
    target = ours_from_hf(tiny_hf_model("qwen2"))
    return {"d1": perturbed_copy(target, 0.1), "d2": perturbed_copy(target, 0.2, seed=1)}


def make(text, drafts, **spec):
    return build(text, SpecConfig(draft_kv_cache_bytes=32 << 10, **spec), drafts.__getitem__, 97)


@pytest.mark.parametrize("text", [FULL, "qwen-0.5b[k=6,width=2]+ngram[ngram_width=3]+adaptive[max_length=6]",
                                  "select[policy=epsilon-greedy,capacities=4:0](./drafts/m.gguf,lookup)"])
def test_specs_round_trip(text):
    assert str(parse(text)) == text
    assert str(parse(text.replace(",", " , "))) == text  # whitespace is ignored


@pytest.mark.parametrize("text,where,message", [
    ("select(a,,b)", 9, "expected a draft name"),
    ("vote", 4, "needs drafts in parentheses"),
    ("max(a,b)", 3, "only vote(...) and select(...)"),
    ("a+turbo", 2, "unknown stage '+turbo'"),
    ("a[k=1", 5, "expected ',' or ']'"),
    ("vote(a,b", 8, "expected ')'"),
    ("a)", 1, "unexpected ')'"),
    ("a[k=1,k=2]", 6, "given twice"),
])
def test_parse_errors_point_at_the_problem(text, where, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as e:
        parse(text)
    assert f"position {where}\n  {text}\n  {' ' * where}^" in str(e.value)


def test_empty_spec_and_none():
    with pytest.raises(InvalidRequestError, match="empty"):
        parse("  ")
    assert build_proposer(None, SpecConfig(), 97, torch.float32, torch.device("cpu")) is None
    assert build_proposer("none", SpecConfig(), 97, torch.float32, torch.device("cpu")) is None


def test_options_are_checked_against_the_config_fields(drafts):
    with pytest.raises(InvalidRequestError, match="unknown option 'speed' for vote; valid options: initial_weight"):
        make("vote[speed=2](d1,d2)", drafts)
    with pytest.raises(InvalidRequestError, match="decision_threshold='often': expected int"):
        make("d1+adaptive[decision_threshold=often]", drafts)
    with pytest.raises(InvalidRequestError, match="policy"):
        make("select[policy=magic](d1,d2)", drafts)


def test_the_factory_builds_the_composition(drafts):
    p = make("select(vote(d1,d2,prompt-lookup),d1,d2+ngram,ngram)+adaptive[max_length=6]", drafts)
    assert isinstance(p, LengthController) and p.config.max_length == 6
    sel = p.inner
    assert isinstance(sel, SelectorProposer)
    vote, d1, staged, ngram = sel.arms
    assert isinstance(vote, VoteProposer) and isinstance(d1, DraftModelProposer)
    assert isinstance(staged, StagedProposer) and isinstance(ngram, NgramProposer)
    assert isinstance(vote.children[2], PromptLookupProposer)
    assert vote.children[0] is d1  # one proposer (one KV cache) for equal leaves outside a vote
    assert staged.draft is not vote.children[1] and staged.draft.model is drafts["d2"]  # own cache, shared weights
    assert staged.ngram is ngram.model  # one set of n-gram tables
    assert [a.name for a in sel.arms] == ["vote(d1,d2,prompt-lookup)", "d1", "d2+ngram", "ngram"]
    p.set_num_speculative_tokens(3)
    assert d1.config.num_speculative_tokens == 3 and staged.draft.config.num_speculative_tokens == 3
    info = describe(p)
    assert info["vote(d1,d2,prompt-lookup)"]["weights"] == {"d1": 1.0, "d2": 1.0, "prompt-lookup": 1.0}
    assert info[p.name]["length"] == 3


def test_draft_options_and_defaults(drafts):
    d = make("d1[k=6,width=2,nodes=9]", drafts)
    assert (d.config.num_speculative_tokens, d.config.top_children, d.config.max_nodes) == (6, 2, 9)
    d = make("d1", drafts, num_speculative_tokens=5, top_children=3)
    assert (d.config.num_speculative_tokens, d.config.top_children) == (5, 3)
    assert make("lookup", drafts, top_children=2).config.num_branches == 2
    # an optional field left at None takes its declared type (head_vocab: int | None), and none unsets it
    d = make("d1[head_vocab=40]", drafts)
    assert d.config.head_vocab == 40
    # a same-vocabulary draft drafts over the first DEFAULT_HEAD_VOCAB ids unless told otherwise
    assert make("d1", drafts).config.head_vocab == DEFAULT_HEAD_VOCAB
    assert make("d1[head_vocab=none]", drafts).config.head_vocab is None
    # and stops its chains where it doubts its next token, unless told otherwise
    assert make("d1", drafts).config.p_min == DEFAULT_P_MIN > 0
    assert make("d1[p_min=0]", drafts).config.p_min == 0.0
    with pytest.raises(InvalidRequestError, match="invalid draft-model settings"):
        make("d1[p_min=1.5]", drafts)
    with pytest.raises(InvalidRequestError, match="head_vocab='many': expected int"):
        make("d1[head_vocab=many]", drafts)


def test_compositions_that_cannot_work_are_refused(drafts):
    with pytest.raises(InvalidRequestError, match="twice"):
        make("vote(d1,d1)", drafts)
    with pytest.raises(InvalidRequestError, match="appears twice inside one vote"):
        make("vote(d1,select(d1,d2))", drafts)
    with pytest.raises(InvalidRequestError, match="must follow a model name"):
        make("prompt-lookup+ngram", drafts)
    with pytest.raises(InvalidRequestError, match="at least two"):
        make("select(d1)", drafts)


def test_each_model_loads_once_and_layer_cuts_share_weights(monkeypatch, drafts):
    calls = []

    def fake_load(name, dtype, device, with_tokenizer=True, quantization=None):
        calls.append(name)
        return drafts[name.split("@")[0]], None

    monkeypatch.setattr(specfleet.runtime.loading.load, "load_model", fake_load)
    p = build_proposer("vote(d1,d1@1,d2@1)", SpecConfig(draft_kv_cache_bytes=32 << 10), 97, torch.float32,
                       torch.device("cpu"))
    assert sorted(calls) == ["d1", "d2@1"]  # d1 whole once (d1@1 is cut from it); d2 only at depth 1
    cut = p.children[1].model
    assert cut.config.num_layers == 1 and len(cut.layers) == 1 and cut.layers[0] is drafts["d1"].layers[0]
    assert len(drafts["d1"].layers) == 2  # the original is untouched
    cache = ModelCache(torch.float32, torch.device("cpu"), ["d1", "d1@x"])
    with pytest.raises(InvalidRequestError, match="positive layer count"):
        cache("d1@x")
    with pytest.raises(InvalidRequestError, match="cannot keep 3 layers"):
        layer_cut(drafts["d1"], 3)
    picked = layer_cut(drafts["d1"], [1])  # any layers, in order (benchmarks/drafts/agreement.py drops middle ones)
    assert picked.config.num_layers == 1 and picked.layers[0] is drafts["d1"].layers[1]
    for bad in ([], [2], [0, 0]):
        with pytest.raises(InvalidRequestError, match="cannot keep layers"):
            layer_cut(drafts["d1"], bad)


def test_ngram_tables_come_from_a_file_when_named(tmp_path, drafts):
    from specfleet.drafting.ngram_model import NgramModel

    m = NgramModel()
    m.add([5, 6, 7, 5, 6, 8])
    m.save(tmp_path / "t.json")
    p = make(f"select(d1+ngram[path={tmp_path}/t.json,ngram_width=3],ngram[path={tmp_path}/t.json])", drafts)
    staged, ngram = p.arms
    assert staged.config.ngram_width == 3 and staged.ngram is ngram.model and ngram.model.tables == m.tables
    with pytest.raises(InvalidRequestError, match="cannot read n-gram tables"):
        make(f"d1+ngram[path={tmp_path}/missing.json]", drafts)
