"""onnxruntime vs torch, engine by engine, on the same fp32 weights and the same pools (max abs diff <= 1e-4)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")  # the exporter

from whiflash_trt.runtime.engine import Engine  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def engines(onnx_engine_dirs):
    torch_dir, onnx_dir = onnx_engine_dirs
    return Engine.load(torch_dir, backend="torch"), Engine.load(onnx_dir)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.float() - b.float()).abs().max()) <= TOL


def random_pools(pool, seed: int):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(pool.k.shape, generator=g), torch.randn(pool.v.shape, generator=g)
    return (k, v), (k.clone(), v.clone())


def test_onnx_engine_runs_graph_models(engines):
    _, onnx_engine = engines
    assert type(onnx_engine.target).__name__ == "GraphTarget"
    assert type(onnx_engine.proposers["eagle3"].model).__name__ == "GraphEagle3"
    assert type(onnx_engine.proposers["dflash"].model).__name__ == "GraphDFlash"


@pytest.mark.parametrize("case", ["prefill", "tree"])
def test_target_step_matches_torch(engines, case):
    torch_engine, onnx_engine = engines
    (kt, vt), (ko, vo) = random_pools(torch_engine.kv.pools["target"], 0)
    if case == "prefill":
        t, past = 9, 0
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        positions = torch.arange(t)
    else:  # tree: 5 nodes after 20 cached tokens, nodes see the context and a sparse ancestor mask
        t, past = 5, 20
        tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]])
        mask = torch.cat([torch.ones(t, past, dtype=torch.bool), tree.bool()], 1)
        positions = past + torch.tensor([0, 1, 1, 2, 2])
    read = torch.randperm(200, generator=torch.Generator().manual_seed(1))[:past + t]
    write = read[past:]
    ids = torch.randint(1, 300, (t,), generator=torch.Generator().manual_seed(2))
    rows = torch.tensor([0, t - 1])
    layers = (1, 3, 4, 5)
    with torch.inference_mode():
        ref = torch_engine.target(ids, positions, kt, vt, write, read, mask, layers, rows)
        out = onnx_engine.target(ids, positions, ko, vo, write, read, mask, layers, rows)
    assert close(out.logits, ref.logits) and close(out.hidden, ref.hidden) and close(out.captured, ref.captured)
    assert close(ko, kt) and close(vo, vt)   # the new K/V were scattered to the same slots


def test_target_embedding_and_head_match_torch(engines):
    torch_engine, onnx_engine = engines
    ids = torch.tensor([3, 1, 299, 0])
    with torch.inference_mode():
        assert close(onnx_engine.target.embed(ids), torch_engine.target.embed(ids))
        h = torch.randn(4, 64)
        assert close(onnx_engine.target.logits(h), torch_engine.target.logits(h))
    assert onnx_engine.target.dtype == torch.float32


def test_eagle3_step_head_fc_and_kv_prefill_match_torch(engines):
    torch_engine, onnx_engine = engines
    mt, mo = torch_engine.proposers["eagle3"].model, onnx_engine.proposers["eagle3"].model
    (kt, vt), (ko, vo) = random_pools(torch_engine.kv.pools["eagle3"], 3)
    g = torch.Generator().manual_seed(4)
    # a tree depth step: 3 nodes written in the middle of the read range, which runs past them (scratch)
    read = torch.arange(40, 70)
    write = read[12:15]
    mask = torch.zeros(3, 30, dtype=torch.bool)
    mask[:, :12] = True
    mask[torch.arange(3), 12 + torch.arange(3)] = True
    embeds, hidden = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g)
    positions = torch.tensor([13, 13, 13])
    feats = torch.randn(6, 192, generator=g)
    with torch.inference_mode():
        ref = mt(embeds, hidden, positions, kt, vt, write, read, mask)
        out = mo(embeds, hidden, positions, ko, vo, write, read, mask)
        assert close(out, ref) and close(ko, kt) and close(vo, vt)
        assert close(mo.draft_logprobs(out), mt.draft_logprobs(ref))
        assert close(mo.fc(feats), mt.fc(feats))
        for a, b in zip(mo.kv_only(feats, embeds.repeat(2, 1), torch.arange(6)),
                        mt.kv_only(feats, embeds.repeat(2, 1), torch.arange(6))):
            assert close(a, b)
        ids = torch.tensor([0, 5, 149])
        assert torch.equal(mo.to_target_ids(ids), mt.to_target_ids(ids))


def test_dflash_block_and_kv_prefill_match_torch(engines):
    torch_engine, onnx_engine = engines
    mt, mo = torch_engine.proposers["dflash"].model, onnx_engine.proposers["dflash"].model
    (kt, vt), (ko, vo) = random_pools(torch_engine.kv.pools["dflash"], 5)
    g = torch.Generator().manual_seed(6)
    block = torch.randn(6, 64, generator=g)
    read = torch.randperm(100, generator=g)[:17]
    feats = torch.randn(7, 128, generator=g)
    with torch.inference_mode():
        assert close(mo(block, torch.arange(17, 23), ko, vo, read), mt(block, torch.arange(17, 23), kt, vt, read))
        for a, b in zip(mo.kv_only(feats, torch.arange(3, 10)), mt.kv_only(feats, torch.arange(3, 10))):
            assert close(a, b)
    assert torch.equal(mo.mask_embedding, mt.mask_embedding)
