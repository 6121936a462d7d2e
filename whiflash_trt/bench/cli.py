"""`whiflash-bench`: thin argument parsing around bench.harness.run_benchmark."""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from whiflash_trt.bench.harness import BenchOptions, run_benchmark
from whiflash_trt.bench.modes import BASE_MODES
from whiflash_trt.bench.prompts import CATEGORIES, COPY_CATEGORIES, MIX_CATEGORIES
from whiflash_trt.config import CATCH_UP, SpecConfig
from whiflash_trt.errors import WhiflashError
from whiflash_trt.help_format import DefaultsHelpFormatter
from whiflash_trt.runtime.device import default_threads
from whiflash_trt.tree_options import add_tree_options, tree_settings


def _names(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(s) for s in _names(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="whiflash-bench", description="Per-category acceptance, speed and switching "
                                "overhead of every decoding mode, side by side, with a losslessness check.",
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--engine", type=Path, help="engine directory (default: the embedded SmolLM2-135M, built once)")
    p.add_argument("--categories", type=_names, help=f"comma-separated, from {','.join(CATEGORIES)}; mix is "
                   f"{','.join(MIX_CATEGORIES)} interleaved; {','.join(COPY_CATEGORIES)} are requests whose answers "
                   "copy from them (default: all, or all of --prompts-file)")
    p.add_argument("--modes", type=_names, default=BASE_MODES, help=f"comma-separated, from {','.join(BASE_MODES)} "
                                                                    f"(default: all; ar is required)")
    p.add_argument("--num-prompts", type=int, help="prompts per category (default: the whole set)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt and mode")
    p.add_argument("--out", type=Path, required=True, help="folder for results.json, results.md and the plots")
    p.add_argument("--prompts-file", type=Path,
                   help='JSON lines {"prompt": ..., "category": ..., "id": ...} instead of the built-in sets')
    p.add_argument("--threshold-sweep", action="store_true",
                   help="also run the routed modes at a handful of other router thresholds")
    p.add_argument("--oracle", action="store_true",
                   help="also the oracle's headroom: the best per-round routing, from both drafters run at every "
                        "position of the ar output and the measured round costs (needs ar, eagle3, dflash)")
    p.add_argument("--entropy-thresholds", type=_floats, help="sweep points for whiflash-entropy (nats)")
    p.add_argument("--neural-thresholds", type=_floats, help="sweep points for whiflash-neural (v1 router: "
                                                             "predicted dAL; v2: the factor by which a drafter's rate "
                                                             "must beat a target-only round's); "
                                                             "with a negative first value write =, e.g. "
                                                             "--neural-thresholds=-0.5,0.5")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"], help="engine dtype")
    p.add_argument("--warmup", type=int, default=1, help="prompts run untimed in every mode first")
    p.add_argument("--near-tie", type=float, help="logit tolerance of the lossless check (default by dtype)")
    p.add_argument("--catch-up", default=SpecConfig.catch_up, choices=list(CATCH_UP), help="routed modes' catch-up")
    add_tree_options(p)
    p.add_argument("--kv-budget-mb", type=int, default=256, help="memory for all KV pools together (MB)")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="torch threads (headline runs: 2; on a machine shared with other jobs fewer threads than "
                        "cores can be much faster)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    command = shlex.join(["whiflash-bench"] + (sys.argv[1:] if argv is None else list(argv)))
    try:
        opts = BenchOptions(
            out=args.out, engine=args.engine, categories=args.categories, modes=args.modes,
            num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, prompts_file=args.prompts_file,
            dtype=args.dtype, warmup=args.warmup, threshold_sweep=args.threshold_sweep, oracle=args.oracle,
            entropy_thresholds=args.entropy_thresholds, neural_thresholds=args.neural_thresholds,
            near_tie=args.near_tie, kv_budget_mb=args.kv_budget_mb, threads=args.threads,
            show_progress=not args.no_progress,
            spec=SpecConfig(catch_up=args.catch_up, **tree_settings(args)),
            command_line=command)
        results = run_benchmark(opts)
    except (WhiflashError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ll = results["lossless"]
    print(f"results in {args.out}: {len(results['records'])} runs, {len(ll['errors'])} failed, "
          f"{len(ll['divergences'])} divergence(s) from ar, {ll['bugs'] - len(ll['errors'])} not at a near-tie")
    return 1 if ll["bugs"] else 0


if __name__ == "__main__":
    sys.exit(main())
