"""results.md: the run's numbers as tables (every number, and more, is in results.json)."""
from __future__ import annotations

import json
from pathlib import Path

from whiflash_trt.config import DFLASH, EAGLE3, SUFFIX
from whiflash_trt.runtime.stats import PHASES

RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"


def write_outputs(results: dict, out: Path) -> None:
    from whiflash_trt.bench import plots

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULTS_JSON).write_text(json.dumps(results, indent=1) + "\n")
    results["plots"] = plots.write_plots(results, out)
    (out / RESULTS_JSON).write_text(json.dumps(results, indent=1) + "\n")
    (out / RESULTS_MD).write_text(render(results))


def _f(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _base_modes(results: dict) -> list[str]:
    return [name for name, m in results["modes"].items() if m["base"] == name]


def _cells(results: dict, skip_ar: bool = False):
    """(category, mode, cell) for the base modes; cells whose every run failed are left out (see errors)."""
    for cat, cells in results["summary"].items():
        for mode in _base_modes(results):
            c = cells.get(mode)
            if c is not None and c["num_prompts"] > 0 and not (skip_ar and mode == "ar"):
                yield cat, mode, c


def render(results: dict) -> str:
    parts = [_setup(results), _headline(results), _routing(results), _phases(results), _lossless(results)]
    if results.get("oracle"):
        parts.append(_oracle(results))
    if results.get("threshold_sweep"):
        parts.append(_sweep(results))
    parts.append(_goals(results))
    if results.get("plots"):
        parts.append("## Plots\n\n" + "\n".join(f"![{name}]({name})" for name in results["plots"]) + "\n")
    return "\n".join(parts)


def _trees(trees: dict[str, dict]) -> str:
    """A run's draft trees as verified (node counts resolved for its machine)."""
    parts = []
    if EAGLE3 in trees:
        t = trees[EAGLE3]
        parts.append(f"EAGLE-3 top-k {t['top_k']}, depth {t['depth']}, {t['total_tokens']} nodes, "
                     f"floor {t['min_prob']}")
    if DFLASH in trees:
        t = trees[DFLASH]
        parts.append(f"DFlash DDTree of {t['total_tokens']} nodes" + (f", top-k {t['top_k']}" if t["top_k"] else "")
                     + (f", floor {t['min_prob']}" if t["min_prob"] else ""))
    if SUFFIX in trees:
        t = trees[SUFFIX]
        parts.append(f"suffix tree of {t['total_tokens']} nodes, floor {t['min_prob']}, depth {t['factor']}x the match")
    return "; ".join(parts)


def _setup(r: dict) -> str:
    env, eng, p = r["environment"], r["engine"], r["prompts"]
    m, v = env["machine"], env["versions"]
    rows = [["command", f"`{r['command_line']}`"],
            ["engine", f"{eng['target']} ({eng['path']}), manifest sha256 `{eng['manifest_sha256'][:16]}`"],
            ["drafters", ", ".join(f"{k} `{(s or '')[:12]}`" for k, s in eng["components"].items()) or "none"],
            ["dtype", f"{eng['run_dtype']} (built {eng['built_dtype']}; weights "
                      f"{eng.get('weights', eng['built_dtype'])})"],
            ["decoding", f"greedy, max {r['generation']['max_new_tokens']} new tokens, "
                         f"{r['generation']['warmup_prompts']} warm-up prompt(s) in every mode, modes interleaved "
                         f"per prompt in rotating order"],
            ["machine", f"{m['cpu']}, {m['cpu_count']} CPUs, {m['torch_threads']} torch threads, {m['platform']}"
                        + (f", GEMM loop {m['gemm']}" if "gemm" in m else "")],
            ["load average", f"before {env['load_average']['before']}, after {env['load_average']['after']}"],
            ["versions", ", ".join(f"{k} {val}" for k, val in v.items())],
            ["prompts", f"{p['num']} prompts, digest `{p['digest'][:16]}`"],
            ["run time", f"{r['seconds']:.0f} s"]]
    if "trees" in r:   # results from before the trees were recorded have none
        rows.insert(5, ["draft trees", _trees(r["trees"])])
    cats = [[c, str(d["num"]), "; ".join(d["sources"]), _f(sum(d["prompt_tokens"]) / d["num"], "{:.0f}")]
            for c, d in p["by_category"].items()]
    return ("# whiflash-bench results\n\n" + _table(["", ""], rows) + "\n### Prompt sets\n\n"
            + _table(["category", "prompts", "source (not used for drafter training)", "mean prompt tokens"], cats))


def _x_roofline(r: dict, c: dict) -> float | None:
    """The median over the cell's prompts of decode rate / the roofline timed before the prompt; results without
    those reads (older runs): the cell's decode rate over the one roofline measured before the run."""
    if c.get("x_roofline") is not None:
        return c["x_roofline"]
    limit = (r.get("roofline") or {}).get("limit_tokens_per_s")
    return c["decode_tokens_per_s"] / limit if limit and c.get("decode_tokens_per_s") else None


def _headline(r: dict) -> str:
    rows = [[cat, mode, _f(c["tau"]), _f(c["tokens_per_s"]), _f(c["decode_tokens_per_s"]), _f(_x_roofline(r, c)),
             _f(c["speedup"], "{:.2f}x"), _f(c["decode_speedup"], "{:.2f}x"), str(c["new_tokens"]),
             str(c["errors"]) if c["errors"] else ""] for cat, mode, c in _cells(r)]
    return ("## Acceptance and speed\n\ntau: mean acceptance length per round (accepted drafts + 1). tokens/s: new "
            "tokens over wall time, prefill included; decode tok/s leaves prefill out. Speedups: median over "
            "prompts of the per-prompt ratio to ar. x roofline: decode tok/s over the memory roofline's "
            "tokens/s, the fastest one-token-per-step decoding this machine allows: one step's bytes at the rate of "
            "a plain read timed just before each prompt's runs; median over the cell's prompts of that ratio (a "
            "shared machine's read rate swings from minute to minute; " + _roofline_text(r) + ").\n\n"
            + _table(["category", "mode", "tau", "tokens/s", "decode tok/s", "x roofline", "speedup",
                      "decode speedup", "tokens", "failed runs"], rows))


def _roofline_text(r: dict) -> str:
    roof = r.get("roofline")
    if not roof:
        return "not measured"
    rates = roof["rates_gbs"]
    reads = [rec["read_gbs"] for rec in r.get("records", []) if "read_gbs" in rec]
    during = f"; the plain read beside the prompts: {min(reads)}-{max(reads)} GB/s" if reads else ""
    return (f"{roof['bytes']['total'] / 1e6:.0f} MB per step at {roof['context']} tokens of context; before the run "
            f"the machine streamed {max(rates['plain_read'], rates['best_kernel'])} GB/s: {roof['limit_ms_per_step']} "
            f"ms per step, {roof['limit_tokens_per_s']} tokens/s{during}; scripts/roofline.py")


def _routing(r: dict) -> str:
    rows = [[cat, mode, ", ".join(f"{d} {_pct(s)}" for d, s in c["round_share"].items()),
             ", ".join(f"{d} {_f(t)}" for d, t in c["tau_per_drafter"].items()),
             _f(c["switches_per_100_tokens"]), _pct(c["switching_overhead"]), _f(c["catch_up_tokens_per_round"])]
            for cat, mode, c in _cells(r, skip_ar=True)]
    return ("## Routing and switching\n\nSwitching overhead: catch-up time / round time. Catch-up is a drafter's "
            "KV-only passes over generated tokens: the last round's accepted tokens (a static drafter too) and a "
            "switch's backlog; a drafter's KV-only prefill of the prompt is the phase drafter_prefill.\n\n"
            + _table(["category", "mode", "share of rounds", "tau per drafter", "switches / 100 tok",
                      "switching overhead", "catch-up tokens / round"], rows))


def _phases(r: dict) -> str:
    rows = [[cat, mode, _f(c["ms_per_round"], "{:.1f}")] + [_pct(c["phase_share"][p]) for p in PHASES]
            + [_pct(c["prefill_share"])] for cat, mode, c in _cells(r)]
    return ("## Time per phase\n\nShare of round time per phase; prefill as a share of total time.\n\n"
            + _table(["category", "mode", "ms / round"] + list(PHASES) + ["prefill / total"], rows))


def _lossless(r: dict) -> str:
    ll = r["lossless"]
    rows = []
    for mode, cells in ll["by_mode"].items():
        for cat, c in cells.items():
            rows.append([mode, cat, f"{c['exact']}/{c['num']}", _pct(c["exact_match_rate"]), str(c["errors"])])
    text = (f"## Losslessness (every mode against {ll['baseline']}, token for token)\n\n"
            + _table(["mode", "category", "exact", "exact-match rate", "failed runs"], rows))
    if ll["errors"]:
        erows = [[e["mode"], e["prompt_id"], f"`{e['error'][:160]}`"] for e in ll["errors"]]
        text += "\nRuns that raised (counted as bugs):\n\n" + _table(["mode", "prompt", "error"], erows)
    if ll["divergences"]:
        drows = [[d["mode"], d["prompt_id"], str(d["position"]), str(d["ar_token"]), str(d["mode_token"]),
                  _f(d["top2_gap"], "{:.4f}"), _f(d["ar_deficit"], "{:.4f}"), _f(d["mode_deficit"], "{:.4f}"),
                  "near-tie" if d["near_tie"] else "**BUG**"] for d in ll["divergences"]]
        text += (f"\nFirst divergences. The target (same dtype) recomputed at each: top-2 gap, and how far below its "
                 f"top logit each side's token lies; "
                 + (f"a near-tie means both within {ll['tolerance']:g}.\n\n" if ll["tolerance"] > 0 else
                    "the check is exact (tolerance 0): every divergence is a bug.\n\n")
                 + _table(["mode", "prompt", "position", "ar token", "mode token", "top-2 gap", "ar deficit",
                           "mode deficit", "verdict"], drows))
    not_ties = ll["bugs"] - len(ll["errors"])
    verdict = "; ".join(x for x in (
        f"{len(ll['errors'])} run(s) failed" if ll["errors"] else "",
        "no divergence" if not ll["divergences"] else
        f"{not_ties} divergence(s) NOT at a near-tie: a bug in the speculative path" if not_ties and ll["tolerance"] > 0
        else f"{not_ties} divergence(s): a bug (the check is exact)" if not_ties else
        "every divergence is at a near-tie of the target's own logits") if x)
    return text + f"\nVerdict: {verdict}.\n"


def _oracle(r: dict) -> str:
    o = r["oracle"]
    costs = ", ".join(f"{d} {1000 * c:.1f} ms" for d, c in o["round_seconds"].items())
    rows = []
    for cat, c in o["categories"].items():
        measured, replayed = c["measured_tokens_per_s"], c["replayed_decode_tokens_per_s"]
        best = c["best_static"]
        rows.append([cat, _f(c["tokens_per_s"]), "-" if best is None else f"{best} {_f(measured[best])}",
                     _f(measured.get("whiflash-entropy")), _f(measured.get("whiflash-neural")),
                     _f(c["decode_tokens_per_s"]), ", ".join(f"{m} {_f(t)}" for m, t in replayed.items()),
                     _f(c["gain_over_best_replayed"], "{:.3f}x"), _f(c.get("drafters_only_gain"), "{:.3f}x"),
                     _f(c["tau"]),
                     ", ".join(f"{d} {_pct(s)}" for d, s in c["round_share"].items())])
    return ("## Oracle headroom\n\nThe best per-round choice among no draft, suffix, EAGLE-3 and DFlash, by dynamic "
            "programming over each drafter's accepted length at every position of the ar output and the mean "
            f"measured round time of each static mode ({costs}). Oracle tok/s adds ar's prefill; the replayed "
            "columns walk the static modes through the same accepted lengths and costs (like for like); gain: "
            "oracle over the best replayed static mode, decode only; drafters only: the same without skipping a "
            "round (only the drafter chosen). Measured columns: this run's tokens/s.\n\n"
            + _table(["category", "oracle tok/s", "best static (measured)", "whiflash-entropy", "whiflash-neural",
                      "oracle decode tok/s", "replayed decode tok/s", "gain", "drafters only", "oracle tau",
                      "oracle rounds"], rows))


def _sweep(r: dict) -> str:
    rows = []
    for base, points in r["threshold_sweep"].items():
        for p in points:
            share = ", ".join(f"{d} {_pct(s)}" for d, s in p["round_share"].items())
            rows.append([base, _f(p["threshold"], "{:g}"), _f(p["tau"]), _f(p["tokens_per_s"]),
                         _f(p["speedup"], "{:.2f}x"), share])
    return ("## Router threshold sweep (all prompts of the run pooled)\n\n"
            + _table(["router", "threshold", "tau", "tokens/s", "speedup", "share of rounds"], rows))


def _goals(r: dict) -> str:
    if not r["goals"]:
        return "## Goals\n\nNot evaluated (needs whiflash-neural, eagle3 and dflash in the run).\n"
    rows = [[g["goal"], g["category"], _f(g["value"], "{:.3f}"), _f(g["target"], "{:.3f}"),
             "-" if g["met"] is None else ("met" if g["met"] else f"missed by {g['short_by']:.3f}")]
            for g in r["goals"]]
    return "## Goals (whiflash-neural)\n\n" + _table(["goal", "category", "measured", "target", ""], rows)
