"""The suffix drafter as the round sees it: a request's own index over its prompt and output (spec.suffix), no model
and no KV pool. It is free, so it catches up and proposes every round before the route, and its offer is the
number of drafts its tree expects to be accepted."""
from __future__ import annotations

import copy

import torch

from whiflash_trt.config import SUFFIX, SpecConfig, SuffixTreeConfig
from whiflash_trt.runtime.drafters import Proposal, Proposer
from whiflash_trt.runtime.sequence import Sequence
from whiflash_trt.runtime.tree_defaults import default_nodes
from whiflash_trt.spec.suffix import SuffixIndex


class SuffixProposer(Proposer):
    name = SUFFIX
    free = True
    tree = SuffixTreeConfig()   # the request's shape: see for_spec

    def __init__(self, device: torch.device, dtype: torch.dtype, native: bool = False) -> None:
        """For a target verifying in `dtype` on `device`, `native` where its linears are GGML blocks (its default
        node count: runtime.tree_defaults)."""
        self.default_nodes = default_nodes(self.name, device, dtype, native)
        self.index = SuffixIndex()

    def for_spec(self, spec: SpecConfig) -> "SuffixProposer":
        """A copy for one request: its tree settings and an index of its own."""
        shaped = copy.copy(self)
        shaped.tree, shaped.index = spec.suffix_tree, SuffixIndex()
        return shaped

    def scratch_slots(self) -> int:
        return 0

    def max_tree_tokens(self) -> int:
        return self.tree.total_tokens or self.default_nodes

    def catch_up(self, seq: Sequence, end: int | None = None, start: int | None = None) -> int:
        """Index the committed tokens not indexed yet (up to `end`); the index's length is the frontier."""
        end = seq.num_committed if end is None else min(end, seq.num_committed)
        if end > self.index.length:
            self.index.append(seq.tokens[self.index.length:end])
        return self.index.length

    def propose(self, seq: Sequence) -> Proposal:
        draft = self.index.draft(seq.pending, self.max_tree_tokens(), self.tree.min_prob, self.tree.factor)
        return Proposal(draft.tree, frontier=self.index.length, expected=draft.expected)
