"""A tokenizer that several threads can use at once: each thread works on its own copy.

Hugging Face tokenizers are not thread-safe: the Rust tokenizer is borrowed mutably while a call
changes its truncation or padding, and a call from another thread at that moment fails with
"Already borrowed". The server encodes prompts on its tokenizer thread while the engine thread
decodes every request's output each step (and a pipelined engine's drafter threads may encode and
decode for cross-vocabulary drafts), all through the one tokenizer the LLM loaded.

A copy per thread rather than a lock around one tokenizer: with a lock, the engine's per-step decode
would wait behind the tokenizer thread encoding a megabyte prompt, stalling every running request.
The copies are made from a template that no thread ever calls (so copying never meets a call in
progress); a copy costs about 0.15 s and the tokenizer's memory once per thread (SmolLM2's).
"""
from __future__ import annotations

import copy
import threading


_OWN = ("_template", "_copy_lock", "_local")


class PerThreadTokenizer:
    """Forwards every attribute and call to the calling thread's own copy of `tokenizer`."""

    def __init__(self, tokenizer):
        self._template = tokenizer
        self._copy_lock = threading.Lock()
        self._local = threading.local()

    def own(self):
        """The calling thread's copy, made on its first use."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            with self._copy_lock:
                tok = self._local.tokenizer = copy.deepcopy(self._template)
        return tok

    def __getattr__(self, name: str):
        if name in _OWN:  # only reached before __init__ ran (an unpickled or copied proxy): no recursion
            raise AttributeError(name)
        return getattr(self.own(), name)

    def __call__(self, *args, **kwargs):
        return self.own()(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.own())


def per_thread(tokenizer) -> PerThreadTokenizer | None:
    """`tokenizer` made safe to share between threads (None stays None; a shared one is kept)."""
    if tokenizer is None or isinstance(tokenizer, PerThreadTokenizer):
        return tokenizer
    return PerThreadTokenizer(tokenizer)
