"""Learning curves from a run folder: training metrics (log.jsonl) and runtime tau of the snapshots (eval JSON)."""
from __future__ import annotations

import json
from pathlib import Path

from whiflash_trt.train.checkpointing import read_log


def smoothed_curve(run_dir: Path, every: int = 20, window: int = 10) -> list[dict]:
    """Every `every` steps: step, training positions, seconds, mean loss and metrics over the last `window` steps."""
    log = read_log(run_dir)
    rows = []
    for i in range(every - 1, len(log), every):
        recent = log[max(0, i - window + 1):i + 1]
        keys = [k for k in recent[-1] if k == "loss" or k.startswith("acc") or k == "accept"]
        row = {"step": log[i]["step"], "tokens": log[i]["tokens"], "seconds": log[i]["seconds"]}
        row.update({k: round(sum(r.get(k, 0.0) for r in recent) / len(recent), 4) for k in keys})
        rows.append(row)
    return rows


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(no steps logged)\n"
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(curves: dict[str, list[dict]], key: str, path: Path) -> bool:
    """Training-token axis plot of `key` per run; False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, rows in curves.items():
        ax.plot([r["tokens"] for r in rows], [r.get(key) for r in rows], label=name)
    ax.set_xlabel("training positions")
    ax.set_ylabel(key)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def snapshot_taus(eval_files: list[Path]) -> list[dict]:
    """Rows (tokens, tau per category) from `whiflash-train eval` reports of snapshots (progress.json beside)."""
    rows = []
    for f in eval_files:
        report = json.loads(Path(f).read_text())
        progress = report.get("progress", {})
        for mode in ("eagle3", "dflash"):
            if mode in report:
                rows.append({"mode": mode, "tokens": progress.get("tokens"), "step": progress.get("step"),
                             **{cat: v["tau"] for cat, v in report[mode].items()}})
    return rows
