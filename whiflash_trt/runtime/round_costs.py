"""Seconds per round of each routing choice on the machine that runs the engine: the throughput router's costs.

A short calibration when an engine with a v2 router file loads (Engine.__init__): two fixed prompts (code, where the
drafters are sure, and open prose, where they are not) decoded for a few tokens each in each static mode (`ar` for a
target-only round, EAGLE-3 with the default tree, DFlash), after an untimed warm-up of each. The modes take turns
(ar, EAGLE-3, DFlash, ar, ...) for `reps` repetitions so that a change of load on a shared machine hits all three
alike, and a choice's cost is the median over repetitions of its mean round time over the prompts (route, draft,
verify, commit; not the drafter's prefill of the prompt in the first round, nor catch-up, 1-2% of a round in steady
decoding). With EAGLE-3's probability floor its tree, and so its round, is bigger where it is sure: on the code prompt
alone the calibration put its round at 1.11x DFlash's where the bench measured 1.06x; with both prompts 1.08-1.09x
(2026-12-04, Intel Xeon with AMX, 2 threads, reps 9). The calibration at load (reps 3, both prompts) took 1.7 s for
SmolLM2-135M there (an earlier measurement: 7-10 s on one loaded CPU thread, one prompt). The costs are used
only as ratios (rate = tokens / seconds); on a loaded 2-core machine these calibrations gave EAGLE-3 : ar ratios
of 2.5-3.0 and DFlash : ar 1.8-2.0 from run to run (the bench's 30-run means: 2.4, 1.7). Costs grow with the
context length and the tree; the calibration fixes both at short prompts and the default tree (a documented
limitation). Engine.round_seconds can be set by a caller that measured better ones.

Known bias (measured 2026-12-01, AMD EPYC, 2 threads): this calibration gave none / EAGLE-3 / DFlash 10.7 / 14.5 /
12.8 ms where the bench's rounds (contexts of ~150-400 tokens, catch-up included) took 12.0 / 19.1 / 16.6, so it
understates a drafting round by 20-40%. The shipped router's threshold was fit against costs measured this way. A
calibration at a 200-token context with catch-up (tried: steady-state rounds from two run lengths) gave ratios near
the bench's but noisy from load to load (EAGLE-3 : none 1.55-1.88), and with it the shipped router skipped drafting
in 81% of the bench's rounds (whiflash-neural 1.08x `ar` over all prompts against EAGLE-3's 1.24x). The costs and
the router's fit must change together: retrain the router against costs measured the new way.

The costs of an engine directory are kept (`cached_round_seconds`) in the user's cache, one small JSON file per
engine (its manifest), backend, thread count, CPU model, GEMM loop, default tree shapes and whiflash-trt version, so
that only the first load of an engine on a machine pays the calibration (later loads read them back); delete the
folder to measure again. A machine whose speed changes (a shared host, another load) keeps the ratios of its first load.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

from whiflash_trt import __version__, kernels
from whiflash_trt.config import AR, DFLASH, EAGLE3, DFlashTreeConfig, GenerationConfig, SpecConfig, TreeConfig
from whiflash_trt.runtime.device import cpu_model
from whiflash_trt.spec.router import NO_DRAFT

# a drafter's round costs more where it drafts a bigger tree (EAGLE-3 with a probability floor: where it is sure), so
# the calibration decodes one prompt where the drafters are sure (code) and one where they are not (open prose)
CALIBRATION_PROMPTS = ("Write a short Python function that returns the sum of a list of numbers, then explain it.",
                       "Describe a walk through a city park on an autumn morning.")
DEFAULT_CACHE = Path.home() / ".cache" / "whiflash-trt" / "round-costs"


def calibration_key(engine) -> str:
    """What the costs depend on besides the machine's load."""
    what = {"manifest": dataclasses.asdict(engine.manifest), "target": type(engine.target).__name__,
            "proposers": sorted(f"{n}:{type(p.model).__name__}" for n, p in engine.proposers.items()),
            "device": str(engine.device), "threads": torch.get_num_threads(), "cpu": cpu_model(),
            "gemm": kernels.gemm() if kernels.registered() else None,
            "trees": [repr(TreeConfig()), repr(DFlashTreeConfig()), DFlashTreeConfig.DEFAULT_NODES],
            "version": __version__, "prompts": CALIBRATION_PROMPTS}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cached_round_seconds(engine, cache_dir: Path | None = DEFAULT_CACHE) -> dict[str, float]:
    """measure_round_seconds once per calibration_key in `cache_dir` (None: measure every time; so is an engine
    assembled from checkpoints, which has no manifest to name it). An unreadable or malformed entry is measured
    again; an unwritable cache only costs the next load a calibration."""
    if cache_dir is None or engine.manifest is None:
        return measure_round_seconds(engine)
    path = Path(cache_dir) / f"{calibration_key(engine)}.json"
    try:
        costs = {k: float(v) for k, v in json.loads(path.read_text())["round_seconds"].items()}
        if costs and all(c > 0 for c in costs.values()):
            return costs
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    costs = measure_round_seconds(engine)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump({"round_seconds": costs, "threads": torch.get_num_threads(), "cpu": cpu_model()}, f)
        os.replace(f.name, path)
    except OSError:
        pass
    return costs


def measure_round_seconds(engine, new_tokens: int = 10, reps: int = 3, warmup_tokens: int = 4) -> dict[str, float]:
    """{NO_DRAFT and each drafter the engine holds: seconds per round} (see the module docstring)."""
    prompts = [engine.encode(prompt) for prompt in CALIBRATION_PROMPTS]
    modes = {choice: mode for choice, mode in ((NO_DRAFT, AR), (EAGLE3, EAGLE3), (DFLASH, DFLASH))
             if choice == NO_DRAFT or choice in engine.proposers}
    for mode in modes.values():
        engine.generate(prompts[0], GenerationConfig(max_new_tokens=warmup_tokens, ignore_eos=True),
                        spec=SpecConfig(mode=mode))
    samples: dict[str, list[float]] = {choice: [] for choice in modes}
    for _ in range(reps):
        for choice, mode in modes.items():   # a repetition's cost: the mean over the prompts
            samples[choice].append(statistics.fmean(steady_seconds_per_round(engine.generate(
                ids, GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True), spec=SpecConfig(mode=mode)).stats)
                for ids in prompts))
    return {choice: statistics.median(xs) for choice, xs in samples.items()}


def steady_seconds_per_round(stats: dict) -> float:
    """A generation's mean round time (its stats dict) without the drafter's prompt prefill and catch-up: the cost
    of a round as the router weighs it (see the module docstring)."""
    steady = sum(t for phase, t in stats["phase_seconds"].items() if phase not in ("drafter_prefill", "catch_up"))
    return steady / max(1, stats["rounds"])
