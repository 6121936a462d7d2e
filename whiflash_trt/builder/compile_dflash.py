"""`whiflash-build --backend compiled`: the DFlash block forward (every layer over the blocks' rows on the engine's
attention kernel, the final norm) exported with torch.export and compiled ahead of time by AOTInductor, like the
target step and EAGLE-3's draft step (whose inductor settings it shares). One graph serves any number of blocks
over any context: rows, keys per row and pool slots are dynamic. The LM head over the drafts, fc and the KV-only
prefill stay the torch module and the proposer (runtime/drafters.py).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from whiflash_trt.builder.compile_target import package, step_dims
from whiflash_trt.models.attention import AttentionContext, RowKeys
from whiflash_trt.models.dflash import DFlashDrafter


class DFlashStep(nn.Module):
    """The exported signature: tensors only -> final-norm hidden [rows, H] of the blocks."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, block_embeds, positions, k_cache, v_cache, write_slots, row_slots, row_len):
        ctx = AttentionContext.at(self.drafter.rotary, positions, block_embeds.dtype, write_slots,
                                  RowKeys(row_slots, row_len), k_cache, v_cache)
        return self.drafter.run(block_embeds, ctx)


def example_inputs(drafter: DFlashDrafter, blocks: int = 2, keys: int = 80, slots: int = 160):
    """`blocks` blocks over `keys` context keys each; every input a tensor of its own and every dynamic size
    distinct (see compile_target.example_inputs)."""
    cfg, dtype = drafter.config, drafter.fc.weight.dtype
    b = cfg.draft_block_len
    rows = blocks * b
    pool = torch.zeros(cfg.num_layers, slots, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
    return (torch.zeros(rows, cfg.hidden_size, dtype=dtype), torch.arange(keys, keys + b).repeat(blocks), pool,
            pool.clone(), torch.arange(keys, keys + rows), torch.arange(keys + b).repeat(rows, 1),
            torch.full((rows,), keys + b))


def compile_dflash(drafter: DFlashDrafter, path: Path) -> dict:
    """Export and compile the block forward of an engine's drafter (fused, over the loaded kernels) into the
    package `path` -> the manifest entry."""
    if not drafter.kernel_attention:
        raise ValueError("the compiled block forward runs on the engine's kernels: load them and fuse the drafter")
    rows, keys, pool = step_dims(drafter.config.max_position_embeddings)
    shapes = ({0: rows}, {0: rows}, pool, pool, {0: rows}, {0: rows, 1: keys}, {0: rows})
    seconds = package(DFlashStep(drafter), example_inputs(drafter), shapes, path)
    return {"path": path.name, "compile_seconds": seconds}
