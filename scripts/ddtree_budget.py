"""DFlash draft trees (DDTree): expected tau per node budget offline, then tau and tokens/s at runtime (issue 13, item 2).

    python scripts/ddtree_budget.py --budgets 8,16,32,64 --per-category 6 --max-new-tokens 64 --threads 1
    python scripts/ddtree_budget.py --runtime --budgets 8,16,32 --runtime-prompts 3 --max-new-tokens 64 --threads 1

Offline (default): on the held-out validation prompts' greedy responses (train.acceptance), every response position is
a round start; one DFlash block forward per position gives the per-position distributions, and for each budget the
tree of the budget - 1 most probable prefixes (spec.ddtree) is scored against the known continuation: its accepted
length is exactly what greedy verification would accept there. "chain" is the block's argmax chain (the runtime
default); "predicted" is DDTree's own estimate, 1 + the tree's summed prefix probability.
Runtime (--runtime): Engine.generate in dflash mode on the first N code and math benchmark prompts, the chain and each
budget interleaved per prompt (so load changes hit every setting alike): tau, tokens/s, seconds per round.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from pathlib import Path

import torch

from whiflash_trt.bench.prompts import builtin_set
from whiflash_trt.builder.default_engine import DEFAULT_CACHE_DIR, default_engine
from whiflash_trt.config import DFLASH, DFlashTreeConfig, GenerationConfig, SpecConfig
from whiflash_trt.runtime.engine import Engine
from whiflash_trt.spec.ddtree import best_prefix_tree
from whiflash_trt.spec.tree import DraftTree
from whiflash_trt.train.acceptance import greedy_responses, held_out_prompts, round_starts
from whiflash_trt.train.router_trainer import accepted_length

CHAIN = "chain"


def offline(engine: Engine, responses, budgets: list[int]) -> dict:
    df = engine.proposers[DFLASH]
    horizon = df.draft_block_len - 1
    sums: dict = defaultdict(lambda: defaultdict(float))
    build_s: dict = defaultdict(float)
    for r in responses:
        for seq, cont in round_starts(engine, r, horizon, slack=df.draft_block_len):
            logits = df.block_logits(seq).float()
            logp = torch.log_softmax(logits, dim=-1)
            trees = {CHAIN: (DraftTree.chain(seq.pending, logits.argmax(-1).tolist()), None)}
            for b in budgets:
                t0 = time.perf_counter()
                trees[b] = best_prefix_tree(seq.pending, logp, b)
                build_s[b] += time.perf_counter() - t0
            for key in (r.category, "mix"):
                s = sums[key]
                s["positions"] += 1
                for name, (tree, expected) in trees.items():
                    s[f"tau_{name}"] += accepted_length(tree, cont)
                    if expected is not None:
                        s[f"predicted_{name}"] += 1 + expected
    positions = sums["mix"]["positions"]
    out = {cat: {k: (int(v) if k == "positions" else round(v / s["positions"], 3)) for k, v in s.items()}
           for cat, s in sums.items()}
    out["heap_ms_per_round"] = {b: round(1000 * build_s[b] / positions, 3) for b in budgets}
    return out


def runtime(engine: Engine, budgets: list[int], num_prompts: int, max_new_tokens: int) -> dict:
    prompts = [p for cat in ("code", "math") for p in builtin_set(cat)[:num_prompts]]
    chain = DFlashTreeConfig(total_tokens=engine.proposers[DFLASH].draft_block_len, top_k=1)   # the whole block
    settings = {CHAIN: SpecConfig(mode=DFLASH, dflash_tree=chain), "ar": SpecConfig(mode="ar")}
    settings |= {str(b): SpecConfig(mode=DFLASH, dflash_tree=DFlashTreeConfig(total_tokens=b)) for b in budgets}
    gen = GenerationConfig(max_new_tokens=max_new_tokens)
    engine.generate(engine.encode(prompts[0].prompt, chat=True), GenerationConfig(max_new_tokens=8))   # warm-up
    sums: dict = defaultdict(lambda: defaultdict(float))
    reference: dict = {}
    for i, p in enumerate(prompts):
        ids = engine.encode(p.prompt, chat=True)
        names = list(settings)
        names = names[i % len(names):] + names[:i % len(names)]          # rotate who runs first
        for name in names:
            result = engine.generate(ids, gen, spec=settings[name])
            st = result.stats
            s = sums[name]
            s["tokens"] += st["new_tokens"]
            s["seconds"] += st["seconds"] - st["prefill_seconds"]
            s["rounds"] += st["rounds"]
            s["tau_sum"] += sum(t for _, t in st["trace"])
            reference.setdefault(p.id, result.token_ids)
            s["lossless"] += int(result.token_ids == reference[p.id])
    return {name: {"tokens_per_s": round(s["tokens"] / s["seconds"], 2),
                   "tau": round(s["tau_sum"] / s["rounds"], 3) if s["rounds"] else 1.0,
                   "s_per_round": round(s["seconds"] / s["rounds"], 4) if s["rounds"] else None,
                   "equal_outputs": f"{int(s['lossless'])}/{len(prompts)}"}
            for name, s in sums.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", type=Path, help="engine directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--budgets", default="8,16,32,64", help="comma-separated DDTree node budgets, root included")
    p.add_argument("--per-category", type=int, default=6, help="offline: validation prompts per category")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--responses", type=Path, help="offline: JSON lines cache of the target's greedy responses")
    p.add_argument("--runtime", action="store_true", help="measure at runtime on code and math benchmark prompts")
    p.add_argument("--runtime-prompts", type=int, default=3, help="runtime: prompts per category (code, math)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",")]
    engine = Engine.load(args.engine or default_engine(DEFAULT_CACHE_DIR), dtype=args.dtype)
    print(json.dumps({"setup": vars(args) | {"engine": str(args.engine), "responses": str(args.responses),
                                             "load_before": os.getloadavg()}}), flush=True)
    start = time.time()
    if args.runtime:
        result = {"runtime": runtime(engine, budgets, args.runtime_prompts, args.max_new_tokens)}
    else:
        responses = greedy_responses(engine, held_out_prompts("val", args.per_category), args.max_new_tokens,
                                     args.responses)
        result = {"offline": offline(engine, responses, budgets)}
    print(json.dumps(result | {"seconds": round(time.time() - start, 1), "load_after": os.getloadavg()}), flush=True)


if __name__ == "__main__":
    main()
