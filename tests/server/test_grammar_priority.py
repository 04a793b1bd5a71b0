"""A large request's grammar compiles only on CPU time the engine leaves idle (issue 44's probe).

A megabyte regex compiles for seconds; at nice 10 its thread still took slices of the cores the
engine's threads wanted, and the steady stream's longest gaps came while it compiled. Large requests'
grammars now compile on a worker of their own under SCHED_IDLE; small ones stay on the tokenizer
workers (nice 10), so a busy engine never starves ordinary requests. In-process, on SmolLM2.
"""
from __future__ import annotations

import os
import sys
import threading

import pytest
from fastapi.testclient import TestClient

from specfleet import LLM
from specfleet.runtime.sample.structured import GrammarCompiler
from specfleet.server.admission import LARGE_BODY_BYTES
from specfleet.server.app import ServerConfig, create_app

pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")]


@pytest.fixture(scope="module")
def client():
    from tests.conftest import real_model_path

    real_model_path("smollm2-135m-instruct")
    llm = LLM("smollm2-135m-instruct", None, dtype="float32", max_model_len=384, kv_cache_bytes=24 << 20,
              max_num_seqs=4)
    with TestClient(create_app(llm, ServerConfig("m", max_body_bytes=4 << 20))) as c:
        yield c


def test_a_large_requests_grammar_compiles_at_idle_priority_and_a_small_ones_does_not(client, monkeypatch):
    seen: list[tuple[str, int, int]] = []  # (thread, scheduling policy, nice) of each grammar compile
    real_build = GrammarCompiler._build

    def build(self, spec):
        tid = threading.get_native_id()
        seen.append((threading.current_thread().name, os.sched_getscheduler(tid),
                     os.getpriority(os.PRIO_PROCESS, tid)))
        return real_build(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_build", build)
    # a large schema (long descriptions: a big body, a grammar that compiles fast), under the server's bounds
    schema = {"type": "object", "properties": {f"k{j}": {"type": "string", "description": "x" * 4000}
                                               for j in range(LARGE_BODY_BYTES // 4000 + 2)}}
    r = client.post("/v1/completions", json={"prompt": "JSON:", "max_tokens": 2, "temperature": 0,
                                             "structured_outputs": {"json": schema}})
    assert r.status_code == 200, r.text
    assert seen and seen[-1][1] == os.SCHED_IDLE, f"a {len(str(schema))}-character schema compiled on {seen}"
    del seen[:]
    r = client.post("/v1/completions", json={"prompt": "Yes or no?", "max_tokens": 2, "temperature": 0,
                                             "structured_outputs": {"regex": "(yes|no)"}})
    assert r.status_code == 200, r.text
    name, policy, nice = seen[-1]
    assert policy != os.SCHED_IDLE and nice >= 10 and name.startswith("specfleet-tokenizer"), seen


def test_a_large_body_is_parsed_below_the_engines_priority(client, monkeypatch):
    """A body over LARGE_BODY_BYTES is parsed off the event loop on the parse workers, niced below the process
    (eight 2 MB prompts parsed at the engine's priority were the probe's longest stalls of other streams)."""
    from specfleet.server.schemas import CompletionRequest

    seen: list[tuple[str, int]] = []
    real = CompletionRequest.model_validate_json.__func__

    def parse(cls, body, *a, **kw):
        seen.append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return real(cls, body, *a, **kw)

    monkeypatch.setattr(CompletionRequest, "model_validate_json", classmethod(parse))
    r = client.post("/v1/completions", json={"prompt": "Say it:", "max_tokens": 1, "temperature": 0,
                                             "user": "x" * (LARGE_BODY_BYTES + 10)})
    assert r.status_code == 200, r.text
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert seen and seen[-1][0].startswith("specfleet-parse") and seen[-1][1] >= min(19, own + 1), seen
