"""The GEMM over a GGUF file's own blocks (kernels/ggml_gemm.h: Q4_0, Q4_1, Q8_0, quantised by gguf's reference
quantiser): its sums are those of its definition (x quantised per row and block to int8, integer block sums, the
fp32 scales) to one bf16 rounding, its rows do not depend on the other rows of the call or on the thread count, and
the fused norm and SwiGLU take it as they take a bf16 weight; every build this CPU runs (AVX2, and AVX-512 VNNI's
vpdpbusd) gives the same bits."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from whiflash_trt import kernels
from whiflash_trt.models.layers import RMSNorm

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.registered(), reason="the kernels are not loaded on this machine "
                                "(no AVX2 and FMA or no C++ compiler: conftest printed why)")

KINDS = list(kernels.GGML_BLOCK_BYTES)
SHAPES = [(203, 576), (64, 32), (8, 1536)]   # out, in: outputs padded to a group of 8, one block, one group


def ggml_weight(kind: str, out_features: int, in_features: int, seed: int = 0):
    """(the GGUF blocks, [N, K/32, block bytes] uint8; their dequantised fp32 weight)"""
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)).numpy()
    raw = quantize(w, getattr(gguf.GGMLQuantizationType, kind))
    kind_type = getattr(gguf.GGMLQuantizationType, kind)
    return kernels.ggml_blocks(torch.from_numpy(raw.copy()), kind), torch.from_numpy(
        np.array(dequantize(raw, kind_type), dtype=np.float32))


def quantised_rows(x: torch.Tensor):
    """x [M, K] bf16 -> its int8 quants [M, K/32, 32] and scales [M, K/32] as ggml_gemm.h makes them (fp32: dx =
    max |x| / 127, q = round half to even of x (1 / dx))"""
    blocks = x.float().view(x.shape[0], -1, 32)
    dx = blocks.abs().amax(-1) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    return torch.round(blocks * inv[..., None]), dx


def reference(kind: str, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The definition in float64: sum over blocks of dw dx sum(qw qx) (+ Q4_0: dw (-8 dx sum qx), Q4_1: mw dx sum
    qx), then the bias."""
    qx, dx = (t.double() for t in quantised_rows(x))
    d = blocks[..., :2].contiguous().view(torch.float16).double()[..., 0]          # [N, B]
    if kind == "Q8_0":
        qw = blocks[..., 2:].contiguous().view(torch.int8).double()
    else:
        qs = blocks[..., 4 if kind == "Q4_1" else 2:]
        qw = torch.cat([qs & 0x0F, qs >> 4], -1).double()                           # [N, B, 32]
    y = torch.einsum("nb,mb,nbi,mbi->mn", d, dx, qw, qx)
    sum_qx = qx.sum(-1)                                                              # [M, B]
    if kind == "Q4_0":
        y = y - 8 * torch.einsum("nb,mb,mb->mn", d, dx, sum_qx)
    if kind == "Q4_1":
        m = blocks[..., 2:4].contiguous().view(torch.float16).double()[..., 0]
        y = y + torch.einsum("nb,mb,mb->mn", m, dx, sum_qx)
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_ggml_gemm_is_its_definition_to_one_rounding(kind, out_features, in_features, bias):
    blocks, dense = ggml_weight(kind, out_features, in_features)
    x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(1)).bfloat16()
    b = torch.randn(out_features) if bias else None
    y = kernels.linear(x, kernels.pack_ggml(blocks), b, out_features)
    want = reference(kind, x, blocks, b)
    # fp32 sums of a few terms, then one bf16 rounding (2^-8 of the value)
    assert torch.allclose(y.double(), want, rtol=2 ** -8, atol=1e-3 * want.abs().max().item())
    # and the weight it computes from is the file's: close to x times the dequantised weight
    exact = x.float() @ dense.T + (0 if b is None else b)
    assert ((y.float() - exact).norm() / exact.norm()).item() < 0.02


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_ggml_rows_do_not_depend_on_the_call(kind, num_threads):
    blocks, _ = ggml_weight(kind, 203, 576)
    packed = kernels.pack_ggml(blocks)
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(2)).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        alone = torch.cat([kernels.linear(x[i:i + 1], packed, None, 203) for i in range(16)])
        for rows in (2, 3, 4, 5, 9, 16):
            got = kernels.linear(x[:rows], packed, None, 203)
            assert torch.equal(got.view(torch.int16), alone[:rows].view(torch.int16)), rows
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_linear_norm_and_swiglu_take_a_ggml_weight(kind):
    """The norm folded in equals the norm module then the GGML GEMM, and SwiGLU over ggml_gate_up's rows equals
    silu(gate) * up of the two GEMMs, bit for bit; their rows do not depend on the call."""
    k, inter = 576, 64
    g = torch.Generator().manual_seed(3)
    x, delta = (torch.randn(6, k, generator=g).bfloat16() for _ in range(2))
    norm = RMSNorm(k, 1e-5).to(torch.bfloat16)
    norm.weight.data = torch.rand(k, generator=g).bfloat16() + 0.5
    gate, _ = ggml_weight(kind, inter, k, seed=4)
    up, _ = ggml_weight(kind, inter, k, seed=5)
    h = x + delta
    y, h_out = kernels.linear_norm(x, delta, norm.weight, 1e-5, kernels.pack_ggml(gate), None, inter)
    assert torch.equal(h_out, h)
    plain = kernels.linear(norm(h), kernels.pack_ggml(gate), None, inter)
    # the fused norm sums its squares in the kernels' order (rows.h): equal to the module's up to that rounding
    assert (y.float() - plain.float()).abs().max().item() <= 0.02 * plain.float().abs().max().item()
    normed = kernels.linear_norm(x, delta, norm.weight, 1e-5, kernels.pack_ggml(gate), None, inter)[0]
    assert torch.equal(normed, y)
    fused = kernels.pack_ggml(kernels.ggml_gate_up(gate, up))
    act = kernels.swiglu(h, fused, inter)
    g_out = kernels.linear(h, kernels.pack_ggml(gate), None, inter)
    u_out = kernels.linear(h, kernels.pack_ggml(up), None, inter)
    assert torch.equal(act, (torch.nn.functional.silu(g_out.float()).bfloat16() * u_out).bfloat16())
    alone = torch.cat([kernels.swiglu(h[i:i + 1], fused, inter) for i in range(6)])
    assert torch.equal(act.view(torch.int16), alone.view(torch.int16))


def ggml_outputs() -> dict[str, torch.Tensor]:
    """Each kind's GEMM at the model's shapes and several row counts, as raw bf16 bits."""
    out = {}
    for kind in KINDS:
        for n, k in [(203, 576), (1536, 576), (576, 1536)]:
            blocks, _ = ggml_weight(kind, n, k, seed=n + k)
            packed = kernels.pack_ggml(blocks)
            bias = torch.randn(n, generator=torch.Generator().manual_seed(7))
            for rows in (1, 3, 7):
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16() * 3
                out[f"{kind} {n}x{k} {rows} rows"] = kernels.linear(x, packed, bias, n).view(torch.int16)
    return out


OTHER_ISAS = [isa for isa in kernels.cpu.cpu_isas() if isa != kernels.isa()]


@pytest.mark.parametrize("isa", OTHER_ISAS or [pytest.param(None, marks=pytest.mark.skip(
    reason="this CPU runs one ISA only"))])
def test_every_build_gives_the_same_bits(isa, tmp_path):
    """A process with WHIFLASH_ISA set to another build (a process holds one library) computes the same outputs."""
    path = tmp_path / f"{isa}.pt"
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import torch; "
            f"import test_ggml_kernels as t; t.kernels.ensure_loaded(); torch.save(t.ggml_outputs(), {str(path)!r})")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, kernels.ISA_ENV: isa},
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs, ours = torch.load(path), ggml_outputs()
    assert theirs.keys() == ours.keys()
    assert [key for key in ours if not torch.equal(ours[key], theirs[key])] == []


def test_ggml_weights_are_checked():
    blocks, _ = ggml_weight("Q4_1", 64, 64)
    packed = kernels.pack_ggml(blocks)
    with pytest.raises(ValueError, match="not Q5_0"):
        kernels.ggml_blocks(torch.zeros(4, 22, dtype=torch.uint8), "Q5_0")
    with pytest.raises(ValueError, match="uint8"):
        kernels.ggml_blocks(torch.zeros(4, 21, dtype=torch.uint8), "Q4_1")
    with pytest.raises(ValueError, match="pack_ggml takes"):
        kernels.pack_ggml(torch.zeros(4, 2, 20, dtype=torch.int8))
    with pytest.raises(ValueError, match="not 21"):
        kernels.pack_ggml(torch.zeros(4, 2, 21, dtype=torch.uint8))
    assert kernels.ggml_kind(blocks) == "Q4_1"
    with pytest.raises(RuntimeError, match="features"):
        kernels.linear(torch.randn(1, 96).bfloat16(), packed, None, 64)
    with pytest.raises(RuntimeError, match="out_features"):
        kernels.linear(torch.randn(1, 64).bfloat16(), packed, None, 80)
    with pytest.raises(RuntimeError, match="GGML weight must be"):
        kernels.linear(torch.randn(1, 64).bfloat16(), packed[..., :150].contiguous(), None, 64)
