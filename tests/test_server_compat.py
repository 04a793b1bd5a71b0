"""Compatibility with what real clients send, in-process on the real SmolLM2-135M-Instruct (it has a
tokenizer and a chat template, which the tiny random models lack): stop strings that are special
tokens, /tokenize and /detokenize, chat templates, message content parts."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from specfleet.llm import LLM
from specfleet.server.app import ServerConfig, create_app
from test_server_harness import MODEL

pytestmark = pytest.mark.real_model

MESSAGES = [{"role": "user", "content": "Hi!"}]  # greedy, it answers in 9 tokens, then <|im_end|>


@pytest.fixture(scope="module")
def llm() -> LLM:
    from conftest import real_model_path

    real_model_path(MODEL)  # skips when the model is not installed
    return LLM(MODEL, None, dtype="float32", max_model_len=384, kv_cache_bytes=24 << 20)


@pytest.fixture(scope="module")
def client(llm):
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
