"""How much per-round routing could win from the drafters' own confidences (issue 14, item 2): simulated tokens/s.

router_signals.py found that the free signals barely predict either drafter's accepted drafts (held-out R^2 ~0-0.07)
while the drafters' own confidences do (DFlash's expected chain length, EAGLE-3's first-step top-1: R^2 ~0.25-0.34,
~0.4 together). Those are not free: a router reading them runs a drafter forward before it chooses, and pays for it
in every round that does not then draft with that drafter. This script answers whether that pays, on the same cached
held-out states (router_signals.py --cache; it measures what is missing):

  policies     the throughput rule (spec.router.best_option: the drafter with the best expected tokens per second
               drafts if that beats threshold x a target-only round's rate) on a ridge fit (features and their
               squares) of each drafter's accepted drafts from
                 history      the shipped router's inputs (spec.router.FEATURES: entropy, margin, the EMAs, the last
                              round), from RouterHistory as an engine keeps it
                 + dflash     DFlash's block confidence (expected chain length, first and third cumulative top-1)
                 + eagle3     EAGLE-3's first-step top-1 probability (its root forward)
                 + both
               fit on random walks over the training prompts (each round none, EAGLE-3 or DFlash at random), the
               threshold the best of a grid on the training prompts; folds by prompt, every prompt scored by the
               fit that did not see it
  gate cost    each confidence costs its forward in every round that does not draft with its drafter: timed here
               on this machine (DFlash: its whole propose; EAGLE-3: its root forward), and at zero (the ceiling the
               information allows)
  references   each static choice, the three-way oracle (bench.oracle), and the shipped router file as it is (in
               sample: it was fit on these states)

Costs of the rounds themselves: --costs or --bench-results, as router_signals.py.

    python scripts/router_ceiling.py --num-prompts 9 --max-new-tokens 96 --costs none=S,eagle3=S,dflash=S \
        --cache SIGCACHE --threads 2
"""
from __future__ import annotations

import json
import math
import random
import statistics
import sys
import time

import torch
from router_signals import e3_root_top1, measure, parser as signals_parser, setup

from whiflash_trt.bench import environment
from whiflash_trt.bench.oracle import NO_DRAFT, replay, solve
from whiflash_trt.config import DFLASH, EAGLE3, WHIFLASH, SpecConfig
from whiflash_trt.runtime.engine import Engine
from whiflash_trt.runtime.replay import capture_output, replay_drafts
from whiflash_trt.spec.router import FrozenPredictor, RouterHistory, best_option

GATES = {"history": (), "+ dflash": (DFLASH,), "+ eagle3": (EAGLE3,), "+ both": (DFLASH, EAGLE3)}
THRESHOLDS = [0.8 + 0.1 * i for i in range(9)]


def confidence_features(m: dict, i: int, gates: tuple[str, ...]) -> list[float]:
    out = []
    if DFLASH in gates:
        cum = [math.prod(m["df_q"][i][:j + 1]) for j in range(len(m["df_q"][i]))]
        out += [sum(cum), cum[0], cum[min(2, len(cum) - 1)]]
    if EAGLE3 in gates:
        out.append(m["e3_top1"][i])
    return out


def accepted(m: dict) -> dict[str, list[int]]:
    """drafter -> its accepted drafts at each state of a measured output."""
    return {d: m[f"a_{d}"] for d in (EAGLE3, DFLASH)}


def walk(m: dict, choose, costs: dict[str, float], gate_seconds: dict[str, float], gates: tuple[str, ...],
         history: RouterHistory) -> tuple[float, list[tuple[list[float], int, int]]]:
    """One output routed by `choose(features) -> choice`: its seconds (rounds plus the gates' forwards where their
    drafter did not draft) and the visited rows (features, a_eagle3, a_dflash)."""
    drafts = accepted(m)
    rows, extra, last = [], 0.0, (None, 0)

    def at(i: int) -> str:
        nonlocal extra, last
        history.update(*last)
        x = history.features(m["entropy"][i], m["margin"][i]) + confidence_features(m, i, gates)
        rows.append((x, drafts[EAGLE3][i], drafts[DFLASH][i]))
        d = choose(x)
        extra += sum(gate_seconds[g] for g in gates if g != d)
        last = (d, 0 if d == NO_DRAFT else drafts[d][i])
        return d

    return replay(drafts, costs, at).seconds + extra, rows


def fit(rows: list[tuple[list[float], int, int]]):
    """Ridge of (a_eagle3, a_dflash) on standardised features and their squares -> predict(x) -> [2]."""
    x = torch.tensor([r[0] for r in rows], dtype=torch.float64)
    y = torch.tensor([[r[1], r[2]] for r in rows], dtype=torch.float64)
    z = torch.cat([x, x ** 2], 1)
    mean, std = z.mean(0), z.std(0).clamp_min(1e-9)
    a = torch.cat([(z - mean) / std, torch.ones(len(z), 1, dtype=z.dtype)], 1)
    w = torch.linalg.solve(a.T @ a + torch.eye(a.shape[1], dtype=a.dtype), a.T @ y)

    def predict(v: list[float]) -> list[float]:
        t = torch.tensor(v, dtype=torch.float64)
        return (torch.cat([(torch.cat([t, t ** 2]) - mean) / std, torch.ones(1, dtype=t.dtype)]) @ w).tolist()
    return predict


def policy(predict, costs: dict[str, float], threshold: float):
    return lambda x: best_option(dict(zip((EAGLE3, DFLASH), predict(x))), costs, threshold)


def cross_validated(measured, folds, gates, costs, gate_seconds, priors, seed) -> dict[int, float]:
    """prompt index -> its seconds under the policy fit on the other folds."""
    seconds = {}
    for f, held in enumerate(folds):
        train = [k for k in range(len(measured)) if k not in held]
        rows = []
        for k in train:
            for w in range(4):   # random routings: every kind of history
                rng = random.Random(f"{seed}-{k}-{w}")
                rows += walk(measured[k], lambda x, r=rng: r.choice((NO_DRAFT, EAGLE3, DFLASH)), costs,
                             gate_seconds, gates, RouterHistory(priors))[1]
        predict = fit(rows)

        def total(ks, t):
            return sum(len(measured[k]["output"]) for k in ks) / sum(
                walk(measured[k], policy(predict, costs, t), costs, gate_seconds, gates, RouterHistory(priors))[0]
                for k in ks)
        best = max(THRESHOLDS, key=lambda t: total(train, t))
        for k in held:
            seconds[k] = walk(measured[k], policy(predict, costs, best), costs, gate_seconds, gates,
                              RouterHistory(priors))[0]
    return seconds


@torch.inference_mode()
def gate_seconds_measured(engine: Engine, measured: list[dict], ids: dict, states: int) -> dict[str, float]:
    """Median seconds of DFlash's propose and EAGLE-3's root forward over the first `states` states of the first
    prompt of each category (the same replay as the cache's)."""
    proposers = engine.proposers_for(SpecConfig(mode=WHIFLASH))
    times = {DFLASH: [], EAGLE3: []}
    for m in {m["category"]: m for m in reversed(measured)}.values():
        p, out = ids[m["id"]], m["output"]
        tokens = p + out
        cap = capture_output(engine, tokens[:-1])
        for state in replay_drafts(engine, proposers, tokens, cap.captured, len(p), len(p) + min(states, len(out) - 1)):
            t0 = time.perf_counter()
            proposers[DFLASH].propose(state.seq)
            t1 = time.perf_counter()
            e3_root_top1(state, proposers[EAGLE3])
            times[DFLASH].append(t1 - t0)
            times[EAGLE3].append(time.perf_counter() - t1)
    return {d: statistics.median(ts) for d, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = signals_parser()
    p.description = __doc__.split("\n")[0]
    p.add_argument("--folds", type=int, default=3, help="folds by prompt (round robin within each category)")
    p.add_argument("--gate-states", type=int, default=24, help="states per category timed for the gate costs")
    args = p.parse_args(argv)
    costs, engine, cats, prompts, ids = setup(args)
    measured = [m for m in measure(engine, prompts, ids, args) if len(m["a_eagle3"]) > 0]
    index: dict[str, int] = {}
    folds = [set() for _ in range(args.folds)]
    for k, m in enumerate(measured):
        folds[index.setdefault(m["category"], 0) % args.folds].add(k)
        index[m["category"]] += 1
    priors = {d: statistics.mean(a for m in measured for a in m[f"a_{d}"]) for d in (EAGLE3, DFLASH)}
    timed = gate_seconds_measured(engine, measured, ids, args.gate_states)
    free = {d: 0.0 for d in timed}

    seconds: dict[str, dict[int, float]] = {}
    for choice in (NO_DRAFT, EAGLE3, DFLASH):
        seconds[f"static {choice}"] = {k: replay(accepted(m), costs, lambda i, c=choice: c).seconds
                                       for k, m in enumerate(measured)}
    seconds["oracle (three-way)"] = {k: solve(accepted(m), costs).seconds for k, m in enumerate(measured)}
    f = engine.router_file
    if f is not None and f.version == 2:   # the same walk and rule, on the file's own predictor and history
        shipped = policy(FrozenPredictor(f.predictor), costs, f.threshold)
        seconds["shipped router file (in sample)"] = {
            k: walk(m, shipped, costs, free, (), RouterHistory(f.priors, f.alpha, f.relax))[0]
            for k, m in enumerate(measured)}
    for name, gates in GATES.items():
        for label, gs in (("free", free), ("timed", timed)) if gates else (("", free),):
            seconds[f"{name} {label}".strip()] = cross_validated(measured, folds, gates, costs, gs, priors, args.seed)

    groups = {c: [k for k, m in enumerate(measured) if m["category"] == c] for c in cats}
    groups["all"] = list(range(len(measured)))
    rate = {name: {c: sum(len(measured[k]["output"]) for k in ks) / sum(s[k] for k in ks) for c, ks in groups.items()}
            for name, s in seconds.items()}
    best = {c: max(rate[f"static {EAGLE3}"][c], rate[f"static {DFLASH}"][c]) for c in groups}
    print("costs (ms): " + ", ".join(f"{d} {1000 * c:.2f}" for d, c in costs.items())
          + "; gate forwards timed here (ms): " + ", ".join(f"{d} {1000 * s:.2f}" for d, s in timed.items())
          + f"; {len(measured)} prompts, {args.folds} folds; load average {environment.load_average()}")
    print("\n| policy | " + " | ".join(groups) + " |\n|---|" + "---|" * len(groups))
    for name, r in rate.items():
        print(f"| {name} | " + " | ".join(f"{r[c]:.1f} ({r[c] / best[c]:.3f})" for c in groups) + " |")
    print("\ntokens/s (in brackets: over the better static drafter of the category)")
    if args.out:
        args.out.write_text(json.dumps({"costs": costs, "gate_seconds": timed, "tokens_per_second": rate}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
