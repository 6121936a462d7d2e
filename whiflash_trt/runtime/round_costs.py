"""Seconds per round of each routing choice on the machine that runs the engine: the throughput router's costs.

A short calibration when an engine with a v2 router file loads (Engine.__init__): a fixed prompt decoded for a few
tokens in each static mode (`ar` for a target-only round, EAGLE-3 with the default tree, DFlash), after an untimed
warm-up of each. The modes take turns (ar, EAGLE-3, DFlash, ar, ...) for `reps` repetitions so that a change of load
on a shared machine hits all three alike, and a choice's cost is the median over repetitions of its mean round time
(route, draft, verify, commit; not catch-up, which in these short runs is the whole prompt's KV-only prefill in
the first round, while in steady decoding it is 1-2% of a round). About 7-10 s for SmolLM2-135M on one loaded CPU
thread. The costs are used only as ratios (rate = tokens / seconds); on a loaded 2-core machine these calibrations
gave EAGLE-3 : ar ratios of 2.5-3.0 and DFlash : ar 1.8-2.0 from run to run (the bench's 30-run means: 2.4, 1.7).
Costs grow with the context length and the tree; the calibration fixes both at a short prompt and the default tree
(a documented limitation). Engine.round_seconds can be set by a caller that measured better ones.
"""
from __future__ import annotations

import statistics

from whiflash_trt.config import AR, DFLASH, EAGLE3, GenerationConfig, SpecConfig
from whiflash_trt.spec.router import NO_DRAFT

CALIBRATION_PROMPT = "Write a short Python function that returns the sum of a list of numbers, then explain it."


def measure_round_seconds(engine, new_tokens: int = 10, reps: int = 3, warmup_tokens: int = 4) -> dict[str, float]:
    """{NO_DRAFT and each drafter the engine holds: seconds per round} (see the module docstring)."""
    ids = engine.encode(CALIBRATION_PROMPT)
    modes = {choice: mode for choice, mode in ((NO_DRAFT, AR), (EAGLE3, EAGLE3), (DFLASH, DFLASH))
             if choice == NO_DRAFT or choice in engine.proposers}
    for mode in modes.values():
        engine.generate(ids, GenerationConfig(max_new_tokens=warmup_tokens, ignore_eos=True),
                        spec=SpecConfig(mode=mode))
    samples: dict[str, list[float]] = {choice: [] for choice in modes}
    for _ in range(reps):
        for choice, mode in modes.items():
            stats = engine.generate(ids, GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True),
                                    spec=SpecConfig(mode=mode)).stats
            steady = sum(t for phase, t in stats["phase_seconds"].items() if phase != "catch_up")
            samples[choice].append(steady / max(1, stats["rounds"]))
    return {choice: statistics.median(xs) for choice, xs in samples.items()}
