"""Seconds per round of each routing choice on the machine that runs the engine: the throughput router's costs.

A short calibration when an engine with a v2 router file loads (Engine.__init__): a fixed prompt decoded for a few
tokens in each static mode (`ar` for a target-only round, then EAGLE-3 with the default tree, then DFlash), after an
untimed warm-up of each; a choice's cost is the mean of its rounds' measured phases (route, catch up, draft, verify,
commit), as the bench's oracle counts them. About 12 rounds per choice: ~4 s for SmolLM2-135M on one CPU thread.
The costs are only used as ratios (rate = tokens / seconds), so a uniformly slower or busier machine gives the same
decisions. Costs grow with the context length and the tree; the calibration fixes both at a short prompt and the
default tree (documented limitation). Engine.round_seconds can be set by a caller that measured better ones.
"""
from __future__ import annotations

from whiflash_trt.config import AR, DFLASH, EAGLE3, GenerationConfig, SpecConfig
from whiflash_trt.spec.router import NO_DRAFT

CALIBRATION_PROMPT = "Write a short Python function that returns the sum of a list of numbers, then explain it."


def measure_round_seconds(engine, new_tokens: int = 12, warmup_tokens: int = 4) -> dict[str, float]:
    """{NO_DRAFT, EAGLE3, DFLASH present in the engine: mean seconds per round} (see the module docstring)."""
    ids = engine.encode(CALIBRATION_PROMPT)
    out = {}
    for choice, mode in ((NO_DRAFT, AR), (EAGLE3, EAGLE3), (DFLASH, DFLASH)):
        if choice != NO_DRAFT and choice not in engine.proposers:
            continue
        spec = SpecConfig(mode=mode)
        engine.generate(ids, GenerationConfig(max_new_tokens=warmup_tokens, ignore_eos=True), spec=spec)
        stats = engine.generate(ids, GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True), spec=spec).stats
        out[choice] = sum(stats["phase_seconds"].values()) / max(1, stats["rounds"])
    return out
