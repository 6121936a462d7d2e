"""KV-only prefill writes exactly the K/V a full drafter forward writes for those positions."""
from __future__ import annotations

import pytest
import torch

from tiny_drafters import make_dflash, make_eagle3
from whiflash_trt import kernels
from whiflash_trt.config import ModelConfig, RopeConfig
from whiflash_trt.models.layers import apply_rope
from whiflash_trt.plugins.kv_prefill import kv_only_prefill_reference

TARGET = ModelConfig(architecture="llama", vocab_size=120, hidden_size=64, intermediate_size=128, num_layers=8,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256,
                     rope=RopeConfig())


def test_eagle3_kv_only_equals_full_midlayer_forward():
    drafter = make_eagle3(TARGET).eval()
    t = 13
    torch.manual_seed(0)
    feats, embeds = torch.randn(t, 3 * 64), torch.randn(t, 64)
    positions = torch.arange(5, 5 + t)
    k_pool, v_pool = torch.zeros(1, 64, 2, 16), torch.zeros(1, 64, 2, 16)
    slots = torch.randperm(64)[:t]                       # scattered slots
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    with torch.no_grad():
        drafter(embeds, drafter.fc(feats), positions, k_pool, v_pool, slots, slots, mask)
        k, v = drafter.kv_only(feats, embeds, positions)
    assert (k[0] - k_pool[0, slots]).abs().max() <= 1e-5
    assert (v[0] - v_pool[0, slots]).abs().max() <= 1e-5


def test_dflash_kv_only_equals_each_layers_context_projection():
    drafter = make_dflash(TARGET).eval()
    t = 11
    torch.manual_seed(1)
    feats = torch.randn(t, len(drafter.config.target_layer_ids) * 64)
    positions = torch.arange(3, 3 + t)
    with torch.no_grad():
        k, v = drafter.kv_only(feats, positions)
        h = drafter.hidden_norm(drafter.fc(feats))            # the reference: context through each layer's k/v
        cos, sin = drafter.rotary(positions, h.dtype)
        for i, layer in enumerate(drafter.layers):
            a = layer.self_attn
            k_ref = apply_rope(a.k_norm(a.k_proj(h).view(t, 2, 16)), cos, sin)
            v_ref = a.v_proj(h).view(t, 2, 16)
            assert (k[i] - k_ref).abs().max() <= 1e-5
            assert (v[i] - v_ref).abs().max() <= 1e-5


def test_custom_op_is_registered_and_matches_reference():
    drafter = make_dflash(TARGET).eval()
    args = (torch.randn(4, 128), drafter.fc.weight, drafter.hidden_norm.weight, torch.empty(4, 0), torch.empty(0),
            torch.stack([l.self_attn.k_proj.weight for l in drafter.layers]),
            torch.stack([l.self_attn.v_proj.weight for l in drafter.layers]),
            torch.stack([l.self_attn.k_norm.weight for l in drafter.layers]),
            torch.randn(4, 16), torch.randn(4, 16), 1e-6)
    with torch.no_grad():
        op = torch.ops.whiflash.kv_only_prefill(*args)
        ref = kv_only_prefill_reference(*args)
    assert all(torch.equal(a, b) for a, b in zip(op, ref))


@pytest.mark.skipif(not kernels.registered(), reason="the kernels are not loaded on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["eagle3", "eagle3-int8", "dflash", "dflash-int8"])
def test_fused_drafters_write_the_contracts_kv_with_the_kernel(kind, dtype):
    """A fused drafter's write_kv_only runs kernels/kv_prefill.cpp (packed weights, straight into the pools): the
    K/V of the contract's reference up to the order of sums (fp32), or up to a bf16 rounding of it (bf16), or, over
    int8 weights (bf16 ones quantised per output row), up to their quantisation; slots it was not given keep their
    values."""
    eagle3 = kind.startswith("eagle3")
    drafter = (make_eagle3 if eagle3 else make_dflash)(TARGET).eval().to(dtype)
    drafter.fuse_projections(int8=kind.endswith("-int8"))
    assert drafter.kv_prefill is not None
    int8 = kind.endswith("-int8") and dtype == torch.bfloat16
    assert (drafter.kv_prefill.fc.dtype == torch.int8) == int8
    t, layers = 7, 1 if eagle3 else len(drafter.layers)
    torch.manual_seed(2)
    feats = torch.randn(t, len(drafter.config.capture_layers) * 64).to(dtype)
    embeds = torch.randn(t, 64).to(dtype)
    positions, slots = torch.arange(9, 9 + t), torch.randperm(40)[:t]
    k_pool, v_pool = (torch.full((layers, 40, 2, 16), 7.0, dtype=dtype) for _ in range(2))
    args = (feats, embeds, positions) if eagle3 else (feats, positions)
    with torch.no_grad():
        k, v = drafter.kv_only(*args)
        drafter.write_kv_only(*args, k_pool, v_pool, slots)
    tol = 2 ** -4 if int8 else 1e-5 if dtype == torch.float32 else 2 ** -7
    for ref, pool in ((k, k_pool), (v, v_pool)):
        got = pool[:, slots].float()
        assert ((got - ref.float()).abs() <= tol * (1 + ref.float().abs())).all()
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots] = False
    assert (k_pool[:, untouched] == 7).all() and (v_pool[:, untouched] == 7).all()


@pytest.mark.skipif(not kernels.registered(), reason="the kernels are not loaded on this machine")
def test_dflash_block_on_the_kernel_equals_the_torch_attention():
    """A fused DFlash drafter given its blocks' scratch slots attends on the kernel (the block's K/V written there,
    each row over its context then the block): the hidden states of the torch path, which never writes the pool,
    for two sequences at once; the context K/V stay as they were."""
    drafter = make_dflash(TARGET).eval()
    drafter.fuse_projections()
    b, layers = drafter.config.draft_block_len, len(drafter.layers)
    torch.manual_seed(3)
    k_pool, v_pool = torch.randn(layers, 64, 2, 16), torch.randn(layers, 64, 2, 16)
    reads = [torch.randperm(30)[:11], 30 + torch.randperm(10)[:4]]
    writes = [torch.arange(40, 40 + b), torch.arange(50, 50 + b)]
    embeds, positions = torch.randn(2 * b, 64), torch.cat([torch.arange(11, 11 + b), torch.arange(4, 4 + b)])
    context = torch.cat(reads)
    before = k_pool[:, context].clone(), v_pool[:, context].clone()
    with torch.no_grad():
        torch_path = drafter.forward_many(embeds, positions, k_pool, v_pool, reads)
        kernel_path = drafter.forward_many(embeds, positions, k_pool, v_pool, reads, writes)
    assert (kernel_path - torch_path).abs().max() <= 1e-4
    assert torch.equal(k_pool[:, context], before[0]) and torch.equal(v_pool[:, context], before[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_rows_are_the_tables_rows_of_forward(dtype):
    """Catch-up takes cos/sin from RotaryTable.rows (tables cast once per dtype): the values forward gives."""
    from whiflash_trt.models.layers import RotaryTable

    table = RotaryTable(16, 256, RopeConfig())
    positions = torch.tensor([0, 7, 3, 255, 100])
    cos, sin = table(positions, dtype)
    rows = table.rows(positions, dtype)
    assert rows[0].dtype == dtype and torch.equal(rows[0], cos[:, 0]) and torch.equal(rows[1], sin[:, 0])
