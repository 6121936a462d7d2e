"""Seconds per round of each routing choice on the machine that runs the engine: the throughput router's costs.

A short calibration when an engine with a v2 router file loads (Engine.__init__): two fixed prompts (code, where the
drafters are sure, and open prose, where they are not; through the chat template where the tokenizer has one) decoded
for a few tokens each in each static mode (`ar` for a target-only round, EAGLE-3 with the default tree, DFlash),
after an untimed warm-up of each. The modes take turns (ar, EAGLE-3, DFlash, ar, ...) for `reps` repetitions so
that a change of load on a shared machine hits all three alike, and a choice's cost is the median over repetitions
of its mean round time over the prompts (route, catch-up, draft, verify, commit: what the benchmark's rounds cost;
not the drafter's prefill of the prompt in the first round). The costs are used only as ratios (rate = tokens /
seconds).

Round costs grow with the context and the tree, and not alike: DFlash's block attends to the whole context with all
of its rows, EAGLE-3's tree is bigger where it is sure (its probability floor). Each prompt therefore brings a
context of the benchmark's size (~150-200 tokens) and catch-up is counted: a shorter calibration understates
DFlash's round against EAGLE-3's and so sends DFlash rounds it does not win. A router's threshold is chosen in
simulation under the costs it was fit with; its predictions do not depend on the costs.

The costs of an engine directory are kept (`cached_round_seconds`) in the user's cache, one small JSON file per
engine (its manifest), backend, thread count, CPU model, GEMM loop, default tree shapes, prompts and whiflash-trt
version, so that only the first load of an engine on a machine pays the calibration (later loads read them back);
delete the folder to measure again. Engine.round_seconds can be set by a caller that measured better ones.

The calibration only seeds the costs the router weighs: their ratios move with a shared machine's speed, so the
engine keeps them current (LiveRoundSeconds), each round a request runs alone moving its choice's cost toward what
that round took. Measurements: docs/measurements.md, "Round costs".
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from whiflash_trt import __version__, kernels
from whiflash_trt.config import (AR, DFLASH, EAGLE3, SUFFIX, DFlashTreeConfig, GenerationConfig, SpecConfig,
                                 TreeConfig)
from whiflash_trt.runtime.device import cpu_model
from whiflash_trt.spec.router import NO_DRAFT, VERIFY_ROW

# a drafter's round costs more where it drafts a bigger tree (EAGLE-3 with a probability floor: where it is sure), so
# the calibration decodes one prompt where the drafters are sure (code) and one where they are not (open prose); and
# DFlash's block attends to the whole context with all its rows, so each prompt brings a context of the benchmark's
# size (~150-200 tokens with the chat template)
CALIBRATION_PROMPTS = (
    "Here is a Python module that keeps a small inventory of items in a warehouse:\n\n```python\n"
    "class Inventory:\n    def __init__(self):\n        self.items = {}\n\n"
    "    def add(self, name, count):\n        self.items[name] = self.items.get(name, 0) + count\n\n"
    "    def remove(self, name, count):\n        if self.items.get(name, 0) < count:\n"
    "            raise ValueError(f'not enough {name}')\n        self.items[name] -= count\n```\n\n"
    "Write a method `report` that returns the items sorted by count, largest first, as a list of (name, count) "
    "pairs, and a method `total` that returns the number of items in stock. Then explain both methods.",
    "The town of Alderbrook sits where two rivers meet at the foot of a long wooded ridge. Its market square is "
    "lined with old stone houses, a bakery that opens before dawn, and a small library that used to be a chapel. "
    "Every autumn the town holds a harvest fair: farmers bring apples, pumpkins and honey, children race wooden "
    "boats on the river, and in the evening a brass band plays in the square while lanterns are lit along the "
    "bridges. Write a short story about a visitor who arrives in Alderbrook on the morning of the fair and what "
    "she finds there.")
DEFAULT_CACHE = Path.home() / ".cache" / "whiflash-trt" / "round-costs"


def calibration_key(engine) -> str:
    """What the costs depend on besides the machine's load."""
    what = {"manifest": dataclasses.asdict(engine.manifest), "target": type(engine.target).__name__,
            "proposers": sorted(f"{n}:{type(getattr(p, 'model', p)).__name__}" for n, p in engine.proposers.items()),
            "device": str(engine.device), "threads": torch.get_num_threads(), "cpu": cpu_model(),
            "gemm": kernels.gemm() if kernels.registered() else None,
            "trees": [repr(TreeConfig()), repr(DFlashTreeConfig()),
                      {n: p.max_tree_tokens() for n, p in sorted(engine.proposers.items())}],
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
        if costs.get(NO_DRAFT, 0) > 0 and all(c >= 0 for c in costs.values()):
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
    chat = bool(getattr(engine.tokenizer, "chat_template", None))
    keep = engine.target.config.max_position_embeddings // 2   # a model of a short context: the prompts' ends
    prompts = [engine.encode(prompt, chat=chat)[-keep:] for prompt in CALIBRATION_PROMPTS]
    for mode in choice_modes(engine).values():
        engine.generate(prompts[0], GenerationConfig(max_new_tokens=warmup_tokens, ignore_eos=True),
                        spec=SpecConfig(mode=mode))
    gen = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    runs = [seconds_per_round_by_prompt(engine, prompts, gen) for _ in range(reps)]
    # a repetition's cost: the mean over the prompts
    costs = {choice: statistics.median(statistics.fmean(run[choice]) for run in runs) for choice in runs[0]}
    if SUFFIX in engine.proposers:   # a free drafter's round: a target-only one plus its verified rows
        costs[VERIFY_ROW] = verify_row_seconds(engine, prompts[0], engine.proposers[SUFFIX].max_tree_tokens())
    return costs


def verify_row_seconds(engine, prompt: list[int], rows: int, reps: int = 5) -> float:
    """Seconds one more verified row adds to a target step at `prompt`'s context: the median step over `rows` rows
    less the median step over one, per further row."""
    if rows < 2:
        return 0.0
    seconds: dict[int, list[float]] = {1: [], rows: []}
    with engine.scratch_sequence(prompt, len(prompt) + rows) as seq:
        engine.runner.step(seq, prompt, logits_rows=[len(prompt) - 1])
        seq.commit(prompt, prompt[-1])
        for _ in range(reps):
            for n, samples in seconds.items():   # the step writes past the committed tokens: each sees the same cache
                start = time.perf_counter()
                engine.runner.step(seq, prompt[-n:])
                samples.append(time.perf_counter() - start)
    return max(0.0, (statistics.median(seconds[rows]) - statistics.median(seconds[1])) / (rows - 1))


def choice_modes(engine) -> dict[str, str]:
    """The routing choices the engine can time, each with the static mode whose rounds it takes: NO_DRAFT (`ar`)
    and each drafter it holds."""
    return {choice: mode for choice, mode in ((NO_DRAFT, AR), (EAGLE3, EAGLE3), (DFLASH, DFLASH))
            if choice == NO_DRAFT or choice in engine.proposers}


def seconds_per_round_by_prompt(engine, prompts: list[list[int]], gen: GenerationConfig,
                                spec: SpecConfig | None = None) -> dict[str, list[float]]:
    """Each choice's steady seconds per round (steady_seconds_per_round) on each prompt, the choices taking turns
    per prompt so that a change of load on a shared machine hits all alike; `spec` gives the trees (its mode is
    each choice's)."""
    spec = spec or SpecConfig()
    modes = choice_modes(engine)
    samples: dict[str, list[float]] = {choice: [] for choice in modes}
    for ids in prompts:
        for choice, mode in modes.items():
            stats = engine.generate(ids, gen, spec=dataclasses.replace(spec, mode=mode)).stats
            samples[choice].append(steady_seconds_per_round(stats))
    return samples


def steady_seconds_per_round(stats: dict) -> float:
    """A generation's mean round time (its stats dict) without the drafter's prompt prefill: the cost of a round as
    the router weighs it (see the module docstring)."""
    steady = sum(t for phase, t in stats["phase_seconds"].items() if phase != "drafter_prefill")
    return steady / max(1, stats["rounds"])


class LiveRoundSeconds(Mapping):
    """choice -> seconds per round, as the throughput router reads them at every choice: seeded (the calibration,
    or a caller's costs), then `observe` moves a choice's cost by `alpha` toward a round's measured seconds (an
    EMA: at 0.05 a change of the machine's speed shows after some 20 rounds of a choice, one round's noise hardly).
    A round is taken as at most twice and at least half the current cost: a shared machine's stall (a round of
    100 ms among rounds of 10) moves the cost by 5%, not 45%. A choice that is not seeded is not tracked; `alpha` 0
    keeps the seeds fixed."""
    ALPHA = 0.05

    def __init__(self, seconds: Mapping[str, float] | None = None, alpha: float = ALPHA) -> None:
        if not 0 <= alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self._seconds, self.alpha = dict(seconds or {}), alpha

    def __getitem__(self, choice: str) -> float:
        return self._seconds[choice]

    def __iter__(self) -> Iterator[str]:
        return iter(self._seconds)

    def __len__(self) -> int:
        return len(self._seconds)

    def __repr__(self) -> str:
        return f"LiveRoundSeconds({self._seconds})"

    def observe(self, choice: str, seconds: float) -> None:
        if choice in self._seconds and seconds > 0:
            cost = self._seconds[choice]
            self._seconds[choice] += self.alpha * (min(max(seconds, cost / 2), 2 * cost) - cost)
