"""DDTree (Ringel & Romano, arXiv 2604.12989): the draft tree of the most probable prefixes under per-position
marginals.

One block-diffusion forward gives a distribution q_d per depth d = 1..L, the same for every path (not
path-conditional). Under the product model a prefix u_1..u_d has probability prod_i q_i(u_i), and the expected
number of accepted drafts of a prefix-closed tree is the sum of its nodes' probabilities; the `budget` most probable
prefixes are the best tree of that many nodes, and they are prefix-closed because a prefix is never more probable
than its parent. Best-first search finds them: popping a prefix pushes its next sibling (same parent, the next rank
at its depth) and its first child (the best token one depth deeper); each prefix is pushed by one that is at least
as probable, so prefixes come off the heap in order. A probability floor (min_prob) therefore ends the search at the
first prefix below it: the tree is the most probable prefixes, `budget` of them at most, each at least that probable.
"""
from __future__ import annotations

import heapq
import math

import torch

from whiflash_trt.spec.tree import DraftTree, min_logprob


def best_prefix_tree(root: int, logprobs: torch.Tensor, total_tokens: int, top_k: int | None = None,
                     min_prob: float = 0.0) -> tuple[DraftTree, float]:
    """The tree of the `total_tokens - 1` most probable prefixes (plus the root; those less probable than min_prob
    left out) and their summed probability (the expected accepted drafts under the product model).

    logprobs: [L, V] log q_d of depth d + 1 (rows need not be normalised for the ranking, but the returned sum is
    only an expectation if they are). top_k: children per node at most (1 = a chain; None = no limit).
    """
    top = torch.topk(logprobs.float(), ranks_needed(total_tokens, logprobs.shape[1], top_k), dim=-1)
    return prefix_tree(root, top.values.tolist(), top.indices.tolist(), total_tokens, min_prob)


def ranks_needed(total_tokens: int, vocab: int, top_k: int | None = None) -> int:
    """Candidates per depth that the tree of `total_tokens` nodes can use (at least 1)."""
    if total_tokens < 1:
        raise ValueError(f"a draft tree needs total_tokens >= 1 (the root), got {total_tokens}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 (or None for no limit), got {top_k}")
    drafts = total_tokens - 1
    return max(1, min(drafts, vocab, top_k or drafts))


def prefix_tree(root: int, score: list[list[float]], ids: list[list[int]], total_tokens: int, min_prob: float = 0.0
                ) -> tuple[DraftTree, float]:
    """best_prefix_tree from each depth's ranked candidates: score[d][r] is log q_{d+1} of ids[d][r], the r-th most
    probable token at depth d + 1 (best first; as many ranks per depth as ranks_needed gives)."""
    num_drafts, depth, floor = total_tokens - 1, len(score), min_logprob(min_prob)
    if num_drafts <= 0 or depth == 0:
        return DraftTree([root], [-1], [0]), 0.0
    width = len(score[0])
    # heap entries: (-log prob of the prefix, tiebreak, parent node, depth 1..L, rank at that depth)
    heap = [(-score[0][0], 0, 0, 1, 0)]
    nodes: list[tuple[float, int, int, int]] = []                      # (log prob, parent node, depth, token)
    pushed = 1
    while heap and len(nodes) < num_drafts:
        neg, _, parent, d, rank = heapq.heappop(heap)
        if -neg < floor:   # every prefix still on the heap is as improbable or more
            break
        nodes.append((-neg, parent, d, ids[d - 1][rank]))
        node = len(nodes)                                              # its index in pop order (root = 0)
        if rank + 1 < width:
            heapq.heappush(heap, (neg + score[d - 1][rank] - score[d - 1][rank + 1], pushed, parent, d, rank + 1))
            pushed += 1
        if d < depth:
            heapq.heappush(heap, (neg - score[d][0], pushed, node, d + 1, 0))
            pushed += 1
    return _depth_ordered(root, nodes), math.fsum(math.exp(lp) for lp, *_ in nodes)


def _depth_ordered(root: int, nodes: list[tuple[float, int, int, int]]) -> DraftTree:
    """Pop-ordered nodes (parents before children) as a DraftTree in (depth, most probable first) order."""
    order = sorted(range(len(nodes)), key=lambda i: (nodes[i][2], -nodes[i][0], i))
    index = {i + 1: j + 1 for j, i in enumerate(order)}                # pop index -> tree index
    index[0] = 0
    return DraftTree([root] + [nodes[i][3] for i in order], [-1] + [index[nodes[i][1]] for i in order],
                     [0] + [nodes[i][2] for i in order])
