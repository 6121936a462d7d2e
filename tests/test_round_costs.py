"""The throughput router file at load: round costs measured at an engine's first load on a machine and read back at
later loads, then kept current by the rounds; a warning when a request drafts other trees than the router was fit
for."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tiny_drafters import build_tiny_engine, save_drafters
from whiflash_trt.runtime.engine import Engine
from whiflash_trt.runtime.round_costs import LiveRoundSeconds, calibration_key
from whiflash_trt.spec.router import FEATURES, VERIFY_ROW, AcceptancePredictor
from whiflash_trt.spec.router_file import save_throughput_router


@pytest.fixture(scope="module")
def v2_engine_dir(tmp_path_factory, tiny_checkpoint):
    folder = tmp_path_factory.mktemp("v2-router")
    costs = {"none": 1.0, "eagle3": 2.0, "dflash": 2.0}
    save_throughput_router(AcceptancePredictor(4, len(FEATURES)), folder / "router.safetensors", 1.0,
                           {"eagle3": 0.0, "dflash": 0.0}, costs, 0.5, 0.0)
    target = tiny_checkpoint("spec")
    return build_tiny_engine(target, folder / "engine", router=folder / "router.safetensors",
                             **save_drafters(folder, target, router=False))


def choice_costs(engine) -> dict[str, float]:
    """The round costs of the routing choices (without the seconds a verified row adds)."""
    return {k: v for k, v in engine.round_seconds.items() if k != VERIFY_ROW}


def test_costs_are_measured_once_and_read_back(v2_engine_dir, tmp_path):
    first = Engine.load(v2_engine_dir, round_costs_cache=tmp_path)
    files = list(tmp_path.glob("*.json"))
    assert [f.stem for f in files] == [calibration_key(first)]
    assert set(first.round_seconds) == {"none", "eagle3", "dflash", VERIFY_ROW}
    assert min(choice_costs(first).values()) > 0 and first.round_seconds[VERIFY_ROW] >= 0
    # two measurements never agree to the last bit: equal costs mean the second load read the first's
    again = Engine.load(v2_engine_dir, round_costs_cache=tmp_path)
    assert again.round_seconds == first.round_seconds
    fresh = Engine.load(v2_engine_dir, round_costs_cache=None)
    assert fresh.round_seconds != first.round_seconds


def test_the_key_changes_with_what_the_costs_depend_on(v2_engine_dir, tmp_path):
    engine = Engine.load(v2_engine_dir, round_costs_cache=tmp_path)
    key = calibration_key(engine)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert calibration_key(engine) != key
    finally:
        torch.set_num_threads(threads)
    assert calibration_key(engine) == key


@pytest.mark.parametrize("content", ["not json", json.dumps({"round_seconds": {"none": -1.0}}), json.dumps([1])])
def test_a_bad_cache_entry_is_measured_again(v2_engine_dir, tmp_path, content):
    engine = Engine.load(v2_engine_dir, round_costs_cache=tmp_path)
    path = tmp_path / f"{calibration_key(engine)}.json"
    path.write_text(content)
    again = Engine.load(v2_engine_dir, round_costs_cache=tmp_path)
    assert min(choice_costs(again).values()) > 0
    assert json.loads(path.read_text())["round_seconds"] == again.round_seconds


def test_the_engine_says_once_when_a_request_drafts_other_trees_than_the_router_was_fit_for(tmp_path,
                                                                                            tiny_checkpoint, capsys):
    from whiflash_trt.config import SpecConfig, TreeConfig

    target = tiny_checkpoint("spec")
    drafters = save_drafters(tmp_path, target, router=False)
    probe = Engine.load(build_tiny_engine(target, tmp_path / "probe", **drafters), round_costs_cache=tmp_path)
    fitted = probe.tree_shapes(SpecConfig(mode="whiflash"))
    assert fitted["eagle3"] == dataclasses.asdict(TreeConfig()) and fitted["dflash"]["top_k"] is None
    save_throughput_router(AcceptancePredictor(4, len(FEATURES)), tmp_path / "router.safetensors", 1.0,
                           {"eagle3": 0.0, "dflash": 0.0}, {"none": 1.0, "eagle3": 2.0, "dflash": 2.0}, 0.5, 0.0,
                           trees=fitted)
    engine = Engine.load(build_tiny_engine(target, tmp_path / "engine", router=tmp_path / "router.safetensors",
                                           **drafters), round_costs_cache=tmp_path)
    capsys.readouterr()
    engine.router_for(SpecConfig(mode="whiflash", router="neural"))
    assert capsys.readouterr().err == ""
    other = SpecConfig(mode="whiflash", router="neural", tree=TreeConfig(top_k=2, depth=3, total_tokens=5))
    engine.router_for(other)
    engine.router_for(other)
    err = capsys.readouterr().err
    assert err.count("the router was fit for draft trees") == 1 and '"total_tokens": 5' in err


def test_a_router_file_from_before_the_probability_floor_matches_trees_without_one(tmp_path, tiny_checkpoint, capsys):
    """Its trees record no min_prob: they had none, so requests drafting the same shapes unpruned are not warned
    about, and pruned ones are."""
    from whiflash_trt.config import DFlashTreeConfig, SpecConfig, TreeConfig

    target = tiny_checkpoint("spec")
    drafters = save_drafters(tmp_path, target, router=False)
    probe = Engine.load(build_tiny_engine(target, tmp_path / "probe", **drafters), round_costs_cache=tmp_path)
    unpruned = SpecConfig(mode="whiflash", router="neural", tree=TreeConfig(3, 2, 6, min_prob=0.0),
                          dflash_tree=DFlashTreeConfig(min_prob=0.0))
    legacy = {d: {k: v for k, v in shape.items() if k != "min_prob"}
              for d, shape in probe.tree_shapes(unpruned).items()}
    save_throughput_router(AcceptancePredictor(4, len(FEATURES)), tmp_path / "router.safetensors", 1.0,
                           {"eagle3": 0.0, "dflash": 0.0}, {"none": 1.0, "eagle3": 2.0, "dflash": 2.0}, 0.5, 0.0,
                           trees=legacy)
    engine = Engine.load(build_tiny_engine(target, tmp_path / "engine", router=tmp_path / "router.safetensors",
                                           **drafters), round_costs_cache=tmp_path)
    capsys.readouterr()
    engine.router_for(unpruned)
    assert capsys.readouterr().err == ""
    engine.router_for(SpecConfig(mode="whiflash", router="neural", tree=TreeConfig(3, 2, 6, min_prob=0.05),
                                 dflash_tree=DFlashTreeConfig(min_prob=0.0)))
    assert '"min_prob": 0.05' in capsys.readouterr().err


def test_a_node_count_left_to_the_machine_matches_the_same_count_named(tmp_path, tiny_checkpoint, capsys):
    """A router file records a node count the request left to the machine as None (runtime.tree_defaults): on this
    machine it stands for that default, so a request naming the same count is not warned about and one more is."""
    from whiflash_trt.config import DFlashTreeConfig, SpecConfig, TreeConfig

    target = tiny_checkpoint("spec")
    drafters = save_drafters(tmp_path, target, router=False)
    probe = Engine.load(build_tiny_engine(target, tmp_path / "probe", **drafters), round_costs_cache=tmp_path)
    fitted = probe.tree_shapes(SpecConfig(mode="whiflash"))
    assert fitted["eagle3"]["total_tokens"] is None and fitted["dflash"]["total_tokens"] is None
    save_throughput_router(AcceptancePredictor(4, len(FEATURES)), tmp_path / "router.safetensors", 1.0,
                           {"eagle3": 0.0, "dflash": 0.0}, {"none": 1.0, "eagle3": 2.0, "dflash": 2.0}, 0.5, 0.0,
                           trees=fitted)
    engine = Engine.load(build_tiny_engine(target, tmp_path / "engine", router=tmp_path / "router.safetensors",
                                           **drafters), round_costs_cache=tmp_path)
    nodes = {d: p.max_tree_tokens() for d, p in engine.proposers.items()}
    capsys.readouterr()
    engine.router_for(SpecConfig(mode="whiflash", router="neural", tree=TreeConfig(total_tokens=nodes["eagle3"]),
                                 dflash_tree=DFlashTreeConfig(total_tokens=nodes["dflash"])))
    assert capsys.readouterr().err == ""
    engine.router_for(SpecConfig(mode="whiflash", router="neural", tree=TreeConfig(total_tokens=nodes["eagle3"] + 1)))
    assert f'"total_tokens": {nodes["eagle3"] + 1}' in capsys.readouterr().err


def test_live_round_seconds_move_toward_each_observed_round():
    costs = LiveRoundSeconds({"none": 1.0, "eagle3": 2.0})
    costs.observe("none", 1.5)
    assert costs["none"] == pytest.approx(1.0 + LiveRoundSeconds.ALPHA * 0.5) and costs["eagle3"] == 2.0
    costs.observe("dflash", 1.0)     # not seeded: not tracked
    costs.observe("eagle3", 0.0)     # no time measured: no change
    assert dict(costs) == {"none": pytest.approx(1.025), "eagle3": 2.0}
    for _ in range(200):
        costs.observe("eagle3", 0.5)
    assert costs["eagle3"] == pytest.approx(0.5, rel=1e-3)
    costs.observe("eagle3", 50.0)    # a stall counts as twice the cost, no more
    assert costs["eagle3"] == pytest.approx(0.5 * (1 + LiveRoundSeconds.ALPHA), rel=1e-3)
    fixed = LiveRoundSeconds({"none": 1.0}, alpha=0.0)
    fixed.observe("none", 3.0)
    assert fixed["none"] == 1.0
    with pytest.raises(ValueError, match="alpha"):
        LiveRoundSeconds({"none": 1.0}, alpha=1.5)


def test_the_throughput_router_weighs_the_costs_as_they_are_at_each_choice():
    from whiflash_trt.spec.router import RouteSignal, ThroughputRouter

    p = AcceptancePredictor(4)
    with torch.no_grad():
        p.fc2.weight.zero_()
        p.fc2.bias.copy_(torch.tensor([1.0, 0.0]))   # EAGLE-3 commits 2 tokens a round, DFlash 1
    costs = LiveRoundSeconds({"none": 1.0, "eagle3": 1.5, "dflash": 1.5})
    router = ThroughputRouter(p, costs, 1.0, {"eagle3": 1.0, "dflash": 0.0})
    signal = RouteSignal(1.0, torch.zeros(4), 0.5)
    assert router.choose(signal) == "eagle3"          # 2 / 1.5 s beats 1 / 1 s
    for _ in range(100):                              # EAGLE-3's rounds now take 3 s
        costs.observe("eagle3", 3.0)
    assert router.choose(signal) == "none"            # 2 / ~3 s does not


def test_the_engine_keeps_the_costs_current_from_the_rounds_a_request_runs_alone(v2_engine_dir, tmp_path):
    from whiflash_trt.config import GenerationConfig, SpecConfig
    from whiflash_trt.runtime.batch import Batch

    engine = Engine.load(v2_engine_dir, round_costs_cache=tmp_path)
    engine.round_seconds = {"none": 100.0, "eagle3": 100.0, "dflash": 100.0}   # far from any round here
    gen = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    engine.generate([5, 6, 7], gen, spec=SpecConfig(mode="ar"))
    assert engine.round_seconds["none"] < 100.0 * (1 - LiveRoundSeconds.ALPHA / 2) ** 5
    assert (engine.round_seconds["eagle3"], engine.round_seconds["dflash"]) == (100.0, 100.0)
    engine.generate([5, 6, 7], gen, spec=SpecConfig(mode="dflash"))
    assert engine.round_seconds["dflash"] < 100.0 and engine.round_seconds["eagle3"] == 100.0
    # two requests in one batch share each round (one target forward): no round is either one's alone
    before = dict(engine.round_seconds)
    batch = Batch(engine, max_running=2)
    for prompt in ([5, 6, 7], [8, 9, 10]):
        batch.submit(engine.request(prompt, gen, SpecConfig(mode="eagle3"), None))
    batch.run()
    assert dict(engine.round_seconds) == before
