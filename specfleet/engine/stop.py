"""Appending output tokens one at a time and ending the request at exactly the right token.

Stop conditions, checked after every appended token, in this order: an EOS token (unless
ignore_eos), a stop token id, a stop string (the text is cut before it, as OpenAI does), max_tokens,
and the end of the context. Tokens after the stopping one are never appended, even when the target
accepted them in the same verification step.

The output is decoded incrementally (engine/detokenize.py): a step decodes its new tokens and a few
before them, not the whole output, and the text equals a full decode.
"""
from __future__ import annotations

from specfleet.engine.detokenize import REPLACEMENT, IncrementalText, byte_piece_ids
from specfleet.engine.request import Request


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.max_model_len = max_model_len
        self._byte_ids: frozenset[int] | None = None  # the tokenizer's byte-fallback pieces, read on first use

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def text(self, req: Request) -> str:
        if req.stop_reason is not None and isinstance(req.stop_reason, str):
            return req.output_text  # already cut at the stop string
        return self._current_text(req)

    def _current_text(self, req: Request) -> str:
        """decode(req.output_token_ids), decoding only what was appended since the last call."""
        if self.tokenizer is None:
            return ""
        if req.detokenized is None:
            if self._byte_ids is None:
                self._byte_ids = byte_piece_ids(self.tokenizer)
            req.detokenized = IncrementalText(self.decode, self._byte_ids)
        return req.detokenized.update(req.output_token_ids)

    def append(self, req: Request, token: int, origin: str) -> bool:
        """Append one token; return True (and set finish_reason) if the request is now finished."""
        req.append_output(token, origin)
        p = req.params
        if not p.ignore_eos and token in self.eos_token_ids:
            req.finish_reason, req.stop_reason = "stop", token
        elif p.stop_token_ids and token in p.stop_token_set:
            req.finish_reason, req.stop_reason = "stop", token
        elif p.stop and self.tokenizer is not None and self._hit_stop_string(req):
            req.finish_reason = "stop"
        elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            req.finish_reason = "length"
        return req.finish_reason is not None

    def _hit_stop_string(self, req: Request) -> bool:
        text = self._current_text(req)
        # only a stop string that ends inside the newest token's text can be new; the previous text's
        # trailing U+FFFD were pieces of a character that may have completed since, so they count as new
        prev_len = len(req.output_text.rstrip(REPLACEMENT))
        hits = []
        for s in req.params.stop:
            i = text.find(s, max(0, prev_len - len(s) + 1))
            if i >= 0:
                hits.append((i, s))
        req.output_text = text
        if not hits:
            return False
        i, s = min(hits)
        req.output_text = text[:i]
        req.stop_reason = s
        return True
