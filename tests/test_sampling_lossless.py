"""Sampling with speculation is lossless: the emitted tokens have exactly the target's distribution.

A chi-square goodness-of-fit test with fixed seeds, which fails when verification is deliberately broken."""
from __future__ import annotations

import torch

from whiflash_trt.spec.tree import DraftTree
from whiflash_trt.spec.verify import Verdict, verify_sampling

VOCAB = 5


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value of observed counts against expected probabilities (cells with p > 0)."""
    keep = probs > 0
    n = counts.sum()
    expected = probs[keep] * n
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat.double() / 2))


def _tree_and_probs(seed: int):
    g = torch.Generator().manual_seed(seed)
    # root -> two children (siblings), first child -> one grandchild: a small tree over a tiny vocabulary
    tree = DraftTree(tokens=[0, 1, 3, 2], parents=[-1, 0, 0, 1], depths=[0, 1, 1, 2])
    probs = torch.softmax(torch.randn(4, VOCAB, generator=g) * 1.5, dim=-1)
    return tree, probs


def _two_token_distribution(tree, probs) -> torch.Tensor:
    """Exact target distribution of the first two emitted tokens given the node distributions:
    token 1 ~ p_root; token 2 ~ p at the node for token 1 if token 1 is a drafted child, else (never
    reached by the tree) the test only counts token 2 when it is determined by a verified node."""
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    kids = tree.children()
    for a in range(VOCAB):
        child = next((c for c in kids[0] if tree.tokens[c] == a), None)
        if child is None:
            continue
        joint[a] = probs[0, a].double() * probs[child].double()
    return joint


def _sample_pairs(verify, tree, probs, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    first = torch.zeros(VOCAB, dtype=torch.float64)
    pairs = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for _ in range(n):
        v: Verdict = verify(tree, probs, g)
        emitted = v.tokens[1:] + [v.bonus]
        first[emitted[0]] += 1
        if len(emitted) >= 2:
            pairs[emitted[0], emitted[1]] += 1
    return first, pairs


def broken_verify(tree, probs, generator):
    """A deliberately wrong verifier: accepts a child with probability 2 p(x) (overweights drafted tokens)."""
    kids = tree.children()
    path = [0]
    while kids[path[-1]] and torch.rand((), generator=generator) < 2 * probs[path[-1], tree.tokens[kids[path[-1]][0]]]:
        path.append(kids[path[-1]][0])
    bonus = int(torch.multinomial(probs[path[-1]], 1, generator=generator))
    return Verdict(path, [tree.tokens[i] for i in path], bonus)


def test_first_and_second_tokens_follow_the_target_distribution():
    tree, probs = _tree_and_probs(0)
    first, pairs = _sample_pairs(verify_sampling, tree, probs, 6000, seed=1)
    assert chi_square_p(first, probs[0].double()) > 1e-3
    joint = _two_token_distribution(tree, probs)
    drafted = joint.sum(1) > 0
    # second token given an accepted first draft follows the target's distribution at that node
    for a in drafted.nonzero().flatten().tolist():
        assert chi_square_p(pairs[a], joint[a] / joint[a].sum()) > 1e-3


def test_chi_square_detects_a_broken_verifier():
    tree, probs = _tree_and_probs(0)
    first, _ = _sample_pairs(broken_verify, tree, probs, 6000, seed=1)
    assert chi_square_p(first, probs[0].double()) < 1e-6


def test_chain_with_rejections_keeps_target_distribution():
    g = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(3, VOCAB, generator=g), dim=-1)
    tree = DraftTree.chain(0, [4, 4])      # drafts that are often wrong
    first, _ = _sample_pairs(verify_sampling, tree, probs, 6000, seed=2)
    assert chi_square_p(first, probs[0].double()) > 1e-3


# ----- through the engine: every mode samples the first two tokens from the target's distribution -----------------
import pytest  # noqa: E402

from whiflash_trt.config import DFlashTreeConfig, GenerationConfig, SamplingConfig, SpecConfig  # noqa: E402
from whiflash_trt.spec.sampling import target_probs  # noqa: E402

SAMPLING = SamplingConfig(temperature=0.8, top_k=3, top_p=0.95)


def _target_next_probs(engine, ids: list[int]) -> torch.Tensor:
    return target_probs(engine.target_logits(ids), SAMPLING).double()


@pytest.mark.parametrize("spec", [SpecConfig("ar"), SpecConfig("eagle3"), SpecConfig("dflash"),
                                  SpecConfig("dflash", dflash_tree=DFlashTreeConfig(top_k=1)),
                                  SpecConfig("dflash", dflash_tree=DFlashTreeConfig(total_tokens=10)),
                                  SpecConfig("whiflash", "entropy", 1.5)],
                         ids=["ar", "eagle3", "dflash", "dflash-chain", "dflash-ddtree-10", "whiflash"])
def test_engine_sampling_matches_target_distribution(spec_engine, spec):
    _check_two_token_distribution(spec_engine, spec)


@pytest.mark.parametrize("spec", [SpecConfig("eagle3"), SpecConfig("dflash"), SpecConfig("whiflash", "entropy", 1.5)],
                         ids=["eagle3", "dflash", "whiflash"])
def test_compiled_engine_sampling_matches_target_distribution(compiled_spec_engine, spec):
    _check_two_token_distribution(compiled_spec_engine, spec)


def _check_two_token_distribution(engine, spec: SpecConfig) -> None:
    """400 seeded two-token samples against the target's own two-step distribution (chi-square)."""
    prompt = [5, 17, 42, 8]
    p1 = _target_next_probs(engine, prompt)
    support = p1.nonzero().flatten().tolist()
    joint = {(a, b): float(p1[a] * q) for a in support
             for b, q in enumerate(_target_next_probs(engine, prompt + [a]).tolist()) if q > 0}
    cells = sorted(joint)
    counts = torch.zeros(len(cells), dtype=torch.float64)
    n = 400
    for seed in range(n):
        out = engine.generate(prompt, GenerationConfig(max_new_tokens=2, ignore_eos=True,
                                                       sampling=SamplingConfig(0.8, 3, 0.95, seed)), spec=spec)
        counts[cells.index(tuple(out.token_ids))] += 1
    assert chi_square_p(counts, torch.tensor([joint[c] for c in cells], dtype=torch.float64)) > 1e-3
