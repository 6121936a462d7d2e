"""Draft trees as flat arrays: node 0 is the root (the pending bonus token), parents[i] < i, nodes ordered by depth.

A chain is the degenerate tree parents = [-1, 0, 1, ...]."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from whiflash_trt.config import check_min_prob


@dataclass(frozen=True)
class DraftTree:
    tokens: list[int]    # [T] target ids; tokens[0] is the root
    parents: list[int]   # [T] parents[0] = -1
    depths: list[int]    # [T] depths[0] = 0; a node's target position is N + depth

    def __post_init__(self) -> None:
        if not self.tokens or self.parents[0] != -1 or self.depths[0] != 0:
            raise ValueError("a draft tree needs a root at index 0")
        if any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError(f"tree parents must precede their children: {self.parents}")

    @classmethod
    def chain(cls, root: int, drafts: list[int]) -> "DraftTree":
        n = len(drafts) + 1
        return cls([root] + list(drafts), [-1] + list(range(n - 1)), list(range(n)))

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents):
            if i:
                kids[p].append(i)
        return kids

    def mask(self) -> torch.Tensor:
        """[T, T] bool: node i may see node j iff j is i or one of its ancestors (built as lists: one torch op)."""
        rows: list[list[bool]] = []
        for i, p in enumerate(self.parents):
            row = list(rows[p]) if p >= 0 else [False] * len(self.tokens)
            row[i] = True
            rows.append(row)
        return torch.tensor(rows, dtype=torch.bool)


def select_nodes(scores: list[float], depths: list[int], budget: int, min_prob: float = 0.0) -> list[int]:
    """Indices of the best `budget` candidates by cumulative log-prob (EAGLE-2's re-ranking), those whose path
    probability is below `min_prob` left out.

    A child's score never exceeds its parent's (log-probs <= 0), and ties go to the shallower node, so the chosen set
    always contains every chosen node's ancestors. Returned in (depth, -score) order: a valid flat-tree order.
    """
    floor = min_logprob(min_prob)
    kept = [i for i in range(len(scores)) if scores[i] >= floor]
    order = sorted(kept, key=lambda i: (-scores[i], depths[i], i))[:budget]
    return sorted(order, key=lambda i: (depths[i], -scores[i], i))


def min_logprob(min_prob: float) -> float:
    """The log of a tree's probability floor (config.TreeConfig.min_prob; -inf for none): nodes whose path log-prob
    is below it are not verified."""
    check_min_prob(min_prob)
    return math.log(min_prob) if min_prob > 0 else -math.inf
