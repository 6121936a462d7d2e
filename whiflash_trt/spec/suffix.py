"""The suffix drafter's index: what followed each earlier occurrence of the text's current suffix, and how often.

A trie of every substring of the token stream up to `depth` tokens long, each node counting the substring's
occurrences, grown as tokens are appended: the nodes of the stream's current suffixes (one per length) are kept, so
appending a token steps each of them to its child, at most `depth` dictionary updates a token and no rescan of the
stream. Proposing follows SuffixDecoding (arXiv 2411.04975): from the longest earlier match of the suffix ending in
the pending token, the draft is the tree of the most probable continuations, where a continuation's probability is
the product along its path of count(child) / count(parent); nodes below `min_prob` are left out, and the tree is no
deeper than `factor` times the match length. The sum of the drafted nodes' probabilities is the number of drafts the
verify would accept if the text went on as it went before (the tree's score). A short match recurs by chance more
often than it predicts, so the offer the router weighs trusts a match of m tokens m / (m + MATCH_PRIOR) of that.
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

from whiflash_trt.spec.tree import DraftTree

MATCH_PRIOR = 3.0   # fit on held-out greedy outputs by scripts/suffix_offers.py (docs/measurements.md)


# A trie node is a list [count, {token: child}]: appending walks ~`depth` of them a token, and list indexing is 2.5x
# faster than slotted attributes there
_Node = list


@dataclass(frozen=True)
class SuffixDraft:
    tree: DraftTree
    probs: list[float]     # per node: its path probability (the root's 1.0)
    match: int             # tokens of the match the tree continues (0: none)

    @property
    def score(self) -> float:
        """Accepted drafts expected under the index's continuation frequencies."""
        return sum(self.probs[1:])

    @property
    def expected(self) -> float:
        """Accepted drafts expected, the score shrunk by the match's length (see the module docstring)."""
        return self.score * self.match / (self.match + MATCH_PRIOR) if self.match else 0.0


class SuffixIndex:
    """Substrings of one token stream up to `depth` long, with counts (see the module docstring)."""

    def __init__(self, depth: int = 24) -> None:
        if depth < 2:
            raise ValueError(f"a suffix index needs depth >= 2, got {depth}")
        self.depth, self.length = depth, 0
        self.root: _Node = [0, {}]
        self._suffixes = [self.root]   # node of the stream's suffix of each length 0 .. depth - 1

    def append(self, tokens: list[int]) -> None:
        root, depth = self.root, self.depth
        for t in tokens:
            suffixes = [root]
            for node in self._suffixes:
                child = node[1].get(t)
                if child is None:
                    child = node[1][t] = [1, {}]
                else:
                    child[0] += 1
                suffixes.append(child)
            del suffixes[depth:]
            self._suffixes = suffixes
        self.length += len(tokens)

    def match(self, last: int, longest: int) -> tuple[int, _Node | None]:
        """The longest suffix of the stream followed by `last`, at most `longest` tokens, that occurred before with a
        continuation: (its length, its node), or (0, None)."""
        for length in range(min(longest, len(self._suffixes)) - 1, -1, -1):
            node = self._suffixes[length][1].get(last)
            if node is not None and node[1]:
                return length + 1, node
        return 0, None

    def draft(self, last: int, nodes: int, min_prob: float = 0.1, factor: float = 1.0) -> SuffixDraft:
        """The tree rooted at the pending token `last` of at most `nodes` nodes (root included)."""
        reach = nodes - 1                                   # the deepest a tree of `nodes` nodes goes
        length, match = self.match(last, self.depth - 1)
        if match is None or reach < 1:
            return SuffixDraft(DraftTree([last], [-1], [0]), [1.0], 0)
        deepest = min(reach, self.depth - length, max(1, math.ceil(factor * length)))
        tokens, parents, depths, probs = [last], [-1], [0], [1.0]
        heap: list[tuple[float, int, int, int, _Node]] = []   # (-prob, order, parent, token, node)
        order = itertools.count()                           # ties: the continuation seen first

        def push(parent: int, node: _Node, prob: float) -> None:
            for token, child in node[1].items():
                p = prob * child[0] / node[0]
                if p >= min_prob:
                    heapq.heappush(heap, (-p, next(order), parent, token, child))

        push(0, match, 1.0)
        while heap and len(tokens) < nodes:
            p, _, parent, token, node = heapq.heappop(heap)
            tokens.append(token)
            parents.append(parent)
            depths.append(depths[parent] + 1)
            probs.append(-p)
            if depths[-1] < deepest:
                push(len(tokens) - 1, node, -p)
        return _by_depth(tokens, parents, depths, probs, length)


def _by_depth(tokens: list[int], parents: list[int], depths: list[int], probs: list[float],
              match: int) -> SuffixDraft:
    """The tree with its nodes in (depth, -probability) order, the flat trees' order (spec.tree)."""
    order = sorted(range(len(tokens)), key=lambda i: (depths[i], -probs[i], i))
    where = {old: new for new, old in enumerate(order)}
    tree = DraftTree([tokens[i] for i in order], [where[parents[i]] if i else -1 for i in order],
                     [depths[i] for i in order])
    return SuffixDraft(tree, [probs[i] for i in order], match)
