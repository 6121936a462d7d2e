"""The compiled backend (builder/compile_target.py, compile_eagle3.py, compile_dflash.py, runtime/backends/compiled.py):
the AOTInductor package of the target step gives rows that do not depend on the rest of the call, and the tokens of
the eager engine; the drafters' packages compute what their modules do."""
from __future__ import annotations

import json
import re
import zipfile

import pytest
import torch

from test_row_invariance import TREE_PARENTS, Runner, assert_rows_invariant, path_to

from whiflash_trt import kernels
from whiflash_trt.builder.build import BuildOptions
from whiflash_trt.config import GenerationConfig, SpecConfig
from whiflash_trt.errors import WhiflashError
from whiflash_trt.manifest import MANIFEST
from whiflash_trt.models.contracts import Segment
from whiflash_trt.runtime.backends.compiled import CompiledDFlash, CompiledEagle3, CompiledTarget
from whiflash_trt.runtime.engine import Engine


def test_the_build_writes_the_package_and_kernels_and_loads_them(compiled_spec_engine_dir, compiled_spec_engine):
    manifest = json.loads((compiled_spec_engine_dir / MANIFEST).read_text())
    assert manifest["build_options"]["backend"] == "compiled"
    assert (compiled_spec_engine_dir / manifest["compiled"]["target"]["path"]).is_file()
    assert (compiled_spec_engine_dir / manifest["kernels"]["path"]).is_file()
    assert isinstance(compiled_spec_engine.target, CompiledTarget)
    assert manifest["compiled"]["target"]["capture_layers"] == manifest["capture_layers"]
    assert (compiled_spec_engine_dir / manifest["compiled"]["eagle3"]["path"]).is_file()
    assert isinstance(compiled_spec_engine.proposers["eagle3"].model, CompiledEagle3)
    assert (compiled_spec_engine_dir / manifest["compiled"]["dflash"]["path"]).is_file()
    assert isinstance(compiled_spec_engine.proposers["dflash"].model, CompiledDFlash)


@pytest.mark.parametrize("step", ["target", "eagle3", "dflash"])
def test_the_packages_call_the_ops_c_shims_not_the_proxy_executor(compiled_spec_engine_dir, step):
    """Every call of an op with a C shim (kernels.C_SHIMS) is a direct call of it in the package's generated code."""
    manifest = json.loads((compiled_spec_engine_dir / MANIFEST).read_text())
    with zipfile.ZipFile(compiled_spec_engine_dir / manifest["compiled"][step]["path"]) as package:
        code = "".join(package.read(name).decode() for name in package.namelist() if name.endswith("wrapper.cpp"))
    called = set(re.findall(r"AOTI_TORCH_ERROR_CODE_CHECK\(aoti_torch_cpu_(\w+)\(", code))
    assert called & set(kernels.C_SHIMS), f"no op of {sorted(kernels.C_SHIMS)} is called directly"
    assert "aoti_torch_proxy_executor_call_function" not in code


def test_the_compiled_draft_step_matches_the_eager_module(compiled_spec_engine):
    """Tree rows of several sequences over scattered slots: the package's hidden states and log-probabilities
    against the fused module's own forward (inductor may round differently in the last place: drafts, not output)."""
    model = compiled_spec_engine.proposers["eagle3"].model
    cfg = model.config
    torch.manual_seed(0)
    slots = torch.randperm(100)
    segments = [Segment(slots[:40], torch.ones(3, 40, dtype=torch.bool).tril(diagonal=37)),
                Segment(slots[40:61], torch.rand(2, 21) < 0.7)]
    segments[1].mask[:, 0] = True
    args = (torch.randn(5, cfg.hidden_size).bfloat16(), torch.randn(5, cfg.hidden_size).bfloat16(),
            torch.tensor([37, 38, 39, 20, 20]))
    pools = [torch.randn(1, 128, cfg.num_kv_heads, cfg.head_dim).bfloat16() for _ in range(2)]
    pools += [p.clone() for p in pools]
    write = torch.tensor([100, 101, 102, 103, 104])
    with torch.inference_mode():
        out, logprobs = model.draft_step(*args, pools[0], pools[1], write, segments)
        ref = model.eager.forward_segments(*args, pools[2], pools[3], write, segments)
        ref_logprobs = model.eager.draft_logprobs(ref)
    assert torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.allclose(logprobs, ref_logprobs, atol=2e-2)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])   # the same K/V written


def test_the_compiled_block_forward_matches_the_eager_module(compiled_spec_engine):
    """Two blocks over scattered context slots: the package's hidden states against the fused module's kernel
    path, the same block K/V written at the blocks' scratch slots, the context untouched."""
    model = compiled_spec_engine.proposers["dflash"].model
    cfg, b = model.config, model.config.draft_block_len
    torch.manual_seed(0)
    slots = torch.randperm(100)
    reads, writes = [slots[:40], slots[40:61]], [torch.arange(100, 100 + b), torch.arange(110, 110 + b)]
    embeds = torch.randn(2 * b, cfg.hidden_size).bfloat16()
    positions = torch.cat([torch.arange(40, 40 + b), torch.arange(21, 21 + b)])
    pools = [torch.randn(cfg.num_layers, 128, cfg.num_kv_heads, cfg.head_dim).bfloat16() for _ in range(2)]
    pools += [p.clone() for p in pools]
    with torch.inference_mode():
        out = model.forward_many(embeds, positions, pools[0], pools[1], reads, writes)
        ref = model.eager.forward_many(embeds, positions, pools[2], pools[3], reads, writes)
    assert torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    for got, want in ((pools[0], pools[2]), (pools[1], pools[3])):
        assert torch.equal(got[:, slots[:61]], want[:, slots[:61]])
        assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("context_tokens", (1, 63, 200))
def test_compiled_verify_rows_equal_one_token_steps(compiled_spec_engine, context_tokens, num_threads):
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        target = compiled_spec_engine.target
        assert_rows_invariant(target, context_tokens, chain_len=12)
        run = Runner(target, context_tokens, seed=1)
        tokens = run.tokens(len(TREE_PARENTS))
        got = run.verify(tokens, TREE_PARENTS)
        for node in range(len(TREE_PARENTS)):
            assert torch.equal(got[node], run.one_by_one([tokens[j] for j in path_to(TREE_PARENTS, node)])[-1])
    finally:
        torch.set_num_threads(before)


def test_compiled_tokens_equal_the_eager_engine(compiled_spec_engine_dir, compiled_spec_engine):
    eager = Engine.load(compiled_spec_engine_dir, backend="torch")
    gen = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    for prompt in ([5, 9, 2], list(range(3, 60)), [7] * 130):
        want = eager.generate(prompt, gen).token_ids
        assert compiled_spec_engine.generate(prompt, gen).token_ids == want
        assert compiled_spec_engine.generate(prompt, gen, spec=SpecConfig(mode="whiflash")).token_ids == want


def test_a_capture_the_package_lacks_runs_eagerly(compiled_spec_engine):
    target = compiled_spec_engine.target
    cfg = target.config
    pools = [torch.zeros(cfg.num_layers, 64, cfg.num_kv_heads, cfg.head_dim, dtype=target.dtype) for _ in range(4)]
    ids, positions = torch.tensor([3, 4, 5]), torch.arange(3)
    segment = [Segment(torch.arange(3), torch.ones(3, 3, dtype=torch.bool).tril())]
    other = tuple(i for i in range(cfg.num_layers) if i not in target.capture_layers)[:1] + target.capture_layers[:1]
    got = target.forward_segments(ids, positions, pools[0], pools[1], torch.arange(3), segment, other)
    want = target.eager.forward_segments(ids, positions, pools[2], pools[3], torch.arange(3), segment, other)
    assert torch.equal(got.captured, want.captured) and torch.equal(got.logits, want.logits)
    sub = target.forward_segments(ids, positions, pools[0], pools[1], torch.arange(3), segment,
                                  target.capture_layers[1:])
    assert sub.captured.shape[1] == cfg.hidden_size * (len(target.capture_layers) - 1)


def test_compiled_needs_bf16_and_a_package(spec_engine_dir):
    with pytest.raises(ValueError, match="bf16"):
        BuildOptions(target="x", output=spec_engine_dir.parent / "never", dtype="fp32", backend="compiled")
    with pytest.raises(WhiflashError, match="no compiled target"):
        Engine.load(spec_engine_dir, backend="compiled")


def test_a_compiled_build_prints_progress_to_stderr_only(tiny_checkpoint, tmp_path, capfd):
    """`whiflash-run --json` builds the default engine on its first run: its stdout must stay JSON lines."""
    from whiflash_trt.builder.build import build_engine

    build_engine(BuildOptions(target=str(tiny_checkpoint("llama")), output=tmp_path / "engine", dtype="bf16",
                              backend="compiled", show_progress=True))
    out, err = capfd.readouterr()
    assert out == "" and "compiling the target step" in err
