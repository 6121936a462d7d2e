"""Time of the target's steps over one sequence (a 300-token context): a decode step, a 9-token chain verify and a
16-node tree verify; median of --repeats, wall-clock (run it on a quiet machine).

    python scripts/bench_engine_steps.py --engine ~/.cache/whiflash-trt/engines/smollm2-135m-bf16-... --threads 2 \
        --backend torch compiled

Backends are timed in turn, step kind by step kind; to compare two versions, run it from each checkout in turn.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from whiflash_trt.runtime.engine import Engine
from whiflash_trt.spec.tree import DraftTree

TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 5, 7, 8, 9, 10, 11, 12]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", type=Path, required=True, help="engine directory")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--repeats", type=int, default=25, help="timed steps per kind")
    p.add_argument("--backend", nargs="+", default=[None], help="backends to time (default: the engine's)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    for backend in args.backend:
        print(json.dumps({"backend": backend or "engine's"} | time_steps(Engine.load(args.engine, backend=backend),
                                                                           args.repeats)))


def time_steps(engine: Engine, repeats: int) -> dict:
    depths = [0]
    for parent in TREE_PARENTS[1:]:
        depths.append(depths[parent] + 1)
    tree = DraftTree(list(range(100, 116)), TREE_PARENTS, depths)
    kinds = {"decode": dict(tokens=[5]), "chain9": dict(tokens=list(range(5, 14))),
             "tree16": dict(tokens=tree.tokens, depths=tree.depths, tree_mask=tree.mask())}
    result = {}
    with engine.scratch_sequence(list(range(1, 301)), 400) as seq:
        engine.runner.step(seq, seq.prompt_ids)
        seq.commit(seq.prompt_ids, None)
        for name, feed in kinds.items():
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                engine.runner.step(seq, **feed)
                times.append(time.perf_counter() - start)
            result[name + "_ms"] = round(statistics.median(times) * 1e3, 2)
    return result


if __name__ == "__main__":
    main()
