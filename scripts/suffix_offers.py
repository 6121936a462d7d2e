"""How well the suffix drafter's offer predicts its acceptance, replayed over a benchmark run's greedy `ar` outputs.

    python scripts/suffix_offers.py --results OUT/results.json [--engine DIR] [--nodes 6 --min-prob 0.1 --factor 1]

At every state of every output (prompt + output[:i] indexed, output[i] pending) the suffix drafter proposes its tree
(spec.suffix, as the engine would), and the drafts the target would accept follow from the known continuation
(runtime.replay.num_accepted). Printed per category: the states with an offer (a tree of more than the root), mean
expected and mean accepted drafts over them, and tau if the suffix drafter drafted every round (rounds walked
through the output: a round at state i goes on at i + accepted + 1); then accepted drafts by
expected-drafts bucket over all states with an offer (a calibrated offer has accepted ~ expected in every bucket),
and by match length: the tree's summed path frequencies (its raw score) against what was accepted, with the match
prior k that fits accepted ~ score * m / (m + k) best (least squares; spec.suffix.MATCH_PRIOR).
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
    """(draft, accepted or None without an offer) of the suffix drafter at each state 0 .. len(output) - 2."""
    index = SuffixIndex()
    index.append(prompt)
    for i in range(len(output) - 1):
        draft = index.draft(output[i], nodes, min_prob, factor)
        yield draft, (num_accepted(draft.tree, output[i + 1:]) if len(draft.tree.tokens) > 1 else None)
        index.append([output[i]])


def fit_prior(offers: list[tuple[int, float, int]]) -> float:
    """The k in [0, 20] (steps of 0.1) that minimises the squared error of score * m / (m + k) against accepted."""
    def error(k: float) -> float:
        return sum((a - s * m / (m + k)) ** 2 for m, s, a in offers)
    return min((k / 10 for k in range(201)), key=error)


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
    per_category: dict[str, list] = defaultdict(list)
    walked: dict[str, list[int]] = defaultdict(lambda: [0, 0])   # category -> [tokens the rounds commit, rounds]
    for r in results["records"]:
        if r["mode"] != "ar" or "error" in r or r["prompt_id"] not in prompts:
            continue
        ids = tokenizer_policy.prompt_ids(tokenizer, prompts[r["prompt_id"]].prompt, True, None)
        found = list(states(ids, r["token_ids"], args.nodes, args.min_prob, args.factor))
        per_category[r["category"]] += found
        per_category["all"] += found
        i, rounds = 0, 0
        while i < len(found):
            i, rounds = i + (found[i][1] or 0) + 1, rounds + 1
        for cat in (r["category"], "all"):
            walked[cat][0] += len(found)
            walked[cat][1] += rounds
    print(f"{'category':10} {'states':>6} {'offers':>7} {'expected':>9} {'accepted':>9} {'tau':>6}")
    for cat, found in per_category.items():
        offered = [(d.expected, a) for d, a in found if a is not None]
        tau = walked[cat][0] / walked[cat][1]
        mean = (lambda xs: sum(xs) / len(xs) if xs else 0.0)
        print(f"{cat:10} {len(found):6} {len(offered) / len(found):7.1%} {mean([e for e, _ in offered]):9.3f} "
              f"{mean([a for _, a in offered]):9.3f} {tau:6.3f}")
    print(f"\n{'expected':>12} {'offers':>7} {'accepted':>9}")
    offered = [(d.expected, a) for d, a in per_category["all"] if a is not None]
    for low, high in zip(BUCKETS, BUCKETS[1:]):
        bucket = [a for e, a in offered if low <= e < high]
        if bucket:
            print(f"{f'[{low:g}, {high:g})':>12} {len(bucket):7} {sum(bucket) / len(bucket):9.3f}")
    offers = [(d.match, d.score, a) for d, a in per_category["all"] if a is not None]
    print(f"\n{'match':>6} {'offers':>7} {'score':>7} {'accepted':>9}")
    for m in sorted({min(m, 8) for m, _, _ in offers}):
        group = [(s, a) for n, s, a in offers if min(n, 8) == m]
        print(f"{m if m < 8 else '8+':>6} {len(group):7} {sum(s for s, _ in group) / len(group):7.3f} "
              f"{sum(a for _, a in group) / len(group):9.3f}")
    print(f"\nbest match prior k: {fit_prior(offers):g}")


if __name__ == "__main__":
    main()
