"""JSON schemas for structured output (runtime/sample/json_schema.py): unknown keywords and formats are
annotations; assertions llguidance lacks are rewritten to an exact grammar, narrowed to a subset of the
valid values, or refused with a 400 naming them (strict=false: generated without them, and said so).

Each rewrite is checked on instances against `jsonschema` (the reference validator): the grammar,
walked byte by byte by llguidance, must accept exactly the valid instances (narrowed: only valid ones).
One test generates with SmolLM2 under a schema with an unknown format and an unknown keyword."""
from __future__ import annotations

import json

import jsonschema
import pytest

from specfleet.errors import InvalidRequestError
from specfleet.runtime.sample.structured import COMPACT_JSON
from specfleet.runtime.sample.json_schema import UnenforceableSchemaError, plan
from specfleet.sampling_params import SamplingParams, StructuredOutputsParams

llguidance = pytest.importorskip("llguidance")
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER  # jsonschema asserts json-pointer (with `jsonpointer`)


class ByteTokenizer:
    """llguidance's TokenizerWrapper fields for a vocabulary of the 256 bytes and EOS."""
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    eos_token_id = 256
    bos_token_id = None

    def __call__(self, text):
        return list(text.encode())


@pytest.fixture(scope="module")
def lltok():
    from llguidance._tokenizer import TokenizerWrapper

    return llguidance.LLTokenizer(TokenizerWrapper(ByteTokenizer()), n_vocab=257)


def accepts(lltok, grammar: str, value) -> bool:
    m = llguidance.LLMatcher(lltok, grammar, log_level=0)
    return bool(m.consume_tokens(list(json.dumps(value).encode()))) and m.is_accepting()


def valid(schema, value) -> bool:
    return jsonschema.Draft202012Validator(schema, format_checker=FORMATS).is_valid(value)


# (schema, instances): every rewrite must accept exactly the valid instances
EXACT = [
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}},
     [{}, {"a": 1}, {"b": 2}, {"a": 1, "b": 2}]),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
      "dependentSchemas": {"a": {"required": ["b"]}}},
     [{}, {"a": 1}, {"b": "x"}, {"a": 1, "b": "x"}]),
    ({"if": {"type": "integer"}, "else": {"type": "string"}}, [1, "x", 1.5, None, [1]]),
    ({"not": {"type": ["string", "null"]}}, ["x", None, 1, True, [1], {}]),
    ({"type": "object", "propertyNames": {"pattern": "^[a-c]+$"}, "additionalProperties": {"type": "integer"}},
     [{}, {"ab": 1}, {"d": 1}, {"ab": "x"}]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "unevaluatedProperties": False},
     [{}, {"a": 1}, {"b": 1}, {"a": 1, "b": 2}]),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": {"type": "string"}},
     [[], [1], [1, "x"], [1, 2], ["x"]]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "allOf": [{"$ref": "#/$defs/b"}],
      "$defs": {"b": {"properties": {"b": {"type": "string"}}}}, "unevaluatedProperties": False},
     [{}, {"a": 1}, {"b": "x"}, {"a": 1, "b": "x"}, {"c": 1}, {"a": 1, "b": 2}]),
    ({"type": "array", "allOf": [{"prefixItems": [True, True]}], "unevaluatedItems": False},
     [[], [1], [1, "x"], [1, 2, 3]]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
      "$comment": "c", "title": "t", "examples": [{"a": 1}], "deprecated": True},
     [{"a": 1}, {}, {"a": "x"}]),
    ({"type": "string", "format": "json-pointer"}, ["", "/a/b", "/a~1b", "a", "/a~2"]),
]


@pytest.mark.parametrize("schema,instances", EXACT, ids=[json.dumps(s)[:60] for s, _ in EXACT])
def test_rewrites_are_exact(lltok, schema, instances):
    p = plan(schema, dict(COMPACT_JSON), relaxed=False)
    assert not p.notes.not_enforced and not p.notes.narrowed, p.notes
    assert any(valid(schema, v) for v in instances) and not all(valid(schema, v) for v in instances)
    for v in instances:
        assert accepts(lltok, p.grammar, v) == valid(schema, v), (schema, v)


NARROWED = [
    ({"if": {"properties": {"c": {"const": "US"}}, "required": ["c"]},
      "then": {"properties": {"z": {"pattern": "^[0-9]{5}$"}}}, "else": {"properties": {"z": {"type": "string"}}}},
     "if", [{"c": "US", "z": "12345"}, {"c": "US", "z": "1"}, {"c": "FR", "z": "x"}]),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, "contains", [[3], [3, 1], [1, 3], [1]]),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", [[], [1], [1, 2], [1, 1]]),
    ({"type": "object", "properties": {"ab": {"type": "string"}}, "additionalProperties": {"type": "integer"},
      "propertyNames": {"maxLength": 2}}, "propertyNames", [{"ab": "x"}, {"ab": "x", "c": 1}, {"abc": 1}]),
]


@pytest.mark.parametrize("schema,keyword,instances", NARROWED, ids=[k for _, k, _ in NARROWED])
def test_narrowed_keywords_only_generate_valid_values(lltok, schema, keyword, instances):
    p = plan(schema, dict(COMPACT_JSON), relaxed=False)
    assert [n.keyword for n in p.notes.narrowed] == [keyword]
    accepted = [v for v in instances if accepts(lltok, p.grammar, v)]
    assert accepted, "a narrowed schema still generates something"
    assert all(valid(schema, v) for v in accepted), accepted
    assert any(valid(schema, v) and v not in accepted for v in instances)  # it is a narrowing


def test_unknown_format_and_keyword_are_annotations(lltok):
    schema = {"type": "object", "properties": {"version": {"type": "string", "format": "semver", "maxLength": 12},
                                              "id": {"type": "string", "format": "uuid"}},
              "required": ["version", "id"], "x-order": ["version"], "discriminator": {"propertyName": "kind"}}
    p = plan(schema, dict(COMPACT_JSON), relaxed=False)
    assert sorted(n.text() for n in p.notes.annotations) == [
        "discriminator at #", "format:semver at #/properties/version", "x-order at #"]
    assert not p.notes.not_enforced and not p.notes.narrowed
    good = {"version": "not-a-semver", "id": "123e4567-e89b-12d3-a456-426614174000"}
    assert accepts(lltok, p.grammar, good)  # semver is not asserted
    assert not accepts(lltok, p.grammar, {**good, "id": "nope"})  # uuid, a known format, is
    assert not accepts(lltok, p.grammar, {**good, "version": "x" * 13})  # its other keywords are


@pytest.mark.parametrize("schema,keyword,where", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "minItems": 2}, "uniqueItems", "#"),
    ({"type": "object", "properties": {"a": {"not": {"const": 1}}}}, "not", "#/properties/a"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"properties": {"b": True}}, True],
      "unevaluatedProperties": False}, "unevaluatedProperties", "#"),
    ({"oneOf": [{"type": "integer"}, {"minimum": 2}]}, "oneOf", None),
])
def test_unenforceable_keywords_are_refused_by_name_or_relaxed(schema, keyword, where):
    with pytest.raises(UnenforceableSchemaError) as e:
        plan(schema, dict(COMPACT_JSON), relaxed=False)
    assert e.value.keyword == keyword and e.value.where == (None if where is None else where[1:])
    assert repr(keyword) in str(e.value) and "strict=false" in str(e.value)
    if where is not None:
        assert f"at {where}" in str(e.value)
    relaxed = plan(schema, dict(COMPACT_JSON), relaxed=True)
    assert [n.keyword for n in relaxed.notes.not_enforced] == [keyword]


def test_invalid_schemas_stay_errors():
    for bad in ('{"type": ', False, [1], {"type": "string", "format": 3}, {"$ref": "http://example.com/s.json"}):
        with pytest.raises(InvalidRequestError):
            plan(bad, dict(COMPACT_JSON), relaxed=True)


def test_server_option_relaxes_only_unsaid_strict(lltok):
    from specfleet.server import serving
    from specfleet.server.schemas import ChatCompletionRequest

    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "minItems": 2}

    class Compiler:  # the grammar compiler's one call here, without a tokenizer
        def grammar(self, spec):
            return plan(spec.json, dict(COMPACT_JSON), relaxed=spec.strict is False).grammar

    def req(strict):
        js = {"name": "x", "schema": schema, **({} if strict is None else {"strict": strict})}
        return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                     "response_format": {"type": "json_schema", "json_schema": js}})

    with pytest.raises(UnenforceableSchemaError):
        serving.structured_outputs(req(None), Compiler())
    assert serving.structured_outputs(req(None), Compiler(), relax_schemas=True).strict is False
    assert serving.structured_outputs(req(False), Compiler()).strict is False
    with pytest.raises(UnenforceableSchemaError):
        serving.structured_outputs(req(True), Compiler(), relax_schemas=True)


@pytest.fixture(scope="module")
def smollm2():
    from tests.conftest import real_model_path
    from specfleet.llm import LLM

    real_model_path("smollm2-135m-instruct")
    return LLM("smollm2-135m-instruct", draft="fleet(grammar,prompt-lookup)", max_num_batched_tokens=1024)


@pytest.mark.real_model
def test_unknown_format_and_keyword_generate_valid_json(smollm2):
    schema = {"type": "object", "x-source": "an API description",
              "properties": {"name": {"type": "string", "maxLength": 16},
                             "version": {"type": "string", "format": "semver", "maxLength": 12},
                             "released": {"type": "string", "format": "date"}},
              "required": ["name", "version", "released"]}
    out = smollm2.chat([[{"role": "user", "content": "Describe a software release as JSON."}]],
                       SamplingParams(temperature=0, max_tokens=80,
                                      structured_outputs=StructuredOutputsParams(json=schema)))[0]
    assert out.finish_reason == "stop", out.text
    value = json.loads(out.text)
    jsonschema.validate(value, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    assert sorted(out.metrics["structured_output"]["annotations"]) == ["format:semver at #/properties/version",
                                                                       "x-source at #"]
    assert set(out.metrics["structured_output"]) == {"annotations"}
    with pytest.raises(UnenforceableSchemaError, match="uniqueItems"):
        smollm2.generate("x", SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(
            json={"type": "array", "items": {"type": "integer"}, "minItems": 2, "uniqueItems": True})))
    assert not smollm2.engine.has_unfinished()


def test_every_keyword_and_format_is_in_the_compatibility_table():
    from pathlib import Path

    from specfleet.runtime.sample import json_schema

    text = (Path(__file__).resolve().parents[3] / "docs" / "compatibility.md").read_text(encoding="utf-8")
    table = text[text.index("\n### JSON Schema keywords\n"):]
    table = table[:table.index("\n## ")]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    named = {k for line in rows for k in __import__("re").findall(r"`([^`]+)`", line.split("|")[1])}
    keywords = (json_schema.ENFORCED | json_schema.ANNOTATIONS | json_schema.REWRITTEN) - {"x-guidance", "id"}
    assert keywords <= named, sorted(keywords - named)
    fmt_row = next(line for line in rows if line.startswith("| `format`"))
    assert all(f"`{f}`" in fmt_row for f in json_schema.KNOWN_FORMATS)


def test_relaxed_drops_what_the_engine_cannot_compile_and_says_so(lltok):
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^(?!x)[a-z]+$"},
                                              "n": {"type": "number", "maximum": 1e27}}, "required": ["code"]}
    with pytest.raises(InvalidRequestError, match="regex"):
        plan(schema, dict(COMPACT_JSON), relaxed=False)
    p = plan(schema, dict(COMPACT_JSON), relaxed=True)
    assert sorted(n.keyword for n in p.notes.not_enforced) == ["minimum/maximum", "pattern"], p.notes
    assert accepts(lltok, p.grammar, {"code": "xy", "n": 3}) and not accepts(lltok, p.grammar, {"n": 3})


def test_property_order_is_kept_per_schema(lltok):
    """The plan cache must not take two schemas that differ only in property order for one."""
    ab = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
    ba = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}, "required": ["a", "b"]}
    assert accepts(lltok, plan(ab, dict(COMPACT_JSON), False).grammar, {"a": 1, "b": 2})
    assert accepts(lltok, plan(ba, dict(COMPACT_JSON), False).grammar, {"b": 2, "a": 1})


def test_openapi_number_formats(lltok):
    """int32 is enforced as bounds; int64 and double (beyond the engine's ranges, or no constraint) compile
    as annotations, as they did before formats were planned."""
    p = plan({"type": "integer", "format": "int32"}, dict(COMPACT_JSON), False)
    assert accepts(lltok, p.grammar, 2**31 - 1) and not accepts(lltok, p.grammar, 2**31)
    for fmt in ("int64", "double"):
        p = plan({"type": "integer", "format": fmt}, dict(COMPACT_JSON), False)
        assert [n.keyword for n in p.notes.annotations] == [f"format:{fmt}"]
        assert accepts(lltok, p.grammar, 2**40)
