"""Malformed and hostile requests against the real server: each gets the right status and a clear
OpenAI-style error, disconnects abort their requests and free their KV, and the server keeps serving."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.server.harness import MODEL, ServerProcess, start_server, stop_server

pytestmark = pytest.mark.real_model

MAX_BODY = 2 << 20
OK_PROMPT = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server():
    # two running, two queued: enough to make the queue overflow on purpose below
    srv = start_server("--kv-cache-mb", "24", "--max-num-seqs", "2", "--max-queue", "2",
                       "--max-body-bytes", str(MAX_BODY))
    yield srv
    stop_server(srv)


def completion(**changes) -> dict:
    return {**OK_PROMPT, **changes}


def chat(**changes) -> dict:
    return {**OK_CHAT, **changes}


def without(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


C, CH = "/v1/completions", "/v1/chat/completions"
# (name, path, body: dict is sent as JSON, str/bytes raw with a JSON content type, status, text in message)
CASES = [
    ("broken json", C, '{"prompt": "hi", ', 400, "not valid JSON"),
    ("json array body", C, "[1, 2]", 400, "must be a JSON object"),
    ("empty body", C, b"", 400, "not valid JSON"),
    ("prompt wrong type", C, completion(prompt=5), 400, "'prompt'"),
    ("max_tokens as string", C, completion(max_tokens="ten"), 400, "'max_tokens'"),
    ("temperature as string", C, completion(temperature="0.5"), 400, "'temperature'"),
    ("stream as string", C, completion(stream="yes"), 400, "'stream'"),
    ("negative max_tokens", C, completion(max_tokens=-5), 400, "max_tokens must be an integer >= 1"),
    ("zero max_tokens", CH, chat(max_tokens=0), 400, "max_tokens must be an integer >= 1"),
    ("huge max_tokens", C, completion(max_tokens=10**12), 400, "does not fit"),
    ("temperature below 0", C, completion(temperature=-0.1), 400, "temperature must be"),
    ("temperature NaN", C, '{"prompt": "hi", "temperature": NaN}', 400, "temperature must be"),
    ("top_p 0", C, completion(top_p=0), 400, "top_p must be in (0, 1]"),
    ("top_k negative", CH, chat(top_k=-7), 400, "top_k must be"),
    ("negative seed", C, completion(seed=-1), 400, "seed must be a non-negative integer"),
    ("stop wrong type", C, completion(stop=5), 400, "'stop'"),
    ("stop empty string", C, completion(stop=""), 400, "stop must be non-empty strings"),
    ("stops too long", C, completion(stop=["x" * 1000] * 5), 400, "at most 4096 are allowed"),
    ("stop contains a special token", C, completion(stop=["\n<|im_start|>"]), 400, "of its own"),
    ("missing prompt", C, without(OK_PROMPT, "prompt"), 400, "missing required field 'prompt'"),
    ("empty prompt", C, completion(prompt=""), 400, "the prompt is empty"),
    ("empty batch of prompts", C, completion(prompt=[]), 400, "prompt is an empty list"),
    ("empty prompt in a batch", C, completion(prompt=["a", ""]), 400, "the prompt is empty"),
    ("token id out of vocab", C, completion(prompt=[1, 2, 10**9]), 400, "outside the vocabulary"),
    ("prompt over context", C, completion(prompt="hello " * 2000), 400, "context holds 384"),
    ("megabyte prompt", C, completion(prompt="word " * 200_000), 400, "shorten the prompt"),
    ("oversized body", C, completion(prompt="x" * (3 << 20)), 413, f"larger than {MAX_BODY} bytes"),
    ("n=0", C, completion(n=0), 400, "n=0 is out of range"),
    ("n beyond the queue", C, completion(n=100, prompt=["a", "b", "c"]), 400, "fit the queue"),
    ("unknown model", C, completion(model="gpt-4"), 404, "'gpt-4' does not exist"),
    ("unknown field", C, completion(temprature=0.5), 400, "unknown field 'temprature'"),
    ("logprobs out of range", C, completion(logprobs=30), 400, "logprobs=30 is out of range"),
    ("unsupported penalty", CH, chat(presence_penalty=1.0), 400, "presence_penalty is not supported"),
    ("empty messages", CH, chat(messages=[]), 400, "'messages'"),
    ("message without content", CH, chat(messages=[{"role": "user"}]), 400, "'messages.0.content'"),
    ("message bad role", CH, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "'messages.0.role'"),
    ("message content wrong type", CH, chat(messages=[{"role": "user", "content": 7}]), 400,
     "'messages.0.content'"),
    ("messages not a list", CH, chat(messages="hi"), 400, "'messages'"),
]


@pytest.mark.parametrize("name,path,body,status,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_clear_error(server: ServerProcess, name, path, body, status, needle):
    if isinstance(body, dict):
        r = httpx.post(server.url(path), json=body, timeout=60)
    else:
        r = httpx.post(server.url(path), content=body, headers=JSON, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    assert set(err) == {"message", "type", "param", "code"} and err["type"]


def test_non_json_content_type_and_unknown_routes(server):
    r = httpx.post(server.url(C), content=json.dumps(OK_PROMPT), headers={"content-type": "text/plain"})
    assert r.status_code == 415 and "Content-Type: application/json" in r.json()["error"]["message"]
    r = httpx.post(server.url("/v1/engines"), json=OK_PROMPT)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(server.url(C))
    assert r.status_code == 405 and "error" in r.json()


def test_openai_client_sees_typed_errors(server):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="temperature must be"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_disconnect_mid_stream_aborts_and_frees_kv(server, endpoint):
    # completions: leave after the first token; chat: after the role chunk, which comes before any token
    path, body = (C, completion) if endpoint == "completions" else (CH, chat)
    with httpx.stream("POST", server.url(path), json=body(max_tokens=300, ignore_eos=True, stream=True),
                      timeout=60) as r:
        assert r.status_code == 200
        assert next(line for line in r.iter_lines() if line.startswith("data:"))
    # the connection is closed: the request must be aborted and its blocks freed within about a step
    m = server.wait_idle(timeout_s=5)
    assert m[f"specfleet_requests_total{{endpoint={endpoint},outcome=http_499}}"] >= 1


def test_disconnect_before_non_streamed_response_aborts(server):
    body = chat(max_tokens=300, ignore_eos=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url(CH), json=body, timeout=httpx.Timeout(60, read=1.5))
    m = server.wait_idle(timeout_s=10)
    assert m["specfleet_requests_total{endpoint=chat,outcome=http_499}"] >= 1


def test_full_queue_answers_429(server):
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = completion(max_tokens=24, ignore_eos=True)
            return await asyncio.gather(*(client.post(server.url(C), json=body) for _ in range(10)))

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429} and codes.count(200) >= 2 and codes.count(429) >= 1, codes
    r = next(r for r in responses if r.status_code == 429)
    assert r.json()["error"]["type"] == "rate_limit_error" and "max_queue=2" in r.json()["error"]["message"]
    assert r.headers["retry-after"] == "1"
    server.wait_idle()


def test_server_still_serves_after_abuse(server):
    t0 = time.perf_counter()
    r = httpx.post(server.url(C), json=completion(max_tokens=4), timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    r = httpx.post(server.url(CH), json=chat(max_tokens=4), timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert httpx.get(server.url("/health")).status_code == 200
    server.wait_idle()
    assert time.perf_counter() - t0 < 60
