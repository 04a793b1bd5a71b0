"""Incremental detokenization (engine/detokenize.py): the text equals a full decode after every token,
on SmolLM2's real byte-level tokenizer with characters split over tokens and on a SentencePiece-style
tokenizer with byte fallback, and a request's decoding work grows linearly with its output, stop
strings included."""
from __future__ import annotations

import random

import pytest

from specfleet.engine.detokenize import IncrementalText
from specfleet.engine.request import Request
from specfleet.engine.stop import StopChecker
from specfleet.sampling_params import SamplingParams

TEXT = ("def add(a, b):\n    return a + b  # héllo wörld, 日本語のテキスト 🎉🚀 naïve café — “quotes” "
        "<|im_end|> Ünïcödé ∑∫√ 한국어 ").strip()


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from tests.conftest import real_model_path
    from specfleet.runtime.loading.checkpoint import tokenizer_folder

    return AutoTokenizer.from_pretrained(tokenizer_folder(real_model_path("smollm2-135m")))


def byte_tokens(tok) -> list[int]:
    """Ids of the single-byte tokens (pieces of multi-byte characters among them)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = tok.get_vocab()
    return [vocab[c] for c in bytes_to_unicode().values() if c in vocab]


def sequences(tok, n: int = 60, length: int = 80):
    rng = random.Random(0)
    singles = byte_tokens(tok)
    text_ids = tok.encode(TEXT)
    for i in range(n):
        kind = i % 3
        if kind == 0:  # anything in the vocabulary, special tokens included
            yield [rng.randrange(len(tok)) for _ in range(length)]
        elif kind == 1:  # mostly single bytes: characters split over tokens, invalid UTF-8 too
            yield [rng.choice(singles) if rng.random() < 0.7 else rng.randrange(len(tok)) for _ in range(length)]
        else:  # real text, cut into single bytes here and there
            ids = []
            for t in text_ids:
                piece = tok.convert_ids_to_tokens(t)
                ids.extend(tok.convert_tokens_to_ids(list(piece)) if rng.random() < 0.3 else [t])
            yield ids


@pytest.mark.real_model
def test_equals_full_decode_after_every_token(tok):
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731 - the engine's decode
    checked = 0
    for ids in sequences(tok):
        inc = IncrementalText(decode)
        for k in range(1, len(ids) + 1):
            assert inc.update(ids[:k]) == decode(ids[:k]), (ids[:k], k)
            checked += 1
    assert checked > 3000


@pytest.mark.real_model
def test_equals_full_decode_when_tokens_come_several_at_a_time(tok):
    """A verification step appends several tokens at once."""
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    rng = random.Random(1)
    for ids in sequences(tok, n=30):
        inc, k = IncrementalText(decode), 0
        while k < len(ids):
            k = min(len(ids), k + rng.randint(1, 6))
            assert inc.update(ids[:k]) == decode(ids[:k])


class CountingTokenizer:
    """The real tokenizer, counting how many token ids it was asked to decode."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0
        self.eos_token_id = tok.eos_token_id

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def feed(checker: StopChecker, req: Request, ids: list[int]) -> int:
    """Append `ids` as the executor does, reading the text after every token; the tokens appended."""
    for n, t in enumerate(ids, 1):
        finished = checker.append(req, t, "target")
        checker.text(req)
        if finished:
            return n
    return len(ids)


@pytest.mark.real_model
@pytest.mark.parametrize("stop", [[], ["never-there"]])
def test_decoding_work_is_linear_in_the_output(tok, stop):
    counting = CountingTokenizer(tok)
    checker = StopChecker(counting, (), 100_000)
    ids = (tok.encode(TEXT) * 40)[:2000]
    req = Request("r", [1], SamplingParams(temperature=0, max_tokens=5000, ignore_eos=True, stop=stop))
    feed(checker, req, ids)
    assert checker.text(req) == tok.decode(ids, skip_special_tokens=True)
    assert counting.decoded < 30 * len(ids), f"{counting.decoded} ids decoded for {len(ids)} tokens"


@pytest.mark.real_model
def test_stop_strings_cut_where_a_full_decode_cuts(tok):
    rng = random.Random(2)
    text_ids = tok.encode(TEXT * 3)
    full_text = tok.decode(text_ids, skip_special_tokens=True)
    for _ in range(40):
        stop = full_text[(i := rng.randrange(len(full_text) - 8)):i + rng.randint(1, 6)]
        checker = StopChecker(tok, (), 100_000)
        req = Request("r", [1], SamplingParams(temperature=0, max_tokens=5000, ignore_eos=True, stop=[stop, "zzzz"]))
        n = feed(checker, req, text_ids)
        # the first k whose full decode contains the stop string is where it must end, cut before it
        k = next(k for k in range(1, len(text_ids) + 1) if stop in tok.decode(text_ids[:k], skip_special_tokens=True))
        assert n == k and req.stop_reason == stop
        assert checker.text(req) == full_text[:full_text.index(stop)]


def sentencepiece_tokenizer():
    """Llama-2 / Gemma style decoding: "▁" for spaces, byte-fallback pieces <0x00>..<0xFF> (here also every
    ASCII character, so runs of them are long), the first token's leading space stripped."""
    from tokenizers import AddedToken, Tokenizer, decoders
    from tokenizers.models import BPE

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ["▁", "▁hello", "▁world", "hel", "lo", "▁the", "▁日本", "語", ".", "▁.", "'s"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    return tok


def test_byte_fallback_runs_equal_full_decode():
    """A byte run that an invalid byte turns into U+FFFD as a whole, after its characters were shown."""
    tok = sentencepiece_tokenizer()
    rng = random.Random(4)
    pieces = [0xE6, 0x97, 0xA5, 0xF0, 0x9F, 0x8E, 0x89, 0xC3, 0xA9, 0x20]  # 日, 🎉, é, a space: and stray bytes
    for _ in range(200):
        ids = [rng.choice(pieces) if rng.random() < 0.6 else rng.randrange(tok.get_vocab_size()) for _ in range(50)]
        checker = StopChecker(tok, (), 100_000)
        req = Request("r", [1], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
        for k, t in enumerate(ids, 1):
            checker.append(req, t, "target")
            assert checker.text(req) == tok.decode(ids[:k], skip_special_tokens=True), ids[:k]
