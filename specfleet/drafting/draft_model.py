"""A small language model as a proposer, on the same runtime as the target.

The draft has its own paged KV cache. Before drafting it catches up on the request's committed
tokens it has not seen (the target's token from the last step and any accepted draft token it never
fed; the whole prompt the first time) in one batched forward, then drafts. A chain keeps the KV of
the draft tokens it fed; the next draft first truncates its cache to the longest common prefix of the
tokens it holds and the request's committed tokens (`sync`), so rollback needs no word from the
verifier about what was accepted, and an accepted prefix is not recomputed: after a step that kept
all k drafted tokens the catch-up is 2 tokens, not k + 1. Trees (whose nodes do not lie on one path)
are truncated back to the committed tokens right after drafting.

Two shapes:
- chain (`top_children` = 1): k batched single-token steps. Greedy requests take the argmax; sampled
  requests draw from the draft's distribution under the request's temperature/top-k/top-p, and
  the tree records those rows so verification can use rejection sampling.
- tree (`top_children` > 1): levels of the best-first tree in the spirit of the staged-speculation
  paper: each level expands the `top_children` most likely children of the `top_children` best
  frontier nodes (by cumulative draft log-probability), one batched forward per level with a tree
  mask; finally the `max_nodes` best nodes overall are kept. Because a child's cumulative
  probability never exceeds its parent's, the kept set is closed under ancestors. The children are
  deterministic choices, so they are verified as point masses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from specfleet.errors import InvalidRequestError
from specfleet.runtime.kv.cache import KVCache, num_blocks_for_budget
from specfleet.runtime.model.decoder import DecoderLM
from specfleet.core.proposer import Feedback, RequestView
from specfleet.core.tree import DraftTree
from specfleet.core.verify import draw
from specfleet.runtime.kv.blocks import BlockManager
from specfleet.runtime.step.runner import ForwardItem, ModelRunner
from specfleet.runtime.sample.sampling import GeneratorStore, target_probs


@dataclass
class DraftModelConfig:
    num_speculative_tokens: int = 4  # chain length, or the tree's maximum depth
    top_children: int = 1  # 1 = chain
    max_nodes: int = 16  # tree node budget (ignored for chains)
    kv_cache_bytes: int = 512 << 20
    block_size: int = 16
    # draft only among the first `head_vocab` token ids: a smaller head matmul per draft token. Lossless
    # (the target verifies every token); rarer tokens are simply never proposed. None = full vocabulary.
    head_vocab: int | None = None
    # map a request's longest cached prefix into the draft cache, as the target's cache does
    # (runtime/kv/blocks.py): a chat's next turn catches the draft up on only what is new
    prefix_caching: bool = True
    # a chain stops early once the draft's own probability of its next token falls below p_min (its
    # first token is always drafted): a token the draft itself doubts is likely rejected, and drafting it
    # costs a draft forward. Lossless at any value (the target verifies what was drafted); 0 = off.
    p_min: float = 0.0

    def validate(self) -> None:
        if self.num_speculative_tokens < 1 or self.top_children < 1 or self.max_nodes < 1 or \
                (self.head_vocab is not None and self.head_vocab < self.top_children) or \
                not 0.0 <= self.p_min <= 1.0:
            raise InvalidRequestError(f"invalid draft-model settings {self}")

    @property
    def draft_slots(self) -> int:
        """Draft-cache slots one request needs while drafting (every level of the beam is fed)."""
        return self.num_speculative_tokens * self.top_children


class DraftModelProposer:
    def __init__(self, model: DecoderLM, name: str, config: DraftModelConfig | None = None,
                 target_vocab_size: int | None = None, device: torch.device | str = "cpu"):
        self.config = config or DraftModelConfig()
        self.config.validate()
        if target_vocab_size is not None and model.config.vocab_size > target_vocab_size:
            raise InvalidRequestError(
                f"draft {name!r} has a vocabulary of {model.config.vocab_size} tokens but the target has "
                f"{target_vocab_size}: a draft must share the target's tokenizer")
        self.name = name
        self.model = model
        self.device = torch.device(device)
        dtype = next(model.parameters()).dtype
        cc = self.config
        num_blocks = num_blocks_for_budget(model.config, dtype, cc.kv_cache_bytes, cc.block_size)
        self.blocks = BlockManager(num_blocks, cc.block_size, cc.prefix_caching)
        self._hashes: dict[str, list[bytes]] = {}  # request id -> its block hashes (prefix cache memo)
        self.vocab_size = model.config.vocab_size
        self.runner = ModelRunner(model, KVCache.allocate(model.config, num_blocks, cc.block_size, dtype, self.device),
                                  self.device, cc.head_vocab)
        self.generators = GeneratorStore(self.device, salt=17)
        # request id -> (committed tokens its draft cache held when it last drafted or prepared, the draft
        # tokens fed after them): the cache holds all_token_ids[:base] + fed (committed tokens never change)
        self._cached: dict[str, tuple[int, list[int]]] = {}

    # -- protocol --------------------------------------------------------------------------------
    def propose(self, requests: list[RequestView]) -> dict[str, DraftTree]:
        seen = {r.request_id: self.sync(r) for r in requests}  # valid tokens already in the draft cache
        ready = [r for r in requests if self._reserve_catch_up(r)]
        if not ready:
            return {}
        items = []
        for r in ready:
            have = seen[r.request_id]
            toks = r.all_token_ids
            items.append(ForwardItem(r.request_id, toks[have:], have, [len(toks) - have - 1]))
        logits = self.forward(items)  # [len(ready), vocab]
        chain = self.config.top_children == 1
        trees: dict[str, DraftTree] = {}
        try:
            if chain:
                trees = self._draft_chains(ready, logits)
            else:
                trees = {r.request_id: self._draft_tree(r, logits[i]) for i, r in enumerate(ready)}
            return trees
        finally:
            for r in ready:  # keep a chain's fed draft tokens (all but the last); drop a tree's nodes
                tree = trees.get(r.request_id)
                fed = tree.token_ids[:-1] if (chain and tree is not None) else []
                self.blocks.truncate(r.request_id, r.num_tokens + len(fed))
                self._cached[r.request_id] = (r.num_tokens, list(fed))
                self._register(r, r.num_tokens - 1)

    def observe(self, feedback: list[Feedback]) -> None:
        pass  # the cache was rolled back to the committed prefix right after drafting

    def release(self, request_id: str) -> None:
        self.blocks.free(request_id)
        self._cached.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self.generators.pop(request_id)

    # -- capabilities (core/proposer.py) and the narrow API a staged draft uses -------------------
    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    def set_num_speculative_tokens(self, n: int) -> None:
        self.config.num_speculative_tokens = n  # in place: a cross-vocabulary wrapper shares this config

    def forward(self, items: list[ForwardItem]) -> torch.Tensor:
        """One draft-model forward over the draft cache (items take their block tables from it)."""
        return self.runner.execute(items, self.blocks)

    def num_cached_tokens(self, request_id: str) -> int:
        return self.blocks.num_tokens(request_id)

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        """Room for `num_tokens` more tokens in the draft cache, or False when it is full."""
        return self.blocks.reserve(request_id, num_tokens)

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Keep at most the first `num_tokens` cached tokens of the request."""
        if self.blocks.num_tokens(request_id) > num_tokens:
            self.blocks.truncate(request_id, num_tokens)

    def commit_path(self, request_id: str, base: int, path: list[int]) -> None:
        """Keep an accepted tree path's KV (node j at layout base + j), drop the rest."""
        self.runner.commit_path(self.blocks, request_id, base, path)

    def free_kv(self, request_id: str) -> None:
        """Drop the request's draft KV but keep its generator (a selector switched it away)."""
        self.blocks.free(request_id)
        self._cached.pop(request_id, None)
        self._hashes.pop(request_id, None)

    def sync(self, req) -> int:
        """Truncate the request's draft cache to the longest common prefix of the tokens it holds and
        the request's tokens, leaving at least the last token to feed (its logits root the next draft);
        returns the number of valid cached tokens. Only the fed draft tokens need comparing."""
        rid = req.request_id
        if not self.blocks.has(rid):
            return self._map_cached_prefix(req)
        held = self.blocks.num_tokens(rid)
        base, fed = self._cached.get(rid, (held, []))
        toks = req.all_token_ids
        same = min(base, held)
        for tok in fed[:held - same]:
            if same >= len(toks) or toks[same] != tok:
                break
            same += 1
        same = min(same, len(toks) - 1)
        if same < held:
            same = self.blocks.truncate(rid, same)
        return same

    def _map_cached_prefix(self, req) -> int:
        """A request new to the draft cache starts from its longest cached prefix; returns its length."""
        cached = self.blocks.cached_prefix(req.all_token_ids, self._hashes.setdefault(req.request_id, []))
        if not cached or not self.blocks.can_allocate(0, cached):
            return 0
        self.blocks.allocate(req.request_id, 0, cached)
        n = len(cached) * self.blocks.block_size
        self.blocks.count_lookup(len(req.all_token_ids), n)
        self._cached[req.request_id] = (n, [])
        return n

    def _register(self, req, num_tokens: int) -> None:
        """Offer the draft cache's full blocks of the request's committed tokens below `num_tokens` (never
        its last token: a later sync may cut back to it) to the prefix cache."""
        self.blocks.register(req.request_id, req.all_token_ids, num_tokens,
                             self._hashes.setdefault(req.request_id, []))

    def prepare(self, requests: list) -> None:
        """Catch the draft cache up on the requests' committed tokens (all but the last one, the next
        draft's root) ahead of a switch to this draft, so its first draft needs no long catch-up."""
        items, prepared = [], []
        for r in requests:
            rid, upto = r.request_id, r.num_tokens - 1
            have = self.sync(r)  # drops stale draft tokens
            if upto <= have or r.num_tokens + self.config.draft_slots >= self.model.config.max_position_embeddings:
                continue
            if not self.reserve(rid, upto - have):
                continue
            items.append(ForwardItem(rid, r.all_token_ids[have:upto], have, [upto - have - 1]))
            self._cached[rid] = (upto, [])
            prepared.append(r)
        if items:
            self.forward(items)
            for r in prepared:
                self._register(r, r.num_tokens - 1)

    # -- internals -------------------------------------------------------------------------------
    def _reserve_catch_up(self, req: RequestView) -> bool:
        """Reserve slots for the catch-up and the whole draft at once (so a batch can never run out
        halfway); skip the request when the draft cache is full."""
        if req.num_tokens + self.config.draft_slots >= self.model.config.max_position_embeddings:
            return False
        rid = req.request_id
        catch_up = req.num_tokens - self.num_cached_tokens(rid)
        return self.reserve(rid, catch_up + self.config.draft_slots)

    def _draft_chains(self, reqs: list[RequestView], logits: torch.Tensor) -> dict[str, DraftTree]:
        k = self.config.num_speculative_tokens
        p_min = self.config.p_min
        tokens: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        active = list(range(len(reqs)))  # requests still drafting; row j of `logits` is request active[j]
        for step in range(k):
            argmax = logits.argmax(-1).tolist()  # one host transfer per draft step for every greedy request
            # the draft's probability of its greedy token, where early stopping may use it
            top_p = torch.softmax(logits.float(), -1).max(-1).values.tolist() if p_min > 0 and step < k - 1 else None
            stay = []
            for j, i in enumerate(active):
                r = reqs[i]
                if r.params.is_greedy:
                    tokens[i].append(argmax[j])
                    p = top_p[j] if top_p is not None else 1.0
                else:
                    q = target_probs(logits[j:j + 1], r.params)[0]
                    tok = draw(q, self.generators.get(r))
                    tokens[i].append(tok)
                    # verification needs q over the whole vocabulary; tokens past a cut head have q = 0
                    probs[i].append(torch.nn.functional.pad(q, (0, self.vocab_size - q.shape[0])))
                    p = float(q[tok]) if top_p is not None else 1.0
                if p >= p_min:
                    stay.append(i)
            active = stay
            if step == k - 1 or not active:
                break
            # draft token `step` sits right after the committed tokens and the earlier draft tokens
            items = [ForwardItem(reqs[i].request_id, [tokens[i][-1]], reqs[i].num_tokens + step, [0]) for i in active]
            logits = self.forward(items)
        return {r.request_id: DraftTree.chain(tokens[i], self.name, torch.stack(probs[i]) if probs[i] else None)
                for i, r in enumerate(reqs)}

    def _draft_tree(self, req: RequestView, root_logits: torch.Tensor) -> DraftTree:
        cfg = self.config
        rid = req.request_id
        base = req.num_tokens  # layout index of tree node 0 in the draft cache
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []  # cumulative log-probability
        paths: list[list[int]] = []
        frontier = [(-1, 0.0)]
        logps = torch.log_softmax(root_logits.float(), -1)[None]  # [frontier, vocab]
        for depth in range(1, cfg.num_speculative_tokens + 1):
            cands = []
            top = torch.topk(logps, cfg.top_children, dim=-1)
            # values and ids of the whole level in one host transfer (float64 holds both exactly)
            host = torch.cat([top.values.double(), top.indices.double()], dim=1).tolist()
            for (node, score), row in zip(frontier, host):
                vals, ids = row[:cfg.top_children], row[cfg.top_children:]
                cands.extend((score + v, node, int(t)) for v, t in zip(vals, ids))
            cands.sort(key=lambda c: -c[0])
            level = cands[:cfg.top_children]  # the beam of this level
            first_new = len(tokens)
            for score, parent, tok in level:
                tokens.append(tok)
                parents.append(parent)
                scores.append(score)
                paths.append((paths[parent] if parent >= 0 else []) + [len(tokens) - 1])
            if depth == cfg.num_speculative_tokens:
                break
            n_new = len(tokens) - first_new
            ctx = base + first_new
            mask = np.zeros((n_new, ctx + n_new), dtype=bool)  # host data, sent with the step's one copy
            mask[:, :base] = True
            for i in range(n_new):
                for a in paths[first_new + i]:
                    mask[i, (base + a) if a < first_new else (ctx + i)] = True
            # a depth-d node is the d-th token after the committed ones: position base + d - 1, as in a chain
            positions = [base + len(paths[first_new + i]) - 1 for i in range(n_new)]
            out = self.forward([ForwardItem(rid, tokens[first_new:], ctx, list(range(n_new)), positions, mask)])
            frontier = [(first_new + i, scores[first_new + i]) for i in range(n_new)]
            logps = torch.log_softmax(out.float(), -1)
        # keep the best max_nodes nodes; shallower first on ties so ancestors always survive
        order = sorted(range(len(tokens)), key=lambda j: (-scores[j], len(paths[j]), j))[:cfg.max_nodes]
        keep = sorted(order, key=lambda j: (len(paths[j]), j))  # parents before children
        new_index = {old: new for new, old in enumerate(keep)}
        return DraftTree([tokens[j] for j in keep],
                         [new_index[parents[j]] if parents[j] >= 0 else -1 for j in keep],
                         [self.name] * len(keep))
