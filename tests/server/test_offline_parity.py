"""The real server in a subprocess, driven by the official `openai` client: completions and chat,
streaming and not, equal to the offline API's output for the same model and settings (fp32)."""
from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from specfleet.llm import LLM
from specfleet.outputs import RequestOutput
from specfleet.runtime.backends.native import kernels
from specfleet.sampling_params import SamplingParams
from tests.server.harness import MODEL, ServerProcess, launch_server, stop_server, wait_ready

pytestmark = pytest.mark.real_model

PROMPT = "The three primary colors are"
MESSAGES = [{"role": "user", "content": "Name two fruits."}]


@pytest.fixture(scope="module")
def launched():
    srv = launch_server("--kv-cache-mb", "24")
    yield srv
    if srv.proc.poll() is None:  # the SIGTERM test may have stopped it already
        stop_server(srv)
    srv.log_path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def server(launched: ServerProcess, want) -> ServerProcess:
    # `want` first: the offline references are computed while the server process starts up
    return wait_ready(launched)


@pytest.fixture(scope="module")
def offline(launched) -> LLM:
    # the same settings as the server (see COMMON_ARGS), so both run identical engines
    return LLM(MODEL, "prompt-lookup", dtype="float32", num_speculative_tokens=3, max_model_len=384,
               kv_cache_bytes=24 << 20)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


SAMPLED = dict(temperature=0.9, top_p=0.95, seed=11, max_tokens=8)


@pytest.fixture(scope="module")
def want(offline: LLM) -> dict[str, RequestOutput]:
    """Offline reference outputs, computed once, one request at a time like the server tests send them.

    They run on a worker thread, as the server's engine does: on a busy two-core machine, OpenMP's
    spin-waiting made forward passes on the main thread ~20x slower (11 s vs 0.6 s here, measured).
    """
    def compute() -> dict[str, RequestOutput]:
        return {"completion": offline.generate(PROMPT, greedy(8))[0],
                "chat": offline.chat(MESSAGES, greedy(8))[0],
                "stop": offline.generate(PROMPT, greedy(12, stop=[","]))[0],
                "sampled": offline.generate(PROMPT, SamplingParams(**SAMPLED))[0]}

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(compute).result()


def test_completion_matches_offline(client, want):
    ref = want["completion"]
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert got.choices[0].text == ref.text
    assert got.choices[0].finish_reason == ref.finish_reason
    assert got.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert got.usage.completion_tokens == len(ref.token_ids)
    spec = got.model_extra["spec"]
    assert spec["drafted"] == ref.metrics["drafted"] and spec["accepted"] == ref.metrics["accepted"]
    assert set(spec) >= {"mean_accepted_length", "acceptance_rate", "drafts_used"}


def test_streamed_completion_matches_offline(client, want):
    ref = want["completion"]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == ref.text
    assert text_chunks[-1].choices[0].finish_reason == ref.finish_reason
    assert all(c.choices[0].finish_reason is None and c.usage is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == len(ref.token_ids)
    assert text_chunks[-1].model_extra["spec"]["drafted"] == ref.metrics["drafted"]


def test_chat_matches_offline(client, want):
    ref = want["chat"]
    got = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert got.choices[0].message.content == ref.text
    assert got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert got.model_extra["spec"]["steps"] == ref.metrics["steps"]


def test_streamed_chat_matches_offline(client, want):
    ref = want["chat"]
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_stop_string_is_cut_in_both_modes(client, want):
    ref = want["stop"]
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=",")
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=",",
                                         stream=True)
    assert got.choices[0].text == ref.text == "".join(c.choices[0].text for c in streamed)
    assert ref.finish_reason == "stop" and "," not in ref.text


def test_token_id_prompt_and_seeded_sampling_match_offline(server, client, offline, want):
    got = client.completions.create(model=MODEL, prompt=offline.encode(PROMPT), max_tokens=8, temperature=0)
    assert got.choices[0].text == want["completion"].text
    got = client.completions.create(model=MODEL, prompt=PROMPT, **SAMPLED)
    if got.choices[0].text != want["sampled"].text:  # seen once in CI (session 44), never here: say what differed
        srv = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=5)
        with ThreadPoolExecutor(1) as pool:
            off = pool.submit(offline.generate, PROMPT, greedy(1, logprobs=5)).result()[0]
        again = client.completions.create(model=MODEL, prompt=PROMPT, **SAMPLED).choices[0].text
        pytest.fail(f"seeded sample: server {got.choices[0].text!r}, offline {want['sampled'].text!r}, the server "
                    f"again {again!r}; first-token top logprobs, server {srv.choices[0].logprobs.top_logprobs[0]}, "
                    f"offline {off.logprobs[0]}; kernels here {kernels.isa() if kernels.available() else None}, "
                    f"server start-up: {server.startup_line()!r}; server log:\n{server.log_tail(40)}")


def test_the_server_runs_the_kernels_this_process_runs(server):
    """The parity tests compare two processes' logits: both must run the same CPU kernel path, not one of them a
    fallback (the start-up line names the path, or why there is none)."""
    here = f"CPU kernels: {kernels.isa()}" if kernels.available() else "CPU kernels unavailable"
    assert here in server.startup_line(), (here, server.startup_line())


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url("/health")).json() == {"status": "ok"}
    m = server.wait_idle()
    assert m["specfleet_spec_draft_tokens_total"] > 0 and m["specfleet_spec_steps_total"] > 0
    assert 0 <= m["specfleet_spec_acceptance_rate"] <= 1 and m["specfleet_spec_mean_accepted_length"] >= 1
    # a token judged is at most a token drafted: per-token acceptance is never below accepted / drafted
    assert m["specfleet_spec_acceptance_rate"] <= m["specfleet_spec_per_token_acceptance"] <= 1
    assert m["specfleet_spec_length"] == 3
    assert m["specfleet_spec_draft_steps_total{draft=prompt-lookup}"] > 0
    assert m["specfleet_generation_tokens_total"] > 0 and m["specfleet_kv_cache_usage_ratio"] == 0


def test_sigterm_lets_inflight_stream_finish(server, client):
    """Last in this module: stops the shared server. A stream running at SIGTERM completes in full."""
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    server.proc.send_signal(signal.SIGTERM)
    rest = list(stream)
    assert rest[-2].choices[0].finish_reason == "length"
    assert rest[-1].usage.completion_tokens == 32
    assert first.choices[0].text + "".join(c.choices[0].text for c in rest[:-1]) != ""
    assert server.proc.wait(60) == 0, server.log_tail()
    assert "server stopped" in server.log_tail()
    with pytest.raises(httpx.TransportError):  # and it no longer listens
        httpx.get(server.url("/health"), timeout=2)
