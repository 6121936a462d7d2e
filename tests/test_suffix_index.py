"""The suffix drafter's index (spec.suffix): counts, the longest match, and the tree of likeliest continuations,
checked against a brute-force scan of the stream."""
from __future__ import annotations

import random

import pytest

from whiflash_trt.spec.suffix import SuffixIndex


def occurrences(stream: list[int], pattern: list[int]) -> list[int]:
    """Start positions of `pattern` in `stream`."""
    n = len(pattern)
    return [i for i in range(len(stream) - n + 1) if stream[i:i + n] == pattern]


def brute_match(stream: list[int], last: int, longest: int) -> int:
    """Length of the longest suffix of stream + [last] (at most `longest`) that occurs in `stream` followed by a
    token."""
    query = stream + [last]
    for length in range(min(longest, len(query)), 0, -1):
        pattern = query[-length:]
        if any(i + length < len(stream) for i in occurrences(stream, pattern)):
            return length
    return 0


def test_counts_equal_the_occurrences_of_every_substring():
    rng = random.Random(0)
    stream = [rng.randrange(4) for _ in range(200)]
    index = SuffixIndex(depth=6)
    for start in range(0, 200, 7):          # appended in pieces, as rounds commit
        index.append(stream[start:start + 7])
    assert index.length == 200
    for _ in range(100):
        n = rng.randrange(1, 7)
        i = rng.randrange(0, 200 - n)
        node = index.root
        for t in stream[i:i + n]:
            node = node[1][t]
        assert node[0] == len(occurrences(stream, stream[i:i + n]))


@pytest.mark.parametrize("seed", range(5))
def test_the_match_is_the_longest_earlier_one(seed):
    rng = random.Random(seed)
    stream = [rng.randrange(3) for _ in range(120)]
    index = SuffixIndex(depth=8)
    index.append(stream)
    for last in range(3):
        length, node = index.match(last, 7)
        assert length == brute_match(stream, last, 7)
        assert (node is None) == (length == 0)


def test_a_copied_passage_is_drafted_as_it_went_before():
    passage = [10, 11, 12, 13, 14, 15, 16, 17]
    index = SuffixIndex()
    index.append([1, 2] + passage + [3, 4] + passage[:3])   # the passage again, three tokens in
    draft = index.draft(passage[3], nodes=6)                  # the pending token is the passage's fourth
    assert draft.match == 4
    assert draft.tree.tokens == [13, 14, 15, 16, 17]          # a chain (it occurred once), as deep as the match
    assert draft.tree.is_chain and draft.probs == [1.0] * 5
    assert draft.score == 4.0
    assert index.draft(passage[3], nodes=6, factor=2.0).tree.tokens == [13, 14, 15, 16, 17, 3]   # the node budget


def test_branches_carry_their_frequencies_and_the_budget_keeps_the_likeliest():
    index = SuffixIndex()
    index.append([7, 1, 7, 1, 7, 1, 7, 2, 7, 3, 9])   # 7 five times: then 1 three times, 2 once, 3 once
    draft = index.draft(7, nodes=3, min_prob=0.0)
    assert draft.match == 1
    assert draft.tree.tokens[1] == 1 and draft.probs[1] == pytest.approx(3 / 5)
    assert len(draft.tree.tokens) == 3 and draft.probs[2] == pytest.approx(1 / 5)   # 2 or 3, not both
    assert draft.score == pytest.approx(4 / 5)
    # min_prob leaves out the rare ones; depth stays within factor x match length (1 here)
    pruned = index.draft(7, nodes=8, min_prob=0.5)
    assert pruned.tree.tokens == [7, 1] and pruned.tree.depths == [0, 1]


def test_trees_are_flat_trees_in_depth_order():
    rng = random.Random(3)
    index = SuffixIndex()
    index.append([rng.randrange(3) for _ in range(300)])
    for last in range(3):
        draft = index.draft(last, nodes=12, min_prob=0.0, factor=4.0)
        tree = draft.tree
        assert tree.depths == sorted(tree.depths)
        for i in range(1, len(tree.tokens)):
            parent = tree.parents[i]
            assert tree.depths[i] == tree.depths[parent] + 1
            assert draft.probs[i] <= draft.probs[parent]
        assert len(tree.tokens) <= 12
        siblings = [(tree.parents[i], tree.tokens[i]) for i in range(1, len(tree.tokens))]
        assert len(set(siblings)) == len(siblings)   # no token twice under one parent


def test_no_match_is_the_root_alone():
    index = SuffixIndex()
    index.append([1, 2, 3])
    draft = index.draft(9, nodes=6)
    assert draft.tree.tokens == [9] and draft.match == 0 and draft.score == 0.0
    assert SuffixIndex().draft(1, nodes=6).tree.tokens == [1]


def test_depth_must_hold_a_match_and_a_draft():
    with pytest.raises(ValueError, match="depth >= 2"):
        SuffixIndex(depth=1)


def test_the_offer_trusts_a_longer_match_more():
    index = SuffixIndex()
    index.append([5, 6, 1, 2, 9, 9, 5, 6, 1, 2])   # "5 6 1 2" twice: a match of up to 4, then "9"
    long, short = index.draft(9, nodes=2), SuffixIndex()
    short.append([1, 2, 3])
    short_draft = short.draft(1, nodes=2)          # a match of one token
    assert long.score == short_draft.score == 1.0
    assert long.match > short_draft.match == 1
    assert long.expected > short_draft.expected > 0
    assert SuffixIndex().draft(1, nodes=4).expected == 0.0
