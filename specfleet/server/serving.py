"""From a validated request to engine input, and from engine outputs to OpenAI response bodies.

Text streams as deltas of the cumulative text the engine reports. Two things are held back until
they are certain: a trailing incomplete UTF-8 character (decoded as U+FFFD), and a trailing piece of
text that could be the start of a stop string (the engine cuts a stop string out of the text once
it is complete, and streamed text cannot be taken back).
"""
from __future__ import annotations

import dataclasses
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

from specfleet.engine.request import PromptError
from specfleet.engine.request import check_prompt as engine_check_prompt
from specfleet.outputs import RequestOutput, TokenLogprob
from specfleet.errors import InvalidRequestError
from specfleet.runtime.sample.structured import GrammarCompiler, close_objects
from specfleet.sampling_params import SamplingParams, StructuredOutputsParams
from specfleet.server import tools
from specfleet.server.errors import APIError
from specfleet.server.schemas import ChatCompletionRequest, CompletionRequest


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
                    specials: Mapping[str, int] | None = None, default_max_tokens: int | None = None,
                    sample: int = 0, structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """OpenAI fields -> SamplingParams. Without max_tokens: `default_max_tokens`, or less where the
    context has less room (the client did not ask for that number, so it is no reason for a 400);
    None: the rest of the context. `sample` numbers the n samples of one prompt: sample j of a seeded
    request is seeded with seed + j (so sample 0 is what n=1 gives). max_tokens=0 (echo only) runs one
    token, which the response leaves out. `structured` is the request's output constraint
    (`structured_outputs`)."""
    room = max_model_len - num_prompt_tokens
    if max_tokens == 0 and isinstance(req, CompletionRequest) and req.echo:
        max_tokens = 1
    elif max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens > room:
        raise APIError(400, f"max_tokens={max_tokens} does not fit: the prompt has {num_prompt_tokens} tokens and "
                            f"the context holds {max_model_len}, so at most {room} tokens can be generated; "
                            f"lower max_tokens or shorten the prompt", param="max_tokens",
                       code="context_length_exceeded")
    # SamplingParams validates ranges itself and raises InvalidRequestError (-> 400)
    stop, special_ids = split_stops(req.stop_list(), specials or {})
    # sample 0 keeps the seed as given, so an invalid one is still refused (by SamplingParams)
    seed = req.seed if req.seed is None or sample == 0 else (req.seed + sample) % 2**63
    if isinstance(req, CompletionRequest):
        logprobs = req.logprobs
        prompt_logprobs = (req.logprobs or 0) if req.echo and req.logprobs is not None else None
    else:
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_logprobs = None
    params = SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=seed,
                            max_tokens=max_tokens, stop=stop, stop_token_ids=[*(req.stop_token_ids or []), *special_ids],
                            ignore_eos=req.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                            structured_outputs=structured, cache_salt=req.cache_salt)
    return params


def check_stop_token_ids(req: CompletionRequest | ChatCompletionRequest, vocab_size: int) -> None:
    """A stop id outside the vocabulary could never be generated: a 400 rather than a stop that never fires."""
    bad = next((t for t in req.stop_token_ids or () if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"stop token id {bad} is outside the vocabulary (0..{vocab_size - 1})",
                       param="stop_token_ids")


def is_constrained(req: CompletionRequest | ChatCompletionRequest) -> bool:
    return req.structured_spec() is not None or (isinstance(req, ChatCompletionRequest)
                                                 and req.forced_tools() is not None)


def structured_outputs(req: CompletionRequest | ChatCompletionRequest,
                       compiler: GrammarCompiler, relax_schemas: bool = False) -> StructuredOutputsParams | None:
    """The request's output constraint, checked by the model's grammar compiler (an invalid one raises
    InvalidRequestError, a 400): a forced tool call's grammar, or its structured-output field. Grammar
    work (the compiler's first use builds its view of the tokenizer, seconds): not for the event loop.
    `relax_schemas` (--unenforceable-schema relax): a JSON schema whose request leaves `strict` unsaid is
    generated under its enforceable part instead of refused (runtime/sample/json_schema.py)."""
    spec = req.structured_spec()
    if relax_schemas and spec is not None and spec.kind == "json" and spec.strict is None:
        spec = dataclasses.replace(spec, strict=False)
    if isinstance(req, ChatCompletionRequest):
        forced = req.forced_tools()
        if forced is not None:
            # a named function is called once (as vLLM does); "required" may call several with parallel_tool_calls
            spec = tools.forced_call_grammar(forced, req.parallel_tool_calls and req.tool_choice == "required",
                                             compiler.literal)
    if spec is not None:
        compiler.grammar(spec)
    return spec


def check_tool_parameters(tool_defs: list[Any], compiler: GrammarCompiler) -> None:
    """Each tool's `parameters` JSON schema, compiled as a forced call would compile it (the same leniency),
    whatever tool_choice is: an invalid one is a 400 naming the tool, with "auto" as with "required".
    Compiled grammars are cached (runtime/sample/structured.py), so a client's usual tools cost this once."""
    for i, tool in enumerate(tool_defs):
        schema = tool.function.parameters
        if schema is None:
            continue
        try:
            broken = _broken_pattern(schema)
            if broken is not None:
                raise InvalidRequestError(f"pattern {broken[0]!r} is not a regular expression ({broken[1]})")
            compiler.grammar(StructuredOutputsParams(json=close_objects(schema), strict=False))
        except InvalidRequestError as e:
            raise APIError(400, f"tool {tool.function.name!r} has an invalid parameters schema: {e}",
                           param=f"tools.{i}.function.parameters") from None


# re's errors for a pattern that is malformed in every regex dialect (ECMA's included), as opposed to syntax
# that is only foreign to Python's re (\p{L}, ...): the lenient compile of tool parameters would drop such a
# pattern as "not enforceable", but a schema holding it is broken, not merely unenforceable here
_STRUCTURAL_REGEX_ERRORS = ("missing )", "unbalanced parenthesis", "unterminated character set", "nothing to repeat",
                            "multiple repeat")


def _broken_pattern(schema: Any, depth: int = 0) -> tuple[str, str] | None:
    """The first `pattern` (or `patternProperties` key) of a JSON schema that is malformed as a regular
    expression in any dialect, with re's reason; None when there is none."""
    if depth > 64:
        return None
    items = schema.items() if isinstance(schema, dict) else enumerate(schema) if isinstance(schema, list) else ()
    for key, value in items:
        found = None
        if key == "pattern" and isinstance(value, str):
            found = _structural_error(value)
            found = (value, found) if found else None
        elif key == "patternProperties" and isinstance(value, dict):
            for p in value:
                err = _structural_error(p) if isinstance(p, str) else None
                if err:
                    return p, err
        if found:
            return found
        if isinstance(value, (dict, list)):
            found = _broken_pattern(value, depth + 1)
            if found:
                return found
    return None


def _structural_error(pattern: str) -> str | None:
    try:
        re.compile(pattern)
    except re.error as e:
        if any(m in str(e) for m in _STRUCTURAL_REGEX_ERRORS):
            return str(e)
    return None


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


def _lp(value: float) -> float:
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


def completion_logprobs(texts: TokenText, entries: list[TokenLogprob | None], token_ids: list[int],
                        offset: int) -> dict[str, Any]:
    """OpenAI's legacy completions logprobs object for these tokens (what lm-evaluation-harness reads):
    per token its text, its log-probability (null for a prompt's first token), the most likely tokens
    with theirs (the token itself included, as vLLM does), and where its text starts in the choice's
    text (cumulative lengths of the tokens' texts, from `offset`)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, e in zip(token_ids, entries):
        t = texts.text(tid)
        tokens.append(t)
        offsets.append(offset)
        offset += len(t)
        if e is None:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(_lp(e.logprob))
            top = {texts.text(a): _lp(lp) for a, lp in e.top}
            top.setdefault(t, _lp(e.logprob))
            tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(texts: TokenText, entries: list[TokenLogprob]) -> dict[str, Any]:
    """The chat logprobs object: per token its text, bytes, log-probability and top_logprobs alternatives."""
    def item(tid: int, lp: float) -> dict[str, Any]:
        return {"token": texts.text(tid), "logprob": _lp(lp), "bytes": texts.bytes(tid)}
    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(a, lp) for a, lp in e.top]}
                        for e in entries],
            "refusal": None}


# -- response bodies --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChoiceOut:
    """One choice of a response, shaped: what its JSON carries beside index and finish_reason."""

    index: int
    out: RequestOutput
    fields: dict[str, Any]
    finish_reason: str | None


def completion_body(response_id: str, created: int, model: str, choices: list[ChoiceOut],
                    usage_: dict[str, int]) -> dict[str, Any]:
    body = {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": c.index, **c.fields, "finish_reason": c.finish_reason} for c in choices],
            "usage": usage_}
    return _with_spec(body, choices)


def chat_body(response_id: str, created: int, model: str, choices: list[ChoiceOut],
              usage_: dict[str, int]) -> dict[str, Any]:
    body = {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": c.index, **c.fields, "finish_reason": c.finish_reason} for c in choices],
            "usage": usage_}
    return _with_spec(body, choices)


def _with_spec(body: dict[str, Any], choices: list[ChoiceOut]) -> dict[str, Any]:
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
