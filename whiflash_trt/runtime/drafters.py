"""The two drafters as the engine sees them: catch up (KV-only prefill of the backlog) and propose a draft tree.

Capabilities are data (name, scratch slots, tokens per round); the engine keeps them in a registry dict. Neither
mutates the Sequence: both return the frontier they reached and the commit phase records it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import torch

from whiflash_trt.config import DFLASH, EAGLE3, DFlashTreeConfig, SpecConfig, TreeConfig
from whiflash_trt.errors import WhiflashError
from whiflash_trt.models.contracts import DFlash, Eagle3, Target, feature_columns
from whiflash_trt.runtime.kv_cache import KVPool
from whiflash_trt.runtime.sequence import Sequence
from whiflash_trt.spec.ddtree import best_prefix_tree
from whiflash_trt.spec.tree import DraftTree, select_nodes


@dataclass(frozen=True)
class Proposal:
    tree: DraftTree
    frontier: int            # the drafter's frontier after drafting


class Proposer:
    """A drafter bound to its KV pool and the target, with its features' columns in the union capture of every verify.
    Each has a name, for_spec(spec) (a copy shaped by the request's tree settings), max_tree_tokens() (nodes a
    round verifies), scratch_slots() (pool slots its draft steps use), backlog(seq), catch_up(seq) -> frontier,
    propose(seq)."""
    name: ClassVar[str]

    def __init__(self, model: Eagle3 | DFlash, pool: KVPool, target: Target, union: tuple[int, ...]) -> None:
        self.model, self.pool, self.target = model, pool, target
        self.cols = feature_columns(model.config.capture_layers, union, target.config.hidden_size).to(pool.k.device)


class Eagle3Proposer(Proposer):
    name = EAGLE3
    model: Eagle3
    tree = TreeConfig()      # the request's shape: see with_tree

    def with_tree(self, tree: TreeConfig) -> "Eagle3Proposer":
        shaped = copy.copy(self)
        shaped.tree = tree
        return shaped

    def for_spec(self, spec: SpecConfig) -> "Eagle3Proposer":
        return self.with_tree(spec.tree)

    def scratch_slots(self) -> int:
        return (self.tree.depth - 1) * self.tree.top_k

    def max_tree_tokens(self) -> int:
        return self.tree.total_tokens

    def backlog(self, seq: Sequence) -> int:
        return max(0, seq.num_committed - 1 - seq.frontiers.get(self.name, 0))

    @torch.inference_mode()
    def catch_up(self, seq: Sequence) -> int:
        """KV-only prefill of positions [frontier, N-1): pairs (F_t, x_{t+1}) with x_{t+1} committed.
        Position N-1 (paired with the pending bonus) is written by the full root forward when drafting."""
        start, end = seq.frontiers.get(self.name, 0), seq.num_committed - 1
        if end <= start:
            return max(start, 0)
        dev = self.pool.k.device
        feats = seq.features_between(start, end)[:, self.cols]
        embeds = self.target.embed(torch.tensor(seq.tokens[start + 1:end + 1], device=dev))
        k, v = self.model.kv_only(feats, embeds, torch.arange(start, end, device=dev))
        slots = seq.slots(start, end).to(dev)
        self.pool.k[:, slots], self.pool.v[:, slots] = k, v
        return end

    @torch.inference_mode()
    def propose(self, seq: Sequence) -> Proposal:
        """EAGLE-2 style dynamic tree: expand the top_k best nodes per depth, keep the best total_tokens - 1."""
        n, k, dev, scratch = seq.num_committed, self.tree.top_k, self.pool.k.device, self.scratch_slots()
        model, embed = self.model, self.target.embed
        # Root: the full layer at position N-1 on (fc(F_{N-1}), b); it also writes that position's K/V.
        g = model.fc(seq.features_between(n - 1, n)[:, self.cols])
        read = seq.slots(0, n + scratch).to(dev)
        root_slot = read[n - 1:n]
        mask = torch.ones(1, n, dtype=torch.bool, device=dev)
        h = model(embed(torch.tensor([seq.pending], device=dev)), g, torch.tensor([n - 1], device=dev),
                  self.pool.k, self.pool.v, root_slot, read[:n], mask)
        logp = model.draft_logprobs(h)[0]
        top = torch.topk(logp, k)
        # Candidate nodes (excluding the root): token, parent (candidate index or -1 = root), depth, score.
        tokens = model.to_target_ids(top.indices).tolist()
        parents, depths, scores = [-1] * k, [1] * k, top.values.tolist()
        level, level_hidden = list(range(k)), h.expand(k, -1)    # nodes to expand and their parents' hidden
        ancestors: dict[int, list[int]] = {-1: []}                # candidate -> scratch slots of expanded ancestors
        for step in range(1, self.tree.depth):
            width = len(level)
            base = n + (step - 1) * k
            slots = list(range(base, base + width))
            mask = torch.zeros(width, n + scratch, dtype=torch.bool, device=dev)
            mask[:, :n] = True
            for j, node in enumerate(level):
                ancestors[node] = ancestors[parents[node]] + [slots[j]]
                mask[j, ancestors[node]] = True
            out = model(embed(torch.tensor([tokens[i] for i in level], device=dev)), level_hidden,
                        torch.full((width,), n - 1 + step, device=dev), self.pool.k, self.pool.v,
                        read[base:base + width], read, mask)
            child = torch.topk(model.draft_logprobs(out), k, dim=-1)              # [width, k]
            child_scores = (torch.tensor([scores[i] for i in level], device=dev)[:, None] + child.values)
            child_ids = model.to_target_ids(child.indices)
            first = len(tokens)
            for j, node in enumerate(level):
                tokens += child_ids[j].tolist()
                parents += [node] * k
                depths += [step + 1] * k
                scores += child_scores[j].tolist()
            best = torch.topk(child_scores.flatten(), k).indices.tolist()
            level = [first + b for b in best]
            level_hidden = out[[b // k for b in best]]
        chosen = select_nodes(scores, depths, self.tree.total_tokens - 1)
        index = {c: i + 1 for i, c in enumerate(chosen)}
        tree = DraftTree([seq.pending] + [tokens[c] for c in chosen],
                         [-1] + [index.get(parents[c], 0) for c in chosen],
                         [0] + [depths[c] for c in chosen])
        return Proposal(tree, frontier=n)


class DFlashProposer(Proposer):
    name = DFLASH
    model: DFlash
    tree = DFlashTreeConfig()   # the request's shape: a DDTree or the block's chain (see with_tree)

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
        return 0   # the block's own K/V never enter the pool

    def max_tree_tokens(self) -> int:
        return self.tree.total_tokens or self.draft_block_len

    def backlog(self, seq: Sequence) -> int:
        return max(0, seq.num_committed - seq.frontiers.get(self.name, 0))

    @torch.inference_mode()
    def catch_up(self, seq: Sequence) -> int:
        """KV-only prefill of context positions [frontier, N) from their target features."""
        start, end = seq.frontiers.get(self.name, 0), seq.num_committed
        if end <= start:
            return start
        dev = self.pool.k.device
        k, v = self.model.kv_only(seq.features_between(start, end)[:, self.cols], torch.arange(start, end, device=dev))
        slots = seq.slots(start, end).to(dev)
        self.pool.k[:, slots], self.pool.v[:, slots] = k, v
        return end

    def block_embeddings(self, root: int) -> torch.Tensor:
        """[B, H]: the root token's embedding, then the mask token's (target row, or the drafter's own)."""
        embed, dev = self.target.embed, self.pool.k.device
        root_e = embed(torch.tensor([root], device=dev))
        mask_e = (self.model.mask_embedding.to(root_e.dtype)[None] if self.model.mask_embedding is not None
                  else embed(torch.tensor([self.model.config.mask_token_id], device=dev)))
        return torch.cat([root_e, mask_e.expand(self.draft_block_len - 1, -1)])

    @torch.inference_mode()
    def block_logits(self, seq: Sequence) -> torch.Tensor:
        """[B-1, vocab] the target lm_head's logits at block slots 1..B-1: the drafts of positions N+1..N+B-1."""
        n, dev = seq.num_committed, self.pool.k.device
        hidden = self.model(self.block_embeddings(seq.pending), torch.arange(n, n + self.draft_block_len, device=dev),
                            self.pool.k, self.pool.v, seq.slots(0, n).to(dev))
        return self.target.logits(hidden[1:])

    @torch.inference_mode()
    def propose(self, seq: Sequence) -> Proposal:
        """One block forward -> the DDTree of max_tree_tokens() nodes; with top_k 1, the chain of argmax drafts."""
        logits = self.block_logits(seq)
        if self.tree.top_k == 1:
            tree = DraftTree.chain(seq.pending, logits.argmax(-1).tolist()[:self.max_tree_tokens() - 1])
        else:
            tree, _ = best_prefix_tree(seq.pending, torch.log_softmax(logits.float(), dim=-1),
                                       self.max_tree_tokens(), self.tree.top_k)
        return Proposal(tree, frontier=seq.num_committed)


def max_prefix_tree_nodes(depth: int, top_k: int | None) -> int | float:
    """Nodes (root included) of the full tree of `depth` levels with `top_k` children each (None: unbounded)."""
    return float("inf") if top_k is None else 1 + sum(top_k ** d for d in range(1, depth + 1))


PROPOSERS = {EAGLE3: Eagle3Proposer, DFLASH: DFlashProposer}   # the drafter registry: name -> proposer type
