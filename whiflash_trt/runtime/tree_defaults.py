"""How many nodes a draft tree verifies when the request names no number (TreeConfig.total_tokens and
DFlashTreeConfig.total_tokens None): set by the rows the verify's GEMM takes per pass over the weights, which is
where a verified node stops being nearly free.

- The kernels' AMX loop (kernels.GEMM_VARIANTS) takes 16 rows per tile: on an Intel Xeon with AMX (family 6 model
  167) EAGLE-3's 8 nodes with its 0.05 floor were as good as 10 and beat the 2-step trees of 6, and DFlash's 5
  nodes were within noise of 6 to 8 and beat 4 (the measurements are in config.TreeConfig and DFlashTreeConfig).
- The FMA and dot loops take 6 rows per pass, and each further row is a second pass over the weights in cache. On an
  AMD EPYC (family 25 model 17, Zen 4, dot loop, 2 threads; 2026-12-04, `python scripts/compare_tree_shapes.py
  --eagle3 ... --dflash ... --num-prompts 5 --skip S --threads 2`, 20 held-out prompts, 96 new tokens, every output
  `ar`'s), speed-up over `ar` in three runs: EAGLE-3 3,3,8@0.05 1.288 / 1.304 / 1.200 against 3,3,6@0.05 1.342 and
  3,3,6 1.420 / 1.270 (3,2,6 1.365 / 1.389 / 1.279); DFlash 6 nodes 1.333 / 1.373 against 5 nodes 1.272 / 1.321.
  The dot loop walks two blocks at a time up to 3 rows (kernels/linear_bf16.cpp), so 2-3 nodes cost little more
  than a decode step there; still, on the same EPYC (2026-12-04, same script, prompts 10-14 and 15-19) EAGLE-3's
  3,3,6@0.05 made 1.325 / 1.477 against 3,3,4@0.05 1.258 and 3,3,3@0.05 1.205 / 1.361, and DFlash's 6 nodes 1.309 /
  1.528 against 4 nodes 1.219 and 3 nodes 1.207 / 1.385: the shorter trees lose more tau than round time.
  The torch path and other devices take this default too.
"""
from __future__ import annotations

import torch

from whiflash_trt import kernels
from whiflash_trt.config import DFLASH, EAGLE3, SUFFIX

NODES = {EAGLE3: 6, DFLASH: 6, SUFFIX: 6}
NODES_BY_GEMM = {"amx": {EAGLE3: 8, DFLASH: 5}}
DEFAULT_NODES_HELP = {d: f"{NODES_BY_GEMM['amx'][d]} where the GEMM runs on AMX tiles, else {NODES[d]}"
                      for d in NODES_BY_GEMM["amx"]} | {SUFFIX: str(NODES[SUFFIX])}


def default_nodes(drafter: str, device: torch.device) -> int:
    """Nodes (root included) that `drafter`'s tree verifies by default on `device` with this process's GEMM loop."""
    gemm = kernels.gemm() if device.type == "cpu" and kernels.registered() else None
    return NODES_BY_GEMM.get(gemm, {}).get(drafter, NODES[drafter])
