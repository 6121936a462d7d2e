"""Drafters' layers over int8 weights (fuse_projections(int8=True), the engine's default where
kernels.int8_layers_pay): which loop each linear runs, and what it gives next to the bf16 layer."""
from __future__ import annotations

import pytest
import torch

from tiny_drafters import make_dflash, make_eagle3
from whiflash_trt import kernels
from whiflash_trt.config import ModelConfig, RopeConfig

pytestmark = pytest.mark.skipif(not kernels.registered(), reason="the kernels are not loaded on this machine")

TARGET = ModelConfig(architecture="llama", vocab_size=120, hidden_size=64, intermediate_size=128, num_layers=8,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256,
                     rope=RopeConfig())


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_int8_layers_are_the_bf16_layers_up_to_quantisation_and_keep_their_rows(kind):
    """Every linear of the layers (and EAGLE-3's fc) holds an int8 weight, run in the loop for many rows (DFlash's
    blocks: the process's GEMM loop, SwiGLU inside it) or for few (EAGLE-3's draft steps: the int8 FMA loop, SwiGLU
    after it); each output within the weights' quantisation of the bf16 layer's, and a row's bits the same alone as
    among other rows."""
    make = make_eagle3 if kind == "eagle3" else make_dflash
    plain, quantised = make(TARGET).eval().bfloat16(), make(TARGET).eval().bfloat16()
    plain.fuse_projections(int8=False)
    quantised.fuse_projections(int8=True)
    pairs = ([(plain.midlayer, quantised.midlayer)] if kind == "eagle3"
             else list(zip(plain.layers, quantised.layers)))
    many_rows = kind == "dflash"
    checks = []   # (bf16 function, int8 function, input width)
    for bf16, int8 in pairs:
        attn, mlp = int8.self_attn, int8.mlp
        for linear in (attn.qkv, attn.o, mlp.down):
            assert linear.kernel_weight.dtype == torch.int8 and linear.many_rows == many_rows
        if many_rows:
            assert mlp.gate_up_packed.dtype == torch.int8
        else:
            assert mlp.gate_up_packed is None and mlp.gate_up.kernel_weight.dtype == torch.int8
        assert bf16.self_attn.qkv.kernel_weight.dtype == torch.int32
        checks += [(bf16.self_attn.qkv, attn.qkv, attn.qkv.weight.shape[1]), (bf16.mlp, mlp, TARGET.hidden_size)]
    if kind == "eagle3":   # fc, the root's projection every round, with the layers
        assert quantised.fc.kernel_weight.dtype == torch.int8 and plain.fc.kernel_weight.dtype == torch.int32
        checks.append((plain.fc, quantised.fc, quantised.fc.weight.shape[1]))
    torch.manual_seed(0)
    for plain_fn, int8_fn, width in checks:
        x = torch.randn(7, width).bfloat16()
        got, want = int8_fn(x).float(), plain_fn(x).float()
        assert not torch.equal(got, want)   # quantised: not the bf16 weights
        scale = want.abs().max()
        assert ((got - want).abs() <= 0.03 * scale).all(), f"{(got - want).abs().max() / scale:.4f}"
        alone = torch.cat([int8_fn(x[i:i + 1]) for i in range(7)])
        assert torch.equal(alone, int8_fn(x))
