"""How well the suffix drafter's offer predicts its acceptance, replayed over a benchmark run's greedy `ar` outputs.

    python scripts/suffix_offers.py --results OUT/results.json [--engine DIR] [--nodes 6 --min-prob 0.1 --factor 1]

At every state of every output (prompt + output[:i] indexed, output[i] pending) the suffix drafter proposes its tree
(spec.suffix, as the engine would), and the drafts the target would accept follow from the known continuation
(runtime.replay.num_accepted). Printed per category: the states with an offer (a tree of more than the root), mean
expected and mean accepted drafts over them, tau if the suffix drafter drafted every round; then accepted drafts by
expected-drafts bucket over all states with an offer (a calibrated offer has accepted ~ expected in every bucket).
No model runs: only the tokenizer (to rebuild the prompts' token ids through the chat template).
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from whiflash_trt.bench.prompts import load_prompts
from whiflash_trt.builder.default_engine import DEFAULT_CACHE_DIR, default_engine
from whiflash_trt.runtime import tokenizer_policy
from whiflash_trt.runtime.loading import load_tokenizer
from whiflash_trt.runtime.replay import num_accepted
from whiflash_trt.spec.suffix import SuffixIndex

BUCKETS = (0.0, 0.25, 0.5, 1.0, 2.0, 3.0, float("inf"))


def states(prompt: list[int], output: list[int], nodes: int, min_prob: float, factor: float):
    """(expected, accepted) of the suffix drafter's tree at each state 0 .. len(output) - 2."""
    index = SuffixIndex()
    index.append(prompt)
    for i in range(len(output) - 1):
        draft = index.draft(output[i], nodes, min_prob, factor)
        yield draft.score, (num_accepted(draft.tree, output[i + 1:]) if len(draft.tree.tokens) > 1 else None)
        index.append([output[i]])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, required=True, help="a whiflash-bench results.json")
    p.add_argument("--engine", type=Path, help="the engine the run used (default: the embedded one)")
    p.add_argument("--nodes", type=int, default=6)
    p.add_argument("--min-prob", type=float, default=0.1)
    p.add_argument("--factor", type=float, default=1.0)
    args = p.parse_args()
    results = json.loads(args.results.read_text())
    tokenizer = load_tokenizer(args.engine or default_engine(DEFAULT_CACHE_DIR))
    prompts = {bp.id: bp for bp in load_prompts(None, None)}
    per_category: dict[str, list[tuple[float, int | None]]] = defaultdict(list)
    for r in results["records"]:
        if r["mode"] != "ar" or "error" in r or r["prompt_id"] not in prompts:
            continue
        ids = tokenizer_policy.prompt_ids(tokenizer, prompts[r["prompt_id"]].prompt, True, None)
        found = list(states(ids, r["token_ids"], args.nodes, args.min_prob, args.factor))
        per_category[r["category"]] += found
        per_category["all"] += found
    print(f"{'category':10} {'states':>6} {'offers':>7} {'expected':>9} {'accepted':>9} {'tau':>6}")
    for cat, found in per_category.items():
        offered = [(e, a) for e, a in found if a is not None]
        tau = 1 + sum(a for _, a in offered) / len(found)
        mean = (lambda xs: sum(xs) / len(xs) if xs else 0.0)
        print(f"{cat:10} {len(found):6} {len(offered) / len(found):7.1%} {mean([e for e, _ in offered]):9.3f} "
              f"{mean([a for _, a in offered]):9.3f} {tau:6.3f}")
    print(f"\n{'expected':>12} {'offers':>7} {'accepted':>9}")
    offered = [(e, a) for e, a in per_category["all"] if a is not None]
    for low, high in zip(BUCKETS, BUCKETS[1:]):
        bucket = [a for e, a in offered if low <= e < high]
        if bucket:
            print(f"{f'[{low:g}, {high:g})':>12} {len(bucket):7} {sum(bucket) / len(bucket):9.3f}")


if __name__ == "__main__":
    main()
