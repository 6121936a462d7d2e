"""The kernels' vocabulary reductions can be called anywhere: without the kernels, or on a tensor off the CPU, each
runs the torch formulation its callers ran before (route signal, greedy verification, the drafters' top k), bit for
bit. tests/test_kernels.py holds the kernels' own results against the same formulations."""
from __future__ import annotations

import pytest
import torch

from whiflash_trt import kernels
from whiflash_trt.spec.router import entropy_and_margin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_vocabulary_ops_run_torch_without_the_kernels(monkeypatch, dtype):
    monkeypatch.setattr(kernels.ops, "registered", lambda: False)
    logits = (torch.randn(3, 500, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    assert torch.equal(kernels.argmax_rows(logits), logits.float().argmax(-1))
    assert kernels.entropy_margin(logits[1]) == entropy_and_margin(logits[1])
    for log_softmax in (False, True):
        want = torch.topk(torch.log_softmax(logits.float(), dim=-1) if log_softmax else logits.float(), 4, dim=-1)
        values, indices = kernels.topk_rows(logits, 4, log_softmax)
        assert torch.equal(values, want.values) and torch.equal(indices, want.indices)


def test_vocabulary_ops_off_the_cpu_run_torch():
    """A meta tensor has no kernel: were the kernel called on it, the op would raise."""
    logits = torch.empty(3, 500, device="meta", dtype=torch.bfloat16)
    assert kernels.argmax_rows(logits).shape == (3,)
    values, indices = kernels.topk_rows(logits, 4, log_softmax=True)
    assert values.device.type == "meta" and values.dtype == torch.float32 and indices.shape == (3, 4)
