"""Loading target weights: Hugging Face folders (config.json + sharded safetensors), validation, instantiation."""
from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from whiflash_trt.config import ModelConfig
from whiflash_trt.errors import CheckpointError
from whiflash_trt.models.layers import RotaryTable
from whiflash_trt.models.target import TargetModel, dense_replaced


@dataclass
class Checkpoint:
    """A target's config and weights under our module names (no "model." prefix), plus where they came from;
    `native`: a GGUF's linears in their own quantized blocks (kernels.ggml_blocks), by the same names, for a native
    engine (the state dict holds them dequantised too)."""
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    source: str
    native: dict[str, torch.Tensor] = field(default_factory=dict)


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"missing {path.name} in {path.parent}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def load_safetensors_dir(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a folder: model.safetensors, or the shards named by model.safetensors.index.json."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(read_json(index).get("weight_map", {}).values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {folder} (PyTorch .bin checkpoints are not supported)")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"weight shard {name} listed in the index is missing from {folder}")
        try:
            tensors.update(load_file(str(path)))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {path}: {e} (file corrupt or truncated?)") from None
    return tensors


def load_hf_checkpoint(folder: str | Path) -> Checkpoint:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    try:
        config = ModelConfig.from_hf(read_json(folder / "config.json"))
    except ValueError as e:
        raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
    raw = load_safetensors_dir(folder)
    state = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in raw.items()}
    return Checkpoint(config=config, state_dict=state, source=str(folder.resolve()))


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = TargetModel(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def validate_state_dict(cfg: ModelConfig, state: dict[str, torch.Tensor], source: str,
                        optional: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """Check names and shapes against the config; returns the dict without keys the model recomputes or ties.
    Names in `optional` may be missing (the dense linears a native target runs as blocks)."""
    expected = {k: v for k, v in expected_shapes(cfg).items() if k not in optional or k in state}
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensors (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensors (e.g. {', '.join(unexpected[:3])})")
        raise CheckpointError(f"weights in {source} do not match their config: " + "; ".join(parts))
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise CheckpointError(f"weights in {source} do not match their config: {name} has shape "
                                  f"{list(state[name].shape)}, the config implies {list(shape)}")
    return state


def instantiate_target(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device | str = "cpu",
                       use_kernels: bool = True, packed: dict[str, torch.Tensor] | None = None) -> TargetModel:
    """Build the model without a random init and load the (validated) weights in the given dtype; its linears and
    attention on the engine's kernels where loaded, unless `use_kernels` is False (graphs for other runtimes).
    `packed`: native blocks (target.pack_native's) the linears run over in place of their dense weights, where the
    caller has found that they run here (runtime.loading.native_weights; the builder, after kernels.load); the
    state dict may then lack the dense linears they replace (target.dense_replaced), which stay meta tensors."""
    replaced = dense_replaced(ckpt.config, packed) if packed else set()
    state = validate_state_dict(ckpt.config, ckpt.state_dict, ckpt.source, replaced)
    with torch.device("meta"):
        model = TargetModel(ckpt.config).to(dtype)   # a replaced linear's weight stays this meta tensor
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, strict=False, assign=True)
    if ckpt.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    cfg = ckpt.config
    model.rotary = RotaryTable(cfg.head_dim, cfg.max_position_embeddings, cfg.rope).to(device)
    model.requires_grad_(False).eval()
    model.fuse_projections(use_kernels, packed)
    return model
