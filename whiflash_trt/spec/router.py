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
from pathlib import Path

import torch
from torch import nn

from whiflash_trt.errors import CheckpointError

AR_DRAFTER = "eagle3"     # names in the engine's drafter registry
BLOCK_DRAFTER = "dflash"
DEFAULT_ENTROPY_THRESHOLD = 1.0
DEFAULT_NEURAL_THRESHOLD = 0.0


@dataclass(frozen=True)
class RouteSignal:
    """What the last verify left behind at the bonus position."""
    entropy: float           # nats, of softmax(logits) at temperature 1
    hidden: torch.Tensor     # [H] target final-norm hidden state of the last accepted position


def entropy_of(logits: torch.Tensor) -> float:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return float(-(logp.exp() * logp).sum())


class EntropyRouter:
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
        return BLOCK_DRAFTER if self.smoothed < self.threshold else AR_DRAFTER


class RouterMLP(nn.Module):
    def __init__(self, hidden_size: int, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(width, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [...] predicted acceptance-length gain of DFlash over EAGLE-3."""
        return self.fc2(self.act(self.fc1(hidden))).squeeze(-1)


class NeuralRouter:
    def __init__(self, mlp: RouterMLP, threshold: float) -> None:
        self.mlp, self.threshold = mlp, threshold

    def reset(self) -> None:
        pass

    def predict(self, hidden: torch.Tensor) -> float:
        with torch.inference_mode():
            return float(self.mlp(hidden.float()))

    def choose(self, signal: RouteSignal) -> str:
        return BLOCK_DRAFTER if self.predict(signal.hidden) > self.threshold else AR_DRAFTER


def save_router(mlp: RouterMLP, path: str | Path, threshold: float, entropy_threshold: float | None = None) -> None:
    from safetensors.torch import save_file

    meta = {"format": "whiflash-router-v1", "threshold": repr(float(threshold)),
            "hidden_size": str(mlp.fc1.in_features), "width": str(mlp.fc1.out_features)}
    if entropy_threshold is not None:
        meta["entropy_threshold"] = repr(float(entropy_threshold))
    save_file({k: v.float().contiguous() for k, v in mlp.state_dict().items()}, str(path), metadata=meta)


@dataclass(frozen=True)
class RouterFile:
    mlp: RouterMLP
    threshold: float
    entropy_threshold: float | None


def load_router(path: str | Path, hidden_size: int) -> RouterFile:
    """Weights file (safetensors: fc1.{weight,bias}, fc2.{weight,bias}; metadata: threshold)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if path.is_dir():
        path = path / "router.safetensors"
    if not path.is_file():
        raise CheckpointError(f"router weights {path} do not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read router weights {path}: {e}") from None
    if set(state) != {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}:
        raise CheckpointError(f"router weights {path}: expected fc1/fc2 weight and bias, found {sorted(state)}")
    width, in_features = state["fc1.weight"].shape
    if in_features != hidden_size:
        raise CheckpointError(f"router {path} takes hidden size {in_features}, the target's is {hidden_size}")
    if tuple(state["fc2.weight"].shape) != (1, width):
        raise CheckpointError(f"router {path}: fc2.weight must be [1, {width}], is {list(state['fc2.weight'].shape)}")
    mlp = RouterMLP(hidden_size, width)
    mlp.load_state_dict(state)
    ent = meta.get("entropy_threshold")
    return RouterFile(mlp.eval(), float(meta.get("threshold", DEFAULT_NEURAL_THRESHOLD)),
                      None if ent is None else float(ent))
