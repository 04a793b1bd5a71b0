"""Response pieces both generating endpoints share: text deltas, usage, the speculation block, logprob
token texts, a choice's final shape and a streamed chunk. Each endpoint shapes its own choices
(server/completions.py, server/chat_completions.py) from these.

Text streams as deltas of the cumulative text the engine reports. Two things are held back until
they are certain: a trailing incomplete UTF-8 character (decoded as U+FFFD), and a trailing piece of
text that could be the start of a stop string (the engine cuts a stop string out of the text once
it is complete, and streamed text cannot be taken back).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from specfleet.outputs import RequestOutput


class StreamState:
    """One choice's stream (an endpoint's subclass makes its chunks): its shape, what of its text was sent,
    the tokens to skip (a completion's echoed prompt) and how many generated tokens were scored."""

    def __init__(self, shape: Any, c: Any, skip_tokens: int = 0):
        self.shape, self.c = shape, c
        self.deltas = DeltaText(c.params.stop)
        self.skip_tokens = skip_tokens
        self.num_scored = 0


class DeltaText:
    """Turns cumulative texts into safe-to-send deltas (see the module docstring)."""

    def __init__(self, stop: list[str]):
        self.stop = stop
        self.sent = ""

    def delta(self, out: RequestOutput) -> str:
        return self.delta_of(out.text, out.finished)

    def delta_of(self, text: str, final: bool, hold: int = 0) -> str:
        """The new part of cumulative `text` that is safe to send; `hold` more trailing characters are
        kept back (a possible start of a tool call)."""
        if not final:
            text = text.rstrip("\ufffd")
            text = text[:len(text) - max(hold, self._stop_prefix_len(text))]
        if len(text) <= len(self.sent):
            return ""
        new = text[len(self.sent):]
        self.sent = text
        return new

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        last = text[-1:]
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if s[k - 1] == last and text.endswith(s[:k]):  # the first test spares most slices
                    best = k
                    break
        return best


def usage(outs: list[RequestOutput], n: int = 1, skip_tokens: int = 0) -> dict[str, Any]:
    """Usage of a response whose choices are `n` samples of each prompt in turn: each prompt counted once
    (its samples share it, as at OpenAI), every choice's tokens (less the `skip_tokens` of an echo with
    max_tokens=0); `prompt_tokens_details.cached_tokens` are the prompt tokens the prefix cache served."""
    n_prompt = sum(len(out.prompt_token_ids) for out in outs[::n])
    n_out = sum(max(0, len(out.token_ids) - skip_tokens) for out in outs)
    cached = sum((out.metrics or {}).get("num_cached_tokens", 0) for out in outs[::n])
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": cached}}


def spec_block(out: RequestOutput) -> dict[str, Any]:
    """This request's speculation statistics (conventions in specfleet/core/stats.py)."""
    m = out.metrics
    return {"steps": m.get("steps", 0), "drafted": m.get("drafted", 0), "accepted": m.get("accepted", 0),
            "mean_accepted_length": m.get("mean_accepted_length", 0.0),
            "acceptance_rate": m.get("acceptance_rate", 0.0), "drafts_used": m.get("drafts_used", {}),
            # proposer calls for this request that raised; > 0: it went on by plain decoding (same output)
            "draft_failures": m.get("draft_failures", 0)}


# -- log-probabilities ------------------------------------------------------------------------------
LOGPROB_FLOOR = -9999.0  # JSON has no -inf; as vLLM


def lp_value(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR


class TokenText:
    """Token ids -> the strings (and bytes) logprobs objects show, cached per id. Without a tokenizer
    a token shows as `token_id:N` (vLLM's form)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._byte_decoder = _byte_decoder(tokenizer)

    def text(self, token_id: int) -> str:
        t = self._text.get(token_id)
        if t is None:
            t = f"token_id:{token_id}" if self.tokenizer is None else \
                self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._text[token_id] = t
        return t

    def bytes(self, token_id: int) -> list[int]:
        """The token's own bytes: exact for byte-level BPE vocabularies (a piece of a UTF-8 character
        included), else the UTF-8 of its text."""
        if self._byte_decoder is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in self._byte_decoder for c in piece):
                return [self._byte_decoder[c] for c in piece]
        return list(self.text(token_id).encode("utf-8"))


def _byte_decoder(tokenizer: Any) -> dict[str, int] | None:
    """GPT-2's byte <-> unicode table, when the vocabulary is byte-level (its pieces spell bytes as
    characters such as `Ġ`)."""
    if tokenizer is None:
        return None
    try:
        from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode
    except ImportError:
        return None
    table = {c: b for b, c in bytes_to_unicode().items()}
    probe = tokenizer.convert_ids_to_tokens(tokenizer.encode(" a", add_special_tokens=False))
    return table if any(isinstance(p, str) and p.startswith("\u0120") for p in probe) else None


# -- response bodies --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChoiceOut:
    """One choice of a response, shaped: what its JSON carries beside index and finish_reason."""

    index: int
    out: RequestOutput
    fields: dict[str, Any]
    finish_reason: str | None


def response_body(obj: str, response_id: str, created: int, model: str, choices: list[ChoiceOut],
                  usage_: dict[str, int]) -> dict[str, Any]:
    """A whole (not streamed) response of either endpoint: `obj` is "text_completion" or "chat.completion"."""
    body = {"id": response_id, "object": obj, "created": created, "model": model,
            "choices": [{"index": c.index, **c.fields, "finish_reason": c.finish_reason} for c in choices],
            "usage": usage_}
    return with_spec(body, choices)


def with_spec(body: dict[str, Any], choices: list[ChoiceOut]) -> dict[str, Any]:
    """One choice: its speculation statistics as `spec`; several: each choice carries its own. A JSON
    schema not fully enforced: `structured_output` says what was not (runtime/sample/json_schema.py)."""
    if choices and "structured_output" in choices[0].out.metrics:
        body["structured_output"] = choices[0].out.metrics["structured_output"]
    if len(choices) == 1:
        body["spec"] = spec_block(choices[0].out)
    else:
        for c, item in zip(choices, body["choices"]):
            item["spec"] = spec_block(c.out)
    return body


def chunk(response_id: str, created: int, model: str, obj: str, index: int, fields: dict[str, Any],
          out: RequestOutput | None, finish_reason: str | None = None) -> dict[str, Any]:
    """One streamed chunk of one choice; its final one (out.finished) carries finish_reason and spec.
    Usage comes only in the separate chunk that `stream_options.include_usage` asks for (usage_chunk)."""
    is_final = out is not None and out.finished
    body: dict[str, Any] = {
        "id": response_id, "object": obj, "created": created, "model": model,
        "choices": [{"index": index, **fields,
                     "finish_reason": (finish_reason or out.finish_reason) if is_final else None}]}
    if is_final:
        body["spec"] = spec_block(out)
        if "structured_output" in out.metrics:
            body["structured_output"] = out.metrics["structured_output"]
    return body


def usage_chunk(response_id: str, created: int, model: str, obj: str, usage_: dict[str, int],
                outs: list[RequestOutput]) -> dict[str, Any]:
    """The extra last chunk that `stream_options.include_usage` asks for: no choices, only usage."""
    body = {"id": response_id, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_}
    if len(outs) == 1:
        body["spec"] = spec_block(outs[0])
    return body


def now() -> int:
    return int(time.time())
