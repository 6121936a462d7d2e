"""The router weights file: safetensors tensors + string metadata, versioned by metadata "format".

v1 ("whiflash-router-v1", or no "format" key): the hidden-state router. Tensors fc1.{weight,bias} [W, H], [W] and
fc2.{weight,bias} [1, W], [1] (RouterMLP); metadata threshold (dAL above it -> DFlash), hidden_size, width, optional
entropy_threshold. Still loads and routes as before (NeuralRouter).

v2 ("whiflash-router-v2"): the throughput router (spec.router.ThroughputRouter). Tensors mean, std [F] (feature
standardisation), fc1.{weight,bias} [W, F], [W], fc2.{weight,bias} [2, W], [2] (AcceptancePredictor; outputs
EAGLE-3, DFlash). Metadata:
    features          comma-separated feature names; must equal spec.router.FEATURES (else a clear error)
    threshold         a drafter must beat the target-only rate by this factor
    alpha, relax      RouterHistory's EMA weight and relaxation toward the priors
    priors            JSON {drafter: mean accepted drafts in the training states} (the EMAs' start)
    round_seconds     JSON {none, eagle3, dflash: seconds per round} measured where the router was trained; the
                      engine measures its own at load (runtime.round_costs) and uses these only if told to
    entropy_threshold, entropy_none_threshold   the calibrated three-way entropy rule (optional)
    trees             JSON {eagle3: {top_k, depth, total_tokens, min_prob}, dflash: {total_tokens, top_k, min_prob}}:
                      the draft trees the training states were measured with (optional; files before it have none;
                      files before the probability floor have no min_prob: 0). The predicted
                      accepted drafts hold for these shapes only: the engine warns when a request drafts others.
Any other "format" is refused with an error naming it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from whiflash_trt.errors import CheckpointError
from whiflash_trt.spec.router import FEATURES, AcceptancePredictor, RouterMLP

DEFAULT_NEURAL_THRESHOLD = 0.0
FORMAT_V1, FORMAT_V2 = "whiflash-router-v1", "whiflash-router-v2"


@dataclass(frozen=True)
class RouterFile:
    version: int                               # 1 or 2
    threshold: float
    entropy_threshold: float | None
    mlp: RouterMLP | None = None               # v1
    predictor: AcceptancePredictor | None = None   # v2
    entropy_none_threshold: float = math.inf
    alpha: float = 0.5
    relax: float = 0.0
    priors: dict[str, float] = field(default_factory=dict)
    round_seconds: dict[str, float] = field(default_factory=dict)
    trees: dict[str, dict] = field(default_factory=dict)   # v2: the tree shapes it was fit for ({}: not recorded)


def save_router(mlp: RouterMLP, path: str | Path, threshold: float, entropy_threshold: float | None = None) -> None:
    """A v1 file."""
    meta = {"format": FORMAT_V1, "threshold": repr(float(threshold)),
            "hidden_size": str(mlp.fc1.in_features), "width": str(mlp.fc1.out_features)}
    if entropy_threshold is not None:
        meta["entropy_threshold"] = repr(float(entropy_threshold))
    _save(mlp.state_dict(), path, meta)


def save_throughput_router(predictor: AcceptancePredictor, path: str | Path, threshold: float,
                           priors: dict[str, float], round_seconds: dict[str, float], alpha: float, relax: float,
                           entropy_threshold: float | None = None,
                           entropy_none_threshold: float = math.inf, trees: dict[str, dict] | None = None) -> None:
    """A v2 file."""
    meta = {"format": FORMAT_V2, "features": ",".join(FEATURES), "threshold": repr(float(threshold)),
            "alpha": repr(float(alpha)), "relax": repr(float(relax)), "width": str(predictor.fc1.out_features),
            "priors": json.dumps(priors), "round_seconds": json.dumps(round_seconds),
            "entropy_none_threshold": repr(float(entropy_none_threshold))}
    if trees:
        meta["trees"] = json.dumps(trees, sort_keys=True)
    if entropy_threshold is not None:
        meta["entropy_threshold"] = repr(float(entropy_threshold))
    _save(predictor.state_dict(), path, meta)


def _save(state: dict, path: str | Path, meta: dict[str, str]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.float().contiguous() for k, v in state.items()}, str(path), metadata=meta)


def load_router(path: str | Path, hidden_size: int) -> RouterFile:
    """A v1 or v2 router file (or the folder holding router.safetensors); `hidden_size` checks a v1 file's input."""
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
    fmt = meta.get("format", FORMAT_V1)
    if fmt == FORMAT_V1:
        return _load_v1(path, state, meta, hidden_size)
    if fmt == FORMAT_V2:
        return _load_v2(path, state, meta)
    raise CheckpointError(f"router weights {path} have format {fmt!r}; this whiflash-trt reads {FORMAT_V1} and "
                          f"{FORMAT_V2} (retrain with whiflash-train router, or upgrade whiflash-trt)")


def _optional_float(meta: dict, key: str, default: float | None) -> float | None:
    return default if key not in meta else float(meta[key])


def _load_v1(path: Path, state: dict, meta: dict, hidden_size: int) -> RouterFile:
    if set(state) != {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}:
        raise CheckpointError(f"router weights {path}: expected fc1/fc2 weight and bias, found {sorted(state)}")
    width, in_features = state["fc1.weight"].shape
    if in_features != hidden_size:
        raise CheckpointError(f"router {path} takes hidden size {in_features}, the target's is {hidden_size}")
    if tuple(state["fc2.weight"].shape) != (1, width):
        raise CheckpointError(f"router {path}: fc2.weight must be [1, {width}], is {list(state['fc2.weight'].shape)}")
    mlp = RouterMLP(hidden_size, width)
    mlp.load_state_dict(state)
    return RouterFile(1, float(meta.get("threshold", DEFAULT_NEURAL_THRESHOLD)),
                      _optional_float(meta, "entropy_threshold", None), mlp=mlp.eval())


def _load_v2(path: Path, state: dict, meta: dict) -> RouterFile:
    features = tuple(meta.get("features", "").split(","))
    if features != FEATURES:
        raise CheckpointError(f"router {path} was trained on features {list(features)}; this whiflash-trt computes "
                              f"{list(FEATURES)}: retrain it with whiflash-train router")
    if set(state) != {"mean", "std", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}:
        raise CheckpointError(f"router weights {path}: expected mean, std and fc1/fc2 weight and bias, found "
                              f"{sorted(state)}")
    width = state["fc1.weight"].shape[0]
    predictor = AcceptancePredictor(width)
    try:
        predictor.load_state_dict(state)
        priors, costs = json.loads(meta["priors"]), json.loads(meta["round_seconds"])
        trees = json.loads(meta.get("trees", "{}"))
        if not isinstance(trees, dict):
            raise ValueError(f"trees must be a JSON object, got {meta['trees']!r}")
        return RouterFile(2, float(meta["threshold"]), _optional_float(meta, "entropy_threshold", None),
                          predictor=predictor.eval(),
                          entropy_none_threshold=float(meta.get("entropy_none_threshold", math.inf)),
                          alpha=float(meta["alpha"]), relax=float(meta["relax"]),
                          priors={k: float(v) for k, v in priors.items()},
                          round_seconds={k: float(v) for k, v in costs.items()}, trees=trees)
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(f"router weights {path} (v2) are malformed: {e}") from None
