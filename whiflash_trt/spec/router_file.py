"""The neural router's weights file: safetensors fc1/fc2 weight and bias, metadata with the calibrated thresholds."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from whiflash_trt.errors import CheckpointError
from whiflash_trt.spec.router import RouterMLP

DEFAULT_NEURAL_THRESHOLD = 0.0


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
