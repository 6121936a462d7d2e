"""One request's state across its rounds: what the round loop reads and advances besides the engine's own parts, and
its output as it grows (stop checks, streaming, the final result)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from whiflash_trt.config import GenerationConfig, SpecConfig
from whiflash_trt.runtime.drafters import Proposer
from whiflash_trt.runtime.sequence import Sequence
from whiflash_trt.runtime.stats import RoundStats
from whiflash_trt.runtime.stopping import StopChecker, StopDecision
from whiflash_trt.spec.router import RouteSignal, Router


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    prompt_tokens: int
    finish_reason: str
    stats: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_tokens": self.prompt_tokens,
                "finish_reason": self.finish_reason, "stats": self.stats}


@dataclass
class Request:
    """Only the commit phase changes `seq`; `signal` is what the last verify left for the router (None without one).
    `output` holds the tokens produced so far (the pending bonus included); `on_tokens` receives them as they become
    final."""
    seq: Sequence
    gen: GenerationConfig
    spec: SpecConfig                  # resolved: no "auto" left
    proposers: dict[str, Proposer]    # the mode's drafters, shaped by spec's tree settings
    router: Router | None             # whiflash mode only
    generator: torch.Generator
    stopper: StopChecker
    on_tokens: Callable[[list[int]], None] | None = None
    stats: RoundStats = field(default_factory=RoundStats)
    signal: RouteSignal | None = None
    output: list[int] = field(default_factory=list)
    decision: StopDecision | None = None
    error: Exception | None = None    # why it ended early (a streaming consumer's exception, KV exhaustion, ...)
    emitted: int = 0
    start: float = field(default_factory=time.perf_counter)
    prefill_seconds: float | None = None

    @property
    def done(self) -> bool:
        return self.error is not None or (self.decision is not None and self.decision.reason is not None)

    def extend(self, new: list[int]) -> None:
        """Append a round's new tokens (after prefill: the first bonus), check the stop rules, stream what is final.
        A consumer's exception ends this request only."""
        if self.prefill_seconds is None:
            self.prefill_seconds = time.perf_counter() - self.start
        self.output += new
        self.decision = self.stopper.check(self.output, len(new))
        if self.on_tokens and self.decision.keep > self.emitted:
            try:
                self.on_tokens(self.output[self.emitted:self.decision.keep])
            except Exception as e:
                self.error = e
            self.emitted = self.decision.keep

    def result(self) -> GenerationResult:
        """The finished request's result (its error is raised instead, if it has one)."""
        if self.error is not None:
            raise self.error
        seconds = time.perf_counter() - self.start
        tokens = self.output[:self.decision.keep]
        stats = {"mode": self.spec.mode, "rounds": len(self.stats.taus), "new_tokens": len(tokens),
                 "seconds": round(seconds, 4), "prefill_seconds": round(self.prefill_seconds, 4),
                 "tokens_per_s": round(len(tokens) / seconds, 2) if seconds > 0 else 0.0,
                 "threads": torch.get_num_threads()}
        if self.router is not None:
            stats.update(router=self.spec.router, threshold=self.router.threshold, catch_up=self.spec.catch_up)
        stats.update(self.stats.to_dict())
        return GenerationResult(tokens, self.stopper.final_text(tokens, self.decision.reason),
                                len(self.seq.prompt_ids), self.decision.reason, stats)
