"""Per category x mode numbers from the per-prompt records (each record: one prompt, one mode, its engine stats).

Definitions (all pooled over the prompts of a cell unless said otherwise):
    tau                   mean acceptance length over all rounds (accepted drafts + 1)
    tokens_per_s          new tokens / wall seconds, prefill included (what a user waits for)
    decode_tokens_per_s   (new tokens - 1) / (seconds - prefill seconds): the part speculation changes
    speedup               median over prompts of (mode tokens/s / ar tokens/s) on the same prompt
    decode_speedup        the same with decode tokens/s
    round_share           share of rounds drafted by each drafter ("none" = a target-only round)
    switches_per_100_tokens  drafter changes between consecutive rounds, per 100 new tokens
    switching_overhead    catch-up seconds / round seconds (route + drafter_prefill + catch_up + draft + verify +
                          commit); catch-up is the KV-only passes over generated tokens, a drafter's KV-only prefill
                          of the prompt (in the first round it drafts) its drafter_prefill
    phase_share           each phase's share of round seconds; ms_per_round the mean round time
    roofline_tokens_per_s the memory roofline when the cell's prompts ran: one decode step's bytes at the plain read
                          rate timed just before each prompt (its records' read_gbs), median over the prompts
    x_roofline            median over prompts of (a prompt's decode tokens/s / the roofline timed before it)
"""
from __future__ import annotations

import statistics
from collections import defaultdict

from whiflash_trt.config import WHIFLASH
from whiflash_trt.runtime.stats import PHASES


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _decode_tps(s: dict) -> float | None:
    return _ratio(s["new_tokens"] - 1, s["seconds"] - s["prefill_seconds"])


def _median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 4) if xs else None


def summarize_cell(records: list[dict], ar_by_prompt: dict[str, dict], step_bytes: int | None = None) -> dict:
    """One cell's numbers (module docstring); the roofline ones where the records carry read_gbs and `step_bytes`
    (one decode step's bytes) is given."""
    stats = [r["stats"] for r in records]
    taus = [t for s in stats for _, t in s["trace"]]
    drafters = [d for s in stats for d, _ in s["trace"]]
    rounds = len(taus)
    tokens = sum(s["new_tokens"] for s in stats)
    seconds = sum(s["seconds"] for s in stats)
    prefill = sum(s["prefill_seconds"] for s in stats)
    phases = {p: sum(s["phase_seconds"][p] for s in stats) for p in PHASES}
    round_s = sum(phases.values())
    per_drafter: dict[str, list[int]] = defaultdict(list)
    for d, t in zip(drafters, taus):
        per_drafter[d].append(t)
    speedups, decode_speedups = [], []
    for r in records:
        ar = ar_by_prompt.get(r["prompt_id"])
        if ar is not None:
            s, a = r["stats"], ar["stats"]
            speedups.append(_ratio(s["new_tokens"] / s["seconds"], a["new_tokens"] / a["seconds"]))
            dt, da = _decode_tps(s), _decode_tps(a)
            decode_speedups.append(_ratio(dt, da) if dt is not None and da is not None else None)
    limits = [r["read_gbs"] * 1e9 / step_bytes if step_bytes and "read_gbs" in r else None for r in records]
    x_roofline = None
    if limits and None not in limits:
        per_prompt = [(_decode_tps(r["stats"]), limit) for r, limit in zip(records, limits)]
        x_roofline = _median([_ratio(d, limit) for d, limit in per_prompt if d is not None])
    return {
        "num_prompts": len(records),
        "new_tokens": tokens,
        "rounds": rounds,
        "tau": round(sum(taus) / rounds, 4) if rounds else None,
        "tau_per_drafter": {d: round(sum(ts) / len(ts), 4) for d, ts in sorted(per_drafter.items())},
        "tokens_per_s": round(tokens / seconds, 3) if seconds > 0 else None,
        "decode_tokens_per_s": _round(_ratio(tokens - len(records), seconds - prefill)),
        "roofline_tokens_per_s": None if x_roofline is None else _median(limits),
        "x_roofline": x_roofline,
        "speedup": _median(speedups),
        "decode_speedup": _median(decode_speedups),
        "speedup_per_prompt": [_round(x) for x in speedups],
        "round_share": {d: round(len(ts) / rounds, 4) for d, ts in sorted(per_drafter.items())},
        "switches_per_100_tokens": round(100 * sum(s["switches"] for s in stats) / tokens, 3) if tokens else None,
        "switching_overhead": _round(_ratio(phases["catch_up"], round_s)),
        "catch_up_tokens_per_round": _round(_ratio(sum(s["catch_up_tokens"] for s in stats), rounds)),
        "ms_per_round": _round(_ratio(1000 * round_s, rounds)),
        "phase_share": {p: _round(_ratio(phases[p], round_s)) for p in PHASES},
        "phase_seconds": {p: round(v, 5) for p, v in phases.items()},
        "prefill_share": _round(_ratio(prefill, seconds)),
        "seconds": round(seconds, 4),
    }


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def ok(records: list[dict]) -> list[dict]:
    """The records whose generation finished (a failed one holds "error" instead of tokens and stats)."""
    return [r for r in records if "error" not in r]


def summarize(records: list[dict], baseline: str = "ar", step_bytes: int | None = None) -> dict:
    """-> {category: {mode: cell}} in first-seen order, plus "all" over every category when there are several.
    A cell counts its failed runs under "errors" and summarises the others (summarize_cell)."""
    ar = {r["prompt_id"]: r for r in ok(records) if r["mode"] == baseline}
    cells: dict[str, dict[str, list[dict]]] = {}
    for r in records:
        cells.setdefault(r["category"], {}).setdefault(r["mode"], []).append(r)
    if len(cells) > 1:
        for r in records:
            cells.setdefault("all", {}).setdefault(r["mode"], []).append(r)
    out = {}
    for cat, modes in cells.items():
        out[cat] = {}
        for mode, rs in modes.items():
            done = ok(rs)
            cell = summarize_cell(done, ar, step_bytes) if done else {"num_prompts": 0}
            cell["errors"] = len(rs) - len(done)
            out[cat][mode] = cell
    return out


def threshold_sweep(records: list[dict], modes) -> dict:
    """Per routed base mode: [{threshold, tau, tokens_per_s, decode_tokens_per_s, speedup, round_share}] sorted by
    threshold, each point pooled over every prompt of the run (all categories)."""
    ar = {r["prompt_id"]: r for r in ok(records) if r["mode"] == "ar"}
    out: dict[str, list[dict]] = {}
    for m in modes:
        if m.spec.mode != WHIFLASH:
            continue
        rs = ok([r for r in records if r["mode"] == m.name])
        if not rs:
            continue
        cell = summarize_cell(rs, ar)
        out.setdefault(m.base, []).append({
            "mode": m.name, "threshold": rs[0]["stats"]["threshold"], "tau": cell["tau"],
            "tokens_per_s": cell["tokens_per_s"], "decode_tokens_per_s": cell["decode_tokens_per_s"],
            "speedup": cell["speedup"], "round_share": cell["round_share"],
            "switching_overhead": cell["switching_overhead"]})
    return {base: sorted(points, key=lambda p: p["threshold"]) for base, points in out.items()}
