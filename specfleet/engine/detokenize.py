"""A request's output text, decoded a few tokens at a time instead of all of it every step.

Decoding the whole output after every token costs O(n) per token, O(n^2) per request: at 16k tokens
that is most of a step. `IncrementalText` keeps the text of the tokens up to `read_offset`, which is
final, and each update decodes only a short window: the tokens from `prefix_offset` (a little context
before `read_offset`, so that decoders which treat a sequence's first token specially, like
SentencePiece's leading-space strip, see the same boundary as a full decode) to the end. The text the
new tokens add is the window's text minus the context's text (the prefix-offset / read-offset
technique of vLLM and TGI).

A byte-level tokenizer can split one UTF-8 character over several tokens; until the last piece arrives
the window decodes to U+FFFD at its end. Such a tail is returned as it is (so the text equals a full
decode at every step: the stream holds it back) but not made final, and the next update decodes it
again with the pieces that complete it. When a window does not decode to its context's text followed
by more (a tokenizer that cleans up spaces across the boundary, say), the update falls back to one
full decode and starts the windows afresh from there.
"""
from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 4  # context kept before read_offset after a full decode (vLLM uses 5 for the prompt)


class IncrementalText:
    """The text of a growing list of token ids under `decode`, equal to `decode(ids)` at every update."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.final = ""  # decode(ids[:read_offset]): never changes again
        self.prefix_offset = 0  # the window starts here: context for the decoder
        self.read_offset = 0  # tokens up to here are in `final`
        self.prefix_text = ""  # decode(ids[prefix_offset:read_offset]), kept between updates
        self.text = ""
        self.num_ids = 0  # len(ids) at the last update

    def update(self, ids: list[int]) -> str:
        """The text of `ids`, which extend the ids of the previous update."""
        if len(ids) == self.num_ids:
            return self.text
        self.num_ids = len(ids)
        window = self.decode(ids[self.prefix_offset:])
        if not window.startswith(self.prefix_text):
            return self._resync(ids)
        tail = window[len(self.prefix_text):]
        if tail and not tail.endswith(REPLACEMENT):  # complete characters: final from now on
            self.final += tail
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            self.prefix_text = self.decode(ids[self.prefix_offset:self.read_offset])
            tail = ""
        self.text = self.final + tail
        return self.text

    def _resync(self, ids: list[int]) -> str:
        """One full decode; the windows start again after it (with context before them)."""
        self.text = self.decode(ids)
        if self.text.endswith(REPLACEMENT):  # an open character: keep nothing final past the window
            self.final, self.prefix_offset, self.read_offset, self.prefix_text = "", 0, 0, ""
            return self.text
        self.final = self.text
        self.read_offset = len(ids)
        self.prefix_offset = max(0, len(ids) - CONTEXT_TOKENS)
        self.prefix_text = self.decode(ids[self.prefix_offset:])
        return self.text
