"""Structured output and forced tool calls against a live server on SmolLM2-135M, driven by the clients
people use, unmodified: the official `openai` client (`.parse()` with a Pydantic model, a forced tool
call streamed and whole, `tool_choice="required"`, vLLM's `structured_outputs` / `guided_*` fields through
`extra_body`) and `langchain-openai` (`bind_tools` with a tool_choice, `with_structured_output` by JSON
schema and by function calling). The server speculates (prompt lookup, with the grammar draft in front),
and every reply must follow its schema; on the code before structured output each of these was a 400."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.harness import ServerProcess, tools_server

SERVED = "smollm2"
API_KEY = "sk-structured-test"


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population: int = Field(ge=0, le=100_000_000)  # bounded: a small model may write digits forever


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    yield from tools_server(SERVED, API_KEY)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=300)


def check_call(call, tool: dict) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


@pytest.mark.real_model
def test_parse_with_a_pydantic_model(client):
    got = client.chat.completions.parse(
        model=SERVED, messages=[{"role": "user", "content": "Tell me about Paris as JSON."}], response_format=City,
        max_tokens=80, temperature=0)
    msg = got.choices[0].message
    assert got.choices[0].finish_reason == "stop", msg.content
    assert isinstance(msg.parsed, City) and msg.parsed == City.model_validate_json(msg.content)
    assert msg.content.startswith('{"name": "')  # json.dumps' layout
    spec = got.model_extra["spec"]
    assert spec["drafts_used"].get("grammar", 0) > 0, spec  # the schema's keys came from the grammar draft


@pytest.mark.real_model
def test_json_object_and_vllm_fields(client):
    got = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "A cat, as JSON."}],
                                         response_format={"type": "json_object"}, max_tokens=60, temperature=0)
    text = got.choices[0].message.content
    if got.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{")
    yes_no = client.completions.create(model=SERVED, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert yes_no.choices[0].text in ("yes", "no") and yes_no.choices[0].finish_reason == "stop"
    phone = client.completions.create(model=SERVED, prompt="Call me at", max_tokens=12, temperature=0.8, seed=3,
                                      extra_body={"guided_regex": r" \d{3}-\d{4}"})
    assert re.fullmatch(r" \d{3}-\d{4}", phone.choices[0].text), phone.choices[0].text
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    raw = client.completions.create(model=SERVED, prompt="Reply in JSON:", max_tokens=20, temperature=0,
                                    extra_body={"guided_json": schema})
    assert json.loads(raw.choices[0].text) in ({"ok": True}, {"ok": False})
    with pytest.raises(openai.BadRequestError, match="invalid regex"):
        client.completions.create(model=SERVED, prompt="x", max_tokens=2, extra_body={"guided_regex": "(a"})


@pytest.mark.real_model
def test_named_tool_is_called(client):
    got = client.chat.completions.create(model=SERVED, messages=ASK, tools=[WEATHER, TIME], max_tokens=60,
                                         temperature=0, tool_choice={"type": "function",
                                                                     "function": {"name": "get_weather"}})
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice.message
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    check_call(call, WEATHER)


@pytest.mark.real_model
def test_forced_tool_call_streams(client):
    stream = client.chat.completions.create(model=SERVED, messages=ASK, tools=[WEATHER], max_tokens=60,
                                            temperature=0, stream=True, parallel_tool_calls=False,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0] and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


@pytest.mark.real_model
def test_required_calls_one_of_the_tools(client):
    got = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Time in Oslo?"}],
                                         tools=[WEATHER, TIME], tool_choice="required", max_tokens=80, temperature=0,
                                         parallel_tool_calls=False)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_call(call, WEATHER if call.function.name == "get_weather" else TIME)


@pytest.mark.real_model
def test_langchain_bind_tools_and_structured_output(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "sunny"

    chat = ChatOpenAI(model=SERVED, base_url=server.url("/v1"), api_key=API_KEY, temperature=0, max_tokens=80,
                      max_retries=0, timeout=300)
    reply = chat.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str)
    for method in ("json_schema", "function_calling"):
        city = chat.with_structured_output(City, method=method).invoke("Tell me about Paris.")
        assert isinstance(city, City), method


RELEASE = {"type": "object", "x-source": "an OpenAPI description",
           "properties": {"version": {"type": "string", "format": "semver", "maxLength": 12},
                          "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
           "required": ["version", "tags"]}


def _format(schema: dict, strict: bool | None = None) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "release", "schema": schema,
                                                   **({} if strict is None else {"strict": strict})}}


@pytest.mark.real_model
def test_schema_annotations_are_accepted_counted_and_refusals_name_the_keyword(server, client):
    """Issue 48: an unknown format and an unknown keyword are annotations (accepted, said in the response,
    counted in /metrics); a keyword the grammar cannot enforce is a 400 naming it and where it is, and
    strict=false generates under the rest of the schema and says what was not enforced."""
    import httpx

    ask = [{"role": "user", "content": "Describe a software release as JSON."}]
    got = client.chat.completions.create(model=SERVED, messages=ask, response_format=_format(RELEASE),
                                         max_tokens=80, temperature=0)
    assert got.choices[0].finish_reason == "stop", got.choices[0].message.content
    jsonschema.validate(json.loads(got.choices[0].message.content), RELEASE)
    assert sorted(got.model_extra["structured_output"]["annotations"]) == [
        "format:semver at #/properties/version", "x-source at #"]
    metrics = httpx.get(server.url("/metrics"), headers={"Authorization": f"Bearer {API_KEY}"}).text
    assert re.search(r'specfleet_json_schema_keywords_total\{kind="annotation",name="format:semver"\} [1-9]', metrics)

    unique = {**RELEASE, "properties": {**RELEASE["properties"], "tags": {
        **RELEASE["properties"]["tags"], "minItems": 2, "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=SERVED, messages=ask, response_format=_format(unique), max_tokens=8)
    assert "'uniqueItems' at #/properties/tags cannot be enforced" in str(e.value)
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):  # strict: true refuses too
        client.chat.completions.create(model=SERVED, messages=ask, response_format=_format(unique, True),
                                       max_tokens=8)
    got = client.chat.completions.create(model=SERVED, messages=ask, response_format=_format(unique, False),
                                         max_tokens=80, temperature=0)
    note = got.model_extra["structured_output"]
    assert [n.split(" (")[0] for n in note["not_enforced"]] == ["uniqueItems at #/properties/tags"], note
    stream = client.chat.completions.create(model=SERVED, messages=ask, response_format=_format(unique, False),
                                            max_tokens=80, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == got.choices[0].message.content
    assert chunks[-1].model_extra["structured_output"] == note  # on the final chunk, as in the whole response
