"""Seconds per round of each routing choice on the machine that runs the engine: the throughput router's costs.

A short calibration when an engine with a v2 router file loads (Engine.__init__): a fixed prompt of about 200
tokens (a typical request's context: a round's attention grows with it) decoded in each static mode (`ar` for a
target-only round, EAGLE-3 with the default tree, DFlash), after an untimed warm-up of each. A choice's cost is what
a round costs in steady decoding, catch-up included: each mode decodes the prompt twice, for `short` and `long`
new tokens, and the cost is the difference of the two runs' round seconds over the difference of their rounds (both
share the first round, whose catch-up is the whole prompt's KV-only prefill). The modes take turns (ar, EAGLE-3,
DFlash, ar, ...) for `reps` repetitions so that a change of load on a shared machine hits all three alike; the cost
is the median over repetitions. About 10 s for SmolLM2-135M on 2 threads. The costs are used only as ratios (rate =
tokens / seconds). The calibration before this one timed 10 new tokens after a 20-token prompt and left catch-up out:
on the AMD EPYC (2 threads) it gave none 10.7, EAGLE-3 14.5 and DFlash 12.8 ms while the bench's rounds took 12.0,
19.1 and 16.6 ms, so the router believed drafting cheaper than it was and drafted on chat, where it loses.
Costs still depend on the context length and the tree; the calibration fixes both at a typical prompt and the
default tree (a documented limitation). Engine.round_seconds can be set by a caller that measured better ones.

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

CALIBRATION_PROMPT = (
    "You are reviewing a small Python module for a data pipeline. It reads a CSV file of orders with the columns "
    "order_id, customer, product, quantity, unit_price and date; it skips rows with a missing quantity, converts "
    "prices to decimals, groups the orders by customer and by month, and writes a JSON summary with the total "
    "spent, the number of orders and the most frequent product of each customer. The current code uses nested "
    "loops and global variables, has no tests, and fails on empty files and on dates in two different formats. "
    "Rewrite it as a set of small functions with type hints and docstrings, handle both date formats and the "
    "empty file, replace the globals with a dataclass, and add pytest tests for each function, including one for "
    "a file with a malformed row. Then explain in a few sentences how each change makes the module easier to "
    "maintain, which edge cases remain, and how you would extend it to read the orders from a database instead "
    "of a CSV file without changing the summary code.")
CALIBRATION_TOKENS = 200   # the prompt's tokens used (SmolLM2's tokenizer makes 209 of it)
DEFAULT_CACHE = Path.home() / ".cache" / "whiflash-trt" / "round-costs"


def calibration_key(engine) -> str:
    """What the costs depend on besides the machine's load."""
    what = {"manifest": dataclasses.asdict(engine.manifest), "target": type(engine.target).__name__,
            "proposers": sorted(f"{n}:{type(p.model).__name__}" for n, p in engine.proposers.items()),
            "device": str(engine.device), "threads": torch.get_num_threads(), "cpu": cpu_model(),
            "gemm": kernels.gemm() if kernels.registered() else None,
            "trees": [repr(TreeConfig()), repr(DFlashTreeConfig()), DFlashTreeConfig.DEFAULT_NODES],
            "version": __version__, "prompt": [CALIBRATION_PROMPT, CALIBRATION_TOKENS]}
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


def measure_round_seconds(engine, short: int = 6, long: int = 30, reps: int = 3,
                          warmup_tokens: int = 4) -> dict[str, float]:
    """{NO_DRAFT and each drafter the engine holds: seconds per round} (see the module docstring)."""
    room = engine.target.config.max_position_embeddings - long - 32   # a short-context model: less prompt
    ids = engine.encode(CALIBRATION_PROMPT)[:max(1, min(CALIBRATION_TOKENS, room))]
    modes = {choice: mode for choice, mode in ((NO_DRAFT, AR), (EAGLE3, EAGLE3), (DFLASH, DFLASH))
             if choice == NO_DRAFT or choice in engine.proposers}
    for mode in modes.values():
        engine.generate(ids, GenerationConfig(max_new_tokens=warmup_tokens, ignore_eos=True),
                        spec=SpecConfig(mode=mode))

    def run(mode: str, tokens: int) -> tuple[float, int]:
        stats = engine.generate(ids, GenerationConfig(max_new_tokens=tokens, ignore_eos=True),
                                spec=SpecConfig(mode=mode)).stats
        return sum(stats["phase_seconds"].values()), stats["rounds"]

    samples: dict[str, list[float]] = {choice: [] for choice in modes}
    for _ in range(reps):
        for choice, mode in modes.items():
            (first, few), (second, many) = run(mode, short), run(mode, long)
            samples[choice].append((second - first) / (many - few) if many > few else second / max(1, many))
    return {choice: statistics.median(xs) for choice, xs in samples.items()}
