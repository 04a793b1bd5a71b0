"""Tool calling: the parser of `<tool_call>` blocks on Qwen2.5-style outputs, the prompt a request with
tools gets from the chat template, and the OpenAI shape of calls the model made (non-streamed and
streamed) on the real SmolLM2-135M-Instruct with the shipped `chatml-tools` template. What the model
writes is canned in the last tests (a 135M model does not call tools on demand): the text of every
output is replaced, so the server's parsing and shaping are what is tested."""
from __future__ import annotations

import dataclasses
import json

import pytest

from specfleet.outputs import SentOutput
from fastapi.testclient import TestClient

from specfleet.engine import async_engine
from specfleet.llm import LLM
from specfleet.server.app import ServerConfig, create_app
from specfleet.server.chat import read_chat_template
from specfleet.server.tools import parse_tool_calls, tool_call_prefix_len
from tests.server.harness import MODEL

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
QWEN_ONE = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>')
QWEN_TWO = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


# -- the parser -------------------------------------------------------------------------------------
def test_parses_a_qwen_tool_call_with_content_before_it():
    content, calls = parse_tool_calls(QWEN_ONE)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert calls[0].id.startswith("call_")


def test_parses_parallel_calls_lists_and_an_unclosed_last_block():
    content, calls = parse_tool_calls(QWEN_TWO)
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    assert len({c.id for c in calls}) == 2
    # a JSON list inside one block (SmolLM2-1.7B's form); "parameters" for "arguments"; arguments as a string
    _, calls = parse_tool_calls('<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "parameters": {"x": 1}}]'
                                '</tool_call>')
    assert [(c.name, c.arguments) for c in calls] == [("a", "{}"), ("b", '{"x": 1}')]
    _, calls = parse_tool_calls('<tool_call>{"name": "a", "arguments": "{\\"q\\": \\"é\\"}"}</tool_call>')
    assert calls[0].arguments == '{"q": "é"}'
    _, calls = parse_tool_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n')  # EOS, no end tag
    assert [c.name for c in calls] == ["get_weather"]


@pytest.mark.parametrize("text", [
    "The weather is fine.",
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \n</tool_call>",  # cut JSON
    "<tool_call>{\"arguments\": {}}</tool_call>",  # no name
    "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",  # arguments not an object
    QWEN_TWO.replace('{"zone": "CET"}', "{zone}"),  # one bad block: none are taken
])
def test_anything_but_well_formed_calls_stays_content(text):
    assert parse_tool_calls(text) == (text, [])


def test_a_bare_call_to_a_known_tool_counts():
    """Small Qwen2.5 models often write the call without its tags."""
    names = frozenset({"get_weather", "get_time"})
    bare = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    content, calls = parse_tool_calls(bare, names)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    _, calls = parse_tool_calls(f'[{bare}, {{"name": "get_time", "parameters": {{}}}}]\n', names)
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    for text in (bare, '{"name": "other", "arguments": {}}',  # not one of the request's tools
                 '{"name": "get_weather", "arguments": {}, "note": 1}',  # more than a call
                 '{"name": "get_weather"}', 'Sure: ' + bare, "[]"):
        expected_names = names if text != bare else frozenset()  # bare without tools: content
        assert parse_tool_calls(text, expected_names) == (text, [])


def test_tool_call_prefix_is_held_back():
    assert [tool_call_prefix_len(t) for t in ("Hi <", "Hi <tool_c", "Hi <tool_call", "Hi", "a < b")] == [1, 7, 10, 0, 0]


# -- the server on SmolLM2 --------------------------------------------------------------------------
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    from tests.conftest import real_model_path

    real_model_path(MODEL)  # skips when the model is not installed
    return LLM(MODEL, None, dtype="float32", max_model_len=512, kv_cache_bytes=24 << 20)


@pytest.fixture()
def client(llm):
    with TestClient(create_app(llm, ServerConfig(MODEL, chat_template=read_chat_template("chatml-tools")))) as c:
        yield c


@pytest.mark.real_model
def test_tools_and_tool_messages_reach_the_template(client):
    r = client.post("/tokenize", json={"messages": HISTORY, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    prompt = client.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in prompt
    # the replayed call (its arguments written as the object they hold, not a quoted string) and its result
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
           '<|im_end|>' in prompt
    assert "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in prompt
    r = client.post("/v1/chat/completions", json={"messages": HISTORY, "tools": [WEATHER], "max_tokens": 8,
                                                   "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(client.post("/tokenize", json={
        "messages": HISTORY, "tools": [WEATHER]}).json()["tokens"])
    # tool_choice "none": the model is not shown the tools
    none = client.post("/tokenize", json={"messages": HISTORY[:1]}).json()["tokens"]
    r = client.post("/v1/chat/completions", json={"messages": HISTORY[:1], "tools": [WEATHER], "tool_choice": "none",
                                                   "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == len(none)


@pytest.mark.real_model
def test_a_template_without_tools_is_a_400_not_a_silent_drop(llm):
    with TestClient(create_app(llm, ServerConfig(MODEL))) as client:  # SmolLM2's own template: no tools
        r = client.post("/v1/chat/completions", json={"messages": HISTORY[:1], "tools": [WEATHER]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert "--chat-template chatml-tools" in r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", json={"messages": HISTORY})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = client.post("/v1/chat/completions", json={"messages": HISTORY[:1], "tools": [WEATHER], "tool_choice": "none",
                                                       "max_tokens": 1})
        assert r.status_code == 200  # not shown, so nothing to render


def canned(llm: LLM, monkeypatch, text: str) -> None:
    """Every output's text becomes a growing prefix of `text` (all of it once finished, with "stop")."""
    executor = llm.engine.executor
    real = executor.output

    def output(req):
        out = real(req)
        if out.finished:
            return dataclasses.replace(out, text=text, finish_reason="stop")
        share = len(out.token_ids) / req.params.max_tokens
        return dataclasses.replace(out, text=text[:int(len(text) * share)])
    sent: dict = {}

    def delta(req):  # a served request's step output is a delta (executor.delta): the same canned text, diffed
        return async_engine.to_delta(output(req), sent.setdefault(req.request_id, SentOutput()))
    monkeypatch.setattr(executor, "output", output)
    monkeypatch.setattr(executor, "delta", delta)


@pytest.mark.real_model
def test_the_models_calls_come_back_in_the_openai_shape(llm, client, monkeypatch):
    canned(llm, monkeypatch, QWEN_ONE)
    body = {"messages": HISTORY[:1], "tools": [WEATHER], "max_tokens": 12, "ignore_eos": True, "temperature": 0}
    got = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert got["finish_reason"] == "tool_calls"
    assert got["message"]["content"] == "Let me check."
    [call] = got["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == "Let me check.\n"  # never a piece of the tag
    deltas = [c["choices"][0]["delta"]["tool_calls"] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    assert len(deltas) == 1 and deltas[0][0]["index"] == 0 and deltas[0][0]["function"] == call["function"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # without tools nothing is parsed: the text is the content
    plain = client.post("/v1/chat/completions", json={k: v for k, v in body.items() if k != "tools"}).json()
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": QWEN_ONE}
    assert plain["choices"][0]["finish_reason"] == "stop"


@pytest.mark.real_model
def test_parallel_tool_calls_false_keeps_the_first(llm, client, monkeypatch):
    canned(llm, monkeypatch, QWEN_TWO)
    body = {"messages": HISTORY[:1], "tools": [WEATHER], "max_tokens": 4, "ignore_eos": True}
    both = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert both["content"] is None and [c["function"]["name"] for c in both["tool_calls"]] == ["get_weather", "get_time"]
    one = client.post("/v1/chat/completions", json={**body, "parallel_tool_calls": False}).json()
    assert [c["function"]["name"] for c in one["choices"][0]["message"]["tool_calls"]] == ["get_weather"]


@pytest.mark.real_model
def test_qwen_calls_a_tool_itself():
    """Qwen2.5-Coder-0.5B-Instruct with its own template (which knows tools): asked for the weather it
    calls get_weather (bare JSON, which this model writes), streamed or not; the call and its result
    replayed reach the prompt in Qwen's format."""
    from tests.conftest import optional_model_path

    optional_model_path("qwen2.5-coder-0.5b-instruct")  # skips when it is not installed (CI installs SmolLM2 only)
    llm = LLM("qwen2.5-coder-0.5b-instruct", None, max_model_len=1024, kv_cache_bytes=64 << 20)
    ask = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    body = {"messages": ask, "tools": [WEATHER], "temperature": 0, "max_tokens": 60}
    with TestClient(create_app(llm, ServerConfig("qwen"))) as client:
        got = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        chunks = [json.loads(ln[6:]) for ln in client.post("/v1/chat/completions", json={**body, "stream": True})
                  .text.splitlines() if ln.startswith("data: {")]
        assert got["finish_reason"] == "tool_calls" and got["message"]["content"] is None
        [call] = got["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        assert not "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)  # the JSON was held back
        [[streamed]] = [c["choices"][0]["delta"]["tool_calls"] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
        assert streamed["function"] == call["function"] and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        history = ask + [{"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": call["id"], "content": "18 degrees Celsius, sunny"}]
        r = client.post("/v1/chat/completions", json={**body, "messages": history})
        ids = client.post("/tokenize", json={"messages": history, "tools": [WEATHER]}).json()["tokens"]
        prompt = client.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    # the call and its result are in the prompt, in Qwen's own format (the 0.5B model then tends to call
    # again rather than answer, so the answer itself is not checked)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18 degrees Celsius, sunny\n</tool_response>" in prompt
