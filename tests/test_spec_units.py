"""Unit tests of the backend-free speculative math: trees, greedy verification, node selection, routers."""
from __future__ import annotations

import math
import random

import pytest
import torch

from whiflash_trt.config import GenerationConfig, SpecConfig, TreeConfig
from whiflash_trt.errors import SpecError
from whiflash_trt.spec.router import EntropyRouter, NeuralRouter, RouterMLP, RouteSignal, entropy_of
from whiflash_trt.spec.tree import DraftTree, select_nodes
from whiflash_trt.spec.verify import verify_greedy


def _logits(choices: list[int], vocab: int = 10) -> torch.Tensor:
    out = torch.zeros(len(choices), vocab)
    out[torch.arange(len(choices)), torch.tensor(choices)] = 5.0
    return out


def test_greedy_tree_walk_follows_the_target_choice_among_siblings():
    #        0(b)
    #      /   |   \
    #    1:4  2:7  3:9        the target picks 7 at the root, then 2 at node 2, then 5 at node 5
    #          |     \
    #         4:1    5:2 (child of 2)  6:3 (child of 5)
    tree = DraftTree(tokens=[0, 4, 7, 9, 1, 2, 3], parents=[-1, 0, 0, 0, 2, 2, 5], depths=[0, 1, 1, 1, 2, 2, 3])
    v = verify_greedy(tree, _logits([7, 0, 2, 0, 0, 8, 0]))
    assert v.path == [0, 2, 5] and v.tokens == [0, 7, 2] and v.bonus == 8 and v.num_accepted == 2


def test_greedy_chain_stops_at_first_mismatch():
    tree = DraftTree.chain(3, [1, 2, 6])
    v = verify_greedy(tree, _logits([1, 2, 5, 0]))
    assert v.tokens == [3, 1, 2] and v.bonus == 5
    assert verify_greedy(tree, _logits([1, 2, 6, 4])).bonus == 4          # all accepted: bonus after the last


def test_tree_mask_is_ancestors_and_self():
    tree = DraftTree(tokens=[0, 1, 2, 3], parents=[-1, 0, 0, 1], depths=[0, 1, 1, 2])
    assert tree.mask().int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert DraftTree.chain(0, [1, 2]).mask().equal(torch.ones(3, 3, dtype=torch.bool).tril())


def test_tree_rejects_children_before_parents():
    with pytest.raises(ValueError):
        DraftTree(tokens=[0, 1, 2], parents=[-1, 2, 0], depths=[0, 2, 1])


def _random_candidates(rng: random.Random, step) -> tuple[list[int], list[int], list[float]]:
    """Up to 29 candidate nodes of a draft tree: parents, depths and cumulative log-probs (each node's own log-prob
    -step(), drawn per node; a step of 0 gives ties on purpose)."""
    parents, depths, scores = [], [], []
    for i in range(rng.randrange(1, 30)):
        p = rng.randrange(-1, i) if i else -1
        parents.append(p)
        depths.append(1 if p < 0 else depths[p] + 1)
        own = -step()
        scores.append(own if p < 0 else scores[p] + own)
    return parents, depths, scores


def test_selected_nodes_always_include_their_ancestors():
    rng = random.Random(0)
    for _ in range(200):
        parents, depths, scores = _random_candidates(rng, lambda: rng.choice([0.0, 0.0, rng.random()]))
        chosen = select_nodes(scores, depths, rng.randrange(1, len(scores) + 1))
        for c in chosen:
            assert parents[c] == -1 or parents[c] in chosen
        assert [depths[c] for c in chosen] == sorted(depths[c] for c in chosen)


def test_a_probability_floor_leaves_out_the_improbable_nodes_and_keeps_the_tree_closed():
    rng = random.Random(1)
    for _ in range(200):
        parents, depths, scores = _random_candidates(rng, lambda: rng.choice([0.0, rng.random(), 3 * rng.random()]))
        budget, min_prob = rng.randrange(1, len(scores) + 1), rng.choice([0.02, 0.1, 0.5])
        chosen = select_nodes(scores, depths, budget, min_prob)
        above = [i for i in range(len(scores)) if scores[i] >= math.log(min_prob)]
        assert set(chosen) <= set(above) and len(chosen) == min(budget, len(above))
        assert all(scores[i] <= min(scores[c] for c in chosen) for i in set(above) - set(chosen))   # the best
        for c in chosen:
            assert parents[c] == -1 or parents[c] in chosen
    with pytest.raises(ValueError, match="min_prob"):
        select_nodes([0.0], [1], 1, 1.0)


def test_entropy_router_smooths_and_thresholds():
    h = torch.zeros(4)
    r = EntropyRouter(threshold=1.0, alpha=0.5)
    # smoothed: 0.2, 1.1, 1.55, 0.825, 0.4625 -> one high-entropy round alone does not flip a low streak
    assert [r.choose(RouteSignal(e, h)) for e in (0.2, 2.0, 2.0, 0.1, 0.1)] == [
        "dflash", "eagle3", "eagle3", "dflash", "dflash"]
    r = EntropyRouter(threshold=1.0, alpha=0.5)
    assert [r.choose(RouteSignal(e, h)) for e in (0.2, 1.6)] == ["dflash", "dflash"]   # (0.2 + 1.6) / 2 = 0.9


def test_entropy_of_uniform_and_peaked():
    assert abs(entropy_of(torch.zeros(8)) - torch.log(torch.tensor(8.0)).item()) < 1e-5
    assert entropy_of(torch.tensor([100.0, 0.0, 0.0])) < 1e-6


def test_neural_router_threshold_decides():
    mlp = RouterMLP(4, 3)
    with torch.no_grad():
        for p in mlp.parameters():
            p.zero_()
        mlp.fc2.bias.fill_(0.7)                          # predicts dAL = 0.7 everywhere
    h = torch.randn(4)
    assert NeuralRouter(mlp, 0.5).choose(RouteSignal(0.0, h)) == "dflash"
    assert NeuralRouter(mlp, 0.9).choose(RouteSignal(0.0, h)) == "eagle3"


def test_neural_router_without_weights_is_a_clear_error(spec_engine):
    saved = spec_engine.router_file
    spec_engine.router_file = None
    try:
        with pytest.raises(SpecError, match="^router neural needs router weights") as raised:
            spec_engine.generate([1, 2, 3], GenerationConfig(max_new_tokens=2),
                                 spec=SpecConfig(mode="whiflash", router="neural"))
        assert raised.value.param == "router"
    finally:
        spec_engine.router_file = saved


def test_mode_without_its_drafter_is_a_clear_error(spec_engine):
    saved = dict(spec_engine.proposers)
    del spec_engine.proposers["dflash"]
    try:
        with pytest.raises(SpecError, match="needs the dflash drafter, which this engine does not have; "
                                            "rebuild it with whiflash-build") as raised:
            spec_engine.generate([1, 2, 3], GenerationConfig(max_new_tokens=2), spec=SpecConfig(mode="whiflash"))
        assert raised.value.param == "mode"
    finally:
        spec_engine.proposers.update(saved)


def test_no_blocks_leak_across_hundreds_of_mixed_requests(spec_engine):
    rng = random.Random(1)
    vocab = spec_engine.target.config.vocab_size
    specs = [SpecConfig("ar"), SpecConfig("eagle3"), SpecConfig("eagle3", tree=TreeConfig(top_k=1, total_tokens=4)),
             SpecConfig("dflash"), SpecConfig("whiflash", "entropy", 1.5), SpecConfig("whiflash", "neural", 0.1),
             SpecConfig("whiflash", "entropy", 1.5, "eager")]
    for i in range(210):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randrange(1, 12))]
        spec_engine.generate(prompt, GenerationConfig(max_new_tokens=rng.randrange(1, 8)), spec=specs[i % len(specs)])
        assert spec_engine.kv.allocator.num_free == spec_engine.kv.allocator.num_blocks


def _throughput_router(expected: dict[str, float], threshold: float = 1.0):
    """A ThroughputRouter whose predictor outputs `expected` (accepted drafts of EAGLE-3, DFlash) whatever the input."""
    from whiflash_trt.spec.router import AcceptancePredictor, ThroughputRouter

    p = AcceptancePredictor(4)
    with torch.no_grad():
        p.fc2.weight.zero_()
        p.fc2.bias.copy_(torch.tensor([expected["eagle3"], expected["dflash"]]))
    costs = {"none": 1.0, "eagle3": 2.4, "dflash": 1.7}
    return ThroughputRouter(p, costs, threshold, {"eagle3": 1.0, "dflash": 0.5})


def test_the_routers_frozen_predictor_computes_the_module():
    from whiflash_trt.spec.router import FEATURES, AcceptancePredictor, FrozenPredictor

    torch.manual_seed(0)
    p = AcceptancePredictor(16)
    with torch.no_grad():
        p.mean.normal_()
        p.std.uniform_(0.5, 2.0)
    frozen = FrozenPredictor(p)
    for _ in range(20):
        x = torch.randn(len(FEATURES)) * 2
        with torch.inference_mode():
            want = p(x).tolist()
        assert frozen(x.tolist()) == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_throughput_router_drafts_only_when_it_beats_target_only_rounds():
    h = torch.zeros(4)
    # rates: none 1/1; eagle3 (a+1)/2.4; dflash (a+1)/1.7
    assert _throughput_router({"eagle3": 1.0, "dflash": 0.5}).choose(RouteSignal(1.0, h)) == "none"
    assert _throughput_router({"eagle3": 2.0, "dflash": 0.5}).choose(RouteSignal(1.0, h)) == "eagle3"   # 1.25
    assert _throughput_router({"eagle3": 2.0, "dflash": 1.4}).choose(RouteSignal(1.0, h)) == "dflash"   # 1.41
    # the threshold is the factor a drafter must win by: 1.25 does not clear 1.3
    assert _throughput_router({"eagle3": 2.0, "dflash": 0.5}, threshold=1.3).choose(RouteSignal(1.0, h)) == "none"
    # a negative prediction counts as zero accepted drafts, never as fewer than the round's one token
    assert _throughput_router({"eagle3": -5.0, "dflash": -5.0}, threshold=0.0).choose(RouteSignal(1.0, h)) != "none"


def test_throughput_router_weighs_a_free_offer_at_a_target_only_round_plus_its_rows():
    from whiflash_trt.spec.router import VERIFY_ROW, Offer, best_option

    h = torch.zeros(4)
    router = _throughput_router({"eagle3": 2.0, "dflash": 0.5})   # eagle3's rate 3 / 2.4 = 1.25
    assert router.choose(RouteSignal(1.0, h), {"suffix": Offer(0.2, 6)}) == "eagle3"    # 1.2 / 1.0
    assert router.choose(RouteSignal(1.0, h), {"suffix": Offer(0.3, 6)}) == "suffix"    # 1.3 / 1.0
    # each verified row adds round_seconds[VERIFY_ROW]: 5 more rows at 0.1 make an offer of 0.5 1.5 / 1.5
    costs = {"none": 1.0, "eagle3": 2.4, "dflash": 1.7, VERIFY_ROW: 0.1}
    expected = {"eagle3": 2.0, "dflash": 0.5}
    assert best_option(expected, costs, 1.0, {"suffix": Offer(0.5, 6)}) == "eagle3"
    assert best_option(expected, costs, 1.0, {"suffix": Offer(0.5, 2)}) == "suffix"     # 1.5 / 1.1
    assert best_option({"eagle3": 0.0, "dflash": 0.0}, costs, 1.2, {"suffix": Offer(0.1, 2)}) == "none"


def test_entropy_and_v1_rules_take_the_best_offer_past_its_threshold():
    from whiflash_trt.spec.router import Offer

    h = torch.zeros(4)
    r = EntropyRouter(threshold=1.0, alpha=1.0, offer_threshold=0.5)
    assert r.choose(RouteSignal(2.0, h), {"suffix": Offer(0.4, 4)}) == "eagle3"
    assert r.choose(RouteSignal(2.0, h), {"suffix": Offer(0.5, 4)}) == "suffix"
    assert r.choose(RouteSignal(0.5, h), {}) == "dflash"
    mlp = RouterMLP(4, 8)
    assert NeuralRouter(mlp, 0.0, offer_threshold=1.0).choose(RouteSignal(2.0, h), {"suffix": Offer(1.5, 4)}) == \
        "suffix"
    assert NeuralRouter(mlp, 0.0, offer_threshold=1.0).choose(RouteSignal(2.0, h), {"suffix": Offer(0.9, 4)}) != \
        "suffix"


def test_router_history_ema_updates_for_the_drafter_that_drafted_and_relaxes_the_other():
    from whiflash_trt.spec.router import FEATURES, RouterHistory

    hist = RouterHistory({"eagle3": 2.0, "dflash": 1.0}, alpha=0.5, relax=0.5)
    hist.update("eagle3", 4)
    assert hist.ema == {"eagle3": 3.0, "dflash": 1.0}
    hist.update("none", 0)                  # neither drafted: both relax toward their priors
    assert hist.ema == {"eagle3": 2.5, "dflash": 1.0}
    f = dict(zip(FEATURES, hist.features(0.7, 0.2)))   # the first round: its entropy is the EMA
    assert f == {"entropy": 0.7, "margin": 0.2, "ema_entropy": 0.7, "ema_eagle3": 2.5, "ema_dflash": 1.0,
                 "prev_none": 1.0, "prev_eagle3": 0.0, "prev_dflash": 0.0, "prev_accepted": 0.0}


def test_entropy_router_skips_drafting_above_its_none_threshold():
    h = torch.zeros(4)
    r = EntropyRouter(threshold=1.0, alpha=1.0, none_threshold=3.0)
    assert [r.choose(RouteSignal(e, h)) for e in (0.5, 2.0, 3.0, 5.0)] == ["dflash", "eagle3", "none", "none"]


def test_route_signal_margin_is_top1_minus_top2():
    from whiflash_trt.spec.router import route_signal

    s = route_signal(torch.log(torch.tensor([0.6, 0.3, 0.1])), torch.zeros(2), "eagle3", 2)
    assert abs(s.margin - 0.3) < 1e-5 and abs(s.entropy - 0.8979457) < 1e-5   # -(.6 ln .6 + .3 ln .3 + .1 ln .1)
    assert (s.drafter, s.accepted) == ("eagle3", 2)
    for seed in range(5):     # against softmax in fp64, vocabulary-sized bf16 logits
        logits = (torch.randn(49152, generator=torch.Generator().manual_seed(seed)) * 4).bfloat16()
        p = torch.softmax(logits.double(), 0)
        top = p.topk(2).values
        s = route_signal(logits, torch.zeros(2))
        assert abs(s.entropy - float(-(p * p.log()).sum())) < 1e-4 and abs(s.margin - float(top[0] - top[1])) < 1e-6
    assert route_signal(torch.tensor([2.0, 2.0, 0.0]), torch.zeros(2)).margin == 0.0     # a tie
    assert route_signal(torch.tensor([3.0]), torch.zeros(2)).margin == 1.0
