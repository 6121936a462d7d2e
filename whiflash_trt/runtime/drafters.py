"""The drafters as the round sees them (Proposer), and the two learned ones: catch up (KV-only prefill of the backlog)
and propose a draft tree.

Capabilities are data (name, scratch slots, tokens per round); the engine keeps them in a registry dict. Neither
mutates the Sequence: both return the frontier they reached and the commit phase records it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import torch

from whiflash_trt import kernels
from whiflash_trt.config import DFLASH, EAGLE3, DFlashTreeConfig, SpecConfig, TreeConfig
from whiflash_trt.errors import WhiflashError
from whiflash_trt.models.contracts import DFlash, Eagle3, Segment, Target, feature_columns
from whiflash_trt.models.layers import FrozenLinear
from whiflash_trt.runtime.kv_cache import KVPool
from whiflash_trt.runtime.sequence import Sequence
from whiflash_trt.runtime.target_runner import joined
from whiflash_trt.runtime.tree_defaults import default_nodes
from whiflash_trt.spec.ddtree import prefix_tree, ranks_needed
from whiflash_trt.spec.tree import DraftTree, select_nodes


@dataclass(frozen=True)
class Proposal:
    tree: DraftTree
    frontier: int                  # the drafter's frontier after drafting
    expected: float | None = None  # accepted drafts the drafter expects of this tree (a free drafter's offer)


class Proposer:
    """A drafter as the round sees it. Each has a name, for_spec(spec) (a copy shaped by the request's tree
    settings), max_tree_tokens() (nodes a round verifies), scratch_slots() (pool slots its draft steps use),
    catch_up(seq, end=None, start=None) -> frontier (bring its state up to the committed tokens, from its frontier or
    `start`, up to `end` at most), propose(seq), and propose_many(seqs) for proposers of one group_key(). A `free`
    drafter runs no model: it catches up and proposes every round before the route, which weighs its offer
    (Proposal.expected); a learned one reads the target's features and is caught up only when it drafts (lazy)."""
    name: ClassVar[str]
    free: ClassVar[bool] = False

    def group_key(self) -> tuple:
        """Proposers with equal keys can propose_many together."""
        return (self.name,)

    def propose_many(self, seqs: list[Sequence]) -> list[Proposal]:
        return [self.propose(seq) for seq in seqs]


class LearnedProposer(Proposer):
    """A drafter model bound to its KV pool and the target, with its features' columns in the union capture of every
    verify."""

    def __init__(self, model: Eagle3 | DFlash, pool: KVPool, target: Target, union: tuple[int, ...]) -> None:
        self.model, self.pool, self.target = model, pool, target
        # a tree's node count when the request names none (the pool's dtype is the target's)
        self.default_nodes = default_nodes(self.name, pool.k.device, pool.k.dtype, target.native)
        self.cols = feature_columns(model.config.capture_layers, union, target.config.hidden_size).to(pool.k.device)
        # how own_features selects them: not at all (both drafters read the same layers), a slice (a view) where they
        # are one run, else the index
        first, count = int(self.cols[0]), self.cols.numel()
        self._select: torch.Tensor | slice | None = self.cols
        if torch.equal(self.cols.cpu(), torch.arange(first, first + count)):
            self._select = None if count == len(union) * target.config.hidden_size else slice(first, first + count)

    def own_features(self, captured: torch.Tensor) -> torch.Tensor:
        """This drafter's columns (self.cols) of captured target features [T, union features]."""
        return captured if self._select is None else captured[:, self._select]


class Eagle3Proposer(LearnedProposer):
    name = EAGLE3
    model: Eagle3
    tree = TreeConfig()      # the request's shape: see with_tree

    def __init__(self, model: Eagle3, pool: KVPool, target: Target, union: tuple[int, ...]) -> None:
        super().__init__(model, pool, target, union)
        # draft id -> target id as a list, read once: a lookup per drafted token instead of torch ops every depth
        self.target_ids: list[int] = model.to_target_ids(torch.arange(model.config.draft_vocab_size)).tolist()

    def group_key(self) -> tuple:
        return (self.name, self.tree)

    def with_tree(self, tree: TreeConfig) -> "Eagle3Proposer":
        shaped = copy.copy(self)
        shaped.tree = tree
        return shaped

    def for_spec(self, spec: SpecConfig) -> "Eagle3Proposer":
        return self.with_tree(spec.tree)

    def scratch_slots(self) -> int:
        return (self.tree.depth - 1) * self.tree.top_k

    def max_tree_tokens(self) -> int:
        return self.tree.total_tokens or self.default_nodes

    @torch.inference_mode()
    def catch_up(self, seq: Sequence, end: int | None = None, start: int | None = None) -> int:
        """KV-only prefill of positions [frontier, N-1) (or [start, end) within them): pairs (F_t, x_{t+1}) with
        x_{t+1} committed. Position N-1 (paired with the pending bonus) is written by the full root forward when
        drafting."""
        start = seq.frontiers.get(self.name, 0) if start is None else start
        end = seq.num_committed - 1 if end is None else min(end, seq.num_committed - 1)
        if end <= start:
            return max(start, 0)
        dev = self.pool.k.device
        feats = self.own_features(seq.features_between(start, end))
        embeds = self.target.embed(torch.tensor(seq.tokens[start + 1:end + 1], device=dev))
        self.model.write_kv_only(feats, embeds, torch.arange(start, end, device=dev), self.pool.k, self.pool.v,
                                 seq.slots(start, end).to(dev))
        return end

    def propose(self, seq: Sequence) -> Proposal:
        return self.propose_many([seq])[0]

    @torch.inference_mode()
    def propose_many(self, seqs: list[Sequence]) -> list[Proposal]:
        """EAGLE-2 style dynamic trees, one per sequence, grown together: every depth is one drafter forward over
        all sequences (each row sees only its own sequence's keys)."""
        k, dev, scratch = self.tree.top_k, self.pool.k.device, self.scratch_slots()
        model, embed = self.model, self.target.embed
        searches = [_TreeSearch(seq, seq.slots(0, seq.num_committed + scratch).to(dev)) for seq in seqs]
        # Root: the full layer at position N-1 on (fc(F_{N-1}), b); it also writes that position's K/V.
        feats = self.own_features(joined([s.seq.features_between(s.n - 1, s.n) for s in searches]))
        h, logprobs = model.draft_step(
            embed(torch.tensor([s.seq.pending for s in searches], device=dev)), model.fc(feats),
            torch.tensor([s.n - 1 for s in searches], device=dev), self.pool.k, self.pool.v,
            joined([s.read[s.n - 1:s.n] for s in searches]), [s.root_segment() for s in searches])
        values, indices = top_k(logprobs, k)
        ids, values = self.to_target(indices), values.tolist()
        for i, s in enumerate(searches):
            s.start(ids[i], values[i], h[i:i + 1].expand(k, -1))
        for step in range(1, self.tree.depth):
            steps = [s.step_inputs(step, k) for s in searches]   # (tokens, positions, write, segment)
            out, logprobs = model.draft_step(
                embed(torch.tensor([t for tokens, *_ in steps for t in tokens], device=dev)),
                joined([s.level_hidden for s in searches]), joined([p for _, p, _, _ in steps]), self.pool.k,
                self.pool.v, joined([w for _, _, w, _ in steps]), [seg for *_, seg in steps])
            values, indices = top_k(logprobs, k)   # [rows of every sequence, k]
            ids, values = self.to_target(indices), values.tolist()
            first = 0
            for s in searches:
                rows = slice(first, first + len(s.level))
                s.grow(step, values[rows], ids[rows], out[rows], k)
                first = rows.stop
        nodes = self.max_tree_tokens()
        return [Proposal(s.tree(nodes, self.tree.min_prob), frontier=s.n) for s in searches]

    def to_target(self, draft_ids: torch.Tensor) -> list[list[int]]:
        table = self.target_ids
        return [[table[i] for i in row] for row in draft_ids.tolist()]


class _TreeSearch:
    """One sequence's EAGLE-2 search: candidate nodes (excluding the root) with token, parent (candidate index or
    -1 = the root), depth and cumulative log-probability; `level` are the nodes the next depth expands. Scores and
    tokens are Python lists (a depth adds k * k of them): tensor ops cost more than the arithmetic here."""

    def __init__(self, seq: Sequence, read: torch.Tensor) -> None:
        self.seq, self.read, self.n = seq, read, seq.num_committed
        self.ancestors: dict[int, list[int]] = {-1: []}    # candidate -> read indices of expanded ancestors
        self.context = torch.arange(self.n, device=read.device)

    def root_segment(self) -> Segment:
        """The root row at position N-1 sees the context (its own key included)."""
        return Segment(self.read[:self.n], lengths=torch.full((1,), self.n, device=self.read.device))

    def start(self, tokens: list[int], scores: list[float], hidden: torch.Tensor) -> None:
        k = len(tokens)
        self.tokens, self.parents, self.depths, self.scores = tokens, [-1] * k, [1] * k, scores
        self.level, self.level_hidden = list(range(k)), hidden   # nodes to expand and their parents' hidden

    def step_inputs(self, step: int, k: int):
        """Depth `step`'s rows: the level's tokens at position N - 1 + step, written to scratch slots, each seeing the
        context and its expanded ancestors (`step` of them, itself included)."""
        n, width, dev = self.n, len(self.level), self.read.device
        base = n + (step - 1) * k
        for j, node in enumerate(self.level):
            self.ancestors[node] = self.ancestors[self.parents[node]] + [base + j]
        own = torch.tensor([self.ancestors[node] for node in self.level], device=dev)   # [width, step]
        order = torch.cat([self.context.expand(width, n), own], dim=1)
        return ([self.tokens[i] for i in self.level], torch.full((width,), n - 1 + step, device=dev),
                self.read[base:base + width], Segment(self.read, order=order))

    def grow(self, step: int, child_values: list[list[float]], child_ids: list[list[int]], out: torch.Tensor,
             k: int) -> None:
        """Add the level's top-k children; the next level is the k best of them (ties: the earlier candidate)."""
        first = len(self.tokens)
        for j, node in enumerate(self.level):
            self.tokens += child_ids[j]
            self.parents += [node] * k
            self.depths += [step + 1] * k
            self.scores += [self.scores[node] + v for v in child_values[j]]
        best = sorted(range(len(self.tokens) - first), key=lambda c: -self.scores[first + c])[:k]
        self.level = [first + b for b in best]
        self.level_hidden = out[[b // k for b in best]]

    def tree(self, total_tokens: int, min_prob: float) -> DraftTree:
        chosen = select_nodes(self.scores, self.depths, total_tokens - 1, min_prob)
        index = {c: i + 1 for i, c in enumerate(chosen)}
        return DraftTree([self.seq.pending] + [self.tokens[c] for c in chosen],
                         [-1] + [index.get(self.parents[c], 0) for c in chosen],
                         [0] + [self.depths[c] for c in chosen])


class DFlashProposer(LearnedProposer):
    name = DFLASH
    model: DFlash
    tree = DFlashTreeConfig()   # the request's shape: a DDTree or the block's chain (see with_tree)

    def __init__(self, model: DFlash, pool: KVPool, target: Target, union: tuple[int, ...]) -> None:
        super().__init__(model, pool, target, union)
        # the block's mask-token rows (blocks_embeddings): the drafter's own embedding, or the target's row of the mask
        # token
        with torch.no_grad():
            mask_e = (model.mask_embedding.to(target.dtype)[None] if model.mask_embedding is not None
                      else target.embed(torch.tensor([model.config.mask_token_id], device=pool.k.device)))
        self._mask_rows = mask_e.expand(self.draft_block_len - 1, -1)
        # A drafter trained over part of the vocabulary drafts from it alone: the target lm_head's rows of those ids,
        # packed once, in int8 on the kernels (SmolLM2: 8192 of 49152 rows, the head's read per round 11x smaller).
        # `vocab` maps a column of `head`'s logits to its target id. A target without its head as a tensor (a graph)
        # drafts over all ids.
        ids, weight = model.draft_vocab(), target.head_weight()
        self.vocab: list[int] | None = None
        self.head: FrozenLinear | None = None
        if ids is not None and weight is not None:
            self.vocab = ids.tolist()
            self.head = FrozenLinear(weight.detach()[ids.to(weight.device)].contiguous(), int8=True)

    @property
    def draft_block_len(self) -> int:
        return self.model.config.draft_block_len

    def with_tree(self, tree: DFlashTreeConfig) -> "DFlashProposer":
        """A copy drafting `tree`; a budget this drafter's block cannot fill is an error."""
        most = max_prefix_tree_nodes(self.draft_block_len - 1, tree.top_k)
        if tree.total_tokens is not None and tree.total_tokens > most:
            raise WhiflashError(f"a DFlash tree of {tree.total_tokens} nodes does not fit this drafter: "
                                f"{self.draft_block_len - 1} drafts per block with top_k {tree.top_k} hold "
                                f"at most {most} nodes, root included")
        shaped = copy.copy(self)
        shaped.tree = tree
        return shaped

    def for_spec(self, spec: SpecConfig) -> "DFlashProposer":
        return self.with_tree(spec.dflash_tree)

    def scratch_slots(self) -> int:
        return self.draft_block_len   # the block's K/V (on the kernel), at the slots past the committed ones

    def max_tree_tokens(self) -> int:
        if self.tree.total_tokens is not None:
            return self.tree.total_tokens
        fits = max_prefix_tree_nodes(self.draft_block_len - 1, self.tree.top_k)
        return int(min(self.default_nodes, fits))

    @torch.inference_mode()
    def catch_up(self, seq: Sequence, end: int | None = None, start: int | None = None) -> int:
        """KV-only prefill of context positions [frontier, N) (or [start, end) within them) from their target
        features."""
        start = seq.frontiers.get(self.name, 0) if start is None else start
        end = seq.num_committed if end is None else min(end, seq.num_committed)
        if end <= start:
            return start
        dev = self.pool.k.device
        self.model.write_kv_only(self.own_features(seq.features_between(start, end)),
                                 torch.arange(start, end, device=dev), self.pool.k, self.pool.v,
                                 seq.slots(start, end).to(dev))
        return end

    def block_embeddings(self, root: int) -> torch.Tensor:
        """[B, H]: the root token's embedding, then the mask token's (target row, or the drafter's own)."""
        return self.blocks_embeddings([root])

    def blocks_embeddings(self, roots: list[int]) -> torch.Tensor:
        """[len(roots) * B, H]: block_embeddings of every root, one after the other (one embedding lookup; the mask
        rows are made once per proposer)."""
        root_e = self.target.embed(torch.tensor(roots, device=self.pool.k.device))
        if len(roots) == 1:
            return torch.cat([root_e, self._mask_rows])
        return torch.cat([root_e[:, None], self._mask_rows.expand(len(roots), -1, -1)], 1).flatten(0, 1)

    def group_key(self) -> tuple:
        return (self.name, self.tree)

    def block_logits(self, seq: Sequence) -> torch.Tensor:
        """[B-1, vocab] logits at block slots 1..B-1 over the target's vocabulary: the drafts of positions
        N+1..N+B-1 (for tools; ids outside a draft vocabulary get -inf)."""
        logits = self.block_logits_many([seq])[0]
        if self.vocab is None:
            return logits
        full = logits.new_full((logits.shape[0], self.target.config.vocab_size), float("-inf"))
        full[:, self.vocab] = logits
        return full

    @torch.inference_mode()
    def block_logits_many(self, seqs: list[Sequence], depth: int | None = None) -> list[torch.Tensor]:
        """Every sequence's block in one drafter forward, then ONE LM head over all their drafts (the weights, the
        head above all, read once): [depth, draft vocab] per sequence (columns: self.vocab's ids, or all), the
        first `depth` drafts (default all B-1; the whole block is still drafted: its positions attend to each
        other)."""
        dev, b = self.pool.k.device, self.draft_block_len
        depth = b - 1 if depth is None else depth
        hidden = self.model.forward_many(
            self.blocks_embeddings([seq.pending for seq in seqs]),
            torch.tensor([p for seq in seqs for p in range(seq.num_committed, seq.num_committed + b)], device=dev),
            self.pool.k, self.pool.v, [seq.slots(0, seq.num_committed).to(dev) for seq in seqs],
            [seq.slots(seq.num_committed, seq.num_committed + b).to(dev) for seq in seqs])
        drafts = hidden[1:1 + depth] if len(seqs) == 1 else hidden.view(len(seqs), b, -1)[:, 1:1 + depth].flatten(0, 1)
        logits = self.target.logits(drafts) if self.head is None else self.head(drafts)
        return [logits] if len(seqs) == 1 else list(logits.split(depth))

    def propose(self, seq: Sequence) -> Proposal:
        return self.propose_many([seq])[0]

    def propose_many(self, seqs: list[Sequence]) -> list[Proposal]:
        """Each block gives the DDTree of max_tree_tokens() nodes at most (prefixes less probable than the tree's
        min_prob left out); with top_k 1, the chain of its argmax drafts (cut where it falls below min_prob)."""
        proposals, nodes = [], self.max_tree_tokens()
        # a tree of `nodes` nodes reaches depth nodes - 1 at most: deeper drafts need no lm_head rows
        for seq, logits in zip(seqs, self.block_logits_many(seqs, min(self.draft_block_len - 1, nodes - 1))):
            if self.tree.top_k == 1 and not self.tree.min_prob:
                tree = DraftTree.chain(seq.pending, logits.argmax(-1).tolist()[:nodes - 1])
            else:
                values, ids = top_k(logits, ranks_needed(nodes, logits.shape[1], self.tree.top_k), log_softmax=True)
                tree, _ = prefix_tree(seq.pending, values.tolist(), ids.tolist(), nodes, self.tree.min_prob)
            if self.vocab is not None:   # draft ids -> target ids (the root is one already)
                tree = DraftTree(tree.tokens[:1] + [self.vocab[t] for t in tree.tokens[1:]], tree.parents,
                                 tree.depths)
            proposals.append(Proposal(tree, frontier=seq.num_committed))
        return proposals


def top_k(x: torch.Tensor, k: int, log_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest values (fp32; with `log_softmax`, of log_softmax(x)) and their indices, largest first:
    the engine's kernel where it is loaded (3 rows of 8192 log-probs: ~6 us against aten's topk ~39 us), else torch."""
    return kernels.topk_rows(x, k, log_softmax)


def max_prefix_tree_nodes(depth: int, top_k: int | None) -> int | float:
    """Nodes (root included) of the full tree of `depth` levels with `top_k` children each (None: unbounded)."""
    return float("inf") if top_k is None else 1 + sum(top_k ** d for d in range(1, depth + 1))

