"""Request bodies of the OpenAI-compatible API, validated by pydantic.

Policy on fields (chosen so that a typo never silently changes a request):
- types are strict: `"0.5"` is not a temperature and `true` is not a max_tokens;
- fields that OpenAI does not define are rejected (`extra="forbid"`), so `max_token` or `temprature`
  get a 400 that names the field instead of being ignored;
- OpenAI fields we do not implement (penalties, logprobs, logit_bias, echo, suffix, best_of, ...)
  are accepted only at their no-op value; anything else gets a 400 saying it is unsupported;
- an explicit `null` in any optional top-level field means "use the default", as at OpenAI (whose
  official client sends null for a keyword argument passed as None); required fields stay required;
- `top_k` and `ignore_eos` are extensions, as in vLLM.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from specfleet.errors import InvalidRequestError

MAX_STOP_STRINGS = 4  # as in OpenAI


class UnsupportedError(InvalidRequestError):
    """A known OpenAI field was given a value this server does not implement."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str | None = None  # optional: a single-model server serves its model either way
    max_tokens: int | None = None  # None: up to the end of the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # extension; 0 or -1 = disabled
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False  # extension: keep generating past EOS (benchmarks, load tests)
    user: str | None = None  # accepted and unused: it only tags requests at OpenAI
    # no-op values only (see the module docstring)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

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
        if self.n != 1:
            raise UnsupportedError("n", f"n={self.n} is not supported; only n=1 is (send separate requests)")
        if self.presence_penalty or self.frequency_penalty:
            param = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            raise UnsupportedError(param, f"{param} is not supported; leave it at 0")
        if self.logit_bias:
            raise UnsupportedError("logit_bias", "logit_bias is not supported; leave it empty")
        if len(self.stop_list()) > MAX_STOP_STRINGS:
            raise UnsupportedError("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed, "
                                           f"got {len(self.stop_list())}")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedError("stream_options", "stream_options is only allowed with stream=true")


class CompletionRequest(_SamplingFields):
    # one prompt: a string, a list with one string, token ids, or a list with one list of token ids
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise UnsupportedError("echo", "echo is not supported; leave it false")
        if self.suffix:
            raise UnsupportedError("suffix", "suffix (insertion) is not supported")
        if self.best_of not in (None, 1):
            raise UnsupportedError("best_of", f"best_of={self.best_of} is not supported; only 1 is")
        if self.logprobs is not None:
            raise UnsupportedError("logprobs", "logprobs are not supported; leave logprobs unset")

    def single_prompt(self) -> str | list[int]:
        """The one prompt this request carries; batches are refused rather than half-served."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise UnsupportedError("prompt", "prompt is an empty list; give a string or token ids")
        if isinstance(p[0], int):
            return p  # type: ignore[return-value]
        if len(p) != 1:
            raise UnsupportedError("prompt", f"prompt holds {len(p)} prompts; send one prompt per request")
        return p[0]  # type: ignore[return-value]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs is not None:
            raise UnsupportedError("logprobs", "logprobs are not supported; leave logprobs unset")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise UnsupportedError("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        # chat templates know "system", not OpenAI's newer "developer" role for the same thing
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


# -- turning pydantic's errors into one clear sentence --------------------------------------------
_EXPECTED = {
    "prompt": "a string, a list with one string, or a list of token ids",
    "stop": "a string or a list of strings",
    "messages": "a non-empty list of {\"role\", \"content\"} objects",
    "content": "a string or a list of {\"type\": \"text\", \"text\"} parts",
    "role": "one of system, developer, user, assistant",
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
    if kind == "extra_forbidden":
        return (f"unknown field '{param}': this server does not support it (check the spelling, "
                f"or remove it)", param)
    if kind == "missing":
        return f"missing required field '{param}'", param
    if kind in ("model_type", "model_attributes_type", "dict_type") and not loc:
        return "the request body must be a JSON object", None
    field_name = next((str(p) for p in reversed(loc) if isinstance(p, str)), "")
    hint = f" (expected {_EXPECTED[field_name]})" if field_name in _EXPECTED else ""
    return f"invalid value for '{param}': {first['msg']}{hint}", param
