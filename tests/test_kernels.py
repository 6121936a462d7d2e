"""The engine's bf16 GEMM kernel (whiflash_trt/kernels), in each inner loop this CPU runs: the products of F.linear
up to one bf16 rounding, and rows that do not depend on the other rows of the call or on the thread count (what
lossless verification needs); the loop a process runs is chosen once per CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from whiflash_trt import kernels
from whiflash_trt.models.layers import FrozenLinear, RMSNorm, apply_rope

pytestmark = pytest.mark.skipif(not kernels.registered(), reason="the kernels are not loaded on this machine "
                                "(no AVX2 and FMA or no C++ compiler: conftest printed why)")

SHAPES = [(960, 576), (577, 64), (200, 1536), (64, 2)]   # out, in: padded and single-block outputs included


@pytest.fixture(params=kernels.available_gemms())
def gemm(request):
    """Each test using it runs once per GEMM loop; the process's own loop is restored after."""
    before = kernels.set_gemm(request.param)
    yield request.param
    kernels.set_gemm(before)


@pytest.fixture(params=["vector", "amx"] if "amx" in kernels.available_gemms() else ["vector"])
def attention_path(request):
    """Each attention test runs once per path this CPU has: the AMX one (kernels/attention_amx.cpp) is taken for bf16
    heads of a multiple of 64 dims in a process whose GEMM loop is AMX, the vector one (simd.h) otherwise."""
    before = kernels.set_gemm("amx" if request.param == "amx" else "fma")
    yield request.param
    kernels.set_gemm(before)


def weights(out_features: int, in_features: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g) if bias else None
    return w, b


@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_fp32_linear_to_one_rounding(gemm, out_features, in_features, bias):
    w, b = weights(out_features, in_features, bias)
    x = torch.randn(7, in_features).bfloat16()
    got = kernels.linear(x, kernels.pack_weight(w), b, out_features)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.bfloat16 and got.shape == (7, out_features)
    # one bf16 rounding (half an ulp, 2^-9 relative) plus fp32 accumulation error
    assert torch.allclose(got.double(), want, rtol=2 ** -8, atol=1e-4 * in_features ** 0.5)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_kernel_rows_do_not_depend_on_the_call(gemm, out_features, in_features, num_threads):
    w, b = weights(out_features, in_features, bias=True)
    packed = kernels.pack_weight(w)
    x = torch.randn(37, in_features).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        alone = torch.cat([kernels.linear(x[i:i + 1], packed, b, out_features) for i in range(37)])
        for rows in (2, 3, 4, 5, 8, 16, 37):
            together = kernels.linear(x[:rows], packed, b, out_features)
            assert torch.equal(together, alone[:rows]), f"{rows} rows differ from the rows alone"
            shifted = kernels.linear(x[37 - rows:], packed, b, out_features)
            assert torch.equal(shifted, alone[37 - rows:]), f"the last {rows} rows differ from the rows alone"
    finally:
        torch.set_num_threads(before)


def unpack_int8(packed: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q [N, K], s [N]) from pack_int8's layout"""
    k = packed.shape[1] - 4
    q = packed[:, :k].transpose(1, 2).reshape(-1, k)[:out_features]
    return q, packed[:, k:].contiguous().view(torch.float32).flatten()[:out_features]


@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_int8_weight_matches_its_dequantised_linear_to_one_rounding(gemm, out_features, in_features):
    w, _ = weights(out_features, in_features, bias=False)
    packed = kernels.pack_int8(w)
    assert packed.dtype == torch.int8 and packed.shape == ((out_features + 63) // 64, in_features + 4, 64)
    q, scale = unpack_int8(packed, out_features)
    # the quantisation: per row, the largest weight at +-127 and every weight within half a step
    assert torch.equal(q.abs().amax(1), torch.full((out_features,), 127, dtype=torch.int8))
    assert (q.double() * scale.double()[:, None] - w.double()).abs().le(scale.double()[:, None] / 2 * 1.001).all()
    for rows, many_rows in ((3, False), (7, False), (3, True), (7, True)):   # many_rows: the process's loop (AMX)
        x = torch.randn(rows, in_features).bfloat16()
        got = kernels.linear(x, packed, None, out_features, many_rows)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        want = (x.double() @ q.double().T) * scale.double()
        # one bf16 rounding plus fp32 accumulation error (the products are exact; their sum cancels, hence the atol)
        assert torch.allclose(got.double(), want, rtol=2 ** -8,
                              atol=1e-5 * in_features ** 0.5 * scale.max().item() * 127)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_int8_rows_do_not_depend_on_the_call(gemm, num_threads):
    w, _ = weights(200, 576, bias=False)
    packed = kernels.pack_int8(w)
    x = torch.randn(13, 576).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        alone = torch.cat([kernels.linear(x[i:i + 1], packed, None, 200) for i in range(13)])
        for rows in (2, 3, 6, 7, 13):
            assert torch.equal(kernels.linear(x[:rows], packed, None, 200), alone[:rows])
            assert torch.equal(kernels.linear(x[13 - rows:], packed, None, 200), alone[13 - rows:])
    finally:
        torch.set_num_threads(before)


def test_int8_weights_are_for_a_bias_free_bf16_head_and_checked():
    w, b = weights(64, 576, bias=True)
    assert FrozenLinear(w, int8=True).kernel_weight.dtype == torch.int8
    assert FrozenLinear(w, b, int8=True).kernel_weight.dtype == torch.int32     # a bias: the bf16 GEMM
    assert FrozenLinear(w.float(), int8=True).kernel_weight.dtype == torch.float32
    x = torch.randn(2, 576).bfloat16()
    with pytest.raises(ValueError, match="no bias"):
        kernels.linear(x, kernels.pack_int8(w), b, 64)
    with pytest.raises(RuntimeError, match=r"K \+ 4"):
        torch.ops.whiflash.linear_i8(x[:, :512], kernels.pack_int8(w), 64)
    with pytest.raises(RuntimeError, match="out_features"):
        torch.ops.whiflash.linear_i8(x, kernels.pack_int8(w), 65)


def norm_case(rows: int, seed: int = 0):
    """x, delta [rows, 576] bf16, a bf16 RMSNorm over 576 and a [gate; up] weight [2 x 1536, 576]"""
    g = torch.Generator().manual_seed(seed)
    x, delta = (torch.randn(2, rows, 576, generator=g) * 2).bfloat16()
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.rand(576, generator=g) + 0.5
    return x, delta, norm.bfloat16(), (torch.randn(3072, 576, generator=g) * 0.05).bfloat16()


def test_linear_norm_adds_normalises_and_projects_as_the_modules_do(gemm):
    x, delta, norm, w = norm_case(19)
    y, h = kernels.linear_norm(x, delta, norm.weight, norm.eps, kernels.pack_weight(w), None, 3072)
    assert torch.equal(h, x + delta)   # the residual add: one bf16 rounding, as in the decoder layer
    want = kernels.linear(norm(x + delta), kernels.pack_weight(w), None, 3072)
    # the sum of squares is ordered otherwise than torch's: a norm may differ in its last bit, rarely
    assert (y == want).float().mean() > 0.99 and torch.allclose(y.float(), want.float(), rtol=2 ** -7, atol=1e-3)
    alone, h_alone = kernels.linear_norm(x, None, norm.weight, norm.eps, kernels.pack_weight(w), None, 3072)
    assert torch.equal(h_alone, x) and h_alone.data_ptr() != x.data_ptr()   # no delta: h is x, a tensor of its own


def test_linear_norm_swiglu_equals_silu_of_its_gate_and_up_to_the_bit(gemm):
    x, delta, norm, w = norm_case(19)
    gate_up, _ = kernels.linear_norm(x, delta, norm.weight, norm.eps, kernels.pack_weight(w), None, 3072)
    gate, up = gate_up.chunk(2, -1)
    fused, _ = kernels.linear_norm(x, delta, norm.weight, norm.eps, kernels.pack_gate_up(w), None, 1536, silu=True)
    assert torch.equal(fused, F.silu(gate) * up)
    plain = kernels.linear(x, kernels.pack_weight(w), None, 3072).chunk(2, -1)
    assert torch.equal(kernels.swiglu(x, kernels.pack_gate_up(w), 1536), F.silu(plain[0]) * plain[1])
    _, h = kernels.linear_norm(x, None, None, 0.0, kernels.pack_gate_up(w), None, 1536, silu=True)
    assert h.shape == (0, 576)   # no norm, no residual stream: nothing copied


def test_swiglu_equals_silu_to_the_bit_for_every_finite_bf16_gate(gemm):
    """The gate reaches SwiGLU as bf16: 65,280 finite values, all of them tried. Row r of x is the unit vector e_r,
    so gate output i of row r is W_gate[i, r], one finite bf16 value each; up is 1. In a build with AVX-512 BF16 a
    silu below fp32's smallest normal comes out as a zero of its sign (it rounds to bf16 with VCVTNEPS2BF16, which
    flushes subnormals; torch rounds them, as the other builds do)."""
    inter, k = 1536, 44
    finite = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = finite[torch.isfinite(finite)]
    gate_w = torch.zeros(k * inter, dtype=torch.bfloat16)
    gate_w[:finite.numel()] = finite
    w = torch.cat([gate_w.view(k, inter).t(), torch.ones(inter, k, dtype=torch.bfloat16)])
    x = torch.eye(k, dtype=torch.bfloat16)
    gate, up = kernels.linear(x, kernels.pack_weight(w), None, 2 * inter).chunk(2, -1)
    assert gate.unique().numel() > 65000 and torch.equal(up, torch.ones_like(up))
    want = F.silu(gate) * up
    silu32 = F.silu(gate.float())
    if kernels.loaded_isa() in ("avx512bf16", "amx"):
        subnormal = (silu32 != 0) & (silu32.abs() < torch.finfo(torch.float32).tiny)
        want[subnormal] = torch.copysign(torch.zeros_like(want[subnormal]), want[subnormal])
    got = kernels.swiglu(x, kernels.pack_gate_up(w), inter)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))   # to the bit: the sign of a zero as well


@pytest.mark.parametrize("num_threads", [1, 2, 3])   # 3: threads that share a normalisation split the rows unevenly
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("narrow", [False, True])   # outputs for 1-3 units of work: fewer than the threads
@pytest.mark.parametrize("int8", [False, True])     # a drafter's layers: an int8 weight (AMX: widened into tiles)
def test_linear_norm_rows_do_not_depend_on_the_call(gemm, num_threads, silu, narrow, int8):
    x, delta, norm, w = norm_case(37)
    if narrow:   # SwiGLU: 32 gate and their 32 up outputs (one block); else 48 outputs (three 16-output tiles)
        w = torch.cat([w[:32], w[1536:1568]]) if silu else w[:48]
    packed = kernels.pack_gate_up(w, int8) if silu else kernels.pack_int8(w) if int8 else kernels.pack_weight(w)
    out = w.shape[0] // 2 if silu else w.shape[0]
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        alone = [kernels.linear_norm(x[i:i + 1], delta[i:i + 1], norm.weight, norm.eps, packed, None, out, silu)
                 for i in range(37)]
        for rows in (2, 5, 16, 37):
            y, h = kernels.linear_norm(x[:rows], delta[:rows], norm.weight, norm.eps, packed, None, out, silu)
            assert torch.equal(y, torch.cat([a[0] for a in alone[:rows]])), f"{rows} rows differ from the rows alone"
            assert torch.equal(h, torch.cat([a[1] for a in alone[:rows]]))
    finally:
        torch.set_num_threads(before)


def integer_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """bf16 integers in [-127, 127], every row reaching 127: pack_int8 quantises it to itself, with scale 1"""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-127, 128, (out_features, in_features), generator=g)
    w[:, 0] = 127
    return w.bfloat16()


@pytest.mark.parametrize("silu", [False, True])
def test_int8_linear_norm_is_the_bf16_gemm_of_its_integers(gemm, silu):
    """An int8 weight (a drafter's layers: linear_norm with the norm, the residual add and SwiGLU) adds the products of
    the bf16 weight of the same integers: with scale 1, the same bits as the bf16 GEMM in the FMA and AMX loops (the
    same products in the same order: the AMX loop widens the int8 weight into its tiles, the FMA loop multiplies it
    in i8_rows), and within a rounding of it in the DOT loop (which pairs its products otherwise)."""
    x, delta, norm, _ = norm_case(20)
    w = integer_weight(3072, 576)
    q, scale = unpack_int8(kernels.pack_int8(w), 3072)
    assert torch.equal(q.bfloat16(), w) and torch.equal(scale, torch.ones(3072))
    out = 1536 if silu else 3072
    pack = kernels.pack_gate_up if silu else lambda weight, int8=False: (
        kernels.pack_int8(weight) if int8 else kernels.pack_weight(weight))
    int8, bf16 = pack(w, int8=True), pack(w)
    assert int8.dtype == torch.int8
    for rows in (1, 3, 5, 8, 16, 20):
        got, h = kernels.linear_norm(x[:rows], delta[:rows], norm.weight, norm.eps, int8, None, out, silu)
        want, h_want = kernels.linear_norm(x[:rows], delta[:rows], norm.weight, norm.eps, bf16, None, out, silu)
        assert torch.equal(h, h_want)
        if gemm == "dot":
            assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=1e-2)
        else:
            assert torch.equal(got, want), f"{rows} rows"


def test_linear_norm_rejects_what_it_cannot_compute():
    x, delta, norm, w = norm_case(2)
    with pytest.raises(RuntimeError, match="a delta needs a norm_weight"):
        kernels.linear_norm(x, delta, None, 1e-5, kernels.pack_weight(w), None, 3072)
    with pytest.raises(RuntimeError, match="norm_weight must be bf16 with K elements"):
        kernels.linear_norm(x, delta, norm.weight[:100], 1e-5, kernels.pack_weight(w), None, 3072)
    with pytest.raises(RuntimeError, match="SwiGLU takes no bias"):
        kernels.linear_norm(x, None, None, 0.0, kernels.pack_gate_up(w), torch.zeros(3072), 1536, silu=True)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.linear_norm(x, None, None, 0.0, kernels.pack_weight(w[:2 * 1000]), None, 1000, silu=True)
    with pytest.raises(RuntimeError, match="int8 weight .* takes no bias"):
        kernels.linear_norm(x, None, None, 0.0, kernels.pack_int8(w), torch.zeros(3072), 3072)
    with pytest.raises(RuntimeError, match="features, the weight"):
        kernels.linear_norm(x[:, :512], None, None, 0.0, kernels.pack_int8(w), None, 3072)
    with pytest.raises(RuntimeError, match=r"int32 \(kernels.pack_weight\) or \[N/8"):   # linear_bf16: no int8
        torch.ops.whiflash.linear_bf16(x, kernels.pack_int8(w), None, 3072)


def test_frozen_linear_runs_on_the_kernel():
    w, b = weights(576, 576, bias=True)
    x = torch.randn(2, 3, 576).bfloat16()
    on = FrozenLinear(w, b)
    assert on.kernel_weight is not None
    assert torch.equal(on(x), kernels.linear(x.view(6, 576), on.kernel_weight, b, 576).view(2, 3, 576))
    assert FrozenLinear(w.float()).kernel_weight.dtype == torch.float32   # fp32: linear_fp32


def test_frozen_linear_runs_on_the_kernel_only_when_asked():
    w, b = weights(576, 576, bias=True)
    x = torch.randn(2, 3, 576).bfloat16()
    on, off = FrozenLinear(w, b), FrozenLinear(w, b, use_kernel=False)
    assert on.kernel_weight is not None and off.kernel_weight is None
    assert torch.allclose(on(x).float(), off(x).float(), rtol=2 ** -6, atol=1e-2)


@pytest.mark.parametrize("out_features,in_features", SHAPES + [(64, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_kernel_matches_linear(out_features, in_features, bias):
    w, b = weights(out_features, in_features, bias)
    x = torch.randn(7, in_features)
    got = kernels.linear(x, kernels.pack_weight(w.float()), b, out_features)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.float32 and got.shape == (7, out_features)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * in_features ** 0.5)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("out_features,in_features", SHAPES + [(64, 3)])
def test_fp32_kernel_rows_do_not_depend_on_the_call(out_features, in_features, num_threads):
    w, b = weights(out_features, in_features, bias=True)
    packed = kernels.pack_weight(w.float())
    x = torch.randn(37, in_features)
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        alone = torch.cat([kernels.linear(x[i:i + 1], packed, b, out_features) for i in range(37)])
        for rows in (2, 3, 4, 5, 8, 16, 37):
            assert torch.equal(kernels.linear(x[:rows], packed, b, out_features), alone[:rows]), f"{rows} rows"
            assert torch.equal(kernels.linear(x[37 - rows:], packed, b, out_features), alone[37 - rows:])
    finally:
        torch.set_num_threads(before)


def test_the_gemm_loops_agree_to_one_rounding():
    w, b = weights(960, 576, bias=True)
    x = torch.randn(9, 576).bfloat16()
    packed = kernels.pack_weight(w)
    out = {}
    for variant in kernels.available_gemms():
        before = kernels.set_gemm(variant)
        try:
            assert kernels.gemm() == variant
            out[variant] = kernels.linear(x, packed, b, 960).double()
        finally:
            kernels.set_gemm(before)
    for variant in out:
        assert torch.allclose(out["fma"], out[variant], rtol=2 ** -7, atol=1e-3), variant


def test_the_gemm_loops_are_those_of_the_loaded_isa():
    want = {"avx2": ("fma",), "avx512": ("fma",), "avx512bf16": ("fma", "dot")}
    isa = kernels.loaded_isa()
    assert isa == kernels.isa()
    if isa == "amx":
        assert kernels.available_gemms()[:2] == ("fma", "dot")
    else:
        assert kernels.available_gemms() == want[isa]
        with pytest.raises(ValueError, match="GEMM variant"):
            kernels.set_gemm("amx")
    for variant in set(kernels.GEMM_VARIANTS) - set(kernels.available_gemms()):   # refused by the library too
        with pytest.raises(RuntimeError, match="set_gemm_variant"):
            torch.ops.whiflash.set_gemm_variant(kernels.GEMM_VARIANTS.index(variant))


def test_the_gemm_loop_can_be_forced(tmp_path, monkeypatch):
    monkeypatch.setenv(kernels.GEMM_ENV, "fma")
    assert kernels.choose_gemm(tmp_path) == "fma"
    monkeypatch.setenv(kernels.GEMM_ENV, "sse")
    with pytest.raises(ValueError, match="WHIFLASH_GEMM"):
        kernels.choose_gemm(tmp_path)
    with pytest.raises(ValueError, match="GEMM variant"):
        kernels.set_gemm("sse")
    monkeypatch.delenv(kernels.GEMM_ENV)
    if len(kernels.available_gemms()) == 1:   # nothing to choose from, nothing measured or kept
        assert kernels.choose_gemm(tmp_path) == kernels.available_gemms()[0]
        assert not list(tmp_path.rglob("gemm-*.json"))


@pytest.mark.skipif(len(kernels.available_gemms()) < 2, reason="this CPU's ISA has one GEMM loop: nothing to choose")
def test_the_gemm_loop_is_chosen_once_per_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv(kernels.GEMM_ENV, raising=False)
    chosen = kernels.choose_gemm(tmp_path)
    kept = list(tmp_path.rglob("gemm-*.json"))
    assert chosen in kernels.available_gemms() and len(kept) == 1
    record = json.loads(kept[0].read_text())
    assert record["variant"] == chosen and set(record["seconds"]) == set(kernels.available_gemms())
    assert chosen == min(record["seconds"], key=record["seconds"].get)
    other = next(v for v in kernels.available_gemms() if v != chosen)
    kept[0].write_text(json.dumps({**record, "variant": other}))
    assert kernels.choose_gemm(tmp_path) == other                  # read back, not measured again
    kept[0].write_text("not json")
    assert kernels.choose_gemm(tmp_path) in kernels.available_gemms()  # a broken record is measured again
    assert f"gemm-{kernels.loaded_isa()}-" in kept[0].name   # keyed by the ISA: amx and avx512bf16 share a build
    assert not list(tmp_path.rglob(".*.tmp"))   # written through a temporary name, renamed into place


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", [1, 2, 17, 49152])
def test_entropy_margin_matches_the_torch_route_signal(dtype, vocab):
    from whiflash_trt.spec.router import entropy_and_margin

    g = torch.Generator().manual_seed(vocab)
    for scale in (0.1, 3.0, 30.0):
        logits = (torch.randn(vocab, generator=g) * scale).to(dtype)
        got, want = kernels.entropy_margin(logits), entropy_and_margin(logits)
        assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    tied = torch.zeros(100, dtype=dtype)
    tied[[3, 7]] = 5.0
    assert kernels.entropy_margin(tied)[1] == 0.0
    with pytest.raises(RuntimeError, match="vocab"):
        kernels.entropy_margin(torch.zeros(2, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_argmax_rows_is_torchs_argmax(dtype):
    g = torch.Generator().manual_seed(0)
    for rows, vocab in ((1, 1), (6, 17), (6, 49152), (3, 100)):
        logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
        assert torch.equal(kernels.argmax_rows(logits), logits.float().argmax(-1))
    ties = torch.zeros(3, 100, dtype=dtype)
    ties[0, [90, 40, 7]] = 3.0     # the first index of a tie, whatever lane it sits in
    ties[1, [99, 33]] = 1.0
    ties[2] = -float("inf")
    assert kernels.argmax_rows(ties).tolist() == [7, 33, 0] == ties.float().argmax(-1).tolist()
    with pytest.raises(RuntimeError, match="rows, vocab"):
        kernels.argmax_rows(torch.zeros(5))


@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_vocabulary_reductions_merge_the_threads_parts(dtype, num_threads):
    """argmax_rows and entropy_margin split the vocabulary between the threads: ties across parts go to the first
    index, a part with nothing above -inf (or only very negative values) loses, and the entropy and margin are the
    whole row's."""
    from whiflash_trt.spec.router import entropy_and_margin

    vocab = 49152
    g = torch.Generator().manual_seed(num_threads)
    logits = (torch.randn(4, vocab, generator=g) * 3).to(dtype)
    logits[0, [40000, 10000, 30000]] = 20.0            # a tie spread over the parts: the first index
    logits[1, : vocab // 2] = -float("inf")             # the first half can hold no choice
    logits[1, 45000] = 50.0
    logits[2, vocab // 2:] = -float("inf")              # nor the second
    logits[3] = -float("inf")
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        assert kernels.argmax_rows(logits).tolist() == [10000, 45000, int(logits[2].float().argmax()), 0]
        for row in (logits[0], torch.where(logits[1].isinf(), -1e4, logits[1].float()).to(dtype),
                    torch.where(logits[2].isinf(), -1e4, logits[2].float()).to(dtype)):
            assert kernels.entropy_margin(row) == pytest.approx(entropy_and_margin(row), rel=1e-4, abs=1e-5)
        assert kernels.entropy_margin(logits[0])[1] == 0.0
        half = torch.full((vocab,), -float("inf"), dtype=dtype)
        half[[7, 30000]] = torch.tensor([2.0, 1.0], dtype=dtype)   # the other parts hold nothing above -inf
        entropy, margin = kernels.entropy_margin(half)
        want_entropy, want_margin = entropy_and_margin(half[[7, 30000]])
        assert (entropy, margin) == pytest.approx((want_entropy, want_margin), rel=1e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_topk_rows_is_torchs_topk(dtype):
    g = torch.Generator().manual_seed(0)
    for rows, vocab, k in ((1, 1, 1), (3, 8192, 3), (5, 8192, 5), (2, 17, 17), (4, 40, 1)):
        logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
        values, indices = kernels.topk_rows(logits, k)
        want = torch.topk(logits.float(), k)
        assert torch.equal(values, want.values) and torch.equal(logits.float().gather(1, indices), values)
        for row_values, row_indices in zip(values.tolist(), indices.tolist()):   # bf16 ties: smaller index first
            assert len(set(row_indices)) == k
            assert all(i < j for a, b, i, j in zip(row_values, row_values[1:], row_indices, row_indices[1:]) if a == b)
        if dtype == torch.float32:   # distinct values: one right answer
            assert torch.equal(indices, want.indices)
        soft_values, soft_indices = kernels.topk_rows(logits, k, log_softmax=True)
        assert torch.equal(soft_indices, indices)
        want = torch.log_softmax(logits.float(), dim=-1).gather(1, indices)
        assert torch.allclose(soft_values, want, rtol=1e-5, atol=1e-5)
    ties = torch.zeros(2, 100, dtype=dtype)
    ties[0, [90, 40, 7, 60]] = 3.0   # ties go to the smaller index, whatever lane it sits in
    ties[1, 55] = float("nan")        # a NaN is never chosen
    ties[1, 99] = 1.0
    values, indices = kernels.topk_rows(ties, 3)
    assert indices.tolist() == [[7, 40, 60], [99, 0, 1]] and values.tolist() == [[3.0] * 3, [1.0, 0.0, 0.0]]
    with pytest.raises(RuntimeError, match="k must be"):
        kernels.topk_rows(ties, 101)
    with pytest.raises(RuntimeError, match="not NaN"):
        kernels.topk_rows(torch.full((1, 4), float("nan"), dtype=dtype), 2)


def test_kernel_rejects_bad_inputs():
    w, _ = weights(64, 32, bias=False)
    packed = kernels.pack_weight(w)
    with pytest.raises(RuntimeError, match="bf16"):
        kernels.linear(torch.randn(2, 32), packed, None, 64)
    with pytest.raises(RuntimeError, match="features"):
        kernels.linear(torch.randn(2, 30).bfloat16(), packed, None, 64)
    with pytest.raises(RuntimeError, match="out_features"):
        kernels.linear(torch.randn(2, 32).bfloat16(), packed, None, 200)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.linear(torch.randn(2, 32).bfloat16(), packed, torch.zeros(64).bfloat16(), 64)
    packed32 = kernels.pack_weight(w.float())
    with pytest.raises(RuntimeError, match="fp32"):
        kernels.linear(torch.randn(2, 32).bfloat16(), packed32, None, 64)
    with pytest.raises(RuntimeError, match="features"):
        kernels.linear(torch.randn(2, 30), packed32, None, 64)
    with pytest.raises(RuntimeError, match="out_features"):
        kernels.linear(torch.randn(2, 32), packed32, None, 200)


def pools_and_queries(dtype, rows: int, heads: int = 6, kv_heads: int = 2, dim: int = 40, slots: int = 300):
    """q and the new k, v of `rows` tokens; pools of 2 layers [2, slots, kv_heads, D] (the tests use layer 1)."""
    g = torch.Generator().manual_seed(1)
    k_pool, v_pool = (torch.randn(2, slots, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(rows, heads, dim, generator=g).to(dtype)
    k, v = (torch.randn(rows, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    return q, k, v, k_pool, v_pool


@pytest.mark.parametrize("dim", [40, 64, 128], ids=["dim40", "dim64", "dim128"])   # 64, 128: the AMX path's too
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_paged_attention_matches_softmax_attention(attention_path, dtype, dim):
    rows, heads, kv_heads = 5, 6, 2
    q, k, v, k_pool, v_pool = pools_and_queries(dtype, rows, heads, kv_heads, dim)
    write = torch.tensor([290, 3, 150, 7, 299])
    row_slots = torch.randperm(280)[:100].repeat(rows, 1)
    row_slots[:, 60:65] = write   # each row sees the new keys too, in the middle of its keys
    row_len = torch.tensor([61, 100, 62, 65, 1])
    pools = k_pool.clone(), v_pool.clone()
    out = kernels.paged_attention(q, k, v, *pools, 1, write, row_slots, row_len, dim ** -0.5)
    assert torch.equal(pools[0][1, write], k) and torch.equal(pools[1][1, write], v)
    assert torch.equal(pools[0][0], k_pool[0]) and torch.equal(pools[1][0], v_pool[0])   # layer 0 untouched
    assert out.shape == (rows, heads * dim) and out.dtype == dtype
    for t in range(rows):
        keys = row_slots[t, :row_len[t]]
        kk = pools[0][1, keys].double().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)  # [heads, S, D]
        vv = pools[1][1, keys].double().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        p = torch.softmax((q[t].double()[:, None] * kk).sum(-1) * dim ** -0.5, -1)   # [heads, S]
        want = (p[..., None] * vv).sum(1).flatten()
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7
        assert torch.allclose(out[t].double(), want, rtol=tol, atol=tol), f"row {t}"


def test_paged_attention_writes_rows_given_as_views_of_a_fused_projection(attention_path):
    """K and V of a verify are column views of the fused QKV output (rows not contiguous): written in place, they
    land in the pools and attend exactly as copies of them do."""
    rows, heads, kv_heads, dim = 4, 6, 2, 64
    q, k, v, k_pool, v_pool = pools_and_queries(torch.bfloat16, rows, heads, kv_heads, dim)
    fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)        # [T, (heads + 2 kv_heads) D]
    k_view = fused[:, heads * dim:(heads + kv_heads) * dim].view(rows, kv_heads, dim)
    v_view = fused[:, (heads + kv_heads) * dim:].view(rows, kv_heads, dim)
    assert not v_view.is_contiguous()
    write = torch.tensor([3, 150, 7, 299])
    row_slots, row_len = torch.cat([torch.arange(100), write]).repeat(rows, 1), torch.tensor([101, 102, 103, 104])
    got_pools, want_pools = (k_pool.clone(), v_pool.clone()), (k_pool.clone(), v_pool.clone())
    got = kernels.paged_attention(q, k_view, v_view, *got_pools, 1, write, row_slots, row_len, dim ** -0.5)
    want = kernels.paged_attention(q, k.contiguous(), v.contiguous(), *want_pools, 1, write, row_slots, row_len,
                                   dim ** -0.5)
    assert torch.equal(got_pools[0], want_pools[0]) and torch.equal(got_pools[1], want_pools[1])
    assert torch.equal(got_pools[1][1, write], v) and torch.equal(got, want)


@pytest.mark.parametrize("dim", [40, 64, 128], ids=["dim40", "dim64", "dim128"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_paged_attention_rotates_q_and_k_as_apply_rope_does(attention_path, dtype, dim):
    """Given cos and sin, the op rotates q and k itself (q and k as column views of the fused projection, as a
    compiled step passes them): the pools' keys and the output equal, bit for bit, apply_rope's q and k attended
    without them."""
    rows, heads, kv_heads = 5, 6, 2
    q, k, v, k_pool, v_pool = pools_and_queries(dtype, rows, heads, kv_heads, dim)
    fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)
    q_view = fused[:, :heads * dim].view(rows, heads, dim)
    k_view = fused[:, heads * dim:(heads + kv_heads) * dim].view(rows, kv_heads, dim)
    angles = torch.randn(rows, dim // 2, generator=torch.Generator().manual_seed(2)) * 3
    cos, sin = (f(torch.cat([angles, angles], -1)).to(dtype)[:, None] for f in (torch.cos, torch.sin))
    write = torch.tensor([290, 3, 150, 7, 299])
    row_slots = torch.cat([torch.arange(100), write]).repeat(rows, 1)
    row_len = torch.tensor([101, 102, 103, 104, 105])
    got_pools, want_pools = (k_pool.clone(), v_pool.clone()), (k_pool.clone(), v_pool.clone())
    got = kernels.paged_attention(q_view, k_view, v, *got_pools, 1, write, row_slots, row_len, dim ** -0.5, cos, sin)
    q_rot, k_rot = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    assert not torch.equal(q_rot, q)
    want = kernels.paged_attention(q_rot, k_rot, v, *want_pools, 1, write, row_slots, row_len, dim ** -0.5)
    assert torch.equal(got_pools[0][1, write], k_rot) and torch.equal(got_pools[0], want_pools[0])
    assert torch.equal(got_pools[1], want_pools[1]) and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="together"):
        kernels.paged_attention(q, k, v, *got_pools, 1, write, row_slots, row_len, 0.1, cos, None)
    with pytest.raises(RuntimeError, match="cos and sin"):
        kernels.paged_attention(q, k, v, *got_pools, 1, write, row_slots, row_len, 0.1, cos[:4], sin[:4])


@pytest.mark.parametrize("dim", [40, 64, 128], ids=["dim40", "dim64", "dim128"])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_paged_attention_rows_do_not_depend_on_the_call(attention_path, num_threads, dim):
    q, k, v, k_pool, v_pool = pools_and_queries(torch.bfloat16, rows=9, dim=dim)
    write = torch.arange(250, 259)
    row_slots = torch.cat([torch.arange(200), write]).repeat(9, 1)
    row_len = torch.arange(201, 210)   # a 9-token chain over 200 context keys
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        together = kernels.paged_attention(q, k, v, k_pool, v_pool, 1, write, row_slots, row_len, 0.1)
        for t in range(9):   # row t alone, as a decode step after the first t chain tokens were written
            alone = kernels.paged_attention(q[t:t + 1], k[t:t + 1], v[t:t + 1], k_pool, v_pool, 1, write[t:t + 1],
                                            row_slots[t:t + 1, :row_len[t]], row_len[t:t + 1], 0.1)
            assert torch.equal(alone[0], together[t]), f"row {t}"
    finally:
        torch.set_num_threads(before)


def test_paged_attention_tree_rows_equal_each_node_alone(attention_path):
    """A tree verify's rows share the context and differ in their ancestors (the layout tree_segment gives); every
    row equals its node fed alone."""
    parents = [-1, 0, 0, 0, 1, 1, 2]
    rows, context = len(parents), 203
    q, k, v, k_pool, v_pool = pools_and_queries(torch.bfloat16, rows=rows, dim=64)
    write = torch.arange(250, 250 + rows)
    own = []
    for node, parent in enumerate(parents):
        own.append((own[parent] if parent >= 0 else []) + [250 + node])
    width = context + max(len(o) for o in own)
    row_slots = torch.tensor([list(range(context)) + o + o[:1] * (width - context - len(o)) for o in own])
    row_len = torch.tensor([context + len(o) for o in own])
    together = kernels.paged_attention(q, k, v, k_pool, v_pool, 1, write, row_slots, row_len, 0.1)
    for t in range(rows):
        alone = kernels.paged_attention(q[t:t + 1], k[t:t + 1], v[t:t + 1], k_pool, v_pool, 1, write[t:t + 1],
                                        row_slots[t:t + 1], row_len[t:t + 1], 0.1)
        assert torch.equal(alone[0], together[t]), f"row {t}"


@pytest.mark.parametrize("rows", [20, 24])
def test_paged_attention_rows_of_a_batch_equal_each_row_alone(attention_path, rows):
    """A batched call's rows see other sequences' keys (in the AMX path: passes of their own per chunk), and rows of
    one sequence share theirs; each equals its row alone, with more rows than one column tile holds (16 queries):
    60 and 72 queries per KV head, four and five tiles."""
    heads, kv_heads, dim = 6, 2, 64
    q, k, v, k_pool, v_pool = pools_and_queries(torch.bfloat16, rows, heads, kv_heads, dim, slots=600)
    g = torch.Generator().manual_seed(3)
    sequences = [torch.randperm(560, generator=g)[:n] for n in (40, 130, 97)]
    owner = [t % 3 for t in range(rows)]
    width = max(len(s) for s in sequences) + rows
    row_slots, row_len = torch.zeros(rows, width, dtype=torch.long), torch.zeros(rows, dtype=torch.long)
    for t in range(rows):   # sequence owner[t] at its own new keys so far (a chain per sequence)
        own = [560 + u for u in range(t + 1) if owner[u] == owner[t]]
        keys = torch.cat([sequences[owner[t]], torch.tensor(own)])
        row_slots[t, :len(keys)], row_len[t] = keys, len(keys)
    write = torch.arange(560, 560 + rows)
    together = kernels.paged_attention(q, k, v, k_pool, v_pool, 1, write, row_slots, row_len, 0.1)
    for t in range(rows):
        alone = kernels.paged_attention(q[t:t + 1], k[t:t + 1], v[t:t + 1], k_pool, v_pool, 1, write[t:t + 1],
                                        row_slots[t:t + 1, :row_len[t]], row_len[t:t + 1], 0.1)
        assert torch.equal(alone[0], together[t]), f"row {t}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_paged_attention_short_rows_have_one_run(attention_path, dtype):
    """Rows of fewer than split_at's 64 keys have no second run: alone (a decode step early in a sequence) and
    together (a verify over a short context, every row's second run empty), each equals softmax attention and the
    row fed alone."""
    heads, kv_heads, dim = 6, 2, 64
    lens = [1, 2, 9, 33, 63]
    q, k, v, k_pool, v_pool = pools_and_queries(dtype, len(lens), heads, kv_heads, dim)
    write = torch.arange(290, 290 + len(lens))
    row_slots = torch.arange(63).repeat(len(lens), 1)
    row_len = torch.tensor(lens)
    together = kernels.paged_attention(q, k, v, k_pool, v_pool, 1, write, row_slots, row_len, dim ** -0.5)
    for t, n in enumerate(lens):
        alone = kernels.paged_attention(q[t:t + 1], k[t:t + 1], v[t:t + 1], k_pool, v_pool, 1, write[t:t + 1],
                                        row_slots[t:t + 1, :n], row_len[t:t + 1], dim ** -0.5)
        assert torch.equal(alone[0], together[t]), f"row {t}"
        kk = k_pool[1, :n].double().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        vv = v_pool[1, :n].double().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        p = torch.softmax((q[t].double()[:, None] * kk).sum(-1) * dim ** -0.5, -1)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7
        assert torch.allclose(alone[0].double(), (p[..., None] * vv).sum(1).flatten(), rtol=tol, atol=tol)


def test_paged_attention_rows_do_not_depend_on_the_thread_count(attention_path):
    """A row's keys are cut into two runs by their number alone, never by the threads (kernel's split_at)."""
    q, k, v, k_pool, v_pool = pools_and_queries(torch.bfloat16, rows=4, dim=64)
    write = torch.arange(250, 254)
    row_slots = torch.cat([torch.arange(200), write]).repeat(4, 1)
    row_len = torch.tensor([63, 64, 201, 204])   # one run, then two (odd and even)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(kernels.paged_attention(q, k, v, k_pool.clone(), v_pool.clone(), 1, write, row_slots, row_len,
                                                0.1))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_paged_attention_rejects_bad_inputs():
    q, k, v, k_pool, v_pool = pools_and_queries(torch.float32, rows=2)
    write, row_len = torch.tensor([0, 1]), torch.tensor([2, 2])
    for bad in (300, -1):
        with pytest.raises(RuntimeError, match="outside the pool"):
            kernels.paged_attention(q, k, v, k_pool, v_pool, 1, write, torch.tensor([[0, bad], [0, 1]]), row_len, 1.0)
    with pytest.raises(RuntimeError, match="write slot is outside"):
        kernels.paged_attention(q, k, v, k_pool, v_pool, 1, torch.tensor([0, 10 ** 6]), torch.tensor([[0, 1], [0, 1]]),
                                row_len, 1.0)
    # slots past a row's length are never read: padding may hold anything
    padded = kernels.paged_attention(q, k, v, k_pool, v_pool, 1, write, torch.tensor([[0, -1], [0, 1]]),
                                     torch.tensor([1, 2]), 1.0)
    assert torch.isfinite(padded).all()
    with pytest.raises(RuntimeError, match="between 1 and W"):
        kernels.paged_attention(q, k, v, k_pool, v_pool, 1, write, torch.tensor([[0, 1], [0, 1]]),
                                torch.tensor([0, 2]), 1.0)
    with pytest.raises(RuntimeError, match="layer"):
        kernels.paged_attention(q, k, v, k_pool, v_pool, 2, write, torch.tensor([[0, 1], [0, 1]]), row_len, 1.0)
    with pytest.raises(RuntimeError, match="dtype"):
        kernels.paged_attention(q.bfloat16(), k, v, k_pool, v_pool, 1, write, torch.tensor([[0, 1], [0, 1]]),
                                row_len, 1.0)


AVX2_FLAGS = "fpu sse2 avx avx2 fma f16c bmi2"
AVX512_FLAGS = AVX2_FLAGS + " avx512f avx512bw avx512vl avx512dq avx512cd"
BF16_FLAGS = AVX512_FLAGS + " avx512_bf16 avx512_vnni"
AMX_FLAGS = BF16_FLAGS + " amx_tile amx_bf16 amx_int8"


@pytest.mark.parametrize("flags,best", [("fpu sse2 avx", None), (AVX2_FLAGS, "avx2"),
                                        (AVX2_FLAGS + " avx512f avx512cd", "avx2"), (AVX512_FLAGS, "avx512"),
                                        (AVX512_FLAGS + " avx512_bf16", "avx512"), (BF16_FLAGS, "avx512bf16"),
                                        (AMX_FLAGS, "amx")])
def test_the_isa_is_the_best_the_cpu_flags_give(monkeypatch, flags, best):
    monkeypatch.setattr(kernels.cpu, "cpuinfo", lambda field: flags if field == "flags" else "")
    monkeypatch.delenv(kernels.ISA_ENV, raising=False)
    assert kernels.isa() == best
    assert kernels.cpu_supported() == (best is not None)
    assert kernels.cpu.cpu_isas() == (kernels.ISAS[:kernels.ISAS.index(best) + 1] if best else ())


def test_whiflash_isa_forces_a_lower_isa_and_refuses_a_higher_one(monkeypatch):
    monkeypatch.setattr(kernels.cpu, "cpuinfo", lambda field: AVX512_FLAGS if field == "flags" else "")
    monkeypatch.setenv(kernels.ISA_ENV, "avx2")
    assert kernels.isa() == "avx2" and kernels.build.build_for() == "avx2"
    for higher in ("avx512bf16", "amx"):
        monkeypatch.setenv(kernels.ISA_ENV, higher)
        with pytest.raises(ValueError, match=f"{kernels.ISA_ENV}={higher} but this CPU runs only"):
            kernels.isa()
    monkeypatch.setenv(kernels.ISA_ENV, "sse4")
    with pytest.raises(ValueError, match="must be one of"):
        kernels.isa()


def test_each_isa_has_its_own_library_version(monkeypatch):
    monkeypatch.setattr(kernels.cpu, "cpuinfo", lambda field: AMX_FLAGS if field == "flags" else "")
    versions = {isa: kernels.build.version(isa) for isa in kernels.ISAS}
    assert versions["amx"] == versions["avx512bf16"]   # one build, the AMX loop chosen at run time
    assert len({versions["avx2"], versions["avx512"], versions["avx512bf16"]}) == 3
    assert all(v.startswith(kernels.build.BUILD_OF_ISA[isa]) for isa, v in versions.items())


def test_the_loaded_library_is_the_build_of_this_isa(tmp_path):
    library = kernels.build.DEFAULT_CACHE / kernels.build.version() / kernels.LIBRARY
    assert kernels.loaded_isa() == kernels.isa()
    assert kernels.build.library_build(library) == kernels.build.build_for()
    assert kernels.build.intact(library)
    other = next(b for b in kernels.build.BUILD_FLAGS if b != kernels.build.build_for())
    foreign = tmp_path / kernels.LIBRARY
    foreign.write_bytes(b"\x7fELF" + kernels.build.MARKER + other.encode() + b"\0rest")
    assert not kernels.load(foreign)   # another build's instructions: not loaded
    foreign.write_bytes(b"\x7fELF no marker")
    assert not kernels.load(foreign)


def test_a_truncated_library_in_the_cache_is_rebuilt_not_loaded(tmp_path):
    """The cached library's bytes are checked against its sha256 before it is used: a truncated one is rebuilt (with
    a line saying so), and a build folder left by a killed build (its cpp_extension lock held) does not block it.
    The build loads the library into the process, and load() must still register the fake shapes torch.export needs
    (a fresh machine has no compiled library in its cache): the rebuilt library exports a linear. In a process of
    its own (a process holds one library)."""
    source = kernels.build.DEFAULT_CACHE / kernels.build.version()
    cached = tmp_path / kernels.build.version()
    cached.mkdir()
    whole = (source / kernels.LIBRARY).read_bytes()
    (cached / kernels.LIBRARY).write_bytes(whole[:len(whole) // 3])
    (cached / (kernels.LIBRARY + ".sha256")).write_text(kernels.build.sha256_of(source / kernels.LIBRARY))
    stale = cached / "build-1-deadbeef"
    stale.mkdir()
    (stale / "lock").write_text("")
    (cached / "build").mkdir()
    (cached / "build" / "lock").write_text("")   # where a single shared build folder would hold its lock
    script = f"""
import torch
from pathlib import Path
from whiflash_trt import kernels
library = kernels.build.compile_library(Path({str(tmp_path)!r}))
assert kernels.load(library) and kernels.registered()

def f(x, packed):
    return kernels.linear(x, packed, None, 64)

w = torch.randn(64, 32).bfloat16()
program = torch.export.export(type("M", (torch.nn.Module,), {{"forward": lambda self, x, p: f(x, p)}})(),
                              (torch.randn(3, 32).bfloat16(), kernels.pack_weight(w)))
print("built", library, "exported", len(program.graph.nodes))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0 and "built" in out.stdout and "exported" in out.stdout, out.stderr[-2000:]
    assert "does not match its sha256; rebuilding" in out.stderr
    rebuilt = cached / kernels.LIBRARY
    assert kernels.build.intact(rebuilt) and rebuilt.stat().st_size > len(whole) // 3
    assert not list(cached.glob(".*.tmp"))   # the temporary names renamed into place
    assert sorted(p.name for p in cached.glob("build*")) == ["build", "build-1-deadbeef"]   # its own build folder gone


def test_cache_files_are_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """The library, its sha256 and the GEMM choice go through a temporary name and a rename: a write that fails
    leaves the old file whole and no temporary behind."""
    path = tmp_path / "gemm-avx2-0.json"
    kernels.build.write_atomically(path, b"old")
    monkeypatch.setattr(kernels.build.os, "replace", lambda src, dst: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        kernels.build.write_atomically(path, b"new")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == [path.name]


OTHER_ISAS = [isa for isa in kernels.ISAS if kernels.build.BUILD_OF_ISA.get(isa) and isa != kernels.isa()]


@pytest.mark.parametrize("isa", OTHER_ISAS)
def test_the_kernel_tests_pass_on_every_other_isa_this_cpu_runs(isa):
    """This module's tests for each ISA the CPU runs besides this process's (the row invariance, bit-exactness and
    torch comparisons of every build: avx2 and avx512 on an AVX-512 machine), each in a process with WHIFLASH_ISA
    set (a process holds one library)."""
    if isa not in kernels.cpu.cpu_isas():
        pytest.skip(f"this CPU lacks {isa} ({' '.join(kernels.cpu.ISA_FLAGS[isa])})")
    env = {**os.environ, kernels.ISA_ENV: isa}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "not every_other_isa and not truncated_library"], capture_output=True, text=True,
                         env=env, timeout=3000)
    assert out.returncode == 0, out.stdout[-3000:]
    assert " passed" in out.stdout and " failed" not in out.stdout
