"""lm-evaluation-harness's own clients, unmodified, against the real server in a subprocess on loopback
(SmolLM2-135M-Instruct, fp32): `local-completions` on a loglikelihood multiple-choice task (it sends
`echo: true, logprobs: 1, max_tokens: 1` with token-id prompts) and on a generation task with 9 stop
strings, and `local-chat-completions` on a small chat task. The tasks are the local YAML and JSONL
files in tests/lmeval_tasks/.

Nothing leaves the machine: the datasets are local JSONL files, the tokenizer lm-eval needs to split
context from continuation is specfleet's own cached copy of the GGUF file's tokenizer (a local
folder), Hugging Face's libraries are put offline, and any socket connection that is not to loopback
fails the test. What is checked is the numbers: lm-eval's per-choice loglikelihoods are the offline
API's prompt log-probabilities for the same tokens, and its generations are the offline API's greedy
output cut at the first of the stop strings."""
from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

import pytest

from specfleet.llm import LLM
from specfleet.sampling_params import SamplingParams
from tests.server.harness import MODEL as DEFAULT_MODEL, ServerProcess, launch_server, stop_server, wait_ready

if os.environ.get("SPECFLEET_REQUIRE_REAL") == "1":  # CI installs the test extra: there it must run
    import lm_eval
else:
    lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install -e '.[test]')")
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

pytestmark = pytest.mark.real_model

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tests" / "lmeval_tasks"  # the task YAMLs name their data files relative to REPO
CONTEXT = 384  # the server's --max-model-len (test_server_harness.COMMON_ARGS)
# CI runs SmolLM2 with prompt lookup; SPECFLEET_LMEVAL_MODEL=qwen-1.5b SPECFLEET_LMEVAL_DRAFT=default runs the same
# checks on the embedded 1.5B with its default speculation (minutes, not in CI)
MODEL = os.environ.get("SPECFLEET_LMEVAL_MODEL", DEFAULT_MODEL)
DRAFT = os.environ.get("SPECFLEET_LMEVAL_DRAFT", "prompt-lookup")
KV_MB = 24 if MODEL == DEFAULT_MODEL else 128  # the 1.5B's KV is 57 kB a token
LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def _guarded(connect):
    def guarded(sock, address, *args):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in LOOPBACK:
            raise AssertionError(f"lm-eval tried to reach {address} off the machine; this test runs offline")
        return connect(sock, address, *args)
    return guarded


@pytest.fixture(scope="module")
def offline_env(tmp_path_factory):
    """Hugging Face's libraries offline (datasets reads its flags at import, so they are patched in its
    config too), the datasets' Arrow cache in a temporary folder, the working directory at the
    repository's root (the tasks' data paths are relative to it), and no connection off loopback."""
    import datasets
    import huggingface_hub

    with pytest.MonkeyPatch.context() as mp:
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            mp.setenv(name, "1")
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf-datasets"))
        mp.setattr(socket.socket, "connect", _guarded(socket.socket.connect))
        mp.setattr(socket.socket, "connect_ex", _guarded(socket.socket.connect_ex))
        mp.chdir(REPO)
        yield


@pytest.fixture(scope="module")
def launched():
    # --mixed-step-factor none: a prompt is never split by a measured (timing-dependent) row cap, so its
    # logits are computed in the same shape as offline below (on this quantized model chunking moves
    # them by about 1e-2; see tests/server/test_logprobs.py)
    srv = launch_server("--kv-cache-mb", str(KV_MB), "--mixed-step-factor", "none", "--draft", DRAFT, model=MODEL)
    yield srv
    if srv.proc.poll() is None:
        stop_server(srv)
    srv.log_path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def offline(launched) -> LLM:
    """The same model and settings as the server (test_server_harness.COMMON_ARGS), loaded while the
    server process starts."""
    draft = () if DRAFT == "default" else (DRAFT,)
    return LLM(MODEL, *draft, dtype="float32", num_speculative_tokens=3, max_model_len=CONTEXT,
               kv_cache_bytes=KV_MB << 20, mixed_step_factor=None)


@pytest.fixture(scope="module")
def server(launched: ServerProcess, offline) -> ServerProcess:
    return wait_ready(launched)


@pytest.fixture(scope="module")
def tokenizer_folder() -> str:
    """specfleet's cached copy of the GGUF file's tokenizer (tokenizer.json and its config): the local
    folder lm-eval loads with transformers.AutoTokenizer, never the hub."""
    from tests.conftest import real_model_path
    from specfleet.runtime.loading.checkpoint import tokenizer_folder as folder

    path = folder(real_model_path(MODEL))
    assert (path / "tokenizer.json").is_file()
    return str(path)


@pytest.fixture(scope="module")
def task_manager(offline_env) -> TaskManager:
    return TaskManager(include_path=str(TASKS), include_defaults=False)


def completions_args(server: ServerProcess, tokenizer: str) -> dict:
    return dict(base_url=server.url("/v1/completions"), model=MODEL, tokenizer=tokenizer,
                tokenizer_backend="huggingface", num_concurrent=1, batch_size=1, max_retries=1, max_length=CONTEXT,
                timeout=120)


@pytest.fixture(scope="module")
def completions_run(server, offline_env, task_manager, tokenizer_folder) -> dict:
    """One lm-eval run of `local-completions` on both completion tasks, with the per-document samples."""
    return lm_eval.simple_evaluate(model="local-completions", model_args=completions_args(server, tokenizer_folder),
                                   tasks=["specfleet_mc", "specfleet_until"], task_manager=task_manager,
                                   log_samples=True, bootstrap_iters=0)


def test_multiple_choice_loglikelihoods_are_the_offline_apis(completions_run, offline, server, tokenizer_folder):
    """Every choice's loglikelihood that lm-eval logged is the sum of the offline API's prompt
    log-probabilities of the continuation's tokens (tokenized as lm-eval tokenizes them: its own
    `_encode_pair`), and its is_greedy flag is whether each of them was the most likely token."""
    samples = completions_run["samples"]["specfleet_mc"]
    docs = [json.loads(line) for line in (TASKS / "specfleet_mc.jsonl").read_text().splitlines()]
    assert len(samples) == len(docs)
    encoder = get_model("local-completions").create_from_arg_obj(completions_args(server, tokenizer_folder))
    correct = []
    for sample in samples:
        doc = docs[sample["doc_id"]]
        assert len(sample["arguments"]) == len(sample["resps"]) == len(doc["choices"])
        lls = []
        for (context, continuation), [(got_ll, got_greedy)] in zip(sample["arguments"], sample["resps"]):
            ctx, cont = encoder._encode_pair(context, continuation)
            assert ctx and cont
            [ref] = offline.generate([ctx + cont], SamplingParams(temperature=0, max_tokens=1, logprobs=1,
                                                                   prompt_logprobs=1))
            scored = ref.prompt_logprobs[len(ctx):]
            assert [e.token_id for e in scored] == cont
            want_ll = sum(e.logprob for e in scored)
            want_greedy = all(e.logprob >= max(lp for _, lp in e.top) for e in scored)
            assert math.isclose(got_ll, want_ll, rel_tol=1e-6, abs_tol=1e-6), \
                (context, continuation, got_ll, want_ll)
            assert got_greedy == want_greedy, (context, continuation)
            lls.append(want_ll)
        correct.append(float(max(range(len(lls)), key=lls.__getitem__) == doc["answer"]))
    acc = completions_run["results"]["specfleet_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    assert acc == pytest.approx(sum(correct) / len(correct))  # the accuracy the offline numbers give


def test_generation_with_nine_stop_strings_is_cut_at_the_first(completions_run, offline):
    """lm-eval sends the task's 9 `until` strings and the EOS token's text as `stop` (more than the 4 the
    server used to allow) and does not cut the text itself: each output must be the offline API's
    greedy output (same prompt tokens, no stop strings) cut where the first stop string begins."""
    samples = completions_run["samples"]["specfleet_until"]
    assert len(samples) == 4
    cut = 0
    for sample in samples:
        [(prompt, gen_kwargs)] = sample["arguments"]
        until = gen_kwargs["until"]
        assert len(until) == 9
        [got] = sample["resps"][0]
        # lm-eval sends the prompt as token ids, without special tokens (add_bos_token is off)
        ids = offline.tokenizer.encode(prompt, add_special_tokens=False)
        [full] = offline.generate([ids], SamplingParams(temperature=0, max_tokens=gen_kwargs["max_gen_toks"]))
        starts = [i for i in (full.text.find(s) for s in until) if i >= 0]
        want = full.text[:min(starts)] if starts else full.text
        assert got == want, (prompt, full.text)
        cut += bool(starts)
    # the task's prompts were chosen so that most of SmolLM2's outputs hit a stop string (the 1.5B's: 2 of 4)
    assert cut >= (3 if MODEL == DEFAULT_MODEL else 1), "too few outputs hit a stop string to test the cut"
    assert 0.0 <= completions_run["results"]["specfleet_until"]["exact_match,none"] <= 1.0


def test_local_chat_completions(server, offline, offline_env, task_manager):
    """`local-chat-completions` (messages rendered by the server's chat template) on a small generation
    task: each answer is the offline chat API's greedy answer with the stop strings lm-eval sends."""
    results = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args=dict(base_url=server.url("/v1/chat/completions"), model=MODEL, num_concurrent=1, max_retries=1,
                        timeout=120),
        tasks=["specfleet_chat"], task_manager=task_manager, apply_chat_template=True, log_samples=True,
        bootstrap_iters=0)
    samples = results["samples"]["specfleet_chat"]
    assert len(samples) == 2
    for sample in samples:
        [(chat, gen_kwargs)] = sample["arguments"]
        messages = json.loads(chat[0])  # lm-eval's JsonChatStr: the messages as JSON
        assert messages[-1]["role"] == "user"
        [want] = offline.chat(messages, SamplingParams(temperature=0, max_tokens=gen_kwargs["max_gen_toks"],
                                                       stop=gen_kwargs["until"]))
        [got] = sample["resps"][0]
        assert got == want.text and got
    assert 0.0 <= results["results"]["specfleet_chat"]["exact_match,none"] <= 1.0
