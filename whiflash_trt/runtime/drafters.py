"""The two drafters as the engine sees them: catch up (KV-only prefill of the backlog) and propose a draft tree.

Capabilities are data (name, capture_layers, scratch slots); the engine keeps them in a registry dict. Neither
mutates the Sequence: both return the frontier they reached and the commit phase records it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from whiflash_trt.config import SpecConfig
from whiflash_trt.models.dflash import DFlashDrafter
from whiflash_trt.models.eagle3 import Eagle3Drafter
from whiflash_trt.models.target import TargetModel
from whiflash_trt.runtime.kv_cache import KVPool
from whiflash_trt.runtime.sequence import Sequence
from whiflash_trt.spec.tree import DraftTree, select_nodes


@dataclass(frozen=True)
class Proposal:
    tree: DraftTree
    frontier: int            # the drafter's frontier after drafting


def _columns(needed: tuple[int, ...], union: tuple[int, ...], hidden: int) -> torch.Tensor:
    """Feature columns of `needed` layers inside the union capture (concatenated in `union` order)."""
    return torch.cat([torch.arange(union.index(layer) * hidden, (union.index(layer) + 1) * hidden)
                      for layer in needed])


class Eagle3Proposer:
    name = "eagle3"

    def __init__(self, model: Eagle3Drafter, pool: KVPool, target: TargetModel, union: tuple[int, ...]) -> None:
        self.model, self.pool, self.target = model, pool, target
        self.capture_layers = model.config.capture_layers
        self.cols = _columns(self.capture_layers, union, target.config.hidden_size).to(pool.k.device)

    def scratch_slots(self, spec: SpecConfig) -> int:
        return (spec.tree_depth - 1) * spec.tree_top_k

    def max_tree_tokens(self, spec: SpecConfig) -> int:
        return spec.tree_total_tokens

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
        embeds = self.target.embed_tokens(torch.tensor(seq.tokens[start + 1:end + 1], device=dev))
        k, v = self.model.kv_only(feats, embeds, torch.arange(start, end, device=dev))
        slots = seq.slots(start, end).to(dev)
        self.pool.k[:, slots], self.pool.v[:, slots] = k, v
        return end

    @torch.inference_mode()
    def propose(self, seq: Sequence, spec: SpecConfig) -> Proposal:
        """EAGLE-2 style dynamic tree: expand the top_k best nodes per depth, keep the best total_tokens - 1."""
        n, k, dev = seq.num_committed, spec.tree_top_k, self.pool.k.device
        model, embed = self.model, self.target.embed_tokens
        # Root: the full layer at position N-1 on (fc(F_{N-1}), b); it also writes that position's K/V.
        g = model.fc(seq.features_between(n - 1, n)[:, self.cols])
        read = seq.slots(0, n + self.scratch_slots(spec)).to(dev)
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
        for step in range(1, spec.tree_depth):
            width = len(level)
            base = n + (step - 1) * k
            slots = list(range(base, base + width))
            mask = torch.zeros(width, n + self.scratch_slots(spec), dtype=torch.bool, device=dev)
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
        chosen = select_nodes(scores, depths, spec.tree_total_tokens - 1)
        index = {c: i + 1 for i, c in enumerate(chosen)}
        tree = DraftTree([seq.pending] + [tokens[c] for c in chosen],
                         [-1] + [index.get(parents[c], 0) for c in chosen],
                         [0] + [depths[c] for c in chosen])
        return Proposal(tree, frontier=n)


class DFlashProposer:
    name = "dflash"

    def __init__(self, model: DFlashDrafter, pool: KVPool, target: TargetModel, union: tuple[int, ...]) -> None:
        self.model, self.pool, self.target = model, pool, target
        self.capture_layers = model.config.capture_layers
        self.block_size = model.config.block_size
        self.cols = _columns(self.capture_layers, union, target.config.hidden_size).to(pool.k.device)

    def scratch_slots(self, spec: SpecConfig) -> int:
        return 0   # the block's own K/V never enter the pool

    def max_tree_tokens(self, spec: SpecConfig) -> int:
        return self.block_size

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
        embed = self.target.embed_tokens
        mask_id = self.model.config.mask_token_id
        dev = embed.weight.device
        root_e = embed(torch.tensor([root], device=dev))
        mask_e = (self.model.mask_embedding.to(root_e.dtype)[None] if self.model.mask_embedding is not None
                  else embed(torch.tensor([mask_id], device=dev)))
        return torch.cat([root_e, mask_e.expand(self.block_size - 1, -1)])

    @torch.inference_mode()
    def propose(self, seq: Sequence, spec: SpecConfig) -> Proposal:
        n, dev = seq.num_committed, self.pool.k.device
        hidden = self.model(self.block_embeddings(seq.pending), torch.arange(n, n + self.block_size, device=dev),
                            self.pool.k, self.pool.v, seq.slots(0, n).to(dev))
        drafts = self.target.lm_head(hidden[1:]).argmax(-1).tolist()
        return Proposal(DraftTree.chain(seq.pending, drafts), frontier=n)
