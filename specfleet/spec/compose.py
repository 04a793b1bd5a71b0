"""Draft specs: one line that names a proposer built from proposers.

Grammar (whitespace is ignored; names are letters, digits and `_ . @ / ~ : -`):

    spec     := expr
    expr     := primary ('+' stage)*
    primary  := NAME [options] | ('vote' | 'select' | 'fleet') [options] '(' expr (',' expr)* ')'
    stage    := 'adaptive' [options]         adaptive speculation length around everything before it
              | 'ngram' [options]            the n-gram model speeds up the draft model before it (staged)
    options  := '[' key '=' value (',' key '=' value)* ']'

A NAME is a built-in draft (`prompt-lookup` or `lookup`; `ngram`, the backoff n-gram model; `suffix`,
suffix-trie drafting over the request's own text and recent outputs), a
registered proposer, or a model: a registered name (`qwen-0.5b`), `MODEL@N` (its first N layers) or a
checkpoint path. A model whose tokenizer differs from the target's (`smollm2-135m-instruct` for a Qwen
target) is detected at build time and drafts through text (spec/cross_vocab.py); not with +ngram. Options set the fields of the matching config dataclass (DraftModelConfig for a
model, PromptLookupConfig, NgramConfig, SuffixConfig (`global` sets use_global), VoteConfig, SelectorConfig,
LengthConfig for +adaptive,
StagedConfig for +ngram, which also takes the tables' order, min_count and path); k, width and nodes are short for the depth, the branching and the node
budget of a draft. Unknown keys are an error that lists the valid ones.

Examples:
    qwen-0.5b                          one draft model
    qwen-0.5b[k=6,width=2]             a best-first tree 6 deep with 2 children per level
    qwen-0.5b+ngram[path=t.json.gz]    the draft model drafting with the n-gram model's help (staged),
                                       tables from `specfleet ngram build` (else learned online)
    vote(qwen-0.5b,qwen-0.5b@18,prompt-lookup)
    suffix[k=8,nodes=12,min_match=3,global=false]   suffix drafting, 8 deep, 12 nodes, own context only
    select[policy=epsilon-greedy](qwen-0.5b,prompt-lookup)
    select(vote(qwen-0.5b,qwen-0.5b@18,prompt-lookup),qwen-0.5b,prompt-lookup)+adaptive[max_length=6]
    fleet(qwen-0.5b,suffix,prompt-lookup,ngram)   per step, the draft of best expected tokens per measured
                                       cost, or none (spec/fleet.py; options set FleetConfig)

Sharing: a model is loaded once however often it is named (the factory also derives `MODEL@N` from
an already loaded MODEL), and equal leaves outside a vote are one proposer (one KV cache), so a
request that the selector moves between `a` and `vote(a,b)` keeps its KV in `a`.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Callable

from specfleet.errors import InvalidRequestError
from specfleet.spec.proposer import Proposer

NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.@/~:-")
CALLS = ("vote", "select", "fleet")
STAGES = ("adaptive", "ngram")
MODEL_ALIASES = {"k": "num_speculative_tokens", "width": "top_children", "nodes": "max_nodes"}


@dataclass
class Node:
    kind: str  # "leaf", "vote", "select", "fleet", "adaptive" or "staged"
    name: str  # the leaf's name, or the keyword
    options: dict[str, str] = field(default_factory=dict)
    children: list["Node"] = field(default_factory=list)

    def __str__(self) -> str:
        opts = f"[{','.join(f'{k}={v}' for k, v in self.options.items())}]" if self.options else ""
        if self.kind == "leaf":
            return self.name + opts
        if self.kind in CALLS:
            return f"{self.kind}{opts}({','.join(map(str, self.children))})"
        return f"{self.children[0]}+{self.name}{opts}"


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.pos = 0

    def fail(self, msg: str) -> None:
        raise InvalidRequestError(f"in draft spec {self.text!r}: {msg} at position {self.pos}\n"
                                  f"  {self.text}\n  {' ' * self.pos}^\n(see specfleet/spec/compose.py for the grammar)")

    def peek(self) -> str:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def expect(self, ch: str) -> None:
        if self.peek() != ch:
            self.fail(f"expected {ch!r}" + (f", found {self.peek()!r}" if self.peek() else ", found the end"))
        self.pos += 1

    def word(self, what: str) -> str:
        self.peek()
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] in NAME_CHARS:
            self.pos += 1
        if self.pos == start:
            found = repr(self.text[self.pos]) if self.pos < len(self.text) else "the end"
            self.fail(f"expected {what}, found {found}")
        return self.text[start:self.pos]

    def options(self) -> dict[str, str]:
        opts: dict[str, str] = {}
        if self.peek() != "[":
            return opts
        self.pos += 1
        while True:
            key = self.word("an option name")
            if key in opts:
                self.pos -= len(key)
                self.fail(f"option {key!r} is given twice")
            self.expect("=")
            opts[key] = self.word(f"a value for {key!r}")
            if self.peek() == "]":
                self.pos += 1
                return opts
            if self.peek() != ",":
                self.fail("expected ',' or ']' after an option")
            self.pos += 1

    def expr(self) -> Node:
        node = self.primary()
        while self.peek() == "+":
            self.pos += 1
            stage = self.word("a stage (adaptive or ngram)")
            if stage not in STAGES:
                self.pos -= len(stage)
                self.fail(f"unknown stage '+{stage}'; stages are {', '.join('+' + s for s in STAGES)}")
            node = Node("adaptive" if stage == "adaptive" else "staged", stage, self.options(), [node])
        return node

    def primary(self) -> Node:
        name = self.word("a draft name, vote(...) or select(...)")
        opts = self.options()
        if self.peek() != "(":
            if name in CALLS:
                self.fail(f"{name} needs drafts in parentheses, e.g. {name}(qwen-0.5b,prompt-lookup)")
            return Node("leaf", name, opts)
        if name not in CALLS:
            self.fail(f"only {' and '.join(c + '(...)' for c in CALLS)} take drafts in parentheses, not {name!r}")
        self.pos += 1
        children = [self.expr()]
        while self.peek() == ",":
            self.pos += 1
            children.append(self.expr())
        self.expect(")")
        return Node(name, name, opts, children)


def parse(text: str) -> Node:
    """The syntax tree of a draft spec; InvalidRequestError (with a caret under the spot) if malformed."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidRequestError("the draft spec is empty; name a draft such as 'qwen-0.5b' or 'prompt-lookup'")
    p = _Parser(text)
    node = p.expr()
    if p.peek():
        p.fail(f"unexpected {p.peek()!r} after a complete spec")
    return node


def apply_options(config, options: dict[str, str], what: str, aliases: dict[str, str] | None = None):
    """`config` (a dataclass instance) with fields replaced by option strings, converted to the
    type of the field's current value."""
    if not options:
        return config
    known = {f.name: f for f in dataclasses.fields(config)}
    changes = {}
    for key, raw in options.items():
        name = (aliases or {}).get(key, key)
        if name not in known:
            raise InvalidRequestError(f"unknown option {key!r} for {what}; valid options: {', '.join(known)}")
        declared = typing.get_args(typing.get_type_hints(type(config)).get(name))
        if raw.lower() == "none" and type(None) in declared:  # an optional field: none unsets it
            changes[name] = None
            continue
        like = getattr(config, name)
        if like is None:  # unset now: convert to the type it is declared with (`int | None` -> int)
            like = next((t() for t in declared if t in (bool, int, float)), None)
        changes[name] = convert(raw, like, f"{what} option {key}")
    return dataclasses.replace(config, **changes)


def convert(raw: str, like, what: str):
    try:
        if isinstance(like, bool):
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError
            return raw.lower() in ("true", "1", "yes", "on")
        if isinstance(like, int):
            return int(raw)
        if isinstance(like, float):
            return float(raw)
    except ValueError:
        raise InvalidRequestError(f"{what}={raw!r}: expected {type(like).__name__}") from None
    return raw


def leaf_names(node: Node) -> list[str]:
    """Every leaf name in the spec, in order (the factory loads the models among them up front)."""
    if node.kind == "leaf":
        return [node.name]
    return [n for c in node.children for n in leaf_names(c)]


def describe(proposer) -> dict:
    """Live state of every strategy in a composed proposer, for /metrics and the CLI: vote weights,
    current adaptive lengths, selector assignments and goodput estimates, and measured overheads."""
    out: dict = {}

    def walk(p) -> None:
        info: dict = {}
        if hasattr(p, "weights"):
            info["weights"] = {k: round(v, 4) for k, v in p.weights.items()}
        if hasattr(p, "monitor"):
            info["length"] = p.length
        if hasattr(p, "estimates"):
            info["arm_goodput"] = {a.name: round(p.estimates.arm_mean(j), 2) for j, a in enumerate(p.arms)}
            info["assigned"] = {a.name: sum(1 for v in p.assignment.values() if v == j) for j, a in enumerate(p.arms)}
        if hasattr(p, "fleet_report"):
            info["fleet"] = p.fleet_report()
        if hasattr(p, "overhead_s"):
            info["overhead_s"] = {k: round(v, 6) for k, v in p.overhead_s.items()}
        if info:
            out[p.name] = info
        for c in getattr(p, "children", []) or []:
            walk(c)

    walk(proposer)
    return out


def total_overhead(proposer) -> float:
    """Seconds spent in voting, weight updates, fitting and matching across the composition."""
    return sum(sum(v.get("overhead_s", {}).values()) for v in describe(proposer).values())


LoadModel = Callable[[str], object]


# -- walking a composed proposer: its leaves, their size, preparing their KV ahead of use -----------
def leaves(p: Proposer) -> list[Proposer]:
    kids = getattr(p, "children", None)
    return [leaf for k in kids for leaf in leaves(k)] if kids else [p]


def model_size(p: Proposer) -> int:
    """Parameters behind a proposer (weightless ones count 0): the prompt-length baseline's order."""
    models = {id(m): m for m in (getattr(leaf, "model", None) for leaf in leaves(p)) if hasattr(m, "parameters")}
    return sum(sum(t.numel() for t in m.parameters()) for m in models.values())


def free_kv(p: Proposer, request_id: str) -> None:
    """Drop a request's draft KV from a leaf (a request switched away from it), keeping the rest of
    its state: a sampled request's draft generator must not restart from its seed."""
    if hasattr(p, "free_kv"):
        p.free_kv(request_id)
    elif hasattr(p, "blocks"):
        p.blocks.free(request_id)


@dataclass(frozen=True)
class TokenSnapshot:
    """What preparing needs of a request, copied so a background thread never reads a list the
    engine is appending to."""

    request_id: str
    all_token_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def prepare_kv(p: Proposer, requests: list) -> None:
    """Catch a proposer's draft caches up on the requests' committed tokens (all but the last one,
    which is the next draft's root), so its first draft after a switch needs no long catch-up.
    Proposers with weights do it in their `prepare`; weightless ones have nothing to prepare."""
    if hasattr(p, "prepare"):
        p.prepare(requests)
