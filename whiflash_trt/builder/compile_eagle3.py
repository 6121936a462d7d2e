"""`whiflash-build --backend compiled`: EAGLE-3's draft step (the midlayer over the tree's rows, the draft head and its
log-softmax) exported with torch.export and compiled ahead of time by AOTInductor, like the target step
(builder/compile_target.py, whose inductor settings it shares). One graph serves every depth of every tree: rows,
keys per row and pool slots are dynamic. fc, the KV-only prefill and the id map stay the torch module.

Compiled, a draft depth costs well under eager's (docs/measurements.md, "Builder"); a round drafts TreeConfig.depth.
The compiled log-probabilities may differ from eager's in the last digits (inductor's own reduction order): that can
change drafts, never output bits.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from whiflash_trt.builder.compile_target import package, step_dims
from whiflash_trt.models.attention import AttentionContext, RowKeys
from whiflash_trt.models.eagle3 import Eagle3Drafter


class Eagle3Step(nn.Module):
    """The exported signature: tensors only -> (out hidden [T, H], draft log-probs [T, draft_vocab])."""

    def __init__(self, drafter: Eagle3Drafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, embeds, hidden, positions, k_cache, v_cache, write_slots, row_slots, row_len):
        ctx = AttentionContext.at(self.drafter.rotary, positions, hidden.dtype, write_slots,
                                  RowKeys(row_slots, row_len), k_cache, v_cache)
        out = self.drafter.run(embeds, hidden, ctx)
        return out, self.drafter.draft_logprobs(out)


def example_inputs(drafter: Eagle3Drafter, rows: int = 3, keys: int = 80, slots: int = 128):
    """Three tree rows over 80 keys; every input a tensor of its own (see compile_target.example_inputs)."""
    cfg, dtype = drafter.config, drafter.fc.weight.dtype
    pool = torch.zeros(1, slots, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
    return (torch.zeros(rows, cfg.hidden_size, dtype=dtype), torch.zeros(rows, cfg.hidden_size, dtype=dtype),
            torch.full((rows,), keys - 1), pool, pool.clone(), torch.arange(keys, keys + rows),
            torch.arange(keys + rows).repeat(rows, 1), torch.full((rows,), keys + 1))


def compile_eagle3(drafter: Eagle3Drafter, path: Path) -> dict:
    """Export and compile the draft step of an engine's drafter (fused, over the loaded kernels) into the package
    `path` -> the manifest entry."""
    if not drafter.kernel_attention:
        raise ValueError("the compiled draft step runs on the engine's kernels: load them and fuse the drafter first")
    rows, keys, pool = step_dims(drafter.config.max_position_embeddings)
    shapes = ({0: rows}, {0: rows}, {0: rows}, pool, pool, {0: rows}, {0: rows, 1: keys}, {0: rows})
    seconds = package(Eagle3Step(drafter), example_inputs(drafter), shapes, path)
    return {"path": path.name, "compile_seconds": seconds}
