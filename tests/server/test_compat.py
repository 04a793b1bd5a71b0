"""Compatibility with what real clients send, in-process on the real SmolLM2-135M-Instruct (it has a
tokenizer and a chat template, which the tiny random models lack): stop strings that are special
tokens, /tokenize and /detokenize, chat templates, message content parts."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from specfleet.llm import LLM
from specfleet.server.app import ServerConfig, create_app
from tests.server.harness import MODEL

pytestmark = pytest.mark.real_model

MESSAGES = [{"role": "user", "content": "Hi!"}]  # greedy, it answers in 9 tokens, then <|im_end|>


@pytest.fixture(scope="module")
def llm() -> LLM:
    from tests.conftest import real_model_path

    real_model_path(MODEL)  # skips when the model is not installed
    return LLM(MODEL, None, dtype="float32", max_model_len=384, kv_cache_bytes=24 << 20)


@pytest.fixture()
def client(llm):  # one app at a time on the shared engine: some tests build their own
    with TestClient(create_app(llm, ServerConfig(MODEL))) as c:
        yield c


def chat(client: TestClient, **fields) -> dict:
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_special_token_stop_string_stops(client):
    # ignore_eos: <|im_end|> (this model's EOS) stops the request only as the stop string asked for
    free = chat(client, max_tokens=40, ignore_eos=True)
    stopped = chat(client, max_tokens=40, ignore_eos=True, stop=["<|im_end|>"])
    assert free["choices"][0]["finish_reason"] == "length"
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] < 40
    text = stopped["choices"][0]["message"]["content"]
    assert text and free["choices"][0]["message"]["content"].startswith(text)


def test_special_token_stop_in_a_stream(client):
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 40, "ignore_eos": True, "stream": True,
            "stop": "<|im_end|>"}
    lines = [ln[6:] for ln in client.post("/v1/chat/completions", json=body).text.splitlines()
             if ln.startswith("data: ") and ln != "data: [DONE]"]
    finals = [json.loads(ln)["choices"][0]["finish_reason"] for ln in lines]
    assert finals[-1] == "stop"


# -- /tokenize and /detokenize (vLLM's shapes) -------------------------------------------------------
def test_tokenize_a_prompt_and_back(client, llm):
    r = client.post("/tokenize", json={"model": MODEL, "prompt": "The sky is blue."})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["tokens"] == llm.encode("The sky is blue.") and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == 384 and "token_strs" not in got
    assert client.post("/detokenize", json={"tokens": got["tokens"]}).json() == {"prompt": "The sky is blue."}
    strs = client.post("/tokenize", json={"prompt": "The sky", "return_token_strs": True}).json()["token_strs"]
    assert "".join(strs).replace("\u0120", " ") == "The sky"  # byte-level BPE shows a space as \u0120


def test_tokenize_messages_gives_the_chat_prompt(client, llm):
    got = client.post("/tokenize", json={"messages": MESSAGES}).json()
    assert got["tokens"] == llm.apply_chat_template(MESSAGES)
    assert chat(client, max_tokens=1)["usage"]["prompt_tokens"] == got["count"]
    text = client.post("/detokenize", json={"tokens": got["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")  # special tokens kept
    bare = client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert got["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < got["count"]


@pytest.mark.parametrize("path,body,status,param", [
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ 1 }}"}, 400, "chat_template"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs"),
])
def test_tokenize_errors(client, path, body, status, param):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


# -- chat templates ---------------------------------------------------------------------------------
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}{{ speaker | default('assistant') }}:{% endif %}"
            "{% if turns is defined %} {{ turns + 1 }}{% endif %}")


def test_chat_template_override_and_kwargs(llm):
    with TestClient(create_app(llm, ServerConfig(MODEL, chat_template=TEMPLATE))) as templated:
        def prompt(**fields) -> str:
            ids = templated.post("/tokenize", json={"messages": MESSAGES, **fields}).json()["tokens"]
            return templated.post("/detokenize", json={"tokens": ids}).json()["prompt"]

        assert prompt() == "user: Hi!\nassistant:"
        assert prompt(chat_template_kwargs={"speaker": "bot"}) == "user: Hi!\nbot:"
        got = templated.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1,
                                                           "chat_template_kwargs": {"speaker": "bot"}}).json()
        want = templated.post("/tokenize", json={"messages": MESSAGES,
                                                 "chat_template_kwargs": {"speaker": "bot"}}).json()["count"]
        assert got["usage"]["prompt_tokens"] == want
        assert prompt(chat_template_kwargs={"turns": 1}) == "user: Hi!\nassistant: 2"
        r = templated.post("/v1/chat/completions", json={"messages": MESSAGES, "chat_template_kwargs": {"turns": "x"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


def test_chat_template_kwargs_reach_the_models_own_template(client, llm):
    # SmolLM2's template reads no variables: a kwarg changes nothing, and the prompt is the offline one
    got = client.post("/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}})
    assert got.json()["tokens"] == llm.apply_chat_template(MESSAGES)


def test_text_parts_are_joined_by_newlines(client, llm):
    parts = [{"type": "text", "text": "Hi!"}, {"type": "text", "text": "Who are you?"}]
    got = client.post("/tokenize", json={"messages": [{"role": "user", "content": parts}]}).json()
    assert got["tokens"] == llm.apply_chat_template([{"role": "user", "content": "Hi!\nWho are you?"}])


def test_chat_stream_sends_usage_once_when_asked(client):
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 3, "ignore_eos": True, "stream": True}
    for include_usage in (False, True):
        options = {"stream_options": {"include_usage": True}} if include_usage else {}
        lines = client.post("/v1/chat/completions", json={**body, **options}).text.splitlines()
        got = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ") and ln != "data: [DONE]"]
        assert [ln for ln in lines if ln][-1] == "data: [DONE]"
        usages = [e["usage"] for e in got if e.get("usage") is not None]
        if include_usage:
            assert len(usages) == 1 and got[-1]["choices"] == [] and got[-1]["usage"]["completion_tokens"] == 3
            assert all("usage" in e for e in got)
        else:
            assert usages == [] and got[-1]["choices"][0]["finish_reason"] == "length"
