"""The whole speculative loop on an onnx engine gives the torch engine's greedy tokens, in every mode."""
from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")  # the exporter

from whiflash_trt.builder.build import BuildOptions  # noqa: E402
from whiflash_trt.config import GenerationConfig, SpecConfig, TreeConfig  # noqa: E402
from whiflash_trt.runtime.engine import Engine  # noqa: E402

# The tiny random target is near-uniform (entropy ~5.6906 nats) and the random router (seed 3) predicts around 0:
# these thresholds make whiflash switch between the drafters within one request (the test checks that it does).
SPECS = [SpecConfig("ar"), SpecConfig(mode="eagle3"),
         SpecConfig(mode="eagle3", tree=TreeConfig(top_k=1, depth=4, total_tokens=5)), SpecConfig(mode="dflash"),
         SpecConfig(mode="whiflash", router="entropy", threshold=5.6906),
         SpecConfig(mode="whiflash", router="entropy", threshold=5.6906, catch_up="eager"),
         SpecConfig(mode="whiflash", router="neural", threshold=0.0)]


@pytest.fixture(scope="module")
def engines(onnx_engine_dirs):
    torch_dir, onnx_dir = onnx_engine_dirs
    return Engine.load(torch_dir), Engine.load(onnx_dir)


def prompts(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [[rng.randrange(1, 300) for _ in range(rng.randrange(2, 30))] for _ in range(n)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.mode}-{s.router}-{s.catch_up}-k{s.tree.top_k}")
def test_onnx_engine_greedy_tokens_equal_torch_engine(engines, spec):
    torch_engine, onnx_engine = engines
    gen = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    used = {}
    for prompt in prompts(2):
        ref = torch_engine.generate(prompt, gen, spec=SpecConfig("ar"))   # target only, torch
        out = onnx_engine.generate(prompt, gen, spec=spec)
        assert out.token_ids == ref.token_ids
        assert torch_engine.generate(prompt, gen, spec=spec).token_ids == ref.token_ids
        for name, n in out.stats.get("rounds_per_drafter", {}).items():
            used[name] = used.get(name, 0) + n
    if spec.mode == "whiflash":
        assert used.get("eagle3") and used.get("dflash"), used      # the router really switched
    assert onnx_engine.kv.allocator.num_free == onnx_engine.kv.allocator.num_blocks


def test_whiflash_run_cli_on_onnx_engine_prints_torch_tokens(onnx_engine_dirs, capsys):
    from whiflash_trt.cli import run_main

    _, onnx_dir = onnx_engine_dirs
    args = ["--prompt", "def add(a, b):", "--max-new-tokens", "12", "--mode", "whiflash", "--json"]
    assert run_main(["--engine", str(onnx_dir)] + args) == 0
    onnx_out = json.loads(capsys.readouterr().out)
    assert run_main(["--engine", str(onnx_dir), "--backend", "torch"] + args) == 0
    torch_out = json.loads(capsys.readouterr().out)
    assert onnx_out["token_ids"] == torch_out["token_ids"] and onnx_out["stats"]["mode"] == "whiflash"


def test_onnx_engine_manifest_records_backend_and_export(onnx_engine_dirs):
    torch_dir, onnx_dir = onnx_engine_dirs
    m = json.loads((onnx_dir / "manifest.json").read_text())
    assert m["build_options"]["backend"] == "onnx"
    assert m["onnx"]["plugin"]["domain"] == "trt.plugins"
    assert "onnx" not in json.loads((torch_dir / "manifest.json").read_text())


def test_onnx_backend_refuses_bf16_before_any_work():
    with pytest.raises(ValueError, match="--dtype fp32"):
        BuildOptions(target="smollm2-135m", output="unused", backend="onnx", dtype="bf16")


def test_torch_engine_has_no_onnx_graphs_to_run(onnx_engine_dirs):
    from whiflash_trt.errors import WhiflashError

    with pytest.raises(WhiflashError, match="has no onnx graphs; rebuild it with whiflash-build backend onnx"):
        Engine.load(onnx_engine_dirs[0], backend="onnx")
