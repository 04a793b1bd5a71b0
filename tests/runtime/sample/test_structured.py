"""Structured output in the engine (runtime/sample/structured.py, drafting/forced_tokens.py, strategies/structured_front.py).

- Greedy constrained decoding with speculation equals plain constrained decoding token for token on
  SmolLM2-135M (JSON schemas, a regex, a choice, a forced tool call's grammar), with the grammar draft in
  front of the default fleet and as a fleet member; drafts are sometimes kept and sometimes not; every
  output follows its constraint.
- A verification's rows are masked by the state after their own paths; a node the grammar forbids is
  never accepted; the matcher holds only committed tokens afterwards.
- The grammar front cuts forbidden nodes from point-mass trees, continues leaves with forced tokens and
  hands the configured draft feedback on its own tree.
(The sampled case: tests/runtime/sample/test_structured_distribution.py.)
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from specfleet.core.proposer import Feedback, leaves
from specfleet.core.tree import DraftTree
from specfleet.core.verify import verify_greedy
from specfleet.drafting.forced_tokens import ForcedTokensProposer
from specfleet.errors import InvalidRequestError
from specfleet.runtime.sample.structured import close_objects
from specfleet.sampling_params import SamplingParams, StructuredOutputsParams
from specfleet.server.tools import forced_call_grammar, parse_tool_calls
from specfleet.strategies.structured_front import GrammarFront
from tiny_engines import steady_fleets
from tests.runtime.sample.test_structured_distribution import EOS, TinyTokenizer, allowed_first, allowed_second, compiler, regex

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
    "required": ["name", "age", "city", "hobbies"]}
ORDER = {"type": "object", "properties": {
    "item": {"type": "string", "enum": ["pizza", "pasta", "salad"]}, "quantity": {"type": "integer", "maximum": 20},
    "extras": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2},
    "delivery": {"type": "boolean"}}, "required": ["item", "quantity", "extras", "delivery"]}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
CASES = [  # (prompt, constraint, check of the text)
    ("Describe a person as JSON.", StructuredOutputsParams(json=PERSON),
     lambda t: jsonschema.validate(json.loads(t), close_objects(PERSON))),
    ("Order a dinner for two as JSON.", StructuredOutputsParams(json=ORDER),
     lambda t: jsonschema.validate(json.loads(t), close_objects(ORDER))),
    ("Give me a list of 3 colors as JSON.", StructuredOutputsParams(json_object=True),  # may run to max_tokens
     lambda t: t.startswith("{")),
    ("What is the date of the moon landing?", StructuredOutputsParams(regex=r"\d{4}-\d{2}-\d{2}"),
     lambda t: re.fullmatch(r"\d{4}-\d{2}-\d{2}", t) is not None),
    ("Is Python a snake or a language?", StructuredOutputsParams(choice=("snake", "language", "both")),
     lambda t: t in ("snake", "language", "both")),
    ("What is the weather in Paris?", forced_call_grammar([WEATHER_TOOL], parallel=False),
     lambda t: [c.name for c in parse_tool_calls(t)[1]] == ["get_weather"]),
]


@pytest.fixture(scope="module")
def smollm2():
    from tests.conftest import real_model_path
    from specfleet.llm import LLM

    real_model_path("smollm2-135m-instruct")
    return LLM("smollm2-135m-instruct", draft=None, max_num_batched_tokens=1024)


@pytest.mark.real_model
@pytest.mark.parametrize("draft", ["fleet(suffix,prompt-lookup)", "fleet(grammar,suffix,prompt-lookup)"])
def test_greedy_constrained_speculation_equals_plain(smollm2, draft):
    from specfleet.llm import LLM

    spec = LLM.from_model(smollm2.model, smollm2.tokenizer, draft, name="smollm2-135m-instruct",
                          max_num_batched_tokens=1024)
    assert isinstance(spec.engine.proposer, GrammarFront) and spec.engine.proposer.name == draft
    steady_fleets(spec.engine.proposer)  # drafts verified and some kept, however busy the host (tiny_engines)
    convs = [[{"role": "user", "content": p}] for p, _, _ in CASES]
    params = [SamplingParams(temperature=0, max_tokens=72, structured_outputs=c) for _, c, _ in CASES]
    plain = smollm2.chat(convs, params)
    fast = spec.chat(convs, params)
    used: dict[str, int] = {}
    for (prompt, _, check), a, b in zip(CASES, plain, fast):
        assert b.token_ids == a.token_ids, (prompt, a.text, b.text)
        assert b.finish_reason == "stop" or prompt.startswith("Give me"), (prompt, b.text)
        check(b.text)
        for k, v in b.metrics.get("drafts_used", {}).items():
            used[k] = used.get(k, 0) + v
    stats = spec.engine.stats
    print(f"{draft}: {stats.as_dict()} drafts used {used}")
    assert 0 < stats.num_accepted < stats.num_drafted
    assert used.get("grammar", 0) > 0
    assert spec.engine.blocks.num_free_blocks == spec.engine.blocks.num_blocks
    # every per-request grammar state went with its request
    assert all(not leaf._states for leaf in leaves(spec.engine.proposer) if isinstance(leaf, ForcedTokensProposer))


@pytest.mark.real_model
def test_invalid_constraints_are_request_errors(smollm2):
    for bad in (StructuredOutputsParams(regex="(a"), StructuredOutputsParams(json='{"type": '),
                StructuredOutputsParams(grammar="start: undefined_rule")):
        with pytest.raises(InvalidRequestError):
            smollm2.generate("x", SamplingParams(max_tokens=2, structured_outputs=bad))
    assert not smollm2.engine.has_unfinished()


def test_structured_outputs_params_validation():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(InvalidRequestError, match="choice"):
        StructuredOutputsParams(choice=[""])
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")
    with pytest.raises(InvalidRequestError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_close_objects_leaves_explicit_additional_properties():
    s = close_objects({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}},
                                                         "c": {"type": "object", "properties": {},
                                                               "additionalProperties": True}},
                       "$defs": {"d": {"properties": {"properties": {"type": "string"}}}}})
    assert s["additionalProperties"] is False and s["properties"]["a"]["additionalProperties"] is False
    assert s["properties"]["c"]["additionalProperties"] is True
    assert s["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in s["$defs"]["d"]["properties"]["properties"]  # a property named so


def allowed_set(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


def test_rows_are_masked_by_their_own_paths():
    m = compiler().matcher(StructuredOutputsParams(regex=regex()))
    # root -> a (0) -> c (2); root -> b (1) -> d (3); root -> c (2, forbidden first) -> a (0)
    tree = DraftTree([0, 2, 1, 3, 2, 0], [-1, 0, -1, 2, -1, 4], ["x"] * 6)
    rows = torch.randn(len(tree) + 1, 8)
    masked = m.mask_rows(tree, rows)
    assert allowed_set(masked[0]) == allowed_first()
    assert allowed_set(masked[1]) == allowed_second(0) == {2}  # after `a`
    assert allowed_set(masked[3]) == allowed_second(1)  # after `b`
    assert allowed_set(masked[4]) == {x for x in range(7) if (x + 3) % 2 == 0 or x == 1}  # after `b d`
    assert allowed_set(masked[2]) == {x for x in range(7) if (x + 2) % 2 == 0 or x == 0}  # after `a c`
    assert torch.equal(masked[5], rows[5]) and torch.equal(masked[6], rows[6])  # below a forbidden node
    assert m.num_tokens == 0 and allowed_set(m.mask_rows(DraftTree(), rows[:1])[0]) == allowed_first()
    # a forbidden node is never accepted, however the target's raw logits favour it
    rows[0] = torch.tensor([0.0, 0, 9, 0, 0, 0, 0, 0])  # the raw argmax is `c`, which may not come first
    result = verify_greedy(tree, m.mask_rows(tree, rows).argmax(-1).tolist())
    assert 4 not in result.accepted_nodes and result.emitted_tokens(tree)[0] in allowed_first()


class Request:
    def __init__(self, rid: str, prompt: list[int], output: list[int], spec):
        self.request_id, self.prompt_token_ids = rid, prompt
        self.all_token_ids = prompt + output
        self.params = SamplingParams(structured_outputs=spec)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class FixedTrees:
    name = "fixed"

    def __init__(self, trees: dict[str, DraftTree]):
        self.trees, self.feedback, self.released = trees, [], []
        self.num_speculative_tokens = 3  # a capability read through the front

    def propose(self, requests):
        return {r.request_id: self.trees[r.request_id] for r in requests if r.request_id in self.trees}

    def observe(self, feedback):
        self.feedback.extend(feedback)

    def release(self, request_id):
        self.released.append(request_id)


def test_grammar_front_forces_cuts_extends_and_maps_feedback_back():
    shared = compiler()
    spec = StructuredOutputsParams(regex="(abc|bdd|bed|bee)f")
    trees = {"plain": DraftTree.chain([4, 5], "fixed"),
             # after `b` (d or e next: nothing forced): d -> d (allowed) and c (forbidden) -> e
             "cut": DraftTree([3, 3, 2, 4], [-1, 0, -1, 2], ["fixed"] * 4)}
    inner = FixedTrees(trees)
    front = GrammarFront(ForcedTokensProposer(lambda: shared), inner)
    assert front.num_speculative_tokens == 3 and front.name == "fixed" and front.children[1] is inner
    reqs = [Request("plain", [1], [], None), Request("forced", [1], [0], spec), Request("cut", [1], [1], spec)]
    out = front.propose(reqs)
    assert out["plain"] is trees["plain"]  # no grammar: untouched
    assert out["forced"].token_ids == [1, 2, 5] and set(out["forced"].origins) == {"grammar"}  # `bcf` after `a`
    cut = out["cut"]  # `c` (and the `e` below it) cut; after `b d d` the grammar forces `f`
    assert cut.token_ids[:2] == [3, 3] and 2 not in cut.token_ids[:2]
    assert cut.token_ids[2:] == [5] and cut.parents[2:] == [1] and cut.origins[2:] == ["grammar"]
    # feedback: the forced request's stays with the front; the cut tree's maps back to the inner's tree
    front.observe([Feedback("forced", out["forced"], [0, 1, 2], 4, 0.0, [1, 2, 5, EOS]),
                   Feedback("cut", cut, [0, 1, 2], 4, 0.0, [3, 3, 5, EOS]),
                   Feedback("plain", trees["plain"], [0], 2, 0.0, [4, 6])])
    got = {fb.request_id: fb for fb in inner.feedback}
    assert set(got) == {"cut", "plain"}
    assert got["cut"].tree is trees["cut"] and got["cut"].accepted_nodes == [0, 1]
    assert got["cut"].emitted_token_ids == [3, 3, 5, EOS]
    front.release("cut")
    assert inner.released == ["cut"]


@pytest.mark.real_model
def test_forced_tool_call_on_qwen_writes_its_special_tags():
    """Qwen2.5's `<tool_call>` is one added token: the grammar must name that token (a quoted literal of
    its text is allowed by llguidance's mask and then refused when consumed). Skipped where the 0.5B is
    not installed (CI installs SmolLM2 only)."""
    from tests.conftest import optional_model_path
    from specfleet.llm import LLM

    optional_model_path("qwen-0.5b")
    base = LLM("qwen-0.5b", draft=None)
    spec = LLM.from_model(base.model, base.tokenizer, "fleet(suffix,prompt-lookup)", name="qwen-0.5b")
    compiler = base.engine.grammar_compiler()
    tag = base.tokenizer.convert_tokens_to_ids("<tool_call>")
    assert compiler.literal("<tool_call>") == f"<[{tag}]>" and compiler.literal("get_weather") == '"get_weather"'
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    text = base.tokenizer.apply_chat_template(msgs, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
    ids = base.tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=60,
                            structured_outputs=forced_call_grammar([WEATHER_TOOL], False, compiler.literal))
    plain, fast = base.generate([ids], params)[0], spec.generate([ids], params)[0]
    assert plain.token_ids[0] == tag and fast.token_ids == plain.token_ids and plain.finish_reason == "stop"
    [call] = parse_tool_calls(plain.text)[1]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    assert fast.metrics["drafts_used"].get("grammar", 0) > 0
