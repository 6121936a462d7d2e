"""CPU time of the target's steps over one sequence (a 300-token context): a decode step, a 9-token chain verify and a
16-node tree verify; median of --repeats, this thread's CPU time (robust to other jobs taking the other cores).

    python scripts/bench_engine_steps.py --engine ~/.cache/whiflash-trt/engines/smollm2-135m-bf16-... --threads 1

To compare two versions, run it from each checkout in turn (interleaved, a few times each).
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
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.load(args.engine)
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
            for _ in range(args.repeats):
                start = time.thread_time()
                engine.runner.step(seq, **feed)
                times.append(time.thread_time() - start)
            result[name + "_ms"] = round(statistics.median(times) * 1e3, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
