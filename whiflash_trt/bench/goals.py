"""The project's goals for WhiFlash-neural, checked against a run's summary (measured, reported, never asserted).

    tau >= the better static drafter's tau in every category, and >= 1.25x it on the mix
    speedup vs ar >= 2.5x on code and json, >= 2.0x on the mix
    switching overhead <= 3% of round time (the paper reports < 6%)
"""
from __future__ import annotations

MODE = "whiflash-neural"


def _goal(name: str, category: str, value: float | None, target: float | None) -> dict:
    if value is None or target is None:
        return {"goal": name, "category": category, "value": value, "target": target, "met": None, "short_by": None}
    met = value >= target if not name.startswith("switching") else value <= target
    short = None if met else round(abs(target - value), 4)
    return {"goal": name, "category": category, "value": round(value, 4), "target": round(target, 4), "met": met,
            "short_by": short}


def evaluate(summary: dict) -> list[dict]:
    out = []
    for cat, cells in summary.items():
        if cat == "all" or MODE not in cells:
            continue
        w = cells[MODE]
        statics = [cells[m].get("tau") for m in ("eagle3", "dflash") if cells.get(m, {}).get("tau") is not None]
        best = max(statics) if len(statics) == 2 else None
        factor = 1.25 if cat == "mix" else 1.0
        out.append(_goal(f"tau >= {factor:g}x better static drafter", cat, w.get("tau"),
                         None if best is None else factor * best))
        if cat in ("code", "json", "mix"):
            out.append(_goal("speedup vs ar", cat, w.get("speedup"), 2.0 if cat == "mix" else 2.5))
        out.append(_goal("switching overhead", cat, w.get("switching_overhead"), 0.03))
    return out
