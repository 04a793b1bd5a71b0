"""Draft specs: one line that names a proposer built from proposers.

Grammar (whitespace is ignored; names are letters, digits and `_ . @ / ~ : -`):

    spec     := expr
    expr     := primary ('+' stage)*
    primary  := NAME [options] | ('vote' | 'select' | 'fleet') [options] '(' expr (',' expr)* ')'
    stage    := 'adaptive' [options]         adaptive speculation length around everything before it
              | 'ngram' [options]            the n-gram model speeds up the draft model before it (staged)
    options  := '[' key '=' value (',' key '=' value)* ']'

A NAME is a built-in draft (`prompt-lookup` or `lookup`; `ngram`, the backoff n-gram model; `suffix`,
suffix-trie drafting over the request's own text and recent outputs; `grammar`, the tokens a request's
structured-output grammar forces, `grammar[k=16]`, drafting/forced_tokens.py; `head`, the feature-conditioned
draft head trained for the target by `specfleet draft train`, options HeadDraftConfig: k, min_prob, path), a
registered proposer, or a model: a registered name (`qwen-0.5b`), `MODEL@N` (its first N layers) or a
checkpoint path. A model whose tokenizer differs from the target's (`smollm2-135m-instruct` for a Qwen
target) is detected at build time and drafts through text (drafting/cross_vocab.py); not with +ngram. Options set the fields of the matching config dataclass (DraftModelConfig for a
model, PromptLookupConfig, NgramConfig, SuffixConfig (`global` sets use_global), VoteConfig, SelectorConfig,
LengthConfig for +adaptive,
StagedConfig for +ngram, which also takes the tables' order, min_count, path and max_entries); k, width and nodes are short for the depth, the branching and the node
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
                                       cost, or none (strategies/fleet.py; options set FleetConfig)

Sharing: a model is loaded once however often it is named (the factory also derives `MODEL@N` from
an already loaded MODEL), and equal leaves outside a vote are one proposer (one KV cache), so a
request that the selector moves between `a` and `vote(a,b)` keeps its KV in `a`.
"""
from __future__ import annotations

import dataclasses
import enum
import typing
from dataclasses import dataclass, field

from specfleet.errors import InvalidRequestError

NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.@/~:-")
CALLS = ("vote", "select", "fleet")
STAGES = ("adaptive", "ngram")
MODEL_ALIASES = {"k": "num_speculative_tokens", "width": "top_children", "nodes": "max_nodes"}


class NodeKind(str, enum.Enum):
    LEAF = "leaf"  # a draft source: a model, prompt-lookup, ngram, suffix or a registered proposer
    VOTE = "vote"
    SELECT = "select"
    FLEET = "fleet"
    ADAPTIVE = "adaptive"  # `+adaptive`: the length controller around its child
    STAGED = "staged"  # `+ngram`: the n-gram model drafting for the draft model before it

    def __str__(self) -> str:
        return self.value


@dataclass
class Node:
    kind: NodeKind
    name: str  # the leaf's name, or the keyword
    options: dict[str, str] = field(default_factory=dict)
    children: list["Node"] = field(default_factory=list)

    def __str__(self) -> str:
        opts = f"[{','.join(f'{k}={v}' for k, v in self.options.items())}]" if self.options else ""
        if self.kind == NodeKind.LEAF:
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
                                  f"  {self.text}\n  {' ' * self.pos}^\n(see specfleet/strategies/spec_language.py for the grammar)")

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
            node = Node(NodeKind.ADAPTIVE if stage == "adaptive" else NodeKind.STAGED, stage, self.options(), [node])
        return node

    def primary(self) -> Node:
        name = self.word("a draft name, vote(...) or select(...)")
        opts = self.options()
        if self.peek() != "(":
            if name in CALLS:
                self.fail(f"{name} needs drafts in parentheses, e.g. {name}(qwen-0.5b,prompt-lookup)")
            return Node(NodeKind.LEAF, name, opts)
        if name not in CALLS:
            self.fail(f"only {' and '.join(c + '(...)' for c in CALLS)} take drafts in parentheses, not {name!r}")
        self.pos += 1
        children = [self.expr()]
        while self.peek() == ",":
            self.pos += 1
            children.append(self.expr())
        self.expect(")")
        return Node(NodeKind(name), name, opts, children)


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
    if node.kind == NodeKind.LEAF:
        return [node.name]
    return [n for c in node.children for n in leaf_names(c)]
