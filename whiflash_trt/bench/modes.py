"""The benchmark's modes: a name and the SpecConfig it runs with (greedy decoding; tree settings fixed per run).

    ar                target only (the baseline every speedup is measured against)
    eagle3 / dflash   one static learned drafter
    suffix            the parameter-free drafter alone
    whiflash-entropy  routed every round by the target's entropy (and the suffix drafter's offer)
    whiflash-neural   routed every round by the neural router (and the suffix drafter's offer)
A threshold-sweep point is a routed mode at another threshold, named e.g. "whiflash-neural@0.5".
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from whiflash_trt.config import AR, DFLASH, EAGLE3, ROUTERS, SUFFIX, WHIFLASH, SpecConfig
from whiflash_trt.errors import WhiflashError

ROUTED = {f"{WHIFLASH}-{router}": router for router in ROUTERS}   # whiflash-entropy, whiflash-neural
BASE_MODES = (AR, EAGLE3, DFLASH, SUFFIX, *ROUTED)
# Sweep points around the router's default threshold t0 (entropy: t0 * factor; neural: t0 + offset).
ENTROPY_FACTORS = (0.25, 0.5, 2.0, 4.0)
NEURAL_OFFSETS = (-1.0, -0.5, 0.5, 1.0)


@dataclass(frozen=True)
class BenchMode:
    name: str
    base: str                     # one of BASE_MODES
    spec: SpecConfig


def base_mode(name: str, template: SpecConfig) -> BenchMode:
    """`template` carries the tree and catch-up settings shared by every mode."""
    if name not in BASE_MODES:
        raise WhiflashError(f"unknown mode {name!r}; expected one of {', '.join(BASE_MODES)}")
    if name in ROUTED:
        return BenchMode(name, name, replace(template, mode=WHIFLASH, router=ROUTED[name], threshold=None))
    return BenchMode(name, name, replace(template, mode=name, threshold=None))


def sweep_points(mode: BenchMode, default: float, thresholds: list[float] | None) -> list[BenchMode]:
    """Routed `mode` at other thresholds (the default itself is `mode`)."""
    if thresholds is None:
        if mode.spec.router == "entropy":
            thresholds = [default * f for f in ENTROPY_FACTORS]
        else:
            thresholds = [default + d for d in NEURAL_OFFSETS]
    points = sorted({round(t, 6) for t in thresholds} - {round(default, 6)})
    return [BenchMode(f"{mode.base}@{t:g}", mode.base, replace(mode.spec, threshold=t)) for t in points]
