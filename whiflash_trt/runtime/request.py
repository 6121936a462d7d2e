"""One request's state across its rounds: what the round loop reads and advances besides the engine's own parts."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from whiflash_trt.config import GenerationConfig, SpecConfig
from whiflash_trt.runtime.drafters import Proposer
from whiflash_trt.runtime.sequence import Sequence
from whiflash_trt.runtime.stats import RoundStats
from whiflash_trt.runtime.stopping import StopChecker
from whiflash_trt.spec.router import RouteSignal, Router


@dataclass
class Request:
    """Only the commit phase changes `seq`; `signal` is what the last verify left for the router."""
    seq: Sequence
    gen: GenerationConfig
    spec: SpecConfig                  # resolved: no "auto" left
    proposers: dict[str, Proposer]    # the mode's drafters, shaped by spec's tree settings
    router: Router | None             # whiflash mode only
    generator: torch.Generator
    stopper: StopChecker
    stats: RoundStats = field(default_factory=RoundStats)
    signal: RouteSignal | None = None
