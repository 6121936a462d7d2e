"""Per-request round statistics: acceptance lengths per drafter, routing, switches, time per phase."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

# drafter_prefill: a drafter's KV-only prefill of the prompt, in the first round it drafts (or every drafter's in
# the first round, with eager catch-up); catch_up: its KV-only passes over generated tokens (the last round's, or a
# switch's backlog), what the switching overhead counts
PHASES = ("route", "drafter_prefill", "catch_up", "draft", "verify", "commit")


@dataclass
class RoundStats:
    taus: list[int] = field(default_factory=list)           # accepted drafts + 1, per round
    drafters: list[str] = field(default_factory=list)       # who drafted each round ("none" = target only)
    phase_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    catch_up_tokens: int = 0            # generated positions caught up (catch_up)
    drafter_prefill_tokens: int = 0     # prompt positions caught up (drafter_prefill)

    def record(self, drafter: str, num_accepted: int, phase_seconds: dict[str, float]) -> None:
        self.taus.append(num_accepted + 1)
        self.drafters.append(drafter)
        for phase, seconds in phase_seconds.items():
            self.phase_seconds[phase] += seconds

    @property
    def switches(self) -> int:
        return sum(a != b for a, b in zip(self.drafters, self.drafters[1:]))

    def to_dict(self) -> dict:
        def mean(xs):
            return round(sum(xs) / len(xs), 4) if xs else None

        per: dict[str, list[int]] = defaultdict(list)
        for d, t in zip(self.drafters, self.taus):
            per[d].append(t)
        round_s = sum(self.phase_seconds[p] for p in PHASES)
        return {
            "tau": mean(self.taus),
            "tau_per_drafter": {d: mean(ts) for d, ts in sorted(per.items())},
            "rounds_per_drafter": {d: len(ts) for d, ts in sorted(per.items())},
            "switches": self.switches,
            "catch_up_tokens": self.catch_up_tokens,
            "drafter_prefill_tokens": self.drafter_prefill_tokens,
            "phase_seconds": {p: round(self.phase_seconds[p], 5) for p in PHASES},
            "switching_overhead": round(self.phase_seconds["catch_up"] / round_s, 5) if round_s > 0 else 0.0,
            "trace": [[d, t] for d, t in zip(self.drafters, self.taus)],
        }
