"""Issue 44: no single request can slow the others. Everything a client controls is bounded, costly work
stays off the engine thread, and side channels are closed. In-process (TestClient) on SmolLM2."""
from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from fastapi.testclient import TestClient

from specfleet import LLM, SamplingParams
from specfleet.errors import InvalidRequestError
from specfleet.runtime.sample import structured as grammar_mod
from specfleet.runtime.sample.structured import GRAMMAR_ENTRY_OVERHEAD, GrammarCompiler
from specfleet.sampling_params import MAX_STOP_TOKEN_IDS, StructuredOutputsParams
from specfleet.server import tools
from specfleet.server.app import ServerConfig, create_app

pytestmark = pytest.mark.real_model

MAX_LEN = 384


@pytest.fixture(scope="module")
def llm(request):
    from tests.conftest import real_model_path

    real_model_path("smollm2-135m-instruct")
    return LLM("smollm2-135m-instruct", None, dtype="float32", max_model_len=MAX_LEN, kv_cache_bytes=24 << 20,
               max_num_seqs=4)


@pytest.fixture()
def client(llm):
    with TestClient(create_app(llm, ServerConfig("m"))) as c:
        yield c


def completion(**fields) -> dict:
    return {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, **fields}


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "max_tokens": 4,
            "temperature": 0, **fields}


def error(r) -> dict:
    return r.json()["error"]


# -- 1: stop_token_ids are bounded, checked against the vocabulary, and tested as a set --------------
def test_stop_token_ids_are_bounded_and_checked(client, llm):
    r = client.post("/v1/completions", json=completion(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)), n=2))
    assert r.status_code == 400 and error(r)["param"] == "stop_token_ids", r.text
    assert f"at most {MAX_STOP_TOKEN_IDS}" in error(r)["message"]
    r = client.post("/v1/completions", json=completion(stop_token_ids=[5, 10**7]))
    assert r.status_code == 400 and "outside the vocabulary" in error(r)["message"], r.text
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))
    # within the bound a stop id still stops at exactly that token (the engine tests a set)
    free = client.post("/v1/completions", json=completion(max_tokens=6, ignore_eos=True)).json()
    ids = llm.tokenizer.encode(free["choices"][0]["text"], add_special_tokens=False)
    stopper = ids[2]
    stopped = client.post("/v1/completions", json=completion(max_tokens=6, ignore_eos=True,
                                                             stop_token_ids=[*range(40_000, 40_900), stopper]))
    body = stopped.json()
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == \
        ids.index(stopper) + 1, body


def test_other_lists_a_client_sends_are_bounded(client):
    r = client.post("/v1/completions", json=completion(stop=["a"] * 300))
    assert r.status_code == 400 and error(r)["param"] == "stop"
    r = client.post("/v1/completions", json=completion(logit_bias={str(i): 1.0 for i in range(2000)}))
    assert r.status_code == 400 and "at most" in error(r)["message"]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    many = [{**tool, "function": {**tool["function"], "name": f"f{i}"}} for i in range(200)]
    r = client.post("/v1/chat/completions", json=chat(tools=many))
    assert r.status_code == 400 and error(r)["param"] == "tools" and "at most 128" in error(r)["message"]



def test_an_output_constraints_text_is_bounded(client, monkeypatch):
    """A regex or grammar longer than MAX_PATTERN_CHARS, choices or a schema longer than MAX_CONSTRAINT_CHARS, is a
    400 naming the field, refused before anything compiles (a 500 KB regex held every other stream 0.2 s a token)."""
    from specfleet.server import schemas

    compiled = []
    monkeypatch.setattr(GrammarCompiler, "_build", lambda self, spec: compiled.append(spec))
    big = "a" * (schemas.MAX_CONSTRAINT_CHARS + 1)
    pattern = "a" * (schemas.MAX_PATTERN_CHARS + 1)
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "x" * 1000} for i in range(600)}}
    for param, body in (("structured_outputs", completion(structured_outputs={"regex": pattern})),
                        ("guided_regex", completion(guided_regex=pattern)),
                        ("guided_grammar", completion(guided_grammar="start: " + pattern)),
                        ("guided_choice", completion(guided_choice=[big[:300_000], big[:300_000]])),
                        ("response_format.json_schema", chat(response_format={
                            "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}))):
        url = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = client.post(url, json=body)
        assert r.status_code == 400, (param, r.text)
        bound = schemas.MAX_CONSTRAINT_CHARS if "choice" in param or "json" in param else schemas.MAX_PATTERN_CHARS
        assert error(r)["param"] == param and f"at most {bound} are allowed" in error(r)["message"], r.text
    assert compiled == []
    assert client.post("/v1/completions", json=completion(max_tokens=2)).status_code == 200  # still serving

# -- 4: admission before tokenization ---------------------------------------------------------------
def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenized(client, llm, monkeypatch):
    seen: list[int] = []
    real = llm.encode
    monkeypatch.setattr(llm, "encode", lambda text: seen.append(len(text)) or real(text))
    r = client.post("/v1/completions", json=completion(prompt="word " * 200_000))
    assert r.status_code == 400 and error(r)["code"] == "context_length_exceeded", r.text
    assert "shorten the prompt" in error(r)["message"]
    assert all(n < 20 * MAX_LEN for n in seen), seen  # at most a bounded head was tokenized
    # a long prompt of short pieces that the byte bound cannot rule out: only its head is tokenized
    seen.clear()
    r = client.post("/v1/completions", json=completion(prompt="x y " * 3000))
    assert r.status_code == 400 and error(r)["code"] == "context_length_exceeded", r.text
    assert seen and max(seen) < len("x y " * 3000), seen
    r = client.post("/v1/chat/completions", json=chat(messages=[{"role": "user", "content": "word " * 200_000}]))
    assert r.status_code == 400 and error(r)["code"] == "context_length_exceeded", r.text


def test_requests_beyond_the_queue_get_429_before_tokenization(llm, monkeypatch):
    gate, entered = threading.Event(), threading.Semaphore(0)
    real = llm.encode

    def slow_encode(text):
        entered.release()
        assert gate.wait(60), "the test never released the tokenizer"
        return real(text)

    monkeypatch.setattr(llm, "encode", slow_encode)
    config = ServerConfig("m", tokenizer_workers=2, max_queue=3)  # requests being prepared count against it
    with TestClient(create_app(llm, config)) as c, ThreadPoolExecutor(3) as pool:
        held = [pool.submit(c.post, "/v1/completions", json=completion()) for _ in range(3)]
        for _ in range(2):  # two workers: two tokenize at once (a third waits for a worker)
            assert entered.acquire(timeout=60)
        admission = c.app.state.admission
        for _ in range(600):
            if admission.num_preparing == 3:
                break
            threading.Event().wait(0.05)
        assert admission.num_preparing == 3
        r = c.post("/v1/completions", json=completion())
        assert r.status_code == 429 and error(r)["code"] == "queue_full", r.text
        assert "being prepared" in error(r)["message"] and r.headers["retry-after"] == "1"
        gate.set()
        assert [f.result(timeout=120).status_code for f in held] == [200, 200, 200]
        assert admission.num_preparing == 0


# -- 2 + 3: grammars compile on a worker, and the compiled ones live in an LRU under a byte budget -------
def test_grammars_are_compiled_off_the_engine_thread(client, monkeypatch):
    threads: list[str] = []
    nice: list[int] = []
    real_build, real_init = getattr(GrammarCompiler, "_build", None), grammar_mod.Matcher.__init__

    def build(self, spec):
        threads.append(threading.current_thread().name)
        nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real_build(self, spec)

    def init(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return real_init(self, *args, **kwargs)

    monkeypatch.setattr(GrammarCompiler, "_build", build, raising=False)  # compiling a constraint
    monkeypatch.setattr(grammar_mod.Matcher, "__init__", init)  # a request's matcher (and its first mask)
    r = client.post("/v1/completions", json=completion(structured_outputs={"regex": "(yes|no)[0-9]{3}"}, n=2,
                                                       max_tokens=8))
    assert r.status_code == 200, r.text
    assert all(c["text"][:2] in ("ye", "no") for c in r.json()["choices"])
    assert threads and not any(t.startswith("specfleet-engine") for t in threads), threads
    # and at a lower CPU priority than the engine's threads, which every stream waits on
    assert nice and all(n >= min(19, os.getpriority(os.PRIO_PROCESS, 0) + 1) for n in nice), nice


def test_the_grammar_cache_stays_within_its_byte_budget(llm):
    base = llm.engine.grammar_compiler()
    budget = 6 * (GRAMMAR_ENTRY_OVERHEAD + 20_000)
    compiler = GrammarCompiler(llm.tokenizer, base.vocab_size, base.eos_token_ids, cache_bytes=budget)

    def schema(i: int) -> dict:
        return {"type": "object", "properties": {f"field_{i}_{k}": {"type": "string", "description": "d" * 300}
                                                 for k in range(50)}}

    for i in range(40):
        compiler.grammar(StructuredOutputsParams(json=schema(i)))
        assert compiler.cached_bytes <= budget
    assert 1 <= len(compiler) < 40
    m = compiler.matcher(StructuredOutputsParams(json=schema(0)))  # evicted long ago: compiled again
    assert bool(m.allowed()[llm.tokenizer.encode("{", add_special_tokens=False)[0]])
    with pytest.raises(InvalidRequestError):
        compiler.grammar(StructuredOutputsParams(regex="(unclosed"))


# -- 5: cache_salt ---------------------------------------------------------------------------------
def test_cache_salt_keeps_prefix_cache_hits_within_a_salt(client):
    prompt = "A long shared preamble that fills several KV blocks of the prefix cache. " * 6

    def cached(**fields) -> int:
        r = client.post("/v1/completions", json=completion(prompt=prompt, max_tokens=1, **fields))
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="alice") == 0
    assert cached(cache_salt="alice") > 0  # the same salt shares
    assert cached(cache_salt="mallory") == 0  # another salt learns nothing of alice's prompt
    assert cached() == 0  # nor does a request without one
    r = client.post("/v1/completions", json=completion(cache_salt=""))
    assert r.status_code == 400 and error(r)["param"] == "cache_salt"


# -- 6 + 7: tool calls ------------------------------------------------------------------------------
def test_a_cut_off_last_call_keeps_the_complete_calls():
    text = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "argu')
    content, calls = tools.parse_tool_calls(text, frozenset({"get_weather"}))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert content == 'Sure.\n<tool_call>\n{"name": "get_weather", "argu'
    # a broken block in the middle still leaves the whole text as content (nothing is guessed)
    broken = text.replace('"Paris"}}', '"Paris"') + "\n</tool_call>"
    assert tools.parse_tool_calls(broken, frozenset({"get_weather"}))[1] == []


def test_forced_calls_are_bounded_to_the_tools_asked_for(llm):
    compiler = llm.engine.grammar_compiler()
    defs = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"]}}} for n in ("a", "b")]
    spec = tools.forced_call_grammar(defs, parallel=True, literal=compiler.literal)

    def accepts(n_calls: int) -> bool:
        call = '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>'
        ids = llm.tokenizer.encode("\n".join([call] * n_calls), add_special_tokens=False)
        m = compiler.matcher(spec)
        return m.m.validate_tokens(ids) == len(ids)

    assert accepts(1) and accepts(2)
    assert not accepts(3)


@pytest.mark.parametrize("name", ["", "get weather", "</tool_call>", "x" * 65])
def test_tool_names_follow_openais_pattern(client, name):
    tool = {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    r = client.post("/v1/chat/completions", json=chat(tools=[tool]))
    assert r.status_code == 400 and error(r)["param"] == "tools.0.function.name", r.text


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_invalid_tool_parameters_are_a_400_whatever_the_tool_choice(client, tool_choice):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(unclosed"}}}}}
    r = client.post("/v1/chat/completions", json=chat(tools=[tool], tool_choice=tool_choice))
    assert r.status_code == 400, r.text
    assert "invalid" in error(r)["message"] and error(r)["param"].startswith("tools.0")


# -- 14: without a key, only Host names of this machine are served ---------------------------------------
def test_host_allowlist_without_a_key(llm):
    app = create_app(llm, ServerConfig("m"))
    with TestClient(app, base_url="http://rebound.attacker.example") as c:
        r = c.get("/v1/models")
        assert r.status_code == 403 and error(r)["code"] == "host_not_allowed"
    for ok in ("http://localhost:8000", "http://127.0.0.1:8000", "http://[::1]:8000", "http://app.localhost"):
        with TestClient(app, base_url=ok) as c:
            assert c.get("/v1/models").status_code == 200, ok
    with TestClient(create_app(llm, ServerConfig("m", allowed_hosts=("api.internal.example",))),
                    base_url="http://api.internal.example") as c:
        assert c.get("/v1/models").status_code == 200
    with TestClient(create_app(llm, ServerConfig("m", api_key="k")), base_url="http://any.example") as c:
        assert c.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200  # the key guards it


def test_a_compiled_grammars_first_mask_and_forced_text_cost_the_engine_little(llm):
    """The engine thread asks every constrained request's matcher for its first mask and the tokens its
    grammar forces: the first mask comes from the compiled grammar (computed on the worker: 0.2 s for a
    1.3 MB regex literal), and only a bounded head of a long forced text is tokenized."""
    import random
    import types

    compiler = llm.engine.grammar_compiler()
    literal = "".join(random.Random(0).choices("abcdefghij", k=20_000))
    m = compiler.matcher(StructuredOutputsParams(regex=literal))

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"llguidance's {name} was called for the first mask")

    real, m.m = m.m, Untouchable()
    first = m.allowed()
    m.m = real
    fresh = grammar_mod.Matcher(compiler, compiler.grammar(StructuredOutputsParams(regex=literal)))
    assert torch.equal(first, fresh.allowed())
    seen: list[int] = []

    class Tok:
        def tokenize_bytes(self, data):
            seen.append(len(data))
            return compiler.lltok.tokenize_bytes(data)

    m.compiler = types.SimpleNamespace(lltok=Tok(), eos_token_ids=compiler.eos_token_ids, vocab_size=compiler.vocab_size)
    forced = m.forced_tokens(4)
    assert 1 <= len(forced) <= 4 and seen and max(seen) < 1000, seen
    assert llm.tokenizer.decode(forced) == literal[:len(llm.tokenizer.decode(forced))]
