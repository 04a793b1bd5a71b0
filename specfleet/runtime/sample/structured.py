"""Grammar-constrained decoding: a request's grammar as a token mask on every row the target samples or
verifies from, through llguidance (the Rust engine behind Guidance; PyPI wheel, no dependencies).

Why llguidance and not xgrammar (measured on this 2-core Zen 3, walking schema-valid JSON token by token,
a mask before every token, scripts in the grammar branch's report): both cost far less than a decode step
(tens of microseconds against 66 ms for the 1.5B): mean 36 / 73 us per mask for llguidance on
SmolLM2's 49,152 / Qwen's 151,936-token vocabulary, 5 / 13 us for xgrammar. But xgrammar's wheel requires
`triton` on Linux x86-64 (a 286 MB wheel, useless on the CPU) and apache-tvm-ffi, where llguidance is
one 3 MB wheel with no dependencies. Its one real cost is building its view of a tokenizer (3 s for
SmolLM2, 5 s for Qwen), paid once per tokenizer and process, on the first constrained request.

Exactness with speculation (`Matcher.mask_rows`): row 0 of a verification is masked by the matcher's
state after the committed tokens, and the row of tree node j by the state after the tokens on the path
to j (the matcher consumes the path and rolls back, so it only ever holds committed tokens). Each row
is then exactly the row plain constrained decoding would sample from at that point. A node whose token
its parent's row forbids can never be accepted (its masked probability is 0, and a masked greedy argmax
is an allowed token), so the rows below it are unreachable and left as they are.

End of output: when the grammar is complete only EOS is allowed (every EOS id of the model, not only
the tokenizer's), so a constrained request ends at the end of its grammar.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import threading
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from specfleet.core.tree import DraftTree
from specfleet.errors import InvalidRequestError
# close_objects lived here; server/tools.py and the tests import it from here still
from specfleet.runtime.sample.json_schema import SchemaNotes, SchemaPlan, close_objects, plan  # noqa: F401
from specfleet.sampling_params import StructuredOutputsParams

logger = logging.getLogger("specfleet.grammar")

# JSON layout when whitespace is not free: json.dumps' own separators
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_TOKENIZERS: dict[tuple[str, int], Any] = {}  # (tokenizer digest, vocab size) -> llguidance.LLTokenizer
_TOKENIZERS_LOCK = threading.Lock()


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # a dependency of specfleet; only a broken install lacks it
        raise InvalidRequestError("structured output needs the llguidance package (pip install llguidance)") from e
    return llguidance


def json_options(spec: StructuredOutputsParams) -> dict:
    return dict(COMPACT_JSON) if spec.disable_any_whitespace else {"whitespace_flexible": True}


def lark_string(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def schema_plan(spec: StructuredOutputsParams) -> SchemaPlan:
    """A JSON constraint's grammar and what of its schema is not fully enforced (runtime/sample/json_schema.py);
    `spec.strict=False` generates under the enforceable part of a schema instead of refusing it."""
    schema: Any = {"type": "object"} if spec.kind == "json_object" else spec.json
    return plan(schema, json_options(spec), relaxed=spec.strict is False)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet checked against a tokenizer)."""
    ll = _llguidance().LLMatcher
    kind = spec.kind
    if kind in ("json", "json_object"):
        return schema_plan(spec).grammar
    if kind == "regex":
        return ll.grammar_from_regex(spec.regex)
    if kind == "choice":
        return ll.grammar_from_lark("start: " + " | ".join(lark_string(c) for c in spec.choice))
    text = spec.grammar
    if "::=" in text:  # GBNF (llama.cpp's grammars, vLLM's guided_grammar for xgrammar)
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions on bad input
            raise InvalidRequestError(f"invalid GBNF grammar: {e}") from None
    return ll.grammar_from_lark(text)


def _tokenizer_json(tokenizer) -> str:
    backend = copy.copy(tokenizer.backend_tokenizer)  # the HF fast tokenizer's Rust side, with added tokens
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


def ll_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of a tokenizer, cached per tokenizer content and vocabulary size (building it
    takes seconds). `tokenizer` is a Hugging Face fast tokenizer, or an object with llguidance's
    TokenizerWrapper fields (`tokens` as bytes, `eos_token_id`, `bos_token_id`, `__call__`), as tests use."""
    llg = _llguidance()
    if not hasattr(tokenizer, "backend_tokenizer"):
        from llguidance._tokenizer import TokenizerWrapper

        return llg.LLTokenizer(TokenizerWrapper(tokenizer), n_vocab=vocab_size)
    text = _tokenizer_json(tokenizer)
    key = (hashlib.sha256(text.encode()).hexdigest(), vocab_size)
    with _TOKENIZERS_LOCK:
        found = _TOKENIZERS.get(key)
        if found is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            found = _TOKENIZERS[key] = llg.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
    return found


# The compiled grammars a compiler keeps, least recently used first out, within this many bytes. Each
# entry is counted as its grammar's text plus GRAMMAR_ENTRY_OVERHEAD for the compiled matcher, so a
# stream of distinct large schemas costs at most this much, however many a client sends.
DEFAULT_GRAMMAR_CACHE_BYTES = 32 << 20
GRAMMAR_ENTRY_OVERHEAD = 64 << 10
# a grammar whose text is longer is not kept: its compiled states can take hundreds of MB (a 1.3 MB regex
# literal: ~200 MB once its first mask is computed), far more than its text says; such a constraint is
# compiled again, on a worker, by each request that sends it
MAX_CACHED_GRAMMAR_CHARS = 128 << 10


class _Compiled:
    """One constraint, checked and compiled: its grammar text, its error ("" when valid), and a matcher
    in its start state whose first mask was already computed (copied for each request)."""

    __slots__ = ("text", "error", "prototype", "nbytes", "lock", "first_mask")

    def __init__(self, text: str, error: str, prototype: Any, nbytes: int):
        self.text, self.error, self.prototype, self.nbytes = text, error, prototype, nbytes
        self.lock = threading.Lock()  # llguidance matchers are not to be used from two threads at once
        # [vocab] bool: the tokens allowed first. Computed once, here, off the engine thread: a matcher
        # copied from the prototype computes it again otherwise (0.2 s for a 1.3 MB regex literal)
        self.first_mask: torch.Tensor | None = None


def spec_key(spec: StructuredOutputsParams) -> str:
    """A digest that tells constraints apart (the cache key): kind, value and options."""
    value = getattr(spec, spec.kind)
    # keys not sorted: a schema's `properties` order is the order its grammar writes them in, so two schemas
    # that differ only in that order are different constraints
    raw = json.dumps([spec.kind, value, spec.strict, spec.disable_any_whitespace], ensure_ascii=False, default=str)
    return hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()


class GrammarCompiler:
    """Turns constraints into matchers for one tokenizer. Compiling (the grammar text, its check, the
    matcher and its first mask) is the slow part, seconds for a megabyte regex: callers that serve other
    requests meanwhile do it on another thread (`compile`, then hand the `matcher` to the engine). Compiled
    grammars are kept in an LRU under `cache_bytes` (DEFAULT_GRAMMAR_CACHE_BYTES)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids=(), cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES):
        self.vocab_size = vocab_size
        self.lltok = ll_tokenizer(tokenizer, vocab_size)
        self.eos_token_ids = sorted({*eos_token_ids, *self.lltok.eos_tokens})
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[str, _Compiled] = OrderedDict()  # spec_key -> compiled, oldest use first
        self._cached_bytes = 0
        self._lock = threading.Lock()

    @property
    def cached_bytes(self) -> int:
        """Bytes the cache counts now (always <= cache_bytes, but for one entry larger than it alone)."""
        return self._cached_bytes

    def __len__(self) -> int:
        return len(self._cache)

    def compile(self, spec: StructuredOutputsParams) -> _Compiled:
        """The checked, compiled constraint (from the cache, or built and cached now); InvalidRequestError
        (a 400 at the server) when it is not valid."""
        key = spec_key(spec)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
        if found is None:
            found = self._build(spec)
            with self._lock:
                if key not in self._cache and (found.error or len(found.text) <= MAX_CACHED_GRAMMAR_CHARS):
                    self._cache[key] = found
                    self._cached_bytes += found.nbytes
                    while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                        _, old = self._cache.popitem(last=False)
                        self._cached_bytes -= old.nbytes
        if found.error:
            raise InvalidRequestError(f"invalid {spec.kind} constraint: {found.error.strip().splitlines()[0]}")
        return found

    def _build(self, spec: StructuredOutputsParams) -> _Compiled:
        text = grammar_text(spec)
        ll = _llguidance().LLMatcher
        is_error, messages = ll.validate_grammar_with_warnings(text, self.lltok)
        error = (messages[0] if messages else "invalid grammar") if is_error else ""
        prototype = None
        if not error:
            prototype = ll(self.lltok, text, log_level=0)
            if prototype.is_error():
                error = prototype.get_error()
        compiled = _Compiled(text, error, prototype, len(text.encode("utf-8", "surrogatepass"))
                             + GRAMMAR_ENTRY_OVERHEAD + self.vocab_size)
        if not error:
            compiled.first_mask = Matcher(self, compiled).allowed()
        return compiled

    def grammar(self, spec: StructuredOutputsParams) -> str:
        """The checked grammar of `spec`; InvalidRequestError (a 400 at the server) when it is not valid."""
        return self.compile(spec).text

    def literal(self, text: str) -> str:
        """Lark for `text` written by this tokenizer: a text that is one special (added) token, such as
        Qwen2.5's `<tool_call>`, must be named as that token (`<[151657]>`): a quoted literal of its text
        would make llguidance allow the token in the mask and then refuse it when consumed."""
        ids = self.lltok.tokenize_str(text)
        if len(ids) == 1 and self.lltok.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return lark_string(text)

    def matcher(self, spec: StructuredOutputsParams) -> "Matcher":
        """A fresh matcher for one request (a copy of the compiled one), with a JSON schema's notes (the
        keywords accepted as annotations, narrowed or not enforced: runtime/sample/json_schema.py)."""
        m = Matcher(self, self.compile(spec))
        if spec.kind == "json":
            m.notes = schema_plan(spec).notes
        return m


_MAX_TOKEN_BYTES = 64  # forced_tokens: bytes tokenized per token wanted (more than any token's text)


_COMPILERS: "weakref.WeakKeyDictionary[Any, dict[int, GrammarCompiler]]" = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.RLock()


def compiler_for(tokenizer, vocab_size: int, eos_token_ids=()) -> GrammarCompiler:
    """The one compiler of a tokenizer object (the engine's and the grammar draft's share it)."""
    if tokenizer is None:
        raise InvalidRequestError("structured output needs the model's tokenizer; this model has none")
    with _COMPILERS_LOCK:  # the server's tokenizer thread, the engine thread and drafter threads ask
        per = _COMPILERS.setdefault(tokenizer, {})
        found = per.get(vocab_size)
        if found is None:
            found = per[vocab_size] = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        elif eos_token_ids and not set(eos_token_ids) <= set(found.eos_token_ids):
            found.eos_token_ids = sorted({*found.eos_token_ids, *eos_token_ids})
        return found


class Matcher:
    """One request's grammar state. It only ever holds committed tokens: `mask_rows` consumes a draft's
    paths and rolls them back."""

    def __init__(self, compiler: GrammarCompiler, grammar: "str | _Compiled"):
        self.compiler = compiler
        self._first_mask = None
        if isinstance(grammar, _Compiled):
            with grammar.lock:
                self.m = grammar.prototype.deep_copy()
            self._first_mask = grammar.first_mask
        else:
            self.m = _llguidance().LLMatcher(compiler.lltok, grammar, log_level=0)
        if self.m.is_error():
            raise InvalidRequestError(f"invalid grammar: {self.m.get_error().strip().splitlines()[0]}")
        self.vocab_size = compiler.vocab_size
        self._words = torch.zeros((self.vocab_size + 31) // 32, dtype=torch.int32)
        self.num_tokens = 0  # committed tokens consumed
        self._trial = 0  # tokens mask_rows consumed on a draft's path (rolled back after)
        self.broken = False  # a committed token the grammar refused (a stop token after the end, an EOS)
        self.notes = SchemaNotes()  # a JSON schema's keywords not fully enforced (runtime/sample/json_schema.py)

    # -- committed tokens ------------------------------------------------------------------------
    def advance(self, tokens: list[int]) -> None:
        """Consume committed tokens (EOS ends the output: it is not fed to the grammar)."""
        eos = self.compiler.eos_token_ids
        for t in tokens:
            if self.broken or t in eos:
                return
            if not self.m.consume_token(t):
                self.broken = True
                logger.warning("grammar: committed token %d was refused (%s); only EOS is allowed from here",
                               t, self.m.get_error().strip().splitlines()[:1])
                return
            self.num_tokens += 1

    def is_accepting(self) -> bool:
        return self.m.is_accepting() or self.m.is_stopped()

    def forced_tokens(self, limit: int) -> list[int]:
        """Tokens the grammar forces next, at most `limit`: the forced text, tokenized as the tokenizer
        would, kept up to the first token the matcher would refuse (a forced `<tool_call>` must be the
        special token, not its characters). Empty when the next token is a free choice."""
        if self.broken or self.m.is_stopped():
            return []
        forced = self.m.compute_ff_bytes()
        if not forced:
            return []
        # only as many bytes as `limit` tokens can hold are tokenized (a long forced literal would cost
        # O(its length) on the engine thread every step); the last token of a cut text may be cut too
        cut = (limit + 2) * _MAX_TOKEN_BYTES
        tokens = self.compiler.lltok.tokenize_bytes(forced[:cut])
        if len(forced) > cut:
            tokens = tokens[:-1]
        tokens = tokens[:limit]
        n = self.m.validate_tokens(tokens)
        return tokens[:n]

    def allows(self, token: int) -> bool:
        return not self.broken and self.m.validate_tokens([token]) == 1

    # -- masks -----------------------------------------------------------------------------------
    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens allowed next (every EOS id wherever one is)."""
        eos = self.compiler.eos_token_ids
        if self._first_mask is not None and self.num_tokens == 0 and self._trial == 0 and not self.broken:
            return self._first_mask.clone()
        if self.broken or self.m.is_error():
            out = torch.zeros(self.vocab_size, dtype=torch.bool)
            out[[t for t in eos if t < self.vocab_size]] = True
            return out
        self.m.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
        bits = np.unpackbits(self._words.numpy().view(np.uint8), bitorder="little")[:self.vocab_size]
        out = torch.from_numpy(bits.astype(bool))
        if eos and bool(out[[t for t in eos if t < self.vocab_size]].any()):
            out[[t for t in eos if t < self.vocab_size]] = True
        if not bool(out.any()):  # nothing allowed (cannot happen with a valid grammar): end the output
            out[[t for t in eos if t < self.vocab_size]] = True
        return out

    def mask_rows(self, tree: DraftTree, rows: torch.Tensor) -> torch.Tensor:
        """A copy of a verification's logit rows [len(tree) + 1, vocab] with each reachable row masked by
        the grammar state after its path (module docstring)."""
        out = rows.clone()
        children: dict[int, list[int]] = {}
        for j, p in enumerate(tree.parents):
            children.setdefault(p, []).append(j)
        neg = float("-inf")
        eos = set(self.compiler.eos_token_ids)

        only_eos = torch.zeros(self.vocab_size, dtype=torch.bool)
        only_eos[[t for t in eos if t < self.vocab_size]] = True

        def visit(node: int, allowed: torch.Tensor) -> None:
            out[node + 1].masked_fill_(~allowed.to(out.device), neg)
            if self.broken:
                return
            for c in children.get(node, []):
                tok = tree.token_ids[c]
                if not (0 <= tok < self.vocab_size and bool(allowed[tok])) or tok in eos:
                    continue  # forbidden (never accepted) or the end of the output: nothing below is reachable
                if self.m.validate_tokens([tok]) != 1:
                    # the mask allowed a token the matcher refuses (an engine quirk): plain decoding would
                    # commit it and then allow only EOS (`advance`), so every row below allows only EOS
                    for j in [c, *(k for k in range(c + 1, len(tree)) if c in tree.path_to(k))]:
                        out[j + 1].masked_fill_(~only_eos.to(out.device), neg)
                    continue
                self.m.consume_token(tok)
                self._trial += 1
                try:
                    visit(c, self.allowed())
                finally:
                    self._trial -= 1
                    self.m.rollback(1)

        visit(-1, self.allowed())
        return out
