"""Text alignment between two tokenizers: pure functions and small per-request state, no models.

A draft of another model family speaks another vocabulary; text is the common ground. Three steps,
each incremental so a step costs in proportion to the new text, not to the context:

1. `CommittedText` decodes the target's committed tokens into text. Its `num_clean` tokens decode to
   `text`; tokens after them are *pending*: byte-level pieces of a character that is not complete yet
   (a 3-byte character split over two tokens decodes to U+FFFD until its last byte arrives).
2. `DraftTokens` keeps the draft's token sequence in sync with that text. Its stable prefix decodes to
   the first `chars` characters exactly; the rest (the last `hold` tokens and any new text) is
   re-tokenized every step, because a word cut at the end of the committed text may tokenize
   differently once it is complete.
3. `target_continuation` turns drafted text into target tokens. It re-tokenizes the last few committed
   target tokens together with the drafted text and keeps the tokens past the committed ones, but only
   if the committed tokens come out unchanged: a stable boundary. When the last committed token would
   merge with the drafted text (committed " fib" + "on", drafted "acci(n):" re-tokenizes to
   " fibonacci" "(n" "):"), the drafted text is tokenized on its own from the boundary ("acci" "(n"
   "):"), which is how the target continues a word it has already cut.

Example (SmolLM2 draft, Qwen target): committed target text "def fib"; the draft's tokens for it are
"def" " fib"; it drafts "onacci" "(" "n" "):" whose text "onacci(n):" becomes the Qwen tokens
"onacci" "(n" "):" after the committed " fib" (" fib" + "onacci(n):" keeps " fib" as it is).
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a decoder returns for bytes that are not (yet) valid UTF-8
MAX_CHAR_PIECES = 4  # a UTF-8 character has at most 4 bytes, so at most 4 byte-level tokens


class TextCodec:
    """Encode text to ids and decode ids to text with nothing added or cleaned up: no BOS/EOS added,
    special tokens kept as their text (so "<|im_end|>" in one vocabulary maps to the other's token of
    that name), no clean-up of spaces. Accepts a transformers tokenizer or a `tokenizers.Tokenizer`."""

    def __init__(self, tokenizer, what: str = "tokenizer"):
        from specfleet.errors import InvalidRequestError

        self._source = tokenizer
        backend = self.tokenizer
        if not (hasattr(backend, "encode") and hasattr(backend, "decode") and hasattr(backend, "get_vocab")):
            raise InvalidRequestError(f"the {what} ({type(tokenizer).__name__}) cannot encode and decode text; "
                                      f"a cross-vocabulary draft needs a tokenizers-backed tokenizer")

    @property
    def tokenizer(self):
        """The Rust tokenizer behind a fast one, looked up at each use: behind LLM's per-thread tokenizer
        (runtime/loading/tokenizer.py) that is the calling thread's copy, so drafter threads never share one."""
        return getattr(self._source, "backend_tokenizer", self._source)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids) if text else []

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False) if ids else ""

    def vocab(self) -> dict[str, int]:
        return self.tokenizer.get_vocab(with_added_tokens=True)

    def start_ids(self) -> list[int]:
        """The ids the tokenizer puts before a text when it adds special tokens (Gemma's BOS; none for
        Qwen's or SmolLM2's): what a model reading its own tokenization expects in front of the text."""
        plain = self.tokenizer.encode("a", add_special_tokens=False).ids
        full = self.tokenizer.encode("a", add_special_tokens=True).ids
        for start in range(len(full) - len(plain) + 1):
            if full[start:start + len(plain)] == plain:
                return list(full[:start])
        return []


def same_vocabulary(a: TextCodec, b: TextCodec) -> bool:
    """True when both tokenizers map the same token strings to the same ids."""
    return a.tokenizer.get_vocab_size(with_added_tokens=True) == b.tokenizer.get_vocab_size(with_added_tokens=True) \
        and a.vocab() == b.vocab()


def continuation_text(codec: TextCodec, context_ids: list[int], new_ids: list[int]) -> str:
    """The text `new_ids` add after `context_ids` (decoded together, so a decoder that treats the first
    token specially, or a character split across the boundary, comes out right), without a trailing
    incomplete character."""
    prefix = codec.decode(context_ids)
    full = codec.decode(list(context_ids) + list(new_ids))
    text = full[len(prefix):] if full.startswith(prefix) else codec.decode(new_ids)
    return text.rstrip(REPLACEMENT)


class CommittedText:
    """The text of a request's committed target tokens, extended incrementally (see the module doc)."""

    def __init__(self, codec: TextCodec, context: int = 4):
        self.codec = codec
        self.context = context  # tokens decoded again before the new ones, so the decoder sees the seam
        self.text = ""
        self.num_clean = 0

    def update(self, ids: list[int]) -> None:
        n = len(ids)
        if n < self.num_clean:  # not the token list this state was built from: start over
            self.text, self.num_clean = "", 0
        if n == self.num_clean:
            return
        start = max(0, self.num_clean - self.context)
        prefix = self.codec.decode(ids[start:self.num_clean])
        for end in range(n, max(self.num_clean, n - MAX_CHAR_PIECES), -1):
            full = self.codec.decode(ids[start:end])
            if not full.endswith(REPLACEMENT):
                break
        else:
            return  # every candidate end cuts a character: wait for its remaining bytes
        if full.startswith(prefix):
            self.text += full[len(prefix):]
        else:  # the decoder is not additive at this seam: decode everything once
            self.text = self.codec.decode(ids[:end])
        self.num_clean = end


class DraftTokens:
    """The draft tokenizer's token sequence for a growing text (see the module doc)."""

    def __init__(self, codec: TextCodec, hold: int = 4):
        self.codec = codec
        self.hold = hold  # trailing tokens re-tokenized every step
        self.ids: list[int] = []  # stable prefix: decodes to text[:chars]
        self.chars = 0

    def sync(self, text: str) -> list[int]:
        """The draft tokens for `text`, which extends the text of the previous call."""
        if len(text) < self.chars:
            self.ids, self.chars = [], 0
        tail = text[self.chars:]
        tail_ids = self.codec.encode(tail)
        keep = len(tail_ids) - self.hold
        if keep > 0:
            done = self.codec.decode(tail_ids[:keep])
            if done and tail.startswith(done) and not done.endswith(REPLACEMENT):
                self.ids += tail_ids[:keep]
                self.chars += len(done)
                tail_ids = tail_ids[keep:]
            # else: these tokens do not decode to a clean prefix on their own; re-tokenize them next time
        return self.ids + tail_ids


def target_continuation(codec: TextCodec, ids: list[int], num_clean: int, drafted_text: str,
                        window: int = 4) -> list[int]:
    """Target tokens that continue `ids` (whose first `num_clean` tokens decode to clean text) with
    `drafted_text`, which continues that clean text; [] when no stable boundary exists.

    The last `window` clean tokens are re-tokenized together with the drafted text and must come out
    unchanged, pending tokens included; otherwise (the boundary falls inside a token of the
    re-tokenization) the drafted text is tokenized on its own from the committed boundary."""
    if not drafted_text:
        return []
    start = max(0, num_clean - window)
    anchor = codec.decode(ids[start:num_clean])
    # the re-tokenized stretch must start on a character boundary
    while anchor.startswith(REPLACEMENT) and start > max(0, num_clean - window - MAX_CHAR_PIECES):
        start -= 1
        anchor = codec.decode(ids[start:num_clean])
    if anchor.startswith(REPLACEMENT):
        start, anchor = num_clean, ""
    committed = ids[start:]
    new = codec.encode(anchor + drafted_text)
    if new[:len(committed)] == committed:
        return new[len(committed):]
    if num_clean == len(ids):
        return codec.encode(drafted_text)
    return []  # the drafted text does not continue the pending bytes the way the target split them
