"""Log-probabilities, echo, n > 1 and batches of prompts over HTTP, in-process on the real
SmolLM2-135M-Instruct with a prompt-lookup draft: the numbers are the offline API's (the target's
own, with or without the draft), shaped as OpenAI's legacy completions object (what
lm-evaluation-harness's `local-completions` reads) and as the chat logprobs object."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from specfleet.llm import LLM
from specfleet.sampling_params import SamplingParams
from specfleet.server.app import ServerConfig, create_app
from tests.server.harness import MODEL

pytestmark = pytest.mark.real_model

TEXT = "The capital of France is Paris. The capital of France is"
MESSAGES = [{"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    from tests.conftest import real_model_path

    real_model_path(MODEL)  # skips when the model is not installed
    # mixed_step_factor=None: no prompt is split into chunks by a measured (timing-dependent) row cap. On
    # this quantized model a prompt's logits depend on how it is chunked (by about 1e-2), so the numbers
    # compared here would otherwise depend on the machine's timing
    return LLM(MODEL, "prompt-lookup", dtype="float32", num_speculative_tokens=3, max_model_len=384,
               kv_cache_bytes=24 << 20, mixed_step_factor=None)


def app(llm: LLM) -> TestClient:
    return TestClient(create_app(llm, ServerConfig(MODEL)))


def post(client: TestClient, path: str, **body) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def events(client: TestClient, path: str, **body) -> list[dict]:
    r = client.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_lm_eval_loglikelihood_request(llm):
    """What lm-evaluation-harness's local-completions sends for loglikelihood: a batch of token-id
    prompts, echo, logprobs=1, max_tokens=1, greedy. token_logprobs[ctxlen:-1] must be the target's
    log-probabilities of the continuation tokens, and top_logprobs tell whether each was greedy."""
    ids = llm.encode(TEXT)
    short = ids[:6]
    refs = llm.generate([ids, short], SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1))
    with app(llm) as client:
        got = post(client, "/v1/completions", prompt=[ids, short], echo=True, logprobs=1, max_tokens=1,
                   temperature=0, seed=1234)
    assert [c["index"] for c in got["choices"]] == [0, 1]
    for choice, ref in zip(got["choices"], refs):
        lp = choice["logprobs"]
        n = len(ref.prompt_token_ids)
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:n] == [e.logprob for e in ref.prompt_logprobs[1:]]
        assert lp["token_logprobs"][n] == ref.logprobs[0].logprob
        for tok, tok_lp, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            assert top[tok] == tok_lp and 1 <= len(top) <= 2  # the most likely token, and the token itself
        assert choice["text"] == llm.tokenizer.decode(ref.prompt_token_ids) + ref.text
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        assert "".join(lp["tokens"]) == choice["text"]
    assert got["usage"]["prompt_tokens"] == len(ids) + len(short)
    # the continuation " Paris" of the repeated sentence is greedy
    n = len(ids)
    assert max(got["choices"][0]["logprobs"]["top_logprobs"][n - 1].values()) == \
        got["choices"][0]["logprobs"]["token_logprobs"][n - 1]


def test_echo_with_max_tokens_0_scores_only_the_prompt(llm):
    with app(llm) as client:
        got = post(client, "/v1/completions", prompt=TEXT, echo=True, logprobs=2, max_tokens=0)
        one = post(client, "/v1/completions", prompt=TEXT, echo=True, logprobs=2, max_tokens=1, temperature=0)
        plain = post(client, "/v1/completions", prompt=TEXT, echo=True, max_tokens=0)
    choice = got["choices"][0]
    assert choice["text"] == TEXT and got["usage"]["completion_tokens"] == 0
    n = got["usage"]["prompt_tokens"]
    assert len(choice["logprobs"]["tokens"]) == n
    assert choice["logprobs"]["token_logprobs"] == one["choices"][0]["logprobs"]["token_logprobs"][:n]
    assert all(len(top) >= 2 for top in choice["logprobs"]["top_logprobs"][1:])
    assert plain["choices"][0]["text"] == TEXT and plain["choices"][0]["logprobs"] is None


def test_completion_logprobs_stream_like_the_whole_answer(llm):
    body = dict(prompt=TEXT, echo=True, logprobs=3, max_tokens=8, temperature=0)
    with app(llm) as client:
        whole = post(client, "/v1/completions", **body)["choices"][0]
        chunks = events(client, "/v1/completions", **body)
    streamed = {k: [x for c in chunks for x in c["choices"][0]["logprobs"][k]]
                for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert streamed == whole["logprobs"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]


def test_chat_logprobs_match_the_offline_api(llm):
    ref = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12, logprobs=2))[0]
    with app(llm) as client:
        got = post(client, "/v1/chat/completions", messages=MESSAGES, temperature=0, max_tokens=12, logprobs=True,
                   top_logprobs=2)
        chunks = events(client, "/v1/chat/completions", messages=MESSAGES, temperature=0, max_tokens=12,
                        logprobs=True, top_logprobs=2)
        none = post(client, "/v1/chat/completions", messages=MESSAGES, temperature=0, max_tokens=2, logprobs=True)
    content = got["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in content] == [e.logprob for e in ref.logprobs]
    assert [[t["logprob"] for t in e["top_logprobs"]] for e in content] == [[lp for _, lp in e.top] for e in ref.logprobs]
    for e in content:
        assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"] or "\ufffd" in e["token"]
        assert e["top_logprobs"][0]["logprob"] == e["logprob"]  # greedy
    # every token counted in usage is listed, the one that ended the answer (<|im_end|>) too
    assert len(content) == got["usage"]["completion_tokens"] and content[-1]["token"] == "<|im_end|>"
    assert "".join(e["token"] for e in content[:-1]) == got["choices"][0]["message"]["content"]
    streamed = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == content
    assert all(e["top_logprobs"] == [] for e in none["choices"][0]["logprobs"]["content"])


def test_n_samples_and_a_batch_of_prompts(llm):
    prompts = ["Once upon a time", "My favourite food is"]
    with app(llm) as client:
        single = [post(client, "/v1/completions", prompt=p, max_tokens=6, seed=5 + j)["choices"][0]["text"]
                  for p in prompts for j in range(2)]
        got = post(client, "/v1/completions", prompt=prompts, n=2, max_tokens=6, seed=5)
        twice = post(client, "/v1/completions", prompt=[prompts[0]] * 2, n=2, max_tokens=1)
        chat = post(client, "/v1/chat/completions", messages=MESSAGES, n=3, max_tokens=5, seed=9, temperature=1.5)
        chunks = events(client, "/v1/chat/completions", messages=MESSAGES, n=3, max_tokens=5, seed=9, temperature=1.5,
                        stream_options={"include_usage": True})
    # choice i * n + j is sample j of prompt i, seeded with seed + j
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in got["choices"]] == single
    assert all("spec" in c for c in got["choices"]) and "spec" not in got
    assert got["usage"]["completion_tokens"] == 4 * 6
    assert got["usage"]["prompt_tokens"] == sum(len(llm.encode(p)) for p in prompts)  # once per prompt, not per sample
    assert twice["usage"]["prompt_tokens"] == 2 * len(llm.encode(prompts[0]))  # a prompt given twice counts twice
    assert len({c["message"]["content"] for c in chat["choices"]}) > 1  # sampled: different answers
    assert chat["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] < chat["usage"]["total_tokens"]
    texts = {i: "" for i in range(3)}
    finished = set()
    for c in chunks[:-1]:
        choice = c["choices"][0]
        texts[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finished.add(choice["index"])
    assert finished == {0, 1, 2} and chunks[-1]["choices"] == []
    # the same seeds give the same samples although the streamed request found the prompt in the prefix
    # cache (so its first step verified a prompt-lookup draft where the first request's had none)
    assert [texts[i] for i in range(3)] == [c["message"]["content"] for c in chat["choices"]]
    streamed_usage = dict(chunks[-1]["usage"])
    assert streamed_usage.pop("prompt_tokens_details")["cached_tokens"] > 0  # the prompt just computed
    assert streamed_usage == {k: v for k, v in chat["usage"].items() if k != "prompt_tokens_details"}
