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
by more (a tokenizer that cleans up spaces across the boundary, say), the update falls back to one full
decode and starts the windows afresh from there.

SentencePiece's byte fallback (Gemma's, Llama-2's) decodes a run of byte pieces ("<0xE6>") as one unit,
and a run that is not valid UTF-8 as a whole becomes one U+FFFD per piece, valid characters before the
bad byte included. So a window's context always reaches back to the start of the run of byte pieces
before `read_offset` (`byte_ids`), and a change of such a run shows as a window that no longer starts
with its context's text, which a full decode then puts right. In text written mostly in byte pieces
(rare scripts on such a model) that happens at most characters, and decoding costs what a full decode
per token cost before; byte-level BPE (GPT-2's, SmolLM2's, Qwen's) has no byte pieces.
"""
from __future__ import annotations

from typing import Callable, Collection

REPLACEMENT = "\ufffd"
# Context tokens a window keeps at least before read_offset. One would do for byte-level BPE; SentencePiece's
# Strip decoder eats a context that is a lone space, so a wider context lets the window see the boundary.
CONTEXT_TOKENS = 4


def byte_piece_ids(tokenizer) -> frozenset[int]:
    """The ids of a SentencePiece tokenizer's byte-fallback pieces ("<0x00>" .. "<0xFF>"); none for a
    tokenizer without a vocabulary to read."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return frozenset()
    return frozenset(i for piece, i in get_vocab().items()
                     if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"))


class IncrementalText:
    """The text of a growing list of token ids under `decode`, equal to `decode(ids)` at every update;
    `byte_ids` are the tokenizer's byte-fallback pieces (none for byte-level BPE)."""

    def __init__(self, decode: Callable[[list[int]], str], byte_ids: Collection[int] = ()):
        self.decode = decode
        self.byte_ids = byte_ids
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
            self._start_window(ids, min(self.read_offset, len(ids) - CONTEXT_TOKENS))
            tail = ""
        self.text = self.final + tail
        return self.text

    def _start_window(self, ids: list[int], context_start: int) -> None:
        """Make all of `ids` final, the next window starting at `context_start` or earlier: at least
        CONTEXT_TOKENS back, and before the run of byte pieces at the end of `ids`."""
        start = max(0, context_start)
        run = len(ids)
        while run > 0 and ids[run - 1] in self.byte_ids:
            run -= 1
        self.prefix_offset = min(start, run)
        self.read_offset = len(ids)
        self.prefix_text = self.decode(ids[self.prefix_offset:])

    def _resync(self, ids: list[int]) -> str:
        """One full decode; the windows start again after it (with context before them)."""
        self.text = self.decode(ids)
        if self.text.endswith(REPLACEMENT):  # an open character: keep nothing final past the window
            self.final, self.prefix_offset, self.read_offset, self.prefix_text = "", 0, 0, ""
            return self.text
        self.final = self.text
        self._start_window(ids, len(ids) - CONTEXT_TOKENS)
        return self.text
