"""Write MODEL_CARD.md for shipped drafters from the run folders' own records (no number typed by hand).

    python -m whiflash_trt.train.model_card --data DATA --eagle3-run RUN --dflash-run RUN --final FINAL --out CARD
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from whiflash_trt.train.checkpointing import read_log
from whiflash_trt.train.data import read_manifest
from whiflash_trt.train.report import markdown_table, smoothed_curve, snapshot_taus

CATS = ("code", "json", "math", "prose", "mix")


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _tau_table(reports: list[dict]) -> str:
    rows = []
    for report in reports:
        for mode, cats in report.items():
            if not isinstance(cats, dict) or "mix" not in cats:
                continue
            rows.append({"mode": mode, **{c: cats.get(c, {}).get("tau") for c in CATS},
                         "tokens/s (mix)": cats["mix"].get("tokens_per_s")})
    return markdown_table(rows)


def _data_section(data: Path) -> str:
    m = read_manifest(data)
    shards = m["shards"]
    seqs = sum(s["num_sequences"] for s in shards)
    toks = sum(s["num_tokens"] for s in shards)
    resp = sum(s["num_response_tokens"] for s in shards)
    lines = [f"- target: `{m['target']}` ({m['dtype']}), captured layers {m['capture_layers']} (0-based layer outputs)",
             f"- training data actually generated: {seqs} sequences, {toks} tokens, of which {resp} response tokens "
             f"(the target's own greedy responses, ~15% sampled at T=0.7), {len(shards)} shards",
             f"- prompt splits (category:source -> count): train {m['prompts']['train']}, "
             f"validation {m['prompts']['val']}, router {m['prompts']['router']}",
             f"- disjointness from the benchmark: {m['disjointness']}"]
    router = data / "router" / "manifest.json"
    if router.is_file():
        r = json.loads(router.read_text())
        lines.append(f"- router data: {sum(s['num_sequences'] for s in r['shards'])} greedy responses "
                     f"({sum(s['num_response_tokens'] for s in r['shards'])} response tokens) to held-out router "
                     f"prompts")
    return "\n".join(lines) + "\n"


def _run_section(name: str, run: Path) -> str:
    log = read_log(run)
    if not log:
        return f"{name}: no training log\n"
    last = log[-1]
    head = (f"{name}: {last['step']} optimizer steps, {last['tokens']} training positions, "
            f"{last['seconds'] / 60:.1f} min of training (epochs over the data: {last['epoch'] + 1}).\n\n")
    return head + markdown_table(smoothed_curve(run, every=max(1, len(log) // 8)))


def build_card(data: Path, eagle3_run: Path, dflash_run: Path, final: Path, bench: Path | None) -> str:
    e3_cfg = json.loads((final / "eagle3" / "config.json").read_text())
    df_cfg = json.loads((final / "dflash" / "config.json").read_text())
    evals = [r for r in (_json(final / "eval-static.json"), _json(final / "eval-router.json")) if r]
    router = _json(final / "router.json")
    parts = ["# Drafters and router for SmolLM2-135M-Instruct (whiflash-trt)\n",
             "Trained on a shared 2-core CPU, no GPU: small drafters, briefly trained (training time below). Every "
             "number below was measured by the commands listed and copied from their output files by "
             "`python -m whiflash_trt.train.model_card`.\n",
             "## Files\n",
             f"- `eagle3/`: EAGLE-3 (public format), hidden {e3_cfg['hidden_size']}, 1 midlayer, heads "
             f"{e3_cfg['num_attention_heads']}/{e3_cfg['num_key_value_heads']}, intermediate "
             f"{e3_cfg['intermediate_size']}, draft vocab {e3_cfg['draft_vocab_size']}, rope theta "
             f"{e3_cfg['rope_theta']}, aux layers {e3_cfg['eagle_config']['eagle_aux_hidden_state_layer_ids']}",
             f"- `dflash/`: DFlash (public format), {df_cfg['num_hidden_layers']} layers, block size "
             f"{df_cfg['block_size']}, target_layer_ids {df_cfg['dflash_config']['target_layer_ids']}, mask token "
             f"{df_cfg['dflash_config']['mask_token_id']} (outside SmolLM2's 49152-row table: the drafter carries "
             f"`mask_embedding`)" + (f", draft vocab {df_cfg['draft_vocab_size']} (d2t/t2d: its loss vocabulary)"
                                     if df_cfg.get("draft_vocab_size") else ""),
             "- `router.safetensors`: throughput router (router file v2, spec/router_file.py): 9 free per-round "
             "features -> 16 -> GELU -> 2, each drafter's expected accepted drafts; routes to the best expected "
             "tokens per second among none / EAGLE-3 / DFlash; calibrated threshold, EMA weight and relaxation, and "
             "the three-way entropy rule's thresholds in its metadata\n",
             "## Data\n", _data_section(data),
             "## Training\n", _run_section("EAGLE-3", eagle3_run), "\n", _run_section("DFlash", dflash_run), "\n"]
    if evals:
        tree = next((r["tree"] for r in evals if "tree" in r), {"top_k": 4, "depth": 5, "total_tokens": 16})
        prompts = evals[0].get("prompts", {})
        nodes = tree["total_tokens"] or "the machine's default number of"
        parts += ["## Validation acceptance length (runtime, greedy, bf16, validation prompts)\n",
                  f"Mean tau per round (accepted drafts + 1) on {sum(prompts.values())} validation prompts "
                  f"({json.dumps(prompts)}), EAGLE-3 tree top_k {tree['top_k']} / depth {tree['depth']} / "
                  f"{nodes} nodes, DFlash block as configured; `lossless` = every speculative output equal to the "
                  "target-only output.\n",
                  _tau_table(evals)]
        parts.append("lossless: " + ", ".join(str(r.get("lossless")) for r in evals) + "\n")
    if router:
        parts.append(router_section(router))
    curve = sorted(final.glob("curve-*.json"))
    if curve:
        rows = sorted(snapshot_taus(curve), key=lambda r: (r["mode"], r["tokens"] or 0))
        parts += ["## Learning curve (runtime tau of training snapshots)\n",
                  "`whiflash-train eval` on snapshots (1 validation prompt per category, 48 new tokens):\n",
                  markdown_table(rows)]
    if bench is not None and bench.is_file():
        parts += ["## Why these sizes\n", "One round's cost on this CPU (`scripts/bench_drafter_rounds.py`):\n",
                  "```\n" + bench.read_text().strip() + "\n```\n"]
    return "\n".join(parts)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--eagle3-run", type=Path, required=True)
    p.add_argument("--dflash-run", type=Path, required=True)
    p.add_argument("--final", type=Path, required=True)
    p.add_argument("--bench", type=Path)
    p.add_argument("--notes", type=Path, help="markdown appended as is (commands, assessment)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    card = build_card(args.data, args.eagle3_run, args.dflash_run, args.final, args.bench)
    if args.notes is not None:
        card += "\n" + args.notes.read_text()
    args.out.write_text(card)


if __name__ == "__main__":
    main()


def router_section(router: dict) -> str:
    """The model card's router section from a v2 `whiflash-train router` report (router.json)."""
    sel, best = router["selection"], router["selection"]["throughput"]
    fit = router["fits"][f"alpha {best['alpha']} relax {best['relax']}"]

    def rate(name: str) -> str:
        return f"{sel[name]['tokens_per_s']:.2f}"

    def shares(r: dict) -> str:
        n = sum(r["rounds"].values())
        return ", ".join(f"{d} {v / n:.2f}" for d, v in r["rounds"].items())

    quality = "; ".join(f"{d}: MSE {q['mse']} vs variance {q['var']} (R^2 {q['r2']})" for d, q in fit["val"].items())
    return "\n".join([
        "## Router\n",
        f"- file: {router['format']}, features {', '.join(router['features'])}; width {router['width']}; "
        f"{router['file_bytes']} bytes",
        f"- states measured: {router['num_states']} (train {router['num_train']}, held-out val {router['num_val']}, "
        f"split by sequence); mean AL there: {json.dumps({k: round(v, 3) for k, v in router['mean_al'].items()})}; "
        f"priors (train mean accepted drafts): {json.dumps({k: round(v, 3) for k, v in router['priors'].items()})}",
        f"- round seconds used: {json.dumps({k: round(v, 4) for k, v in router['round_seconds'].items()})}",
        f"- held-out prediction quality (val walk rows, alpha {best['alpha']}, relax {best['relax']}): {quality}",
        f"- simulated tokens/s on the val states: ar {rate('ar')}, EAGLE-3 only {rate('eagle3')}, DFlash only "
        f"{rate('dflash')}, oracle (three-way) {sel['oracle']['tokens_per_s']:.2f}; throughput router (threshold "
        f"{best['threshold']}) {rate('throughput')} (rounds: {shares(best)}; agrees with the oracle's choice on "
        f"{best['oracle_agreement']['accuracy']} of visited states, {best['oracle_agreement']['accuracy_decisive']} "
        f"of the decisive ones); entropy rule (DFlash below {sel['entropy']['threshold']} nats, none from "
        f"{sel['entropy']['none_threshold']}) {rate('entropy')} (rounds: {shares(sel['entropy'])})\n"])
