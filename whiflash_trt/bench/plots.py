"""PNG plots of a run (matplotlib, Agg): tau and speedup per category and mode, one within-sequence routing
trace, and (with a sweep) tokens/s and tau against the router threshold."""
from __future__ import annotations

from pathlib import Path

from whiflash_trt.errors import WhiflashError

COLORS = {"ar": "#888888", "eagle3": "#1f77b4", "dflash": "#ff7f0e", "whiflash-entropy": "#2ca02c",
          "whiflash-neural": "#d62728", "none": "#888888"}
TRACE_MODES = ("whiflash-neural", "whiflash-entropy")


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise WhiflashError("whiflash-bench draws its plots with matplotlib: pip install 'whiflash-trt[bench]' "
                            "(or pip install matplotlib)") from None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(results: dict, out: Path) -> list[str]:
    """Draw what the results hold; -> file names written into `out`."""
    plt = _pyplot()
    written = []
    modes = [name for name, m in results["modes"].items() if m["base"] == name]
    for key, label, ref in (("tau", "mean acceptance length (tau)", None), ("speedup", "speedup vs ar (median)", 1.0)):
        name = f"{key}.png"
        _bars(plt, results["summary"], modes, key, label, ref, out / name)
        written.append(name)
    record = pick_trace(results["records"])
    if record is not None:
        _trace(plt, record, out / "trace.png")
        written.append("trace.png")
    if results.get("threshold_sweep"):
        _sweep(plt, results, out / "threshold_sweep.png")
        written.append("threshold_sweep.png")
    return written


def _bars(plt, summary: dict, modes: list[str], key: str, label: str, ref: float | None, path: Path) -> None:
    cats = [c for c in summary if c != "all"] or list(summary)
    width = 0.8 / max(len(modes), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cats) + 2), 4))
    for j, mode in enumerate(modes):
        xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(cats))]
        ys = [(summary[c].get(mode) or {}).get(key) or 0.0 for c in cats]
        bars = ax.bar(xs, ys, width, label=mode, color=COLORS.get(mode))
        ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
    if ref is not None:
        ax.axhline(ref, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(cats)), cats)
    ax.set_ylabel(label)
    ax.set_title(f"{label} per category and mode")
    ax.legend(fontsize=8, ncols=min(len(modes), 5), loc="upper center", bbox_to_anchor=(0.5, -0.1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pick_trace(records: list[dict]) -> dict | None:
    """The routed run with the most drafter switches (prefer the neural router): the volatility made visible."""
    for mode in TRACE_MODES:
        runs = [r for r in records if r["mode"] == mode and "error" not in r and r["stats"].get("trace")]
        if runs:
            return max(runs, key=lambda r: (r["stats"]["switches"], -records.index(r)))
    return None


def _trace(plt, record: dict, path: Path) -> None:
    trace = record["stats"]["trace"]
    fig, ax = plt.subplots(figsize=(10, 3.6))
    pos = 0
    seen = set()
    for drafter, tau in trace:
        ax.bar(pos, tau, width=tau, align="edge", color=COLORS.get(drafter, "#555555"), edgecolor="white",
               linewidth=0.4, label=None if drafter in seen else drafter)
        seen.add(drafter)
        pos += tau
    ax.set_xlabel("position in the generated sequence (tokens)")
    ax.set_ylabel("accepted length (tau)")
    s = record["stats"]
    ax.set_title(f"{record['mode']} on {record['prompt_id']} ({record['category']}): {len(trace)} rounds, "
                 f"{s['switches']} switches (run with the most switches)", fontsize=9)
    ax.legend(title="drafter", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sweep(plt, results: dict, path: Path) -> None:
    sweep = results["threshold_sweep"]
    fig, axes = plt.subplots(len(sweep), 2, figsize=(10, 3.2 * len(sweep)), squeeze=False)
    all_cells = results["summary"].get("all") or next(iter(results["summary"].values()))
    for row, (base, points) in enumerate(sweep.items()):
        xs = [p["threshold"] for p in points]
        for col, (key, label) in enumerate((("tokens_per_s", "tokens/s"), ("tau", "tau"))):
            ax = axes[row][col]
            ax.plot(xs, [p[key] for p in points], marker="o", color=COLORS.get(base), label=base)
            for static in ("eagle3", "dflash", "ar"):
                if static in all_cells and all_cells[static].get(key) is not None:
                    ax.axhline(all_cells[static][key], linestyle="--", linewidth=0.8, color=COLORS[static],
                               label=static)
            ax.set_xlabel(f"{base} threshold")
            ax.set_ylabel(label)
            ax.legend(fontsize=7)
    fig.suptitle("router threshold sweep (all prompts pooled)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
