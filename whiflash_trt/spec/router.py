"""Token-level routers: every round, which drafter drafts next. They see target signals only, never a drafter.

Entropy router (our design). After each verify the target's next-token distribution at the bonus position is
already computed, so its entropy costs nothing. Low entropy means the target is sure of what comes next: structured,
predictable continuations (code, JSON, templated math), where a block drafter's B-1 parallel guesses tend to survive;
high entropy means open-ended text, where EAGLE-3's tree hedges over several continuations. One number swings from
token to token, so it is smoothed over rounds with an exponential moving average (alpha 0.5: the current round
counts half) before it is compared: choose DFlash when the smoothed entropy (nats) is below the threshold.

A third choice, NO_DRAFT (a target-only round), is open to both rules below: when no drafter is expected to pay for
its round, drafting makes decoding slower than `ar`.

Entropy rule, three-way: choose NO_DRAFT when the smoothed entropy is at or above `none_threshold` (inf by default:
never). whiflash-train router calibrates both thresholds on held-out states.

Neural router v1 (WhiFlash-Neural, router file v1): MLP hidden -> GELU -> 1 on the target's final-layer hidden state
(after the final norm) at the last accepted position; it predicts dAL = AL(DFlash) - AL(EAGLE-3); choose DFlash when
it exceeds the threshold. Kept so that v1 files still route as they did.

Throughput router (router file v2, issue 14): the objective is expected tokens per second. For each option d a small
MLP over cheap per-round features (RouterHistory.features: the target's entropy and top-1/top-2 margin at the bonus
position, each drafter's EMA of its own accepted drafts, the previous round's choice and accepted drafts) predicts
E[accepted drafts of d]; the round commits that plus one token and costs c_d seconds (round_seconds, measured on the
machine that runs the engine and kept current by its rounds: runtime.round_costs), so its rate is (E[a_d] + 1) / c_d,
against 1 / c_none for a target-only round. The best drafter drafts when its rate exceeds `threshold` times the
target-only rate (threshold 1: the pure objective; above 1 a drafter must win by a margin), else the round is
target-only.

Free drafters (the suffix drafter) propose before the route, so every rule also hears their offers: the number of
drafts a free drafter's tree expects to be accepted, and the nodes it verifies. The entropy and v1 rules take the best
offer when it expects at least `offer_threshold` accepted drafts; the throughput rule weighs an offer as one more
option, at the cost of a target-only round plus its verified rows (round_seconds[VERIFY_ROW] a row).
"""
from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import torch
from torch import nn

from whiflash_trt.config import DFLASH, EAGLE3

DEFAULT_ENTROPY_THRESHOLD = 1.0
DEFAULT_OFFER_THRESHOLD = 0.5           # accepted drafts a free drafter's offer must expect (entropy and v1 rules)
NO_OFFERS: Mapping[str, "Offer"] = MappingProxyType({})
VERIFY_ROW = "verify_row"               # round_seconds' key of the seconds one more verified row adds to a round
NO_DRAFT = "none"                       # a target-only round (the engine runs one for any name it has no drafter of)
DRAFTERS = (EAGLE3, DFLASH)             # the throughput router's output order
_SQRT_HALF = math.sqrt(0.5)


@dataclass(frozen=True)
class RouteSignal:
    """What the last round left behind at the bonus position."""
    entropy: float           # nats, of softmax(logits) at temperature 1
    hidden: torch.Tensor     # [H] target final-norm hidden state of the last accepted position
    margin: float = 0.0      # top-1 minus top-2 probability of the same distribution
    drafter: str | None = None   # who drafted the round that left it: EAGLE3, DFLASH, NO_DRAFT; None after prefill
    accepted: int = 0        # that round's accepted drafts


@dataclass(frozen=True)
class Offer:
    """A free drafter's proposal as a router weighs it."""
    expected: float          # accepted drafts its tree expects
    nodes: int               # nodes it verifies, root included


def best_offer(offers: Mapping[str, Offer], threshold: float) -> str | None:
    """The offer expecting the most accepted drafts, if that is at least `threshold`."""
    best = max(offers, key=lambda n: offers[n].expected, default=None)
    return best if best is not None and offers[best].expected >= threshold else None


def entropy_and_margin(logits: torch.Tensor) -> tuple[float, float]:
    """Entropy (nats) and top-1 minus top-2 probability of softmax(logits [vocab]), from one exp pass:
    H = log S + m - sum_i e_i z_i / S with e = exp(z - max z), S = sum e. A route runs this every round, so no
    topk (over 49152 entries it alone took ~100 us, more than 1% of an ar round): the runner-up is the max once the
    top entry is zeroed."""
    z = logits.float()
    top, i = z.max(0)
    e = (z - top).exp_()
    total = e.sum()
    entropy = total.log() + top - torch.dot(e, z) / total
    if z.numel() < 2:
        return float(entropy), 1.0
    e[i] = 0.0
    return float(entropy), float((1.0 - e.max()) / total)


def entropy_of(logits: torch.Tensor) -> float:
    return entropy_and_margin(logits)[0]


def route_signal(logits: torch.Tensor, hidden: torch.Tensor, drafter: str | None = None,
                 accepted: int = 0) -> RouteSignal:
    """The signal of a bonus position from its logits [vocab]."""
    entropy, margin = entropy_and_margin(logits)
    return RouteSignal(entropy, hidden, margin, drafter, accepted)


class Router(Protocol):
    """One per request: choose names the drafter of the next round (NO_DRAFT: none) from the last round's signal
    and the free drafters' offers."""
    threshold: float

    def choose(self, signal: RouteSignal, offers: Mapping[str, Offer] = NO_OFFERS) -> str: ...


class EntropyRouter(Router):
    def __init__(self, threshold: float = DEFAULT_ENTROPY_THRESHOLD, alpha: float = 0.5,
                 none_threshold: float = math.inf, offer_threshold: float = DEFAULT_OFFER_THRESHOLD) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"entropy smoothing alpha must be in (0, 1], got {alpha}")
        self.threshold, self.alpha, self.none_threshold = threshold, alpha, none_threshold
        self.offer_threshold = offer_threshold
        self.smoothed: float | None = None

    def reset(self) -> None:
        self.smoothed = None

    def choose(self, signal: RouteSignal, offers: Mapping[str, Offer] = NO_OFFERS) -> str:
        e = signal.entropy
        self.smoothed = e if self.smoothed is None else self.alpha * e + (1 - self.alpha) * self.smoothed
        offer = best_offer(offers, self.offer_threshold)
        if offer is not None:
            return offer
        if self.smoothed >= self.none_threshold:
            return NO_DRAFT
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
    def __init__(self, mlp: RouterMLP, threshold: float, offer_threshold: float = DEFAULT_OFFER_THRESHOLD) -> None:
        self.mlp, self.threshold, self.offer_threshold = mlp, threshold, offer_threshold

    def predict(self, hidden: torch.Tensor) -> float:
        with torch.inference_mode():
            return float(self.mlp(hidden.float()))

    def choose(self, signal: RouteSignal, offers: Mapping[str, Offer] = NO_OFFERS) -> str:
        offer = best_offer(offers, self.offer_threshold)
        if offer is not None:
            return offer
        return DFLASH if self.predict(signal.hidden) > self.threshold else EAGLE3


# ----- throughput router (v2) -----------------------------------------------------------------------------------
FEATURES = ("entropy", "margin", "ema_entropy", "ema_eagle3", "ema_dflash", "prev_none", "prev_eagle3", "prev_dflash",
            "prev_accepted")


class RouterHistory:
    """The free per-request state behind the throughput router's features. Each drafter's EMA (weight `alpha` on
    the newest round) of its own accepted drafts starts at its prior (the training mean) and is updated when that
    drafter drafts; every round it does not draft it relaxes toward the prior by `relax`, so a drafter that stopped
    paying is retried once its bad streak is old. The target's entropy at the bonus position is smoothed with the
    same `alpha` over every round (a slow, category-like signal next to the round's own). The trainer's walks use
    this same class."""

    def __init__(self, priors: dict[str, float], alpha: float = 0.5, relax: float = 0.0) -> None:
        if not 0 < alpha <= 1 or not 0 <= relax <= 1:
            raise ValueError(f"history needs alpha in (0, 1] and relax in [0, 1], got {alpha}, {relax}")
        self.priors, self.alpha, self.relax = dict(priors), alpha, relax
        self.ema = dict(priors)
        self.prev: str | None = None
        self.prev_accepted = 0
        self.ema_entropy: float | None = None

    def update(self, drafter: str | None, accepted: int) -> None:
        """Record the round that just ended (None: prefill, nothing drafted)."""
        for d in DRAFTERS:
            if d == drafter:
                self.ema[d] = self.alpha * accepted + (1 - self.alpha) * self.ema[d]
            else:
                self.ema[d] += self.relax * (self.priors[d] - self.ema[d])
        self.prev, self.prev_accepted = drafter, accepted

    def features(self, entropy: float, margin: float) -> list[float]:
        """In FEATURES order; call once per round (it advances the entropy EMA)."""
        self.ema_entropy = entropy if self.ema_entropy is None else \
            self.alpha * entropy + (1 - self.alpha) * self.ema_entropy
        return [entropy, margin, self.ema_entropy, self.ema[EAGLE3], self.ema[DFLASH], float(self.prev == NO_DRAFT),
                float(self.prev == EAGLE3), float(self.prev == DFLASH), float(self.prev_accepted)]


class AcceptancePredictor(nn.Module):
    """[..., len(FEATURES)] -> [..., 2]: expected accepted drafts of (EAGLE-3, DFlash) this round. Inputs are
    standardised by the stored training mean/std; fc1 -> GELU -> fc2 (a few hundred parameters)."""

    def __init__(self, width: int, num_features: int = len(FEATURES)) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(num_features))
        self.register_buffer("std", torch.ones(num_features))
        self.fc1 = nn.Linear(num_features, width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(width, len(DRAFTERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1((x - self.mean) / self.std)))


class FrozenPredictor:
    """An AcceptancePredictor's forward over plain Python floats, its weights copied once: a route runs it every
    round, and torch's dispatch of its few small ops costs several times this whole forward. Same arithmetic
    (standardise, fc1, exact GELU, fc2) in double precision, the standardisation folded into fc1
    (w / std, b - w . mean / std) and the dot products as sum(map(mul, ...)), the fewest Python operations per call.
    Timings: docs/measurements.md, "Router"."""

    def __init__(self, model: AcceptancePredictor) -> None:
        mean, std = model.mean.tolist(), model.std.tolist()
        w1, b1 = model.fc1.weight.tolist(), model.fc1.bias.tolist()
        self.w1 = [[w / s for w, s in zip(row, std)] for row in w1]
        self.b1 = [b - sum(w * m / s for w, m, s in zip(row, mean, std)) for row, b in zip(w1, b1)]
        self.w2, self.b2 = model.fc2.weight.tolist(), model.fc2.bias.tolist()

    def __call__(self, x: list[float]) -> list[float]:
        a = [b + sum(map(operator.mul, row, x)) for row, b in zip(self.w1, self.b1)]
        h = [0.5 * v * (1.0 + math.erf(v * _SQRT_HALF)) for v in a]
        return [b + sum(map(operator.mul, row, h)) for row, b in zip(self.w2, self.b2)]


def best_option(expected: dict[str, float], round_seconds: Mapping[str, float], threshold: float,
                offers: Mapping[str, Offer] = NO_OFFERS) -> str:
    """The throughput rule: `expected[d]` = E[accepted drafts of d]; the drafter with the highest expected tokens
    per second drafts if that beats `threshold` times a target-only round's rate, else NO_DRAFT. An offer's round
    costs a target-only round plus its verified rows."""
    rate = {d: (max(a, 0.0) + 1) / round_seconds[d] for d, a in expected.items()}
    row = round_seconds.get(VERIFY_ROW, 0.0)
    rate |= {n: (o.expected + 1) / (round_seconds[NO_DRAFT] + row * (o.nodes - 1)) for n, o in offers.items()}
    best = max(rate, key=rate.get)
    return best if rate[best] > threshold / round_seconds[NO_DRAFT] else NO_DRAFT


class ThroughputRouter(Router):
    """`round_seconds` is read at every choice, not copied: the engine's LiveRoundSeconds stay current."""

    def __init__(self, predictor: AcceptancePredictor, round_seconds: Mapping[str, float], threshold: float,
                 priors: dict[str, float], alpha: float = 0.5, relax: float = 0.0) -> None:
        missing = [d for d in (NO_DRAFT, *DRAFTERS) if not round_seconds.get(d, 0) > 0]
        if missing:
            raise ValueError(f"throughput router needs a positive round cost for {missing}, got {round_seconds}")
        self.predictor, self.round_seconds, self.threshold = predictor, round_seconds, threshold
        self.predict = FrozenPredictor(predictor)   # the predictor's weights as they are now
        self.history = RouterHistory(priors, alpha, relax)

    def expected(self, signal: RouteSignal) -> dict[str, float]:
        return dict(zip(DRAFTERS, self.predict(self.history.features(signal.entropy, signal.margin))))

    def choose(self, signal: RouteSignal, offers: Mapping[str, Offer] = NO_OFFERS) -> str:
        self.history.update(signal.drafter, signal.accepted)
        return best_option(self.expected(signal), self.round_seconds, self.threshold, offers)
