"""Token-level routers: every round, which drafter drafts next. They see target signals only, never a drafter.

Entropy router (our design). After each verify the target's next-token distribution at the bonus position is
already computed, so its entropy costs nothing. Low entropy means the target is sure of what comes next: structured,
predictable continuations (code, JSON, templated math), where a block drafter's B-1 parallel guesses tend to survive;
high entropy means open-ended text, where EAGLE-3's tree hedges over several continuations. One number swings from
token to token, so it is smoothed over rounds with an exponential moving average (alpha 0.5: the current round
counts half) before it is compared: choose DFlash when the smoothed entropy (nats) is below the threshold.

Neural router (WhiFlash-Neural): MLP hidden -> GELU -> 1 on the target's final-layer hidden state (after the final
norm) at the last accepted position; it predicts dAL = AL(DFlash) - AL(EAGLE-3); choose DFlash when it exceeds the
threshold. The threshold trades expected token gain against round latency and is tuned per machine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from whiflash_trt.config import DFLASH, EAGLE3

DEFAULT_ENTROPY_THRESHOLD = 1.0


@dataclass(frozen=True)
class RouteSignal:
    """What the last verify left behind at the bonus position."""
    entropy: float           # nats, of softmax(logits) at temperature 1
    hidden: torch.Tensor     # [H] target final-norm hidden state of the last accepted position


def entropy_of(logits: torch.Tensor) -> float:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return float(-(logp.exp() * logp).sum())


class Router(Protocol):
    """One per request: choose names the drafter (EAGLE3 or DFLASH) of the next round."""
    threshold: float

    def choose(self, signal: RouteSignal) -> str: ...


class EntropyRouter(Router):
    def __init__(self, threshold: float = DEFAULT_ENTROPY_THRESHOLD, alpha: float = 0.5) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"entropy smoothing alpha must be in (0, 1], got {alpha}")
        self.threshold, self.alpha = threshold, alpha
        self.smoothed: float | None = None

    def reset(self) -> None:
        self.smoothed = None

    def choose(self, signal: RouteSignal) -> str:
        e = signal.entropy
        self.smoothed = e if self.smoothed is None else self.alpha * e + (1 - self.alpha) * self.smoothed
        return DFLASH if self.smoothed < self.threshold else EAGLE3


class RouterMLP(nn.Module):
    def __init__(self, hidden_size: int, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(width, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [...] predicted acceptance-length gain of DFlash over EAGLE-3."""
        return self.fc2(self.act(self.fc1(hidden))).squeeze(-1)


class NeuralRouter(Router):
    def __init__(self, mlp: RouterMLP, threshold: float) -> None:
        self.mlp, self.threshold = mlp, threshold

    def predict(self, hidden: torch.Tensor) -> float:
        with torch.inference_mode():
            return float(self.mlp(hidden.float()))

    def choose(self, signal: RouteSignal) -> str:
        return DFLASH if self.predict(signal.hidden) > self.threshold else EAGLE3
