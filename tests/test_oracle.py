"""The oracle's dynamic program (bench.oracle) against a hand-computed case and against brute force."""
from __future__ import annotations

import itertools
import math
import random

import pytest

from whiflash_trt.bench.oracle import CHOICES, NO_DRAFT, replay, round_costs, solve
from whiflash_trt.runtime.replay import num_accepted
from whiflash_trt.spec.tree import DraftTree

COSTS = {"none": 1.0, "eagle3": 1.5, "dflash": 2.5}


def test_dp_finds_the_hand_computed_mixed_routing():
    # 6 states. EAGLE-3 accepts 1 draft at state 0 (-> state 2); DFlash accepts 3 at state 2 (-> state 6, the end).
    # V(5..3) = 1, 2, 3 (target steps); V(2) = 2.5 (DFlash); V(1) = 3.5 (a step); V(0) = min(1 + 3.5, 1.5 + 2.5,
    # 2.5 + 3.5) = 4.0 (EAGLE-3). Static: ar 6.0, EAGLE-3 5 rounds 7.5, DFlash 3 rounds 7.5.
    accepted = {"eagle3": [1, 0, 0, 0, 0, 0], "dflash": [0, 0, 3, 0, 0, 0]}
    plan = solve(accepted, COSTS)
    assert plan.seconds == pytest.approx(4.0) and plan.choices == ("eagle3", "dflash") and plan.tokens == 6
    static = {c: replay(accepted, COSTS, lambda i, c=c: c) for c in CHOICES if c == "none" or c in accepted}
    assert {c: p.seconds for c, p in static.items()} == {"none": 6.0, "eagle3": 7.5, "dflash": 7.5}
    assert static["dflash"].choices == ("dflash", "dflash", "dflash")


def _brute_force(accepted: dict[str, list[int]], costs: dict[str, float]) -> float:
    """Least total cost over every sequence of choices (each sequence ends when it reaches the last state)."""
    n = len(next(iter(accepted.values())))
    best = float("inf")
    for seq in itertools.product(CHOICES, repeat=n):
        i, total = 0, 0.0
        for c in seq:
            if i >= n:
                break
            total += costs[c]
            i += (0 if c == NO_DRAFT else accepted[c][i]) + 1
        best = min(best, total)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_dp_equals_brute_force_and_beats_every_static_mode(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    accepted = {d: [rng.randint(0, n - 1 - i) for i in range(n)] for d in ("eagle3", "dflash", "suffix")}
    costs = {"none": 1.0, "eagle3": rng.uniform(1.0, 3.0), "dflash": rng.uniform(1.0, 4.0),
             "suffix": rng.uniform(1.0, 1.5)}
    plan = solve(accepted, costs)
    assert plan.seconds == pytest.approx(_brute_force(accepted, costs))
    assert replay(accepted, costs, _follow(plan.choices)).seconds == pytest.approx(plan.seconds)
    for c in CHOICES:
        assert plan.seconds <= replay(accepted, costs, lambda i, c=c: c).seconds + 1e-12
    # without skipping (bench.oracle's drafters-only headroom): never "none", the best of the drafters' sequences
    drafters = solve(accepted, {**costs, NO_DRAFT: math.inf})
    assert NO_DRAFT not in drafters.choices and drafters.seconds >= plan.seconds - 1e-12
    assert drafters.seconds == pytest.approx(_brute_force(accepted, {**costs, NO_DRAFT: math.inf}))


def _follow(choices):
    it = iter(choices)
    return lambda i: next(it)


def test_dp_rejects_missing_costs_and_ragged_lengths():
    with pytest.raises(ValueError, match="no round cost for dflash"):
        solve({"dflash": [0]}, {"none": 1.0})
    with pytest.raises(ValueError, match="different numbers of states"):
        solve({"eagle3": [0, 0], "dflash": [0]}, COSTS)
    with pytest.raises(ValueError, match="positive"):
        solve({"eagle3": [0]}, {"none": 0.0, "eagle3": 1.0})


def test_round_costs_are_mean_round_seconds_of_each_static_mode():
    def run(mode, rounds, seconds):
        return {"mode": mode, "stats": {"rounds": rounds, "phase_seconds": {"verify": seconds * 0.75,
                                                                           "draft": seconds * 0.25}}}
    records = [run("ar", 4, 2.0), run("ar", 6, 3.0), run("eagle3", 2, 3.0), run("suffix", 5, 3.0),
               run("dflash", 1, 4.0), {"mode": "dflash", "error": "boom"}]
    assert round_costs(records) == pytest.approx({"none": 0.5, "eagle3": 1.5, "dflash": 4.0, "suffix": 0.6})
    with pytest.raises(ValueError, match="needs measured dflash rounds"):
        round_costs(records[:4])


def test_num_accepted_follows_the_matching_branch_of_a_tree():
    # root 0 -> (1: 5, 2: 6); 2 -> (3: 7, 4: 8); 4 -> 5: 9
    tree = DraftTree([0, 5, 6, 7, 8, 9], [-1, 0, 0, 2, 2, 4], [0, 1, 1, 2, 2, 3])
    assert num_accepted(tree, [6, 8, 9, 1]) == 3
    assert num_accepted(tree, [6, 8, 2]) == 2
    assert num_accepted(tree, [5, 7]) == 1
    assert num_accepted(tree, [4]) == 0
    assert num_accepted(tree, [6, 8]) == 2       # the continuation ends before the tree
    assert num_accepted(DraftTree.chain(0, [1, 2, 3]), [1, 2, 4]) == 2
