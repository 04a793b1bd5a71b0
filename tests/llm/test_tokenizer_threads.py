"""The tokenizer is shared by the server's tokenizer thread (encode) and the engine thread (decode):
no tokenizer object may ever be inside a call on two threads at once."""
from __future__ import annotations

import threading
import time

import pytest

from specfleet.llm import LLM
from specfleet.runtime.loading.tokenizer import PerThreadTokenizer
from specfleet.sampling_params import SamplingParams
from tiny_models import ours_from_hf, random_prompts, tiny_hf_model


class BorrowChecked:
    """A tokenizer that, like a Hugging Face one under a mutable borrow, fails a call made while another
    thread is inside a call ("Already borrowed"). Token t is one letter."""

    eos_token_id = None
    chat_template = None

    def __init__(self):
        self._busy = threading.Lock()

    def _enter(self):
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("Already borrowed")
        time.sleep(0.0005)  # stay inside long enough for an overlap to show

    def encode(self, text, add_special_tokens=True):
        self._enter()
        try:
            return [ord(c) % 26 for c in text]
        finally:
            self._busy.release()

    def decode(self, ids, skip_special_tokens=True):
        self._enter()
        try:
            return "".join(chr(ord("a") + t % 26) for t in ids)
        finally:
            self._busy.release()

    def __deepcopy__(self, memo):
        return BorrowChecked()


def test_encode_on_one_thread_while_the_engine_decodes_on_another():
    llm = LLM.from_model(ours_from_hf(tiny_hf_model("llama")), BorrowChecked(), None, dtype="float32",
                         kv_cache_bytes=1 << 20, block_size=4)
    errors, done = [], threading.Event()

    def tokenizer_thread():  # what the server's tokenizer thread does for each request
        while not done.is_set():
            try:
                llm.encode("hello world " * 20)
            except Exception as e:  # noqa: BLE001 - collected for the assertion
                errors.append(e)

    t = threading.Thread(target=tokenizer_thread)
    t.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=["zzzz"])
        for _ in range(3):
            outs = llm.generate(random_prompts([5, 9, 7, 3]), params)  # decodes every step (stop strings)
            assert all(len(o.text) == 40 for o in outs)
    finally:
        done.set()
        t.join()
    assert not errors, errors[:3]


@pytest.mark.real_model
def test_real_tokenizer_copies_agree_across_threads():
    """Each thread's copy of SmolLM2's tokenizer encodes and decodes exactly as the original."""
    from transformers import AutoTokenizer

    from tests.conftest import real_model_path
    from specfleet.runtime.loading.checkpoint import tokenizer_folder

    tok = AutoTokenizer.from_pretrained(tokenizer_folder(real_model_path("smollm2-135m")))
    shared = PerThreadTokenizer(tok)
    text = "def add(a, b):\n    return a + b  # héllo 日本語"
    want = tok.encode(text)
    results = []

    def use():
        for _ in range(50):
            ids = shared.encode(text)
            results.append((ids == want, shared.decode(ids) == tok.decode(want), len(shared) == len(tok)))

    threads = [threading.Thread(target=use) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(results) == 150 and all(all(r) for r in results)
    assert shared.chat_template == tok.chat_template and shared.eos_token_id == tok.eos_token_id


@pytest.mark.real_model
def test_cross_vocabulary_codec_uses_the_calling_threads_copy():
    """A cross-vocabulary draft's codec, built once on the main thread, must not pin that thread's copy:
    drafter threads use it too."""
    from transformers import AutoTokenizer

    from tests.conftest import real_model_path
    from specfleet.drafting.text_align import TextCodec
    from specfleet.runtime.loading.checkpoint import tokenizer_folder

    tok = AutoTokenizer.from_pretrained(tokenizer_folder(real_model_path("smollm2-135m")))
    codec = TextCodec(PerThreadTokenizer(tok))
    here = codec.tokenizer
    there = []
    thread = threading.Thread(target=lambda: there.append((codec.tokenizer, codec.encode("héllo"))))
    thread.start()
    thread.join()
    assert there[0][0] is not here and there[0][1] == codec.encode("héllo")
