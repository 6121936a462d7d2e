"""bf16 runs on any CPU torch runs on: with the engine's kernels not used and oneDNN's bf16 GEMM unavailable (the
case of every AVX2-only CPU), a bf16 engine loads, its linears widen to fp32 inside row_linear's fixed-order GEMM,
and greedy output in every speculative mode equals `ar`'s token for token. On a CPU where oneDNN's bf16 reorder
exists it is made to raise here, so a call that still reached it would fail the test."""
from __future__ import annotations

import random

import pytest
import torch

from whiflash_trt import kernels
from whiflash_trt.config import DFlashTreeConfig, GenerationConfig, SpecConfig, TreeConfig
from whiflash_trt.models import layers

SPECS = [
    SpecConfig(mode="eagle3", tree=TreeConfig(top_k=3, depth=3, total_tokens=8)),
    SpecConfig(mode="dflash", dflash_tree=DFlashTreeConfig(total_tokens=9, top_k=2)),
    SpecConfig(mode="whiflash", router="entropy", threshold=1.5),
]


def _no_onednn_reorder(*args, **kwargs):
    raise AssertionError("oneDNN's bf16 reorder was called with its bf16 path made unavailable")


@pytest.fixture(scope="module")
def slow_path_engine(spec_engine_dir):
    """spec_engine_dir loaded in bf16 as an AVX2-only CPU without the kernels loads it."""
    from whiflash_trt.runtime.engine import Engine

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "registered", lambda: False)
        patch.setattr(kernels.ops, "registered", lambda: False)   # what the ops themselves ask (kernels/ops.py)
        patch.setattr(layers, "onednn_bf16", lambda: False)
        patch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", _no_onednn_reorder)
        engine = Engine.load(spec_engine_dir, dtype="bf16", backend="torch")
        yield engine


def test_bf16_loads_on_the_widened_path(slow_path_engine):
    assert slow_path_engine.target.dtype == torch.bfloat16
    head = slow_path_engine.target.head
    assert head.widened is not None and head.widened.dtype == torch.float32 and head.packed is None


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.mode)
def test_bf16_speculative_greedy_equals_ar_without_fast_paths(slow_path_engine, spec):
    engine = slow_path_engine
    rng = random.Random(7)
    vocab = engine.target.config.vocab_size
    for i in range(3):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randrange(2, 30))]
        gen = GenerationConfig(max_new_tokens=12 + 9 * i)
        ref = engine.generate(prompt, gen, spec=SpecConfig(mode="ar"))
        out = engine.generate(prompt, gen, spec=spec)
        assert out.token_ids == ref.token_ids, f"prompt {i}: {spec.mode} differs from ar in bf16"
    assert engine.kv.allocator.num_free == engine.kv.allocator.num_blocks
