"""The benchmark run: every mode on every prompt in one process, interleaved per prompt in a rotating order.

The machine is noisy, so no mode ever runs its whole set before the next: prompt i runs all modes, starting at
mode i mod M. Greedy decoding, after a warm-up of every mode. Records (one per prompt and mode) hold the tokens
and the engine's per-request stats; summary, losslessness check, report and plots are computed from them.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from whiflash_trt.bench.modes import BASE_MODES, BenchMode, base_mode, sweep_points
from whiflash_trt.bench.prompts import BenchPrompt
from whiflash_trt.config import AR, DFLASH, EAGLE3, SUFFIX, WHIFLASH, GenerationConfig, SpecConfig
from whiflash_trt.errors import WhiflashError

WARMUP_TOKENS = 16


@dataclass(frozen=True)
class BenchOptions:
    out: Path
    engine: Path | None = None              # None: the embedded default engine
    categories: tuple[str, ...] | None = None
    modes: tuple[str, ...] = BASE_MODES
    num_prompts: int | None = None
    max_new_tokens: int = 128
    prompts_file: Path | None = None
    dtype: str = "bf16"
    warmup: int = 1                         # prompts run (untimed) in every mode before measuring
    threshold_sweep: bool = False
    oracle: bool = False                    # also the oracle's headroom (bench.oracle): drafters at every position
    entropy_thresholds: tuple[float, ...] | None = None
    neural_thresholds: tuple[float, ...] | None = None
    near_tie: float | None = None           # None: lossless.NEAR_TIE[dtype]
    spec: SpecConfig = field(default_factory=SpecConfig)   # tree and catch-up settings shared by every mode
    kv_budget_mb: int = 256
    threads: int | None = None              # torch intra-op threads (None: torch's default)
    show_progress: bool = True
    command_line: str = ""

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"--max-new-tokens must be positive, got {self.max_new_tokens}")
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"--threads must be positive, got {self.threads}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if AR not in self.modes:
            raise ValueError("the modes must include ar: it is the baseline of speedups and of the lossless check")
        if self.oracle and not {AR, EAGLE3, DFLASH, SUFFIX} <= set(self.modes):
            raise ValueError("--oracle needs the ar, eagle3, dflash and suffix modes: their measured rounds are its "
                             "costs")
        if len(set(self.modes)) != len(self.modes):
            raise ValueError(f"modes repeat: {', '.join(self.modes)}")

    def to_dict(self) -> dict:
        d = asdict(self)
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()}


def resolve_modes(engine, opts: BenchOptions) -> list[BenchMode]:
    """Base modes, each checked by planning it (Engine.plan raises SpecError naming a drafter or router weights the
    engine lacks), then sweep points around each routed mode's default threshold (only the threshold differs, so
    they hold when their base does). The runs plan their own requests."""
    modes = [base_mode(name, opts.spec) for name in opts.modes]
    plans = [engine.plan(m.spec) for m in modes]
    if opts.threshold_sweep:
        lists = {"entropy": opts.entropy_thresholds, "neural": opts.neural_thresholds}
        for m, plan in zip(list(modes), plans):
            if m.spec.mode == WHIFLASH:
                given = lists[m.spec.router]
                modes += sweep_points(m, plan.router.threshold, None if given is None else list(given))
    return modes


def encode_prompts(engine, prompts: list[BenchPrompt], max_new_tokens: int) -> dict[str, list[int]]:
    """Chat-templated token ids per prompt id; a prompt that leaves no room to generate is an error."""
    context = engine.target.config.max_position_embeddings
    ids = {}
    for p in prompts:
        ids[p.id] = engine.encode(p.prompt, chat=True)
        if len(ids[p.id]) + max_new_tokens > context:
            raise WhiflashError(f"prompt {p.id} has {len(ids[p.id])} tokens; with --max-new-tokens "
                                f"{max_new_tokens} it exceeds the target's context of {context} tokens")
    return ids


def rotation(modes: list[BenchMode], i: int) -> list[BenchMode]:
    k = i % len(modes)
    return modes[k:] + modes[:k]


def warm_up(engine, prompt_ids: list[list[int]], modes: list[BenchMode], gen: GenerationConfig) -> None:
    short = GenerationConfig(max_new_tokens=min(gen.max_new_tokens, WARMUP_TOKENS), sampling=gen.sampling)
    for ids in prompt_ids:
        for m in modes:
            try:
                engine.generate(ids, short, spec=m.spec)
            except Exception:  # noqa: BLE001 - the measured run of this mode records the error
                pass


def run_prompts(engine, prompts: list[BenchPrompt], ids: dict[str, list[int]], modes: list[BenchMode],
                gen: GenerationConfig, show_progress: bool = True,
                read_rate: Callable[[], float] | None = None) -> list[dict]:
    """Every mode on every prompt, in rotating order. `read_rate` (GB/s of a plain read) is timed before each
    prompt's runs and kept in their records as read_gbs: the roofline at the time they ran."""
    records = []
    bar = tqdm(total=len(prompts) * len(modes), desc="bench", unit="run", disable=not show_progress)
    try:
        for i, p in enumerate(prompts):
            read = {} if read_rate is None else {"read_gbs": round(read_rate(), 2)}
            for order, m in enumerate(rotation(modes, i)):
                bar.set_postfix_str(f"{p.category} {m.name}", refresh=False)
                record = {"prompt_id": p.id, "category": p.category, "mode": m.name, "base_mode": m.base,
                          "order": order, "prompt_tokens": len(ids[p.id]), **read}
                try:
                    result = engine.generate(ids[p.id], gen, spec=m.spec)
                except Exception as e:  # a failing mode is a finding to report, not a reason to lose the run
                    record["error"] = f"{type(e).__name__}: {e}"
                else:
                    record.update(finish_reason=result.finish_reason, token_ids=result.token_ids, text=result.text,
                                  stats=result.stats)
                records.append(record)
                bar.update()
    finally:
        bar.close()
    return records


def run_benchmark(opts: BenchOptions) -> dict:
    """Load, run, check, summarise; write results.json, results.md and the plots into opts.out. -> results."""
    from whiflash_trt.bench import environment, goals, oracle, plots, report
    from whiflash_trt.bench.lossless import NEAR_TIE, check_lossless
    from whiflash_trt.bench.prompts import load_prompts, prompt_set_digest
    from whiflash_trt.bench.roofline import BUFFER_BYTES, plain_read_gbs
    from whiflash_trt.bench.summary import summarize, threshold_sweep
    from whiflash_trt.runtime.engine import Engine

    plots.require_matplotlib()
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    start = time.perf_counter()
    load_before = environment.load_average()
    prompts = load_prompts(list(opts.categories) if opts.categories else None, opts.num_prompts, opts.prompts_file)
    engine_dir = opts.engine if opts.engine is not None else environment.default_engine_dir()
    engine = Engine.load(engine_dir, dtype=opts.dtype, kv_budget_bytes=opts.kv_budget_mb * 2**20)
    modes = resolve_modes(engine, opts)
    gen = GenerationConfig(max_new_tokens=opts.max_new_tokens)
    ids = encode_prompts(engine, prompts, opts.max_new_tokens)
    warm_up(engine, [ids[p.id] for p in prompts[:opts.warmup]], modes, gen)
    limit = _roofline(engine, opts, [len(i) for i in ids.values()])
    flat = torch.ones(BUFFER_BYTES // 4)
    records = run_prompts(engine, prompts, ids, modes, gen, opts.show_progress, lambda: plain_read_gbs(flat))
    del flat
    tolerance = opts.near_tie if opts.near_tie is not None else NEAR_TIE[opts.dtype]
    lossless = check_lossless(records, ids, engine.target_logits, tolerance)
    summary = summarize(records, step_bytes=limit["bytes"]["total"])
    headroom = oracle.evaluate(engine, records, ids, summary, opts.spec, opts.show_progress) if opts.oracle else None
    results = {
        "schema": "whiflash-bench-v1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command_line": opts.command_line,
        "options": opts.to_dict(),
        "environment": environment.describe(load_before),
        "engine": environment.engine_info(engine_dir, engine, opts.dtype),
        "prompts": {"digest": prompt_set_digest(prompts), "num": len(prompts),
                    "by_category": _prompt_index(prompts, ids)},
        "modes": {m.name: {"base": m.base, **asdict(m.spec)} for m in modes},
        "generation": {"greedy": True, "max_new_tokens": opts.max_new_tokens, "warmup_prompts": opts.warmup},
        "trees": {**engine.resolved_tree_shapes(engine.tree_shapes(opts.spec)),   # the nodes this machine verifies
                  SUFFIX: {**asdict(opts.spec.suffix_tree),
                           "total_tokens": engine.proposers[SUFFIX].for_spec(opts.spec).max_tree_tokens()}},
        "summary": summary,
        "roofline": limit,
        "lossless": lossless,
        "oracle": headroom,
        "threshold_sweep": threshold_sweep(records, modes) if opts.threshold_sweep else None,
        "goals": goals.evaluate(summary),
        "records": records,
        "seconds": round(time.perf_counter() - start, 2),
    }
    report.write_outputs(results, opts.out)
    return results


def _roofline(engine, opts: BenchOptions, prompt_lengths: list[int]) -> dict:
    """The decode-step limit of this machine at the run's mean context (prompt + half the new tokens)."""
    from whiflash_trt.bench.roofline import measure_stream_rates, native_weight_bytes, roofline
    from whiflash_trt.config import parse_dtype

    cfg = engine.target.config
    context = round(sum(prompt_lengths) / len(prompt_lengths) + opts.max_new_tokens / 2)
    return roofline(cfg, parse_dtype(opts.dtype), context, measure_stream_rates(cfg.hidden_size, cfg.intermediate_size),
                    native_weight_bytes(engine))


def _prompt_index(prompts: list[BenchPrompt], ids: dict[str, list[int]]) -> dict:
    out: dict[str, dict] = {}
    for p in prompts:
        cell = out.setdefault(p.category, {"num": 0, "sources": [], "ids": [], "prompt_tokens": []})
        cell["num"] += 1
        if p.source not in cell["sources"]:
            cell["sources"].append(p.source)
        cell["ids"].append(p.id)
        cell["prompt_tokens"].append(len(ids[p.id]))
    return out
