"""The request-field policy (server/schemas.py): unknown fields are accepted, logged once per name and
counted in /metrics; near misses of known fields and unsupported values of known fields are a 400
naming the field. In-process on a tiny random model (token-id prompts: it has no tokenizer)."""
from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from specfleet.llm import LLM
from specfleet.server import serving
from specfleet.server.app import ServerConfig, create_app
from specfleet.server.errors import APIError
from specfleet.server.metrics import MAX_UNKNOWN_FIELD_LABELS, OTHER_FIELD
from specfleet.server.schemas import MAX_UNKNOWN_FIELDS, ChatCompletionRequest, CompletionRequest, UnsupportedError
from tiny_models import ours_from_hf, random_prompts, tiny_hf_model

PROMPT = random_prompts([6])[0]
OK = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def client():
    model = ours_from_hf(tiny_hf_model("llama"))
    llm = LLM.from_model(model, None, None, dtype="float32", kv_cache_bytes=1 << 20, block_size=4)
    with TestClient(create_app(llm, ServerConfig("tiny"))) as c:
        yield c


def unknown_count(client: TestClient, field: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'specfleet_unknown_request_fields_total{{field="{field}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_unknown_fields_are_accepted_counted_and_logged_once(client, caplog):
    caplog.set_level(logging.WARNING, logger="specfleet.server")
    for _ in range(3):
        r = client.post("/v1/completions", json={**OK, "x_client_trace": "abc", "stream_options": None})
        assert r.status_code == 200, r.text
    assert unknown_count(client, "x_client_trace") == 3
    logged = [rec for rec in caplog.records if "x_client_trace" in rec.getMessage()]
    assert len(logged) == 1 and "unknown request field" in logged[0].getMessage()


def test_unknown_nested_fields_are_named_by_their_path():
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}], "x": 1}],
        "stream": True, "stream_options": {"include_usage": True, "y": 2}, "z": 3})
    assert sorted(req.check_fields()) == ["messages.content.cache_control", "messages.x", "stream_options.y", "z"]


def test_unknown_field_labels_are_bounded(client):
    for i in range(MAX_UNKNOWN_FIELD_LABELS + 5):
        assert client.post("/v1/completions", json={**OK, f"zz_field_{i}": 1}).status_code == 200
    assert unknown_count(client, OTHER_FIELD) >= 5
    assert unknown_count(client, f"zz_field_{MAX_UNKNOWN_FIELD_LABELS + 4}") == 0


@pytest.mark.parametrize("field,meant", [("max_token", "max_tokens"), ("temprature", "temperature"),
                                         ("maxTokens", "max_tokens"), ("Top_P", "top_p"), ("sed", "seed"),
                                         ("max_new_tokens", "max_tokens"), ("stream_option", "stream_options")])
def test_near_miss_of_a_known_field_is_a_400_naming_it(client, field, meant):
    r = client.post("/v1/completions", json={**OK, field: 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and f"did you mean '{meant}'" in err["message"]


def test_near_miss_inside_an_object(client):
    r = client.post("/v1/completions", json={**OK, "stream": True, "stream_options": {"include_usgae": True}})
    assert r.status_code == 400
    assert "did you mean 'stream_options.include_usage'" in r.json()["error"]["message"]


@pytest.mark.parametrize("path,body,param,needle", [
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions", "use tools and tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "g"}}],
                              "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice.function.name", "not among the request's tools"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "already constrains the output"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "needs a json_schema object"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}, "guided_regex": "a+"},
     "guided_regex", "give one output constraint"),
    ("/v1/completions", {**OK, "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one of"),
    ("/v1/completions", {**OK, "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "llguidance"),
    ("/v1/completions", {**OK, "guided_json": {}}, None, "needs the model's tokenizer"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs", "needs logprobs=true"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "out of range"),
    ("/v1/completions", {**OK, "logprobs": 21}, "logprobs", "out of range"),
    ("/v1/completions", {**OK, "max_tokens": 0}, "max_tokens", "only allowed with echo=true"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, "n", "out of range"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.0.tool_calls", "only assistant messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": None}]}, "messages.0.content",
     "null only in an assistant message with tool_calls"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "42"}]}, "messages.0.tool_call_id",
     "needs the tool_call_id"),
    ("/v1/chat/completions", {**CHAT, "chat_template": "{{ x }}"}, "chat_template", "--chat-template"),
    ("/v1/completions", {**OK, "min_p": 0.1}, "min_p", "min_p is not supported"),
])
def test_known_unsupported_fields_keep_their_400(client, path, body, param, needle):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    assert unknown_count(client, param) == 0  # refused, not counted as unknown


@pytest.mark.parametrize("fields", [{"tools": []}, {"tool_choice": "none"}, {"response_format": {"type": "text"}},
                                    {"metadata": {"a": "b"}, "store": True}, {"parallel_tool_calls": False},
                                    {"min_p": 0.0, "repetition_penalty": 1.0}, {"modalities": ["text"]}])
def test_no_op_values_of_unsupported_fields_are_accepted(fields):
    req = ChatCompletionRequest.model_validate({**CHAT, **fields})
    assert req.check_fields() == []


def test_policy_covers_completions_too():
    with pytest.raises(UnsupportedError, match="did you mean 'echo'"):
        CompletionRequest.model_validate({**OK, "ecoh": True}).check_fields()
    assert CompletionRequest.model_validate({**OK, "top_a": 0.1}).check_fields() == ["top_a"]


def test_many_stop_strings_are_allowed_and_their_total_length_is_bounded(client):
    r = client.post("/v1/completions", json={**OK, "stop": [f"stop{i}" for i in range(40)]})
    assert r.status_code == 200, r.text
    r = client.post("/v1/completions", json={**OK, "stop": ["y" * 2000, "z" * 2097]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert "total 4097 characters" in r.json()["error"]["message"]


class _AddedToken:
    def __init__(self, content: str, special: bool):
        self.content, self.special = content, special


class _FakeTokenizer:
    added_tokens_decoder = {2: _AddedToken("<|im_end|>", True), 7: _AddedToken("<tool>", False)}
    all_special_tokens = ["<|im_end|>", "<s>"]

    def convert_tokens_to_ids(self, text: str) -> int:
        return {"<|im_end|>": 2, "<s>": 1}[text]


def test_special_token_stops_become_stop_token_ids():
    specials = serving.special_tokens(_FakeTokenizer())
    assert specials == {"<|im_end|>": 2, "<s>": 1}  # "<tool>" is not special: decoding keeps it as text
    req = CompletionRequest.model_validate({**OK, "stop": ["<|im_end|>", "\n\n", "<tool>"], "stop_token_ids": [9]})
    params = serving.sampling_params(req, 4, 6, 64, specials)
    assert params.stop == ["\n\n", "<tool>"] and sorted(params.stop_token_ids) == [2, 9]
    req = CompletionRequest.model_validate({**OK, "stop": "end<|im_end|>"})
    with pytest.raises(APIError, match="of its own") as caught:
        serving.sampling_params(req, 4, 6, 64, specials)
    assert caught.value.param == "stop"


def test_a_field_repeated_in_every_message_counts_once(client):
    messages = [{"role": "user", "content": "x", "reasoning_content": "r"}] * 100
    req = ChatCompletionRequest.model_validate({"messages": messages})
    assert req.check_fields() == ["messages.reasoning_content"]


def test_too_many_distinct_unknown_fields_is_a_400(client):
    body = {**OK, **{f"made_up_{i}": 1 for i in range(MAX_UNKNOWN_FIELDS + 1)}}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400 and f"more than {MAX_UNKNOWN_FIELDS} fields" in r.json()["error"]["message"]
    assert client.post("/v1/completions", json={**OK, **{f"made_up_{i}": 1 for i in range(8)}}).status_code == 200
