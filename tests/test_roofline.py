"""The roofline's byte count is what a decode step reads: every parameter of the target once (an untied embedding
table only one row) plus the K/V of the context; its rates are measured, positive, at the current thread count; the
engine's decode step is timed against the read turn by turn."""
from __future__ import annotations

import pytest
import torch

from whiflash_trt.bench.roofline import (gemm_macs_per_row, interleaved_decode, measure_gemm_compute,
                                       measure_stream_rates, roofline, step_bytes, verify_floor)
from whiflash_trt.config import ModelConfig
from whiflash_trt.models.target import TargetModel


@pytest.mark.parametrize("tied", [True, False])
def test_step_bytes_count_every_weight_a_step_reads(tied):
    cfg = ModelConfig(architecture="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=128,
                      tie_word_embeddings=tied)
    model = TargetModel(cfg).to(torch.bfloat16)
    params = {id(p): p for p in model.parameters()}.values()      # a tied table counts once
    read = sum(p.numel() for p in params) - (0 if tied else cfg.vocab_size * cfg.hidden_size - cfg.hidden_size)
    got = step_bytes(cfg, torch.bfloat16, context=10)
    assert got["weights"] == 2 * read
    assert got["kv_cache"] == 2 * cfg.num_layers * 10 * cfg.num_kv_heads * cfg.head_dim * 2


def test_roofline_limit_follows_from_bytes_and_the_best_rate():
    torch.set_num_threads(1)
    rates = measure_stream_rates(hidden=64, rows=128, repeats=2)
    assert rates.threads == 1 and rates.plain_read > 0 and rates.best_kernel == max(rates.kernels.values())
    cfg = ModelConfig(architecture="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=64)
    out = roofline(cfg, torch.float32, 32, rates)
    seconds = out["bytes"]["total"] / (max(rates.plain_read, rates.best_kernel) * 1e9)
    assert out["limit_ms_per_step"] == pytest.approx(seconds * 1e3, abs=0.01)


def test_verify_floor_is_the_slower_of_bytes_and_gemm_multiply_adds():
    torch.set_num_threads(1)
    rates = measure_stream_rates(hidden=64, rows=128, repeats=2)
    compute = measure_gemm_compute(hidden=64, repeats=2, calls=2)
    assert compute.gmacs > 0 and compute.threads == 1
    cfg = ModelConfig(architecture="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=64)
    # every projection (q, k, v, o, gate, up, down) and the LM head, once per row
    assert gemm_macs_per_row(cfg) == 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128) + 1000 * 64
    floors = verify_floor(cfg, torch.bfloat16, 32, rates, compute, rows=(1, 16, 4096))
    memory_ms = roofline(cfg, torch.bfloat16, 32, rates)["limit_ms_per_step"]
    for t, f in floors.items():
        assert f["memory_ms"] == pytest.approx(memory_ms, abs=0.01)
        assert f["compute_ms"] == pytest.approx(t * gemm_macs_per_row(cfg) / compute.gmacs / 1e6, abs=0.01)
        assert f["floor_ms"] == max(f["memory_ms"], f["compute_ms"])
    assert floors[4096]["compute_ms"] > floors[16]["compute_ms"] > floors[1]["compute_ms"]


def test_interleaved_decode_times_the_engines_step_against_each_turns_read(spec_engine):
    torch.set_num_threads(1)
    cfg = spec_engine.target.config
    out = interleaved_decode(spec_engine, context=20, turns=3)
    assert out["bytes"] == step_bytes(cfg, spec_engine.target.dtype, 20)["total"]
    assert out["step_ms"] > 0 and out["plain_read_gbs"] > 0
    assert out["roofline_ms"] == pytest.approx(out["bytes"] / (out["plain_read_gbs"] * 1e9) * 1e3, rel=0.05, abs=0.01)
    lo, hi = out["step_over_roofline_range"]
    assert lo <= out["step_over_roofline"] <= hi
    with pytest.raises(ValueError, match="turns"):
        interleaved_decode(spec_engine, context=20, turns=0)
