"""Building a proposer from a draft spec (see spec_language.py) and its settings.

`build_proposer(draft, spec, target_vocab_size, dtype, device)` is what specfleet.llm calls; `build`
does the same with a caller-supplied model loader (tests hand in tiny models by name).
"""
from __future__ import annotations

import copy
import logging
from typing import Callable
from dataclasses import dataclass, field, replace

import torch

from specfleet.core.model_ref import ModelRef
from specfleet.runtime.sample.structured import compiler_for
from specfleet.errors import InvalidRequestError
from specfleet.core.proposer import leaves
from specfleet.strategies.spec_language import MODEL_ALIASES, Node, NodeKind, apply_options, leaf_names, parse
from specfleet.drafting.cross_vocab import cross_vocab_draft
from specfleet.drafting.draft_model import DraftModelConfig, DraftModelProposer
from specfleet.drafting.forced_tokens import GRAMMAR_ORIGIN, GrammarDraftConfig, ForcedTokensProposer
from specfleet.drafting.head import HeadDraftConfig, HeadProposer
from specfleet.strategies.fleet import FleetConfig, FleetProposer
from specfleet.strategies.length import LengthConfig, LengthController
from specfleet.drafting.ngram_model import NgramConfig, NgramModel, NgramProposer
from specfleet.drafting.prompt_lookup import PromptLookupConfig, PromptLookupProposer
from specfleet.core.proposer import Proposer, get_factory, registered_names
from specfleet.strategies.selector import SelectorConfig, SelectorProposer
from specfleet.drafting.staged import StagedConfig, StagedProposer
from specfleet.drafting.suffix import SuffixConfig, SuffixProposer
from specfleet.drafting.datastore import (Datastore, DatastoreConfig, DatastoreProposer, check_tokenizer,
                                          stdlib_datastore)
from specfleet.strategies.vote import VoteConfig, VoteProposer

logger = logging.getLogger(__name__)

# A same-vocabulary draft model's head covers only the first DEFAULT_HEAD_VOCAB token ids unless its spec
# says otherwise (`qwen-0.5b[head_vocab=none]` for the whole vocabulary): byte-level BPE ids come in merge
# order, so the low ids are the common tokens. Lossless either way (the target verifies every token; a
# token past the cut is simply never proposed). Measured for Qwen2.5's 151936-token vocabulary: the cut
# reads 43 % of the 0.5B's Q8_0 head (3.4 ms instead of 8.4 ms of a ~35 ms draft step) and covers 99.2 % of
# the tokens of HumanEval's reference solutions and 97.8 % of ShareGPT's first replies (32768 ids: 96.4 % /
# 93.1 %); the fleet preset reports the coverage of the target's own outputs in every run.
DEFAULT_HEAD_VOCAB = 65536
# A same-vocabulary draft model's chain stops after a token whose draft probability is below DEFAULT_P_MIN
# unless its spec says otherwise (`qwen-0.5b[p_min=0]` drafts every chain to its full depth). Lossless either
# way. Measured with the 0.5B for the 1.5B on HumanEval (benchmarks/RESULTS.md, benchmarks/drafts/draft_cost.py): 11 %
# fewer drafted tokens for the same tokens per step (acceptance per drafted token 0.77 -> 0.85).
DEFAULT_P_MIN = 0.4

LoadModel = Callable[..., object]  # (name, quantization=None) -> model
LOOKUP_NAMES = ("prompt-lookup", "lookup")
DATASTORE_NAME = "datastore"  # retrieval from a corpus of text others wrote (drafting/datastore.py)
LOOKUP_ALIASES = {"k": "num_speculative_tokens", "width": "num_branches"}
HEAD_NAME = "head"  # the feature-conditioned draft head trained for the target (drafting/head.py)
HEAD_ALIASES = {"k": "num_speculative_tokens"}
SUFFIX_ALIASES = {"k": "max_depth", "nodes": "max_nodes", "global": "use_global"}  # `global` is a Python keyword


@dataclass(frozen=True)
class SpecConfig:
    """Speculation settings; each strategy's defaults live in its own config, overridable per spec."""

    num_speculative_tokens: int = 4  # chain length / tree depth
    top_children: int = 1  # > 1: a best-first tree with this branching
    max_nodes: int = 16  # tree node budget
    draft_kv_cache_bytes: int = 512 << 20  # per draft model
    prefix_caching: bool = True  # draft models' caches reuse cached prefixes, as the target's does
    vote: VoteConfig = field(default_factory=VoteConfig)
    length: LengthConfig = field(default_factory=LengthConfig)
    selector: SelectorConfig = field(default_factory=SelectorConfig)
    ngram: NgramConfig = field(default_factory=NgramConfig)
    staged: StagedConfig = field(default_factory=StagedConfig)


def build_proposer(draft: str | None, spec: SpecConfig, target_vocab_size: int, dtype: torch.dtype,
                   device: torch.device, quantization: str | None = None, target_tokenizer=None,
                   target_model=None) -> Proposer | None:
    """`target_tokenizer` lets a draft model of another vocabulary draft through text (drafting/cross_vocab.py);
    `target_model` is what a draft head (`head`, drafting/head.py) reads its embeddings from and is found by."""
    if draft is None or draft.strip().lower() in ("", "none"):
        return None
    node = parse(draft)
    return build(node, spec, ModelCache(dtype, device, leaf_names(node), quantization), target_vocab_size, device,
                 target_tokenizer, target_model)


def build(spec_text: str | Node, spec: SpecConfig, load_model: LoadModel, target_vocab_size: int | None = None,
          device: torch.device | str = "cpu", target_tokenizer=None, target_model=None) -> Proposer:
    node = parse(spec_text) if isinstance(spec_text, str) else spec_text
    return _Builder(spec, load_model, target_vocab_size, torch.device(device), target_tokenizer,
                    target_model).build(node)


def layer_cut(model, num_layers: int | list[int]):
    """A view of `model` with only its first `num_layers` layers (or the layers of that list, in order), sharing
    every weight."""
    total = model.config.num_layers
    keep = list(range(num_layers)) if isinstance(num_layers, int) else list(num_layers)
    if not keep or not all(0 <= i < total for i in keep) or len(set(keep)) != len(keep):
        what = f"{num_layers} layers" if isinstance(num_layers, int) else f"layers {num_layers}"
        raise InvalidRequestError(f"cannot keep {what} of a {total}-layer model")
    cut = copy.copy(model)
    cut._modules, cut._parameters, cut._buffers = dict(model._modules), dict(model._parameters), dict(model._buffers)
    cut.layers = torch.nn.ModuleList([model.layers[i] for i in keep])
    cut.config = replace(model.config, num_layers=len(keep))
    return cut


class ModelCache:
    """Loads each model once: a base named with several depths (`m`, `m@12`) is loaded whole once and
    the cut drafts share its weights; a base named with one depth only is loaded at that depth."""

    def __init__(self, dtype: torch.dtype, device: torch.device, names: list[str], quantization: str | None = None):
        self.dtype, self.device, self.quantization = dtype, device, quantization
        self._variants: dict[str, set[str]] = {}
        for n in names:
            try:
                self._variants.setdefault(ModelRef.parse(n).name, set()).add(n)
            except InvalidRequestError:
                pass  # reported when the draft is built
        self._models: dict[object, object] = {}

    def __call__(self, name: str, quantization: str | None = None):
        """The model `name`; `quantization` (a draft's `[quant=...]`) overrides the engine-wide mode."""
        from specfleet.runtime.loading import load
        from specfleet.runtime.formats.quant import parse_quantization

        quant = self.quantization if quantization is None else parse_quantization(quantization)
        ref = ModelRef.parse(name)
        # a base named at one depth only is loaded at that depth; else whole, and the cuts share it
        key = name if len(self._variants.get(ref.name, {name})) == 1 else ref.name
        if (key, quant) not in self._models:
            self._models[key, quant] = load.load_model(key, self.dtype, self.device, with_tokenizer=False,
                                                       quantization=quant)[0]
        model = self._models[key, quant]
        return layer_cut(model, ref.num_layers) if key != name else model


def _guess(raw: str):
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


class _Builder:
    def __init__(self, spec: SpecConfig, load_model: LoadModel, vocab: int | None, device: torch.device,
                 target_tokenizer=None, target_model=None):
        self.spec, self.load_model, self.vocab, self.device = spec, load_model, vocab, device
        self.target_tokenizer = target_tokenizer
        self.target_model = target_model
        self.shared: dict[str, Proposer] = {}  # canonical leaf text -> proposer
        self.ngram_models: dict[tuple, NgramModel] = {}

    def build(self, node: Node) -> Proposer:
        build = {NodeKind.LEAF: self._leaf, NodeKind.VOTE: self._vote, NodeKind.SELECT: self._select,
                 NodeKind.FLEET: self._fleet, NodeKind.ADAPTIVE: self._adaptive, NodeKind.STAGED: self._staged}
        return build[node.kind](node)

    def _leaf(self, node: Node) -> Proposer:
        key = str(node)
        if key not in self.shared:
            self.shared[key] = self._new_leaf(node)
        return self.shared[key]

    def _new_leaf(self, node: Node) -> Proposer:
        spec, name, opts = self.spec, node.name, node.options
        label = str(node)
        if name in LOOKUP_NAMES:
            cfg = apply_options(PromptLookupConfig(spec.num_speculative_tokens, num_branches=spec.top_children),
                                opts, name, LOOKUP_ALIASES)
            return PromptLookupProposer(cfg, name=label if opts else "prompt-lookup")
        if name == HEAD_NAME:
            if self.target_model is None:
                raise InvalidRequestError("the draft head reads the target's features and embeddings; "
                                          "build it with the target model (LLM does)")
            cfg = apply_options(HeadDraftConfig(max(spec.num_speculative_tokens, HeadDraftConfig.num_speculative_tokens)),
                                opts, name, HEAD_ALIASES)
            return HeadProposer.for_target(self.target_model, cfg, name=label)
        if name == "suffix":
            return SuffixProposer(apply_options(SuffixConfig(), opts, name, SUFFIX_ALIASES), name=label)
        if name == DATASTORE_NAME:
            return self._datastore(opts, label)
        if name == GRAMMAR_ORIGIN:
            if self.target_tokenizer is None:
                raise InvalidRequestError("the grammar draft needs the target's tokenizer")
            cfg = apply_options(GrammarDraftConfig(), opts, name, {"k": "max_tokens"})
            tokenizer, vocab = self.target_tokenizer, self.vocab
            return ForcedTokensProposer(lambda: compiler_for(tokenizer, vocab), cfg, name=label)
        if name == "ngram":
            cfg = apply_options(replace(spec.ngram, num_speculative_tokens=spec.num_speculative_tokens), opts, name,
                                MODEL_ALIASES)
            cfg.validate()
            return NgramProposer(cfg, self._ngram_model(cfg), name=label)
        if name in registered_names():
            kwargs = {k: _guess(v) for k, v in opts.items()}  # a plugin's factory: types unknown here
            kwargs.setdefault("num_speculative_tokens", spec.num_speculative_tokens)
            return get_factory(name)(**kwargs)
        return self._model_draft(node, label)

    def _model_draft(self, node: Node, label: str) -> Proposer:
        spec = self.spec
        cfg = DraftModelConfig(spec.num_speculative_tokens, spec.top_children, spec.max_nodes,
                               spec.draft_kv_cache_bytes, prefix_caching=spec.prefix_caching)
        # `quant` picks the draft's weight format (runtime/formats/quant.py): it changes acceptance, never the output
        options = {k: v for k, v in node.options.items() if k != "quant"}
        cfg = apply_options(cfg, options, f"draft model {node.name!r}", MODEL_ALIASES)
        quant = node.options.get("quant")
        model = self.load_model(node.name) if quant is None else self.load_model(node.name, quantization=quant)
        # a model of another vocabulary drafts through text
        cross = cross_vocab_draft(model, node.name, label, cfg, self.vocab, self.target_tokenizer, self.load_model,
                                  self.device)
        if cross is not None:
            return cross
        if "head_vocab" not in options:  # a same-vocabulary draft drafts over the common tokens by default
            cfg = replace(cfg, head_vocab=DEFAULT_HEAD_VOCAB)
        if "p_min" not in options:  # and stops a chain where it doubts its next token
            cfg = replace(cfg, p_min=DEFAULT_P_MIN)
        return DraftModelProposer(model, label, cfg, self.vocab, self.device)

    def _datastore(self, opts: dict, label: str) -> Proposer:
        cfg = apply_options(DatastoreConfig(), opts, DATASTORE_NAME, SUFFIX_ALIASES)
        cfg.validate()
        if cfg.path is None:
            if self.target_tokenizer is None:
                raise InvalidRequestError("the datastore draft without a path builds its corpus with the target's "
                                          "tokenizer; give it one (LLM does) or name a built one: datastore[path=DIR]")
            store = stdlib_datastore(self.target_tokenizer, log=logger.info)
        else:
            store = Datastore.load(cfg.path)
            check_tokenizer(store, self.target_tokenizer, cfg.path)
        if self.vocab is not None and store.max_token >= self.vocab:
            raise InvalidRequestError(f"datastore {cfg.path or 'default'!r} holds token ids beyond the target's "
                                      f"vocabulary of {self.vocab}")
        return DatastoreProposer(store, cfg, name=label if opts else DATASTORE_NAME)

    def _ngram_model(self, cfg: NgramConfig) -> NgramModel:
        key = (cfg.order, cfg.min_count, cfg.path, cfg.max_entries)  # one set of tables per setting, shared
        if key not in self.ngram_models:
            self.ngram_models[key] = NgramModel.load(cfg.path, cfg.min_count, cfg.max_entries) if cfg.path \
                else NgramModel(cfg.order, cfg.min_count, cfg.max_entries)
        return self.ngram_models[key]

    def _staged(self, node: Node) -> Proposer:
        inner = node.children[0]
        weightless = (*LOOKUP_NAMES, "ngram", "suffix", DATASTORE_NAME, GRAMMAR_ORIGIN, HEAD_NAME, *registered_names())
        if inner.kind != NodeKind.LEAF or inner.name in weightless:
            raise InvalidRequestError(f"'{inner}+ngram': the n-gram stage speeds up a draft model, so it must "
                                      f"follow a model name, as in qwen-0.5b+ngram")
        # the stage's options set StagedConfig, except the tables' own settings (order, min_count, path, max_entries)
        table_keys = {"order", "min_count", "path", "max_entries"}
        cfg = apply_options(self.spec.staged, {k: v for k, v in node.options.items() if k not in table_keys}, "+ngram")
        tables = apply_options(self.spec.ngram, {k: v for k, v in node.options.items() if k in table_keys}, "+ngram")
        tables.validate()
        # its own DraftModelProposer (the weights are shared): a draft cache must not be drafted from
        # twice in one step, which a vote over `m` and `m+ngram` would otherwise do
        draft = self._model_draft(inner, str(inner))
        if not isinstance(draft, DraftModelProposer):
            raise InvalidRequestError(f"'{node}': the n-gram stage drafts in the target's vocabulary, and "
                                      f"{inner.name!r} has another tokenizer; use {inner.name!r} without +ngram")
        ngram = self._ngram_model(tables)
        staged = StagedProposer(draft, ngram, cfg)
        staged.name = str(node)
        return staged

    def _vote(self, node: Node) -> Proposer:
        children = [self.build(c) for c in node.children]
        seen: set[int] = set()
        for leaf in (leaf for c in children for leaf in leaves(c)):
            if id(leaf) in seen:
                raise InvalidRequestError(f"{node}: a draft appears twice inside one vote; each voter must be distinct")
            seen.add(id(leaf))
        return VoteProposer(children, apply_options(self.spec.vote, node.options, "vote"), name=str(node))

    def _select(self, node: Node) -> Proposer:
        arms = [self.build(c) for c in node.children]
        return SelectorProposer(arms, apply_options(self.spec.selector, node.options, "select"), name=str(node))

    def _fleet(self, node: Node) -> Proposer:
        members = [self.build(c) for c in node.children]
        return FleetProposer(members, apply_options(FleetConfig(), node.options, "fleet"), name=str(node))

    def _adaptive(self, node: Node) -> Proposer:
        inner = self.build(node.children[0])
        cfg = apply_options(self.spec.length, node.options, "+adaptive")
        return LengthController(inner, cfg, initial=self.spec.num_speculative_tokens)
