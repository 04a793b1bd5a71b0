"""The real server in a subprocess, driven by the official `openai` client: explicit nulls in optional
fields, GET /v1/models/{id}, HEAD /health, --api-key, tool calling (the server runs the shipped
`chatml-tools` template, since SmolLM2's own has no tools), logprobs, echo, n and batches of prompts as
the SDK parses them, and a shutdown that times out with requests still running (each gets a complete
503 answer; the server logs no traceback and exits 0). One in-process test on a tiny random model
covers a request that arrives once shutdown has begun."""
from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from specfleet.llm import LLM
from specfleet.server.app import ServerConfig, create_app
from tests.server.harness import MODEL, ServerProcess, start_server, tools_server
from tiny_models import ours_from_hf, random_prompts, tiny_hf_model

SERVED = "specfleet-test/smollm2"  # a slash in the id, as a model given by its folder path has
PROMPT = "The three primary colors are"
MESSAGES = [{"role": "user", "content": "Name two fruits."}]


API_KEY = "sk-specfleet-test"  # the module's server requires it: the official client sends it as a bearer key


@pytest.fixture(scope="module")
def server():
    yield from tools_server(SERVED, API_KEY)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=120)


@pytest.mark.real_model
def test_wrong_api_key_is_an_authentication_error(server):
    wrong = openai.OpenAI(base_url=server.url("/v1"), api_key="sk-wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.models.list()
    assert caught.value.code == "invalid_api_key"
    assert httpx.get(server.url("/metrics"), timeout=10).status_code == 401


# (endpoint, what the request sets to null, what it needs beside the null to stay short)
NULL_CASES = [
    *[("completions", {field: None}) for field in
      ("temperature", "top_p", "n", "stream", "stream_options", "presence_penalty", "frequency_penalty", "echo",
       "best_of", "logprobs", "suffix", "seed", "stop", "logit_bias", "user", "top_k", "ignore_eos")],
    *[("chat", {field: None}) for field in
      ("temperature", "top_p", "n", "stream", "stream_options", "presence_penalty", "frequency_penalty",
       "logprobs", "top_logprobs", "seed", "stop", "logit_bias", "user", "max_completion_tokens", "top_k",
       "ignore_eos")],
    ("chat", {"max_tokens": None, "max_completion_tokens": 2}),
]
EXTENSIONS = ("top_k", "ignore_eos")  # not in the client's signature: sent through extra_body


def create(client: openai.OpenAI, endpoint: str, fields: dict) -> str:
    """Send a request with `fields` (None is sent as null) and return the generated text."""
    kwargs = {k: v for k, v in fields.items() if k not in EXTENSIONS}
    extra = {k: v for k, v in fields.items() if k in EXTENSIONS}
    if endpoint == "completions":
        got = client.completions.create(model=SERVED, prompt=PROMPT, extra_body=extra, **kwargs)
        return got.choices[0].text
    got = client.chat.completions.create(model=SERVED, messages=MESSAGES, extra_body=extra, **kwargs)
    return got.choices[0].message.content


@pytest.mark.real_model
@pytest.mark.parametrize("endpoint,nulls", NULL_CASES,
                         ids=[f"{e}-{'+'.join(k for k, v in n.items() if v is None)}" for e, n in NULL_CASES])
def test_null_means_default(client, endpoint, nulls):
    fields = {"max_tokens": 2, "seed": 7, **nulls}  # sampled (default temperature 1) but seeded
    with_nulls = create(client, endpoint, fields)
    omitted = create(client, endpoint, {k: v for k, v in fields.items() if v is not None})
    assert isinstance(with_nulls, str) and with_nulls
    if "seed" not in nulls:  # the same seeded request either way: the null changed nothing
        assert with_nulls == omitted


@pytest.mark.real_model
def test_null_does_not_make_a_required_field_optional(client):
    with pytest.raises(openai.BadRequestError, match="'messages'"):
        client.chat.completions.create(model=SERVED, messages=None, max_tokens=2)


@pytest.mark.real_model
def test_models_retrieve(client):
    got = client.models.retrieve(SERVED)
    assert got.id == SERVED and got.object == "model" and got.owned_by == "specfleet"
    assert got.model_extra["max_model_len"] == 384
    assert [m.id for m in client.models.list().data] == [SERVED]
    for unknown in ("gpt-4", "specfleet-test/other", SERVED + "/x"):
        with pytest.raises(openai.NotFoundError) as caught:
            client.models.retrieve(unknown)
        assert caught.value.code == "model_not_found" and repr(unknown) in caught.value.message


@pytest.mark.real_model
def test_head_health(server):
    r = httpx.head(server.url("/health"), timeout=10)
    assert r.status_code == 200 and r.content == b""
    assert httpx.get(server.url("/health"), timeout=10).json() == {"status": "ok"}


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.real_model
def test_tool_call_round_trip(server, client):
    """A request with tools; then the conversation with the assistant's call (content null) and the
    tool's result, which the template renders; then the final answer. The 135M model rarely calls a
    tool by itself, so the call is canned; whatever it writes must come back in a shape the SDK parses."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=SERVED, messages=ask, tools=[WEATHER], tool_choice="auto",
                                           max_tokens=40, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    for call in choice.message.tool_calls or []:
        assert call.type == "function" and isinstance(json.loads(call.function.arguments), dict)
    conversation = ask + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    final = client.chat.completions.create(model=SERVED, messages=conversation, tools=[WEATHER], max_tokens=30,
                                           temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert final.choices[0].message.role == "assistant"
    # the prompt it ran on is the template's, with the call and its result in it
    headers = {"Authorization": f"Bearer {API_KEY}"}
    ids = httpx.post(server.url("/tokenize"), json={"messages": conversation, "tools": [WEATHER]}, headers=headers,
                     timeout=30).json()["tokens"]
    assert final.usage.prompt_tokens == len(ids)
    prompt = httpx.post(server.url("/detokenize"), json={"tokens": ids}, headers=headers, timeout=30).json()["prompt"]
    assert '"arguments": {"city": "Paris"}' in prompt and "<tool_response>\n18 degrees and sunny\n" in prompt
    streamed = list(client.chat.completions.create(model=SERVED, messages=conversation, tools=[WEATHER],
                                                   max_tokens=30, temperature=0, stream=True))
    assert streamed[-1].choices[0].finish_reason == final.choices[0].finish_reason
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text.strip() == (final.choices[0].message.content or "").strip()  # (content before a call is stripped)


@pytest.mark.real_model
def test_logprobs_echo_n_and_prompt_batches_through_the_sdk(client):
    # lm-evaluation-harness's loglikelihood request: token-id prompts, echo, logprobs=1, max_tokens=1
    prompts = [[504, 1345, 3256, 4375, 359], [504, 1345, 3256]]
    got = client.completions.create(model=SERVED, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0)
    assert [c.index for c in got.choices] == [0, 1]
    for c, ids in zip(got.choices, prompts):
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(ids) + 1
        assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
        assert all(max(top.values()) >= x for top, x in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
    chat = client.chat.completions.create(model=SERVED, messages=MESSAGES, logprobs=True, top_logprobs=2,
                                          max_tokens=3, temperature=0, n=2)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    for item in chat.choices[0].logprobs.content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob == item.logprob


@pytest.mark.real_model
def test_shutdown_past_timeout_answers_every_request():
    """SIGTERM with four long requests running and a 1 s --shutdown-timeout: the two non-streamed ones
    get a 503 error body, the two streams a final error event and [DONE], and the server exits 0."""
    srv = start_server("--kv-cache-mb", "100", "--shutdown-timeout", "1")  # KV for 4 full contexts
    try:
        client = openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0, timeout=60)
        long = {"max_tokens": 300, "temperature": 0, "extra_body": {"ignore_eos": True}}

        def completion() -> openai.APIStatusError:
            with pytest.raises(openai.APIStatusError) as caught:
                client.completions.create(model=MODEL, prompt=PROMPT, **long)
            return caught.value

        def chat() -> openai.APIStatusError:
            with pytest.raises(openai.APIStatusError) as caught:
                client.chat.completions.create(model=MODEL, messages=MESSAGES, **long)
            return caught.value

        def chat_stream() -> tuple[int, openai.APIError]:
            chunks = 0
            with pytest.raises(openai.APIError) as caught:
                for _ in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **long):
                    chunks += 1
            return chunks, caught.value

        def raw_stream() -> list[str]:
            body = {"prompt": PROMPT, "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", srv.url("/v1/completions"), json=body, timeout=60) as r:
                assert r.status_code == 200
                return [line for line in r.iter_lines() if line]

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(f) for f in (completion, chat, chat_stream, raw_stream)]
            deadline = time.monotonic() + 60
            while srv.metrics()["specfleet_requests_running"] < 4:  # all four generating
                ended = [f.exception() or f.result() for f in futures if f.done()]
                assert not ended and time.monotonic() < deadline, f"ended early: {ended}\n{srv.log_tail()}"
                time.sleep(0.1)
            srv.proc.send_signal(signal.SIGTERM)
            (plain, chatted, (chunks, streamed), lines) = [f.result(timeout=60) for f in futures]
        status = srv.proc.wait(60)
        log = srv.log_path.read_text(errors="replace")
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
    srv.log_path.unlink(missing_ok=True)

    for err in (plain, chatted):
        assert err.status_code == 503 and err.response.headers["content-type"] == "application/json"
        assert set(err.body) == {"message", "type", "param", "code"} and err.code == "shutting_down"
        assert "shut down before this request finished" in err.message
    assert chunks >= 1 and streamed.code == "shutting_down"  # the role chunk came before the error event
    assert lines[-1] == "data: [DONE]"
    final = json.loads(lines[-2][len("data: "):])
    assert final["error"]["code"] == "shutting_down" and final["error"]["type"] == "service_unavailable"
    assert all("error" not in json.loads(line[len("data: "):]) for line in lines[:-2])
    assert status == 0, log
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log
    assert "4 request(s) still running after 1s end with 503" in log and "server stopped" in log


def test_request_arriving_during_shutdown_gets_503():
    model = ours_from_hf(tiny_hf_model("llama"))
    llm = LLM.from_model(model, None, None, dtype="float32", kv_cache_bytes=1 << 20, block_size=4)
    app = create_app(llm, ServerConfig("tiny"))
    body = {"prompt": random_prompts([6])[0], "max_tokens": 2}
    with TestClient(app) as client:
        assert client.post("/v1/completions", json=body).status_code == 200
        timer = client.portal.call(app.state.drain.begin)  # what `specfleet serve` does on SIGTERM
        try:
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "shutting_down" and "accepts no new" in r.json()["error"]["message"]
            assert client.post("/v1/chat/completions", json={"messages": MESSAGES}).status_code == 503
        finally:
            client.portal.call(timer.cancel)
