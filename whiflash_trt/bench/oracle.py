"""Oracle headroom: the best per-round routing any router could reach on this run's prompts, costs and drafters.

At temperature 0 the output does not depend on the drafter, so the `ar` output of a prompt is every mode's output.
State i: i output tokens committed after the prompt and output token i pending (i = 0 after prefill). A round at i
with drafter d commits a_d(i) + 1 tokens (its accepted drafts and the pending token) and costs c_d seconds; "none"
(a target-only step) has a = 0. Each drafter's a_d(i) comes from runtime.replay (its draft at i against the known
output). Generation of M output tokens ends at state M - 1, so by dynamic programming from the end
    V(i) = 0 for i >= M - 1,    V(i) = min_d [c_d + V(i + a_d(i) + 1)],
and V(0) is the least decode time of any routing. c_d is the mean measured round time (all phases) of the static
mode d in the same bench run; the static modes replayed with the same a_d and c_d are the like-for-like baseline.
The same optimum without "none" (always drafting, only the drafter chosen) splits the headroom into what choosing
the drafter can win and what skipping a round adds.
The model leaves out what a real switch adds (a longer catch-up backlog) and round-to-round variation of c_d.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from whiflash_trt.config import AR, DFLASH, EAGLE3, SUFFIX, WHIFLASH, SpecConfig
from whiflash_trt.runtime.replay import accepted_at, capture_output
from whiflash_trt.spec.router import NO_DRAFT       # a target-only round, as in the engine's round trace

CHOICES = (NO_DRAFT, SUFFIX, EAGLE3, DFLASH)        # ties go to the earlier (cheaper to run) choice
STATIC = {NO_DRAFT: AR, SUFFIX: SUFFIX, EAGLE3: EAGLE3, DFLASH: DFLASH}   # choice -> the bench mode always making it


@dataclass(frozen=True)
class Plan:
    seconds: float              # decode seconds (sum of round costs)
    choices: tuple[str, ...]    # the choice of every round, in order
    tokens: int                 # output tokens the rounds commit (M - 1)


def _check(accepted: dict[str, list[int]], costs: dict[str, float]) -> int:
    missing = [d for d in accepted if d not in costs] + ([] if NO_DRAFT in costs else [NO_DRAFT])
    if missing:
        raise ValueError(f"no round cost for {', '.join(missing)}")
    if any(c <= 0 for c in costs.values()):
        raise ValueError(f"round costs must be positive, got {costs}")
    lengths = {len(a) for a in accepted.values()}
    if len(lengths) > 1:
        raise ValueError(f"accepted lengths cover different numbers of states: {sorted(lengths)}")
    return lengths.pop() if lengths else 0


def _accepted(accepted: dict[str, list[int]], choice: str, i: int) -> int:
    return 0 if choice == NO_DRAFT else accepted[choice][i]


def optimal(accepted: dict[str, list[int]], costs: dict[str, float]) -> tuple[list[float], list[str]]:
    """(V(i) for i in 0..M-1, the optimal choice at every state 0..M-2) for one output. `accepted[d][i]`: drafter
    d's accepted drafts at state i, for the M - 1 states that need a round; `costs[d]` seconds per round of d,
    "none" included (an infinite cost takes a choice out)."""
    num_states = _check(accepted, costs)
    names = [c for c in CHOICES if c == NO_DRAFT or c in accepted]
    value = [0.0] * (num_states + 1)           # value[M - 1] = 0
    best = [NO_DRAFT] * num_states
    for i in range(num_states - 1, -1, -1):
        options = [(costs[d] + value[min(i + _accepted(accepted, d, i) + 1, num_states)], d) for d in names]
        value[i], best[i] = min(options, key=lambda o: o[0])   # min keeps the first of equal options
    return value, best


def solve(accepted: dict[str, list[int]], costs: dict[str, float]) -> Plan:
    """The optimal routing of one output (see optimal) as the rounds it runs."""
    value, best = optimal(accepted, costs)
    return Plan(value[0], tuple(_walk(len(best), accepted, lambda i: best[i])), len(best))


def replay(accepted: dict[str, list[int]], costs: dict[str, float], choose: Callable[[int], str]) -> Plan:
    """The routing `choose(state) -> choice` walked through one output, with the same accepted lengths and costs."""
    num_states = _check(accepted, costs)
    choices = _walk(num_states, accepted, choose)
    return Plan(sum(costs[d] for d in choices), tuple(choices), num_states)


def _walk(num_states: int, accepted: dict[str, list[int]], choose: Callable[[int], str]) -> list[str]:
    i, choices = 0, []
    while i < num_states:
        d = choose(i)
        choices.append(d)
        i += _accepted(accepted, d, i) + 1
    return choices


def round_costs(records: list[dict]) -> dict[str, float]:
    """Mean seconds per round (every phase) of each static mode's runs: choice -> c_d."""
    costs = {}
    for choice, mode in STATIC.items():
        stats = [r["stats"] for r in records if r["mode"] == mode and "error" not in r]
        rounds = sum(s["rounds"] for s in stats)
        if not rounds:
            raise ValueError(f"the oracle needs measured {mode} rounds; no {mode} run finished with a round")
        costs[choice] = sum(sum(s["phase_seconds"].values()) for s in stats) / rounds
    return costs


def prompt_accepted(engine, prompt_ids: list[int], output_ids: list[int], spec: SpecConfig) -> dict[str, list[int]]:
    """drafter -> accepted drafts at each state 0..M-2 of this greedy output (the trees as in `spec`)."""
    proposers = engine.proposers_for(replace(spec, mode=WHIFLASH))
    if len(output_ids) < 2:
        return {name: [] for name in proposers}
    tokens = list(prompt_ids) + list(output_ids)
    features = capture_output(engine, tokens[:-1]).captured
    p = len(prompt_ids)
    return accepted_at(engine, proposers, tokens, features, p, p + len(output_ids) - 1)


def evaluate(engine, records: list[dict], ids: dict[str, list[int]], summary: dict, spec: SpecConfig,
             show_progress: bool = True) -> dict:
    """The oracle section of results.json: round costs, per prompt the accepted lengths and the optimal choices,
    per category (and "all") the oracle's tokens/s next to the static modes replayed with the same costs and the
    measured tokens/s of every mode in `summary`."""
    from tqdm import tqdm

    costs = round_costs(records)
    prompts = []
    runs = [r for r in records if r["mode"] == AR and "error" not in r]
    for r in tqdm(runs, desc="oracle", unit="prompt", disable=not show_progress):
        accepted = prompt_accepted(engine, ids[r["prompt_id"]], r["token_ids"], spec)
        plan = solve(accepted, costs)
        drafters_only = solve(accepted, {**costs, NO_DRAFT: math.inf}).seconds
        static = {STATIC[c]: replay(accepted, costs, lambda i, c=c: c).seconds
                  for c in CHOICES if c == NO_DRAFT or c in accepted}
        prompts.append({"prompt_id": r["prompt_id"], "category": r["category"], "new_tokens": len(r["token_ids"]),
                        "prefill_seconds": r["stats"]["prefill_seconds"], "seconds": plan.seconds,
                        "drafters_only_seconds": drafters_only, "static_seconds": static,
                        "choices": list(plan.choices), "accepted": accepted})
    groups: dict[str, list[dict]] = {}
    for p in prompts:
        groups.setdefault(p["category"], []).append(p)
    if len(groups) > 1:
        groups["all"] = prompts
    return {"round_seconds": costs, "categories": {cat: _cell(ps, summary.get(cat, {})) for cat, ps in groups.items()},
            "prompts": prompts}


def _cell(prompts: list[dict], measured: dict) -> dict:
    tokens = sum(p["new_tokens"] for p in prompts)
    decode_tokens = tokens - len(prompts)
    seconds = sum(p["seconds"] for p in prompts)
    rounds = [c for p in prompts for c in p["choices"]]
    replayed = {m: _rate(decode_tokens, sum(p["static_seconds"][m] for p in prompts))
                for m in prompts[0]["static_seconds"]}
    best_replayed = max(replayed, key=lambda m: replayed[m] or 0.0)
    static = {m: measured[m]["tokens_per_s"] for m in STATIC.values() if measured.get(m, {}).get("num_prompts")}
    best_static = max(static, key=lambda m: static[m] or 0.0) if static else None
    oracle_decode = _rate(decode_tokens, seconds)
    return {
        "num_prompts": len(prompts),
        "tokens_per_s": _rate(tokens, seconds + sum(p["prefill_seconds"] for p in prompts)),  # ar's prefill
        "decode_tokens_per_s": oracle_decode,
        "tau": round(decode_tokens / len(rounds), 4) if rounds else None,
        "round_share": {c: round(rounds.count(c) / len(rounds), 4) if rounds else None for c in CHOICES},
        "replayed_decode_tokens_per_s": replayed,
        "best_replayed": best_replayed,
        "gain_over_best_replayed": _ratio(oracle_decode, replayed[best_replayed]),
        "drafters_only_gain": _ratio(_rate(decode_tokens, sum(p["drafters_only_seconds"] for p in prompts)),
                                     replayed[best_replayed]),
        "measured_tokens_per_s": {m: c["tokens_per_s"] for m, c in measured.items() if c.get("num_prompts")},
        "measured_decode_tokens_per_s": {m: c["decode_tokens_per_s"] for m, c in measured.items()
                                         if c.get("num_prompts")},
        "best_static": best_static,
    }


def _rate(tokens: int, seconds: float) -> float | None:
    return round(tokens / seconds, 3) if seconds > 0 else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None
