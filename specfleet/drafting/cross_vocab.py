"""A draft model of another family (another tokenizer) as a proposer of the target's tokens.

The draft runs in its own vocabulary on the text of the request (drafting/text_align.py does the text
work); each step, per request:

1. the target's committed tokens are decoded to text (incrementally) and the draft's token sequence
   is brought in sync with that text, after the ids the draft's tokenizer starts a text with (Gemma's
   BOS, without which it reads text badly; nothing for SmolLM2);
2. the draft cache is rolled back to the longest common prefix of the tokens it holds and that
   sequence, so only new draft tokens are fed (a drafted run that the target accepted re-tokenizes,
   as a rule, to the very tokens the draft fed, whose KV is then kept);
3. a `DraftModelProposer` over the draft model drafts a chain (or a best-first tree) of draft tokens
   from that sequence, always greedily;
4. every root-to-leaf path's text is re-tokenized by the target's tokenizer against the committed
   tail (`target_continuation`), and the target-token sequences are merged into one DraftTree.

Verification stays in the target's vocabulary, so greedy output is the target's token for token.

Sampling: the drafted tokens are a deterministic function of the committed tokens, so the tree
carries no draft probabilities and verification treats every node as a point mass q = 1 on its
token, exactly as for prompt lookup. Point-mass rejection sampling is lossless for any proposal that
does not depend on the verifier's own random draws (core/verify.py: a node x is kept with probability
p(x), otherwise the next token comes from p with x removed, so P(token = y) = p(y)). A point mass is
also the better proposal when q only resembles p: a token kept with probability p(x) is best chosen as
the draft's argmax, while a draw from q would be kept with probability sum_x q(x) p(x), which is
lower; and q, defined over another vocabulary, has no value at a target token anyway.

Grammar: any model name works as a draft of any target. When the target's tokenizer is known (LLM
hands it to the factory), `cross_vocab_draft` compares the draft's tokenizer with it and wraps a
draft of another vocabulary in this proposer, so `smollm2-135m-instruct` drafts for a Qwen target
alone, inside vote/select/fleet and under +adaptive. The n-gram stage (`MODEL+ngram`) drafts in the
target's vocabulary and refuses such a draft.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from specfleet.core.model_ref import ModelRef
from specfleet.errors import InvalidRequestError
from specfleet.sampling_params import SamplingParams
from specfleet.drafting.draft_model import DraftModelConfig, DraftModelProposer
from specfleet.core.proposer import Feedback
from specfleet.drafting.prompt_lookup import tree_from_sequences
from specfleet.drafting.text_align import (CommittedText, DraftTokens, TextCodec, continuation_text, same_vocabulary,
                                       target_continuation)
from specfleet.core.tree import DraftTree

GREEDY = SamplingParams(temperature=0)
CONTEXT_TOKENS = 4  # draft tokens decoded before the drafted ones, so their text starts right


@dataclass
class _DraftView:
    """A request as the draft model sees it: the draft tokenization of its committed text."""

    request_id: str
    all_token_ids: list[int]

    @property
    def params(self) -> SamplingParams:
        return GREEDY  # the draft always drafts its argmax (see the module doc)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass
class _State:
    committed: CommittedText
    draft: DraftTokens
    held: list[int] = field(default_factory=list)  # the draft tokens whose KV the draft cache holds


class CrossVocabProposer:
    def __init__(self, draft: DraftModelProposer, draft_tokenizer, target_tokenizer, name: str | None = None,
                 max_tokens_per_draft_token: float = 2.0):
        self.inner = draft
        self.name = name or draft.name
        self.model = draft.model  # model_size counts it: the fleet treats this as an expensive draft
        self.config = draft.config  # shared with the inner draft
        self.draft_codec = TextCodec(draft_tokenizer, f"tokenizer of draft {self.name!r}")
        self.target_codec = TextCodec(target_tokenizer, "target's tokenizer")
        self.start_ids = self.draft_codec.start_ids()  # before the text's draft tokens (a BOS)
        self.max_tokens_per_draft_token = max_tokens_per_draft_token
        self._states: dict[str, _State] = {}

    @property
    def blocks(self):
        return self.inner.blocks

    @property
    def num_speculative_tokens(self) -> int:
        return self.inner.num_speculative_tokens

    def set_num_speculative_tokens(self, n: int) -> None:
        self.inner.set_num_speculative_tokens(n)

    # -- protocol --------------------------------------------------------------------------------
    def propose(self, requests: list) -> dict[str, DraftTree]:
        views = {r.request_id: self._view(r) for r in requests}
        usable = [v for v in views.values() if v.all_token_ids]
        if not usable:
            return {}
        draft_trees = self.inner.propose(usable)
        chain = self.config.top_children == 1
        trees: dict[str, DraftTree] = {}
        for r in requests:
            rid, view = r.request_id, views[r.request_id]
            tree = draft_trees.get(rid)
            state = self._states[rid]
            if tree is None:  # not drafted (no cache room): the cache holds a prefix of the view at most
                held = self.inner.num_cached_tokens(rid)
                state.held = view.all_token_ids[:held]
                continue
            state.held = view.all_token_ids + (tree.token_ids[:-1] if chain else [])  # what the inner keeps
            converted = self._to_target(r.all_token_ids, state, view.all_token_ids, tree)
            if len(converted):
                trees[rid] = converted
        return trees

    def observe(self, feedback: list[Feedback]) -> None:
        pass  # the next propose re-synchronizes the draft cache with the committed text

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)
        self._states.pop(request_id, None)

    def free_kv(self, request_id: str) -> None:
        self.inner.free_kv(request_id)
        state = self._states.get(request_id)
        if state is not None:
            state.held = []

    def prepare(self, requests: list) -> None:
        """Catch the draft cache up on the requests' committed text ahead of a switch to this draft."""
        views = [self._view(r) for r in requests]
        self.inner.prepare([v for v in views if v.all_token_ids])
        for v in views:
            held = self.inner.num_cached_tokens(v.request_id)
            self._states[v.request_id].held = v.all_token_ids[:held]

    # -- internals -------------------------------------------------------------------------------
    def _view(self, req) -> _DraftView:
        """Bring the request's text and draft tokens up to date and roll the draft cache back to the
        longest common prefix of what it holds and the new draft tokens."""
        rid = req.request_id
        state = self._states.get(rid)
        if state is None:
            state = self._states[rid] = _State(CommittedText(self.target_codec), DraftTokens(self.draft_codec))
        state.committed.update(req.all_token_ids)
        seq = self.start_ids + state.draft.sync(state.committed.text)
        cached = self.inner.num_cached_tokens(rid)
        if cached:
            same = 0
            limit = min(len(state.held), len(seq), cached)
            while same < limit and state.held[same] == seq[same]:
                same += 1
            self.inner.rollback(rid, same)
            state.held = state.held[:same]
        return _DraftView(rid, seq)

    def _to_target(self, target_ids: list[int], state: _State, draft_ids: list[int], tree: DraftTree) -> DraftTree:
        """The target-token tree for a draft-token tree: each leaf's path as text, re-tokenized."""
        context = draft_ids[-CONTEXT_TOKENS:]
        cap = max(1, int(self.config.num_speculative_tokens * self.max_tokens_per_draft_token))
        seqs = []
        for leaf in tree.leaves():
            drafted = [tree.token_ids[j] for j in tree.path_to(leaf)]
            text = continuation_text(self.draft_codec, context, drafted)
            seq = target_continuation(self.target_codec, target_ids, state.committed.num_clean, text)[:cap]
            if seq:
                seqs.append(seq)
        merged = tree_from_sequences(seqs, self.name)
        return merged.truncated(self.config.max_nodes) if not tree.is_chain else merged


@functools.lru_cache(maxsize=8)
def load_tokenizer(name: str):
    """The tokenizer of a registered model name or checkpoint path (`MODEL@N` names its model), or
    None when the checkpoint has none."""
    from transformers import AutoTokenizer

    from specfleet.registry import resolve_model
    from specfleet.runtime.loading.checkpoint import is_gguf_file, tokenizer_folder

    path = resolve_model(ModelRef.parse(name).name)
    folder = tokenizer_folder(path) if is_gguf_file(path) else path
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, TypeError):
        return None


def cross_vocab_draft(model, name: str, label: str, config: DraftModelConfig, target_vocab_size: int | None,
                      target_tokenizer, load_model, device: torch.device | str = "cpu") -> CrossVocabProposer | None:
    """A CrossVocabProposer when the draft model `name` speaks another vocabulary than the target; None
    when it shares the target's (or the target's tokenizer is unknown: then nothing can be compared).
    `load_model` may offer `tokenizer(name)` (a test's loader does); otherwise the tokenizer is found
    through the model registry."""
    if target_tokenizer is None:
        return None
    getter = getattr(load_model, "tokenizer", None)
    draft_tokenizer = getter(name) if getter is not None else load_tokenizer(name)
    if draft_tokenizer is None:
        if target_vocab_size is not None and model.config.vocab_size != target_vocab_size:
            raise InvalidRequestError(
                f"draft {name!r} has a vocabulary of {model.config.vocab_size} tokens and the target "
                f"{target_vocab_size}, and the draft has no tokenizer to translate its tokens through text; "
                f"use a checkpoint with its tokenizer files (tokenizer.json) or a GGUF file")
        return None
    draft_codec = TextCodec(draft_tokenizer, f"tokenizer of draft {name!r}")
    if same_vocabulary(draft_codec, TextCodec(target_tokenizer, "target's tokenizer")):
        return None
    inner = DraftModelProposer(model, label, config, None, device)
    return CrossVocabProposer(inner, draft_tokenizer, target_tokenizer, name=label)
