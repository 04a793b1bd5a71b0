"""From a validated request to engine input: prompt checks, sampling parameters, stop strings, the
output constraint (structured outputs, forced tool calls) and tool parameter schemas.

The response side (text deltas, usage, bodies) is in server/responses.py and the endpoints' own
modules; DeltaText is re-exported here.
"""
from __future__ import annotations

import dataclasses
import re
import uuid
from typing import Any, Mapping

from specfleet.engine.request import PromptError
from specfleet.engine.request import check_prompt as engine_check_prompt
from specfleet.errors import InvalidRequestError
from specfleet.runtime.sample.structured import GrammarCompiler, close_objects
from specfleet.sampling_params import SamplingParams, StructuredOutputsParams
from specfleet.server import tools
from specfleet.server.errors import APIError
from specfleet.server.responses import DeltaText  # noqa: F401 -- re-exported
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
