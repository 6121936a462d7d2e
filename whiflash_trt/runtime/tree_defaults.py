"""How many nodes a draft tree verifies when the request names no number (TreeConfig.total_tokens and
DFlashTreeConfig.total_tokens None): set by the rows the verify's GEMM takes per pass over the weights, which is
where a verified node stops being nearly free.

- The kernels' AMX loop (kernels.GEMM_VARIANTS) takes 16 rows per tile: EAGLE-3 verifies 8 nodes (with its 0.05
  floor as good as 10, and better than the 2-step trees of 6), DFlash 5 (within noise of 6 to 8, better than 4).
- The FMA and dot loops take 6 rows per pass, and each further row is a second pass over the weights in cache: 6
  nodes for both. The dot loop's two-block walk makes 2-3 rows cost little more than a decode step
  (kernels/linear_bf16.cpp), but trees that small lose more tau than round time.
- The FMA loop on AVX2 (8 lanes) is compute-bound from 3 rows: each row past the second adds 0.1-0.15x a decode
  step's GEMM time (SmolLM2's linears: 10.8 ms at 1 and 2 rows, 12.4-12.8 at 3, 14.2 at 4, 15.6 at 6): 4 nodes for
  every drafter (the suffix drafter too: 4 beat 3 and 6 on the copy-heavy prompts).
- A native target's GGML GEMM (kernels/ggml_gemm.h, every build): a decode step is so cheap (97 MB streamed) that
  each verified row costs relatively more, in the GEMM and in the attention, which reads every key once per row: 3
  nodes for the learned drafters and 4 for the suffix drafter, on AVX2 (Zen 3) and on AVX-512 VNNI (Zen 4) alike.
- The torch path, fp32 targets and other devices take this default too.

The comparisons behind these counts: docs/measurements.md, "Default node counts".
"""
from __future__ import annotations

import torch

from whiflash_trt import kernels
from whiflash_trt.config import DFLASH, EAGLE3, SUFFIX

NODES = {EAGLE3: 6, DFLASH: 6, SUFFIX: 6}
AVX2_FMA = "fma-avx2"   # the FMA loop of the avx2 build
GGML = "ggml"   # a native target's GGML GEMM, in every build
NODES_BY_GEMM = {"amx": {EAGLE3: 8, DFLASH: 5}, AVX2_FMA: {EAGLE3: 4, DFLASH: 4, SUFFIX: 4},
                 GGML: {EAGLE3: 3, DFLASH: 3, SUFFIX: 4}}
DEFAULT_NODES_HELP = {d: f"{NODES_BY_GEMM['amx'].get(d, NODES[d])} where the GEMM runs on AMX tiles, "
                         f"{NODES_BY_GEMM[AVX2_FMA][d]} on AVX2-only CPUs, {NODES_BY_GEMM[GGML][d]} for a native "
                         f"target, else {NODES[d]}" for d in NODES}


def gemm_kind(native: bool = False) -> str | None:
    """This process's GEMM loop as the defaults key it (None without the kernels); `native`: a target on GGML
    blocks, whose GEMM is ggml_gemm.h on every loop."""
    if not kernels.registered():
        return None
    if native:
        return GGML
    gemm = kernels.gemm()
    return AVX2_FMA if gemm == "fma" and kernels.loaded_isa() == "avx2" else gemm


def default_nodes(drafter: str, device: torch.device, dtype: torch.dtype, native: bool = False) -> int:
    """Nodes (root included) that `drafter`'s tree verifies by default for a target of `dtype` on `device` (`native`:
    its linears on GGML blocks): by the GEMM the verify runs on where that is the kernels' (bf16 on the CPU), else
    NODES."""
    gemm = gemm_kind(native) if device.type == "cpu" and dtype == torch.bfloat16 else None
    return NODES_BY_GEMM.get(gemm, {}).get(drafter, NODES[drafter])
