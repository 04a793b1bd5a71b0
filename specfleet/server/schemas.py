"""Request bodies of the OpenAI-compatible API, validated by pydantic.

Policy on fields (chosen so that a typo never silently changes a request, while the clients people
already use, which send fields of newer API versions, keep working; docs/compatibility.md has the table):
- types are strict: `"0.5"` is not a temperature and `true` is not a max_tokens;
- a field this server does not know is accepted and ignored (the app logs its name once and counts
  it in /metrics), unless its name is a near miss of a known field (`max_token`, `temprature`,
  `maxTokens`): that is a 400 naming the field it probably meant;
- fields OpenAI or vLLM define that we do not implement (penalties, beam search, ...) are accepted only at their no-op value; anything else gets a 400 saying it is
  unsupported, never a silent ignore (see `Unsupported`);
- an explicit `null` in any optional top-level field means "use the default", as at OpenAI (whose
  official client sends null for a keyword argument passed as None); required fields stay required;
- `top_k`, `ignore_eos`, `stop_token_ids` and `chat_template_kwargs` are extensions, as in vLLM;
- structured output: OpenAI's `response_format` (json_object, json_schema), vLLM's `structured_outputs`
  object and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields, at most
  one of them per request (`structured_spec`).
"""
from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from specfleet.errors import InvalidRequestError
from specfleet.sampling_params import (MAX_CACHE_SALT_CHARS, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS,
                                       StructuredOutputsParams)

# Stop strings are bounded by their total length, not their number (OpenAI allows 4): the engine
# scans each new token's text for every stop string and the stream holds back prefixes of them, so
# the cost grows with the characters, and a client with many short stops (code models) is served.
MAX_STOP_CHARS = 4096
MAX_STOPS = 256  # stop strings (each is searched for in every new token's text)
MAX_LOGIT_BIAS = 1024  # entries (refused anyway unless empty; bounded so a refusal is cheap too)
MAX_TOOLS = 128  # tool definitions, as at OpenAI
# An output constraint's text. Compiling one costs the server's CPU about a second per megabyte, beside every
# other stream, and a regex's or grammar's text also sets what each token's mask costs on the engine thread
# (a literal regex: about 0.25 ms per thousand characters per token on a Zen 5 core, measured), so those are
# bounded more tightly than choices and JSON schemas (whose masks stayed cheap at 190 KB in the isolation probe).
MAX_CONSTRAINT_CHARS = 512 * 1024  # the choices together, a JSON schema as compact JSON
MAX_PATTERN_CHARS = 64 * 1024  # a regex's or a grammar's text
MAX_UNKNOWN_FIELDS = 64  # distinct unknown field names one request may carry

# max_tokens when a /v1/completions request omits it, as at OpenAI and vLLM; chat requests have no
# such default (they end at EOS or the end of the context, as at OpenAI)
DEFAULT_COMPLETION_TOKENS = 16
MAX_N = 128  # samples per prompt, as at OpenAI


class UnsupportedError(InvalidRequestError):
    """A known OpenAI field was given a value this server does not implement (or a near-miss name)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Unsupported:
    """A field other servers define that this one does not implement: accepted only when its value
    is null or one of `noop` (what the field's absence means); else a 400 that says `why`.
    `noop=None` means every value is a no-op here (metadata that cannot change the output)."""

    why: str
    noop: tuple[Any, ...] | None = ()

    def allows(self, value: Any) -> bool:
        return value is None or self.noop is None or any(value == v and type(value) is type(v) for v in self.noop)


def _ignored(why: str) -> Unsupported:
    return Unsupported(why, None)


_OLD_FUNCTIONS = "the deprecated functions / function_call form is not supported; use tools and tool_choice"
# fields of the OpenAI API (and of vLLM's extensions to it) that we know and do not implement,
# shared by both endpoints; each model adds its own in `_unsupported`
_SAMPLING_UNSUPPORTED: dict[str, Unsupported] = {
    "min_p": Unsupported("min_p is not supported; leave it at 0", (0, 0.0)),
    "repetition_penalty": Unsupported("repetition_penalty is not supported; leave it at 1", (1, 1.0)),
    "min_tokens": Unsupported("min_tokens is not supported; leave it at 0", (0,)),
    "use_beam_search": Unsupported("beam search is not supported", (False,)),
    "length_penalty": Unsupported("length_penalty (beam search) is not supported", (1, 1.0)),
    "include_stop_str_in_output": Unsupported("the stop string is always cut from the output", (False,)),
    "skip_special_tokens": Unsupported("special tokens are always skipped in the output", (True,)),
    "spaces_between_special_tokens": Unsupported("special tokens are always skipped in the output", (True,)),
    "prompt_logprobs": Unsupported("prompt_logprobs are not supported"),
    "guided_whitespace_pattern": Unsupported("a custom whitespace pattern is not supported; JSON is written "
                                             "with json.dumps' separators (structured_outputs."
                                             "disable_any_whitespace=false allows any whitespace)"),
    # cannot change what is generated here: accepted whatever their value
    "metadata": _ignored("stored completions are not kept"),
    "store": _ignored("stored completions are not kept"),
    "service_tier": _ignored("there is one tier"),
    "prompt_cache_key": _ignored("the prefix cache needs no key"),
    "safety_identifier": _ignored("only tags requests at OpenAI"),
}


class _Strict(BaseModel):
    # extra="allow": unknown fields are kept so that `check_fields` can tell a typo from a field of a
    # newer client (see the module docstring)
    model_config = ConfigDict(extra="allow", strict=True)
    _unsupported: ClassVar[dict[str, Unsupported]] = {}

    def check_supported(self) -> None:
        """Refuse values of known fields that this server does not implement (a 400 naming the field)."""

    @classmethod
    def known_fields(cls) -> set[str]:
        return set(cls.model_fields) | set(cls._unsupported)

    def check_fields(self) -> list[str]:
        """Apply the field policy to this object and the objects inside it; return the distinct unknown
        fields (dotted names without list indexes, e.g. `messages.foo`) and raise on a near miss, an
        unsupported value, or more than MAX_UNKNOWN_FIELDS unknown names (each costs a near-miss search
        on the event loop, so a body full of made-up names is refused rather than searched)."""
        unknown: dict[str, None] = {}  # an ordered set: a field repeated in every message counts once
        self._check_fields("", unknown)
        return list(unknown)

    def _check_fields(self, where: str, unknown: dict[str, None]) -> None:
        for name, value in (self.model_extra or {}).items():
            path = f"{where}{name}"
            if name in self._unsupported:
                if not self._unsupported[name].allows(value):
                    raise UnsupportedError(path, f"unsupported field '{path}': {self._unsupported[name].why}")
            elif path in unknown:
                continue
            elif len(unknown) >= MAX_UNKNOWN_FIELDS:
                raise UnsupportedError(path, f"the request has more than {MAX_UNKNOWN_FIELDS} fields this server "
                                             f"does not know")
            elif (meant := near_miss(name, self.known_fields())) is not None:
                raise UnsupportedError(path, f"unknown field '{path}': did you mean '{where}{meant}'?")
            else:
                unknown[path] = None
        for name in type(self).model_fields:
            value = getattr(self, name)
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, _Strict):
                    item._check_fields(f"{where}{name}.", unknown)


def near_miss(name: str, known: set[str]) -> str | None:
    """The known field `name` is probably a misspelling of, if any: the same letters in another case
    or without underscores (`maxTokens`), two neighbours swapped (`ecoh`), or close by difflib's
    measure (`max_token`, `temprature`). The cutoff keeps unrelated short names apart (`top_a` is
    not `top_p`)."""
    def norm(s: str) -> str:
        return s.lower().replace("_", "").replace("-", "")

    by_norm = {norm(k): k for k in known}
    n = norm(name)
    if n in by_norm:
        return by_norm[n]
    swapped = next((k for k in by_norm if _one_swap_apart(n, k)), None)
    if swapped is not None:
        return by_norm[swapped]
    close = difflib.get_close_matches(n, list(by_norm), n=1, cutoff=0.85)
    return by_norm[close[0]] if close else None


def _one_swap_apart(a: str, b: str) -> bool:
    """Whether `a` is `b` with two adjacent characters swapped (difflib scores these low)."""
    diff = [i for i in range(len(a)) if a[i] != b[i]] if len(a) == len(b) else []
    return len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]]


class StreamOptions(_Strict):
    include_usage: bool = False
    _unsupported = {"continuous_usage_stats": Unsupported("usage is sent once, at the end of the stream",
                                                          (False,))}


class JsonSchemaFormat(_Strict):
    """response_format.json_schema, as OpenAI's clients send it (`.parse()` sends strict=true)."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # false: generate under the enforceable part of the schema (runtime/sample/json_schema.py)

    @classmethod
    def known_fields(cls) -> set[str]:
        return (set(cls.model_fields) - {"schema_"}) | {"schema"}


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    _unsupported = {"structural_tag": Unsupported("structural tags are not supported")}


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` request field (its StructuredOutputsParams): exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # None: true here (json.dumps' layout), unlike vLLM
    _unsupported = {
        "structural_tag": Unsupported("structural tags are not supported"),
        "whitespace_pattern": Unsupported("a custom whitespace pattern is not supported"),
        "disable_fallback": _ignored("there is one grammar engine (llguidance) and no fallback"),
        "disable_additional_properties": Unsupported("additionalProperties is enforced as the schema says",
                                                     (False,)),
    }

    @classmethod
    def known_fields(cls) -> set[str]:
        return (set(cls.model_fields) - {"json_"}) | {"json"} | set(cls._unsupported)


class _SamplingFields(_Strict):
    model: str | None = None  # optional: a single-model server serves its model either way
    max_tokens: int | None = None  # None: the endpoint's default (DEFAULT_COMPLETION_TOKENS, or the context)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # extension; 0 or -1 = disabled
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension, as in vLLM (at most MAX_STOP_TOKEN_IDS)
    # extension, as in vLLM: only requests with the same salt share prefix-cache blocks (docs/compatibility.md)
    cache_salt: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False  # extension: keep generating past EOS (benchmarks, load tests)
    user: str | None = None  # accepted and unused: it only tags requests at OpenAI
    # no-op values only (see the module docstring)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # structured output (at most one of these; `structured_spec`)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted for "auto", "guidance", "llguidance"
    _unsupported = _SAMPLING_UNSUPPORTED

    @field_validator("*", mode="before")
    @classmethod
    def _null_means_default(cls, value: Any, info: ValidationInfo) -> Any:
        # applies to the fields of the request subclasses too; a required field has no default
        # (is_required), so its null still fails as a wrong type
        if value is None and info.field_name is not None:
            field = cls.model_fields[info.field_name]
            if not field.is_required():
                return field.get_default(call_default_factory=True)
        return value

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def check_supported(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise UnsupportedError("n", f"n={self.n} is out of range: give 1 to {MAX_N} samples")
        if self.presence_penalty or self.frequency_penalty:
            param = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            raise UnsupportedError(param, f"{param} is not supported; leave it at 0")
        if self.logit_bias and len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise UnsupportedError("logit_bias", f"logit_bias has {len(self.logit_bias)} entries; at most "
                                                 f"{MAX_LOGIT_BIAS} are allowed (and logit_bias is not supported)")
        if self.logit_bias:
            raise UnsupportedError("logit_bias", "logit_bias is not supported; leave it empty")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise UnsupportedError("stop_token_ids", f"stop_token_ids has {len(self.stop_token_ids)} ids; at most "
                                                     f"{MAX_STOP_TOKEN_IDS} are allowed")
        if self.cache_salt is not None and not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS:
            raise UnsupportedError("cache_salt", f"cache_salt must be a non-empty string of at most "
                                                 f"{MAX_CACHE_SALT_CHARS} characters")
        if len(self.stop_list()) > MAX_STOPS:
            raise UnsupportedError("stop", f"{len(self.stop_list())} stop strings were given; at most {MAX_STOPS} "
                                           f"are allowed")
        stop_chars = sum(len(s) for s in self.stop_list())
        if stop_chars > MAX_STOP_CHARS:
            raise UnsupportedError("stop", f"the stop strings total {stop_chars} characters; at most "
                                           f"{MAX_STOP_CHARS} are allowed")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedError("stream_options", "stream_options is only allowed with stream=true")
        if self.guided_decoding_backend not in (None, "auto", "guidance", "llguidance"):
            raise UnsupportedError("guided_decoding_backend", f"guided_decoding_backend "
                                                              f"{self.guided_decoding_backend!r} is not available: "
                                                              f"the one grammar engine here is llguidance ('guidance')")
        self.structured_spec()

    def structured_spec(self) -> StructuredOutputsParams | None:
        """The request's output constraint, from whichever one field gives it (a 400 for two)."""
        found: list[tuple[str, StructuredOutputsParams]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", _spec("response_format", json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            js = rf.json_schema
            if js is None:
                raise UnsupportedError("response_format.json_schema", "response_format of type json_schema needs "
                                                                      "a json_schema object {name, schema, strict}")
            found.append(("response_format", _spec("response_format.json_schema",
                                                    **({"json_object": True} if js.schema_ is None else
                                                       {"json": js.schema_}), strict=js.strict)))
        so = self.structured_outputs
        if so is not None:
            given = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                       ("grammar", so.grammar), ("json_object", so.json_object or None))
                     if v is not None}
            extra = {} if so.disable_any_whitespace is None else {"disable_any_whitespace": so.disable_any_whitespace}
            found.append(("structured_outputs", _spec("structured_outputs", **given, **extra)))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                found.append((name, _spec(name, **{key: value})))
        if len(found) > 1:
            raise UnsupportedError(found[1][0], f"give one output constraint, not {found[0][0]} and {found[1][0]}")
        return found[0][1] if found else None


def _constraint_chars(fields: dict[str, Any]) -> int:
    """The length of a constraint's text: a regex's or grammar's characters, the choices' in all, a JSON
    schema's as compact JSON (stopping once past the bound)."""
    size = 0
    for key in ("regex", "grammar"):
        if isinstance(fields.get(key), str):
            size += len(fields[key])
    for choice in fields.get("choice") or ():
        size += len(choice) if isinstance(choice, str) else 0
    if fields.get("json") is not None:
        try:
            size += len(json.dumps(fields["json"], separators=(",", ":"), ensure_ascii=False))
        except (TypeError, ValueError, RecursionError):
            pass  # not JSON: StructuredOutputsParams says why
    return size


def _spec(param: str, **fields: Any) -> StructuredOutputsParams:
    """A StructuredOutputsParams, or a 400 naming `param` (its checks: one kind, the right types)."""
    if "choice" in fields and fields["choice"] is not None:
        fields["choice"] = tuple(fields["choice"])
    for key in ("regex", "grammar"):
        if isinstance(fields.get(key), str) and len(fields[key]) > MAX_PATTERN_CHARS:
            raise UnsupportedError(param, f"the {key} is {len(fields[key])} characters long; at most "
                                          f"{MAX_PATTERN_CHARS} are allowed")
    size = _constraint_chars(fields)
    if size > MAX_CONSTRAINT_CHARS:
        raise UnsupportedError(param, f"the output constraint is {size} characters long; at most "
                                      f"{MAX_CONSTRAINT_CHARS} are allowed")
    try:
        return StructuredOutputsParams(**fields)
    except InvalidRequestError as e:
        raise UnsupportedError(param, str(e)) from None


class CompletionRequest(_SamplingFields):
    # a string, token ids, or a list of either (a batch: each prompt gets its own `n` choices)
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None
    _unsupported = {**_SAMPLING_UNSUPPORTED,
                    "add_special_tokens": Unsupported("a text prompt always gets the model's special tokens "
                                                      "(BOS); send token ids for full control", (True,))}

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise UnsupportedError("suffix", "suffix (insertion) is not supported")
        if self.best_of not in (None, 1):
            raise UnsupportedError("best_of", f"best_of={self.best_of} is not supported; only 1 is (use n for "
                                              f"several samples)")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise UnsupportedError("logprobs", f"logprobs={self.logprobs} is out of range: give 0 to "
                                               f"{MAX_LOGPROBS} alternatives per token")
        if self.max_tokens == 0 and not self.echo:
            raise UnsupportedError("max_tokens", "max_tokens=0 is only allowed with echo=true (scoring a prompt)")

    def prompts(self) -> list[str | list[int]]:
        """The prompts this request carries, in order: one, or a batch."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise UnsupportedError("prompt", "prompt is an empty list; give a string, token ids, or a list of these")
        if isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it


class MessageToolCall(_Strict):
    """A call an assistant message made (replayed in the conversation)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None  # required; null only in an assistant message with tool_calls
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages only
    tool_call_id: str | None = None  # tool messages: the call this is the result of
    _unsupported = {"function_call": Unsupported(_OLD_FUNCTIONS),
                    "refusal": Unsupported("an assistant message's refusal cannot be replayed; leave it null"),
                    "audio": Unsupported("audio is not supported")}

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)  # as vLLM joins them

    def check(self, where: str) -> None:
        if self.tool_calls and self.role != "assistant":
            raise UnsupportedError(f"{where}.tool_calls", "only assistant messages carry tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise UnsupportedError(f"{where}.content", "content may be null only in an assistant message with "
                                                       "tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise UnsupportedError(f"{where}.tool_call_id", "a tool message needs the tool_call_id of the call "
                                                            "it answers")

    @property
    def uses_tools(self) -> bool:
        return self.role == "tool" or bool(self.tool_calls)


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; given to the chat template as it is
    strict: bool | None = None  # accepted; a forced call's arguments always follow `parameters`


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


# OpenAI's rule for function names: they are written into the prompt and parsed back out of the reply,
# so markup (`</tool_call>`), spaces or an empty name would break both
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_tools(tools: list[ToolDef] | None) -> None:
    """The bound on how many tools a request defines, and OpenAI's pattern for their names (a 400
    naming the tool). Their `parameters` schemas are checked by the grammar compiler (server/chat_completions.py)."""
    if not tools:
        return
    if len(tools) > MAX_TOOLS:
        raise UnsupportedError("tools", f"{len(tools)} tools were given; at most {MAX_TOOLS} are allowed")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if TOOL_NAME.fullmatch(name) is None:
            raise UnsupportedError(f"tools.{i}.function.name", f"invalid tool name {name[:80]!r}: a function name "
                                                               f"is 1 to 64 letters, digits, underscores or dashes")
        if name in seen:
            raise UnsupportedError(f"tools.{i}.function.name", f"two tools are named {name!r}; names must differ")
        seen.add(name)


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension: variables for the chat template
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    _unsupported = {
        **_SAMPLING_UNSUPPORTED,
        "functions": Unsupported(_OLD_FUNCTIONS, ([],)),
        "function_call": Unsupported(_OLD_FUNCTIONS, ("none", "auto")),
        "audio": Unsupported("audio output is not supported"),
        "modalities": Unsupported("only text output is supported", (["text"],)),
        "prediction": Unsupported("predicted outputs are not supported (speculation needs no hint)"),
        "web_search_options": Unsupported("web search is not supported"),
        "reasoning_effort": Unsupported("reasoning_effort is not supported"),
        "verbosity": Unsupported("verbosity is not supported"),
        "chat_template": Unsupported("per-request chat templates are not supported; start the server with "
                                     "--chat-template FILE"),
        "add_generation_prompt": Unsupported("the assistant's turn is always opened", (True,)),
        "continue_final_message": Unsupported("continuing the final message is not supported", (False,)),
        "echo": Unsupported("echo is not supported", (False,)),
        "add_special_tokens": Unsupported("the chat template places the special tokens", (False,)),
        "documents": Unsupported("documents (RAG templates) are not supported"),
    }

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise UnsupportedError("top_logprobs", "top_logprobs needs logprobs=true")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise UnsupportedError("top_logprobs", f"top_logprobs={self.top_logprobs} is out of range: give 0 "
                                                       f"to {MAX_LOGPROBS}")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise UnsupportedError("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
        for i, m in enumerate(self.messages):
            m.check(f"messages.{i}")
        check_tools(self.tools)
        if self.forced_tools() is not None and self.structured_spec() is not None:
            raise UnsupportedError("tool_choice", "a forced tool call (tool_choice 'required' or a named function) "
                                                  "already constrains the output; drop the response_format / "
                                                  "structured output field or use tool_choice 'auto'")

    def forced_tools(self) -> list[dict[str, Any]] | None:
        """The tools one of which the reply must call (tool_choice "required": any; a named function: that
        one), or None when the model decides."""
        choice = self.tool_choice
        if choice != "required" and not isinstance(choice, NamedToolChoice):
            return None
        if not self.tools:
            raise UnsupportedError("tool_choice", "tool_choice 'required' or a named function needs tools")
        defs = [t.model_dump(exclude_none=True) for t in self.tools]
        if choice == "required":
            return defs
        named = [d for d in defs if d["function"]["name"] == choice.function.name]
        if not named:
            raise UnsupportedError("tool_choice.function.name", f"tool_choice names {choice.function.name!r}, which "
                                                                f"is not among the request's tools")
        return named[:1]

    def active_tools(self) -> list[dict[str, Any]] | None:
        """The tools the model is shown (and whose calls are parsed): none with tool_choice "none"."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates read them: "system" for OpenAI's newer "developer" role, content as
    text ("" for an assistant message that only calls tools), and a call's arguments as the JSON object
    they hold (templates write them with `tojson`; a string would come out quoted twice)."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                               for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text  # not JSON: the template gets it as the string it is
    return value if isinstance(value, dict) else text


class TokenizeRequest(_Strict):
    """POST /tokenize with a prompt (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    """POST /tokenize with messages: the prompt a chat request with them would get (vLLM's shape)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
    tools: list[ToolDef] | None = None
    _unsupported = {"add_special_tokens": ChatCompletionRequest._unsupported["add_special_tokens"],
                    "continue_final_message": ChatCompletionRequest._unsupported["continue_final_message"],
                    "chat_template": ChatCompletionRequest._unsupported["chat_template"]}

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)

    def check_supported(self) -> None:
        for i, m in enumerate(self.messages):
            m.check(f"messages.{i}")
        check_tools(self.tools)

    def active_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's shape)."""

    model: str | None = None
    tokens: list[int]


# -- turning pydantic's errors into one clear sentence --------------------------------------------
_EXPECTED = {
    "prompt": "a string, a list of token ids, or a list of these",
    "stop": "a string or a list of strings",
    "messages": "a non-empty list of {\"role\", \"content\"} objects",
    "content": "a string or a list of {\"type\": \"text\", \"text\"} parts",
    "role": "one of system, developer, user, assistant, tool",
}


def _is_field_name(part: Any) -> bool:
    # union errors add the member type to the location ("str", "list[int]", "TextPart"); skip those
    return isinstance(part, int) or (isinstance(part, str) and "[" not in part and part.islower()
                                     and part not in ("str", "int", "float", "bool", "list", "dict"))


def describe_validation_error(err: ValidationError) -> tuple[str, str | None]:
    """(message, param) for the first problem in `err`, worded for the person who sent the request."""
    first = err.errors()[0]
    kind = first["type"]
    if kind == "json_invalid":
        return f"the request body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])})", None
    loc = [p for p in first["loc"] if _is_field_name(p)]
    param = ".".join(str(p) for p in loc) or None
    if kind == "missing":
        return f"missing required field '{param}'", param
    if kind in ("model_type", "model_attributes_type", "dict_type") and not loc:
        return "the request body must be a JSON object", None
    field_name = next((str(p) for p in reversed(loc) if isinstance(p, str)), "")
    hint = f" (expected {_EXPECTED[field_name]})" if field_name in _EXPECTED else ""
    return f"invalid value for '{param}': {first['msg']}{hint}", param
