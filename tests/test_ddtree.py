"""DDTree's best-first builder against brute force: the N most probable prefixes under per-position marginals."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from whiflash_trt.spec.ddtree import best_prefix_tree
from whiflash_trt.spec.tree import DraftTree


def _paths(tree: DraftTree) -> set[tuple[int, ...]]:
    """Each non-root node's token path from the root's child down to it."""
    out = set()
    for i in range(1, len(tree.tokens)):
        path, j = [], i
        while j > 0:
            path.append(tree.tokens[j])
            j = tree.parents[j]
        out.add(tuple(reversed(path)))
    return out


def _brute_force(logprobs: torch.Tensor, num: int, top_k: int | None) -> tuple[set[tuple[int, ...]], float]:
    """Every prefix of every depth (ranks limited to top_k per depth), the `num` most probable ones."""
    depth, vocab = logprobs.shape
    ranked = [logprobs[d].argsort(descending=True)[:top_k or vocab].tolist() for d in range(depth)]
    prefixes = [p for d in range(1, depth + 1) for p in itertools.product(*ranked[:d])]
    score = {p: sum(float(logprobs[d, t]) for d, t in enumerate(p)) for p in prefixes}
    best = sorted(prefixes, key=lambda p: -score[p])[:num]
    return set(best), sum(math.exp(score[p]) for p in best)


def _check_valid(tree: DraftTree, root: int) -> None:
    assert tree.tokens[0] == root
    for i in range(1, len(tree.tokens)):
        assert tree.depths[i] == tree.depths[tree.parents[i]] + 1
    assert tree.depths == sorted(tree.depths)                       # flat-tree order: by depth
    for kids in tree.children():
        tokens = [tree.tokens[c] for c in kids]
        assert len(tokens) == len(set(tokens))                      # siblings are distinct drafts


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("top_k", [None, 2])
def test_heap_builder_returns_exactly_the_most_probable_prefixes(seed, top_k):
    g = torch.Generator().manual_seed(seed)
    depth, vocab = 4, 5
    logprobs = torch.log_softmax(torch.randn(depth, vocab, generator=g) * 2, dim=-1)
    for total in (1, 2, 3, 5, 8, 17, 40, 200):
        tree, expected = best_prefix_tree(7, logprobs, total, top_k)
        best, brute_expected = _brute_force(logprobs, total - 1, top_k)
        _check_valid(tree, 7)
        assert _paths(tree) == best
        assert len(tree.tokens) == 1 + len(best)                 # fewer only when every prefix is in
        assert expected == pytest.approx(brute_expected, rel=1e-5)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("min_prob", [0.01, 0.05, 0.2])
def test_a_probability_floor_keeps_the_most_probable_prefixes_above_it(seed, min_prob):
    g = torch.Generator().manual_seed(seed)
    logprobs = torch.log_softmax(torch.randn(4, 5, generator=g) * 2, dim=-1)
    for total in (2, 5, 17, 200):
        tree, expected = best_prefix_tree(7, logprobs, total, min_prob=min_prob)
        best, _ = _brute_force(logprobs, total - 1, None)
        _check_valid(tree, 7)
        prob = {path: math.exp(sum(logprobs[d, t].item() for d, t in enumerate(path))) for path in best}
        assert _paths(tree) == {path for path in best if prob[path] >= min_prob}
        assert expected == pytest.approx(sum(p for p in prob.values() if p >= min_prob), rel=1e-5, abs=1e-9)


def test_budget_past_every_prefix_gives_the_whole_tree():
    logprobs = torch.log_softmax(torch.randn(2, 3), dim=-1)
    tree, expected = best_prefix_tree(0, logprobs, 100)
    assert len(tree.tokens) == 1 + 3 + 9
    assert expected == pytest.approx(1.0 + 1.0)                     # each depth's marginal sums to one


def test_top_k_one_is_the_greedy_chain():
    logprobs = torch.log_softmax(torch.randn(6, 11), dim=-1)
    tree, _ = best_prefix_tree(3, logprobs, 7, top_k=1)
    assert tree == DraftTree.chain(3, logprobs.argmax(-1).tolist())
    short, _ = best_prefix_tree(3, logprobs, 4, top_k=1)
    assert short == DraftTree.chain(3, logprobs.argmax(-1).tolist()[:3])


def test_a_flat_first_position_widens_the_tree_before_deepening_it():
    # depth 1 is a near coin flip between tokens 1 and 2, depth 2 prefers 3 (0.6): the second-best first draft
    # (0.49) beats the best two-token prefix (0.5 * 0.6), so the 3-node tree holds both first-position candidates.
    probs = torch.tensor([[0.01, 0.5, 0.49, 0.0], [0.0, 0.0, 0.4, 0.6], [0.9, 0.1, 0.0, 0.0]]) + 1e-9
    tree, _ = best_prefix_tree(9, probs.log(), 3)
    assert tree.tokens == [9, 1, 2] and tree.parents == [-1, 0, 0]
    tree, _ = best_prefix_tree(9, probs.log(), 5)
    assert _paths(tree) == {(1,), (2,), (1, 3), (2, 3)}


def test_bad_budgets_are_refused_with_the_value():
    with pytest.raises(ValueError, match="total_tokens >= 1"):
        best_prefix_tree(0, torch.zeros(2, 2), 0)
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        best_prefix_tree(0, torch.zeros(2, 2), 4, top_k=0)
