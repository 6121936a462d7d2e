"""The throughput router file at load: round costs measured at an engine's first load on a machine and read back at
later loads; a warning when a request drafts other trees than the router was fit for."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tiny_drafters import build_tiny_engine, save_drafters
from whiflash_trt.runtime.engine import Engine
from whiflash_trt.runtime.round_costs import calibration_key
from whiflash_trt.spec.router import FEATURES, AcceptancePredictor
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


def test_costs_are_measured_once_and_read_back(v2_engine_dir, tmp_path):
    first = Engine.load(v2_engine_dir, round_costs_cache=tmp_path)
    files = list(tmp_path.glob("*.json"))
    assert [f.stem for f in files] == [calibration_key(first)]
    assert set(first.round_seconds) == {"none", "eagle3", "dflash"} and min(first.round_seconds.values()) > 0
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
    assert min(again.round_seconds.values()) > 0
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
