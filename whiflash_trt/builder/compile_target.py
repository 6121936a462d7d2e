"""`whiflash-build --backend compiled`: the target's forward exported with torch.export and compiled ahead of time by
AOTInductor into one package the runtime loads without recompiling (runtime/backends/compiled.py).

The graph is the eager forward (TargetModel.run) over the engine's kernels: the GEMMs (with the layers'
residual adds, RMSNorms and SwiGLU inside them: kernels.linear_norm) and the paged attention stay custom ops
(whiflash_trt/kernels), which the KV pools are written through; inductor fuses what is left between them (RoPE, the
final norm) and drops the per-op dispatch of eager mode. One graph serves every call: the new rows T, the keys per
row W, the logit rows and the pool slots are dynamic.

Bits: emulate_precision_casts keeps eager's bf16 roundings between ops, but inductor sums the final norm's squares in
its own order, so a compiled step's logits can differ from the eager step's in the last place. What losslessness
needs holds: the compiled step's rows do not depend on the rest of the call (tests/test_compiled.py, chains and
trees at 1 and 2 threads), and its greedy tokens equal the eager engine's on the tests' prompts.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from whiflash_trt import kernels
from whiflash_trt.models.attention import AttentionContext, RowKeys
from whiflash_trt.models.target import TargetModel

# inductor settings of the package: bf16 roundings as eager mode does them; weights stay inputs of the kernels
# (they are prepacked already), so freezing has nothing to fold; inductor's own kernels on one thread, so no
# reduction is split over threads by the row count (with 2 threads a 30-row prefill's rows differed from eager's in
# later layers; the GEMM and attention ops still use every torch thread).
INDUCTOR_CONFIGS = {"emulate_precision_casts": True, "freezing": False, "cpp.threads": 1}


class TargetStep(nn.Module):
    """The exported signature: tensors only, the captured layers fixed."""

    def __init__(self, target: TargetModel, capture_layers: tuple[int, ...]) -> None:
        super().__init__()
        self.target, self.capture_layers = target, capture_layers

    def forward(self, input_ids, positions, k_cache, v_cache, write_slots, row_slots, row_len, logits_indices):
        m = self.target
        ctx = AttentionContext.at(m.rotary, positions, m.dtype, write_slots, RowKeys(row_slots, row_len), k_cache,
                                  v_cache)
        out = m.run(input_ids, ctx, self.capture_layers, logits_indices)
        return (out.logits, out.hidden) + ((out.captured,) if self.capture_layers else ())


def example_inputs(target: TargetModel, rows: int = 4, keys: int = 80, slots: int = 128):
    """A 4-token chain over 80 keys. Only shapes and dtypes matter, but every input is a tensor of its own: the
    export would take one tensor passed twice (positions as write slots) for one input of the graph."""
    cfg = target.config
    pool = torch.zeros(cfg.num_layers, slots, cfg.num_kv_heads, cfg.head_dim, dtype=target.dtype)
    positions = torch.arange(keys - rows, keys)
    return (torch.zeros(rows, dtype=torch.long), positions, pool, pool.clone(), positions + 8,
            (torch.arange(keys) + 8).repeat(rows, 1), positions + 1, torch.arange(rows))


def step_dims(max_positions: int) -> tuple[torch.export.Dim, torch.export.Dim, dict]:
    """The dynamic sizes every step graph shares: its rows, the keys a row reads (RowKeys' width) and a pool's
    slots (axis 1 of [layers, slots, kv_heads, D])."""
    return (torch.export.Dim("rows", min=1, max=max_positions), torch.export.Dim("keys", min=1, max=max_positions),
            {1: torch.export.Dim("slots", min=2)})


def package(module: nn.Module, inputs: tuple, shapes: tuple, path: Path) -> float:
    """torch.export `module` on `inputs` with the dynamic `shapes`, then compile it ahead of time into the package
    `path` (the engine's ops called through their C shims: kernels.c_shims) -> the seconds it took."""
    start = time.perf_counter()
    with torch.no_grad():
        program = torch.export.export(module, inputs, dynamic_shapes=shapes)
        torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs={
            **INDUCTOR_CONFIGS, "aot_inductor.custom_ops_to_c_shims": kernels.c_shims()})
    return round(time.perf_counter() - start, 1)


def compile_target(target: TargetModel, capture_layers: tuple[int, ...], path: Path) -> dict:
    """Export and compile the target step into the package `path` -> the manifest entry. The target must be fused
    over the loaded kernels (instantiate_target after kernels.load)."""
    if not target.kernel_attention:
        raise ValueError("the compiled target runs on the engine's kernels: load them before instantiating it")
    max_pos = target.config.max_position_embeddings
    rows, keys, pool = step_dims(max_pos)
    logit_rows = torch.export.Dim("logit_rows", min=1, max=max_pos)
    shapes = ({0: rows}, {0: rows}, pool, pool, {0: rows}, {0: rows, 1: keys}, {0: rows}, {0: logit_rows})
    seconds = package(TargetStep(target, capture_layers), example_inputs(target), shapes, path)
    return {"path": path.name, "capture_layers": list(capture_layers), "compile_seconds": seconds}
