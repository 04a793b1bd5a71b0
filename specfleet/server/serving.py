"""From a validated request to engine input, and from engine outputs to OpenAI response bodies.

Text streams as deltas of the cumulative text the engine reports. Two things are held back until
they are certain: a trailing incomplete UTF-8 character (decoded as U+FFFD), and a trailing piece of
text that could be the start of a stop string (the engine cuts a stop string out of the text once
it is complete, and streamed text cannot be taken back).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

from specfleet.engine.request import PromptError
from specfleet.engine.request import check_prompt as engine_check_prompt
from specfleet.outputs import RequestOutput
from specfleet.sampling_params import SamplingParams
from specfleet.server.errors import APIError
from specfleet.server.schemas import ChatCompletionRequest, CompletionRequest


@dataclass(frozen=True)
class Prepared:
    """What the engine needs for one request, plus the ids the response repeats."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    created: int


def new_request_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def check_prompt(prompt_token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """The engine's admission rules, checked before a response starts (so they can be a 400)."""
    try:
        engine_check_prompt(prompt_token_ids, vocab_size, max_model_len)
    except PromptError as e:
        raise APIError(400, str(e), param=e.param, code=e.code) from None


def special_tokens(tokenizer: Any) -> dict[str, int]:
    """Text -> id of the tokens that decoding drops (skip_special_tokens=True): the engine matches stop
    strings against the decoded text, so these can only stop a request as token ids."""
    if tokenizer is None:
        return {}
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = {tok.content: i for i, tok in decoder.items() if getattr(tok, "special", False)}
    for text in getattr(tokenizer, "all_special_tokens", []):
        token_id = tokenizer.convert_tokens_to_ids(text)
        if isinstance(token_id, int) and token_id >= 0:
            found.setdefault(text, token_id)
    return found


def split_stops(stops: list[str], specials: Mapping[str, int]) -> tuple[list[str], list[int]]:
    """(stop strings, stop token ids): a stop string that is a special token (`<|im_end|>`) becomes its
    token id, since it never appears in the decoded text; one that merely contains a special token
    could never match, so it is a 400 rather than a stop that silently never fires."""
    strings, ids = [], []
    for s in stops:
        if s in specials:
            ids.append(specials[s])
            continue
        inside = next((t for t in specials if t in s), None)
        if inside is not None:
            raise APIError(400, f"the stop string {s!r} contains the special token {inside!r}, which never appears "
                                f"in the generated text; give {inside!r} as a stop string of its own", param="stop")
        strings.append(s)
    return strings, ids


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                    num_prompt_tokens: int, max_model_len: int,
                    specials: Mapping[str, int] | None = None, default_max_tokens: int | None = None) -> SamplingParams:
    """OpenAI fields -> SamplingParams. Without max_tokens: `default_max_tokens`, or less where the
    context has less room (the client did not ask for that number, so it is no reason for a 400);
    None: the rest of the context."""
    room = max_model_len - num_prompt_tokens
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens > room:
        raise APIError(400, f"max_tokens={max_tokens} does not fit: the prompt has {num_prompt_tokens} tokens and "
                            f"the context holds {max_model_len}, so at most {room} tokens can be generated; "
                            f"lower max_tokens or shorten the prompt", param="max_tokens",
                       code="context_length_exceeded")
    # SamplingParams validates ranges itself and raises InvalidRequestError (-> 400)
    stop, special_ids = split_stops(req.stop_list(), specials or {})
    return SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed,
                          max_tokens=max_tokens, stop=stop, stop_token_ids=[*(req.stop_token_ids or []), *special_ids],
                          ignore_eos=req.ignore_eos)


class DeltaText:
    """Turns cumulative texts into safe-to-send deltas (see the module docstring)."""

    def __init__(self, stop: list[str]):
        self.stop = stop
        self.sent = ""

    def delta(self, out: RequestOutput) -> str:
        text = out.text
        if not out.finished:
            text = text.rstrip("\ufffd")
            text = text[:len(text) - self._stop_prefix_len(text)]
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


def usage(out: RequestOutput) -> dict[str, int]:
    n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def spec_block(out: RequestOutput) -> dict[str, Any]:
    """This request's speculation statistics (conventions in specfleet/core/stats.py)."""
    m = out.metrics
    return {"steps": m.get("steps", 0), "drafted": m.get("drafted", 0), "accepted": m.get("accepted", 0),
            "mean_accepted_length": m.get("mean_accepted_length", 0.0),
            "acceptance_rate": m.get("acceptance_rate", 0.0), "drafts_used": m.get("drafts_used", {})}


def completion_body(p: Prepared, model: str, out: RequestOutput) -> dict[str, Any]:
    return {"id": p.request_id, "object": "text_completion", "created": p.created, "model": model,
            "choices": [{"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}],
            "usage": usage(out), "spec": spec_block(out)}


def completion_chunk(p: Prepared, model: str, text: str, out: RequestOutput | None) -> dict[str, Any]:
    """One streamed completion chunk; the final one (out.finished) carries spec. Usage comes only in
    the separate chunk that `stream_options.include_usage` asks for (usage_chunk), as at OpenAI."""
    is_final = out is not None and out.finished
    body: dict[str, Any] = {
        "id": p.request_id, "object": "text_completion", "created": p.created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None,
                     "finish_reason": out.finish_reason if is_final else None}]}
    if is_final:
        body["spec"] = spec_block(out)
    return body


def chat_body(p: Prepared, model: str, out: RequestOutput) -> dict[str, Any]:
    return {"id": p.request_id, "object": "chat.completion", "created": p.created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                         "logprobs": None, "finish_reason": out.finish_reason}],
            "usage": usage(out), "spec": spec_block(out)}


def chat_chunk(p: Prepared, model: str, delta: dict[str, str], out: RequestOutput | None) -> dict[str, Any]:
    is_final = out is not None and out.finished
    body: dict[str, Any] = {
        "id": p.request_id, "object": "chat.completion.chunk", "created": p.created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None,
                     "finish_reason": out.finish_reason if is_final else None}]}
    if is_final:
        body["spec"] = spec_block(out)
    return body


def usage_chunk(p: Prepared, model: str, out: RequestOutput, obj: str) -> dict[str, Any]:
    """The extra last chunk that `stream_options.include_usage` asks for: no choices, only usage."""
    return {"id": p.request_id, "object": obj, "created": p.created, "model": model, "choices": [],
            "usage": usage(out), "spec": spec_block(out)}


def now() -> int:
    return int(time.time())
