"""Per-request sampling settings. Temperature 0 means greedy decoding.

`logprobs` and `prompt_logprobs` ask for log-probabilities of the target's own distribution (the
log-softmax of its logits, before temperature, top-k and top-p, as vLLM reports them): None (the
default) computes nothing; n >= 0 gives each token's own log-probability plus its n most likely
alternatives (at most MAX_LOGPROBS).

`structured_outputs` constrains the output to a JSON schema, any JSON object, a regular expression, one
of a list of strings, or a grammar (vLLM's `StructuredOutputsParams`, same field names). The target's
logits are masked by the grammar before temperature, top-k and top-p, at every row speculation verifies,
so speculative output is exactly constrained decoding's (runtime/sample/structured.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from specfleet.errors import InvalidRequestError

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs and vLLM's default max_logprobs
# every new token is tested against a request's stop ids (a set) and each of its n samples holds the
# list: bounded so that no one request can make the engine thread, shared by all, slow or large
MAX_STOP_TOKEN_IDS = 1024
MAX_CACHE_SALT_CHARS = 256


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on the output; exactly one of `json`, `json_object`, `regex`, `choice`, `grammar`.

    json                a JSON schema (a dict, or its JSON text)
    json_object         True: any JSON object
    regex               the whole output matches this regular expression (Rust `regex` syntax)
    choice              the output is one of these strings
    grammar             a context-free grammar: llguidance's Lark syntax, or GBNF (llama.cpp's; told
                        apart by its `::=`), converted to Lark
    strict              JSON schemas (runtime/sample/json_schema.py): unknown keywords and formats are
                        annotations either way; True or None (the default) refuses a schema keyword the
                        grammar engine cannot enforce where ignoring it could return JSON the schema
                        rejects; False generates under the enforceable rest of the schema and lists what
                        was not enforced in the output's `metrics["structured_output"]` (the server:
                        None follows its --unenforceable-schema option)
    disable_any_whitespace  JSON: True (the default here, unlike vLLM) writes JSON as `json.dumps` does,
                        `{"a": 1, "b": [2, 3]}`: a fixed layout keeps small models from looping on
                        whitespace, and the grammar draft can draft the schema's fixed text; False
                        allows any whitespace between tokens
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    strict: bool | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice) if isinstance(self.choice, list) else self.choice)
        self.validate()

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "json_object", "regex", "choice", "grammar") if self._given(k))

    def _given(self, name: str) -> bool:
        value = getattr(self, name)
        return value is True if name == "json_object" else value is not None

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidRequestError(f"invalid structured_outputs: {msg}")

        given = [k for k in ("json", "json_object", "regex", "choice", "grammar") if self._given(k)]
        if len(given) != 1:
            bad(f"give exactly one of json, json_object, regex, choice, grammar; got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            bad(f"json must be a JSON schema (an object, or its text), got {type(self.json).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            bad("regex must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            bad("grammar must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, tuple) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            bad("choice must be a non-empty list of non-empty strings")
        if not isinstance(self.json_object, bool) or not isinstance(self.strict, (bool, type(None))) \
                or not isinstance(self.disable_any_whitespace, bool):
            bad("json_object, strict and disable_any_whitespace must be booleans")


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # per generated token: its log-probability and this many alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token but the first
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow
    # isolates this request's prefix-cache entries: only requests with the same salt share cached blocks
    # (vLLM's `cache_salt`), so one client cannot learn from cache hits what prompts another sent
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def stop_token_set(self) -> frozenset[int]:
        """stop_token_ids as a set: the engine tests every new token against it. Built once per list
        (a request's n samples may share one list object)."""
        ids = self.stop_token_ids
        cached = self.__dict__.get("_stop_set")
        if cached is None or cached[0] is not ids or cached[1] != len(ids):
            cached = (ids, len(ids), frozenset(ids))
            self.__dict__["_stop_set"] = cached
        return cached[2]

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidRequestError(f"invalid sampling parameter: {msg}")

        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            bad(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            bad(f"top_k must be an integer >= 1, or 0/-1 to disable, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) \
                or not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not (0 <= self.seed < 2**63)):
            bad(f"seed must be a non-negative integer below 2**63, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad(f"stop must be non-empty strings, got {self.stop!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad(f"stop_token_ids has {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
        bad_id = next((t for t in self.stop_token_ids if not isinstance(t, int) or isinstance(t, bool) or t < 0),
                      None)
        if bad_id is not None:
            bad(f"stop_token_ids must be non-negative integers, got {bad_id!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt
                                            or len(self.cache_salt) > MAX_CACHE_SALT_CHARS):
            bad(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_LOGPROBS):
                bad(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {n!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad(f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}")
