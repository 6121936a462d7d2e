"""Public checkpoint formats of both drafters (Hugging Face folders: config.json + model.safetensors), validated
against the target they will serve. Loading is a name map; saving writes the same layout back."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from whiflash_trt.config import ModelConfig, RopeConfig
from whiflash_trt.errors import CheckpointError
from whiflash_trt.models.checkpoints import load_safetensors_dir, read_json
from whiflash_trt.models.dflash import DFlashConfig, DFlashDrafter, default_target_layer_ids
from whiflash_trt.models.eagle3 import Eagle3Config, Eagle3Drafter


def _folder(path: str | Path) -> Path:
    path = Path(path)
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if not path.is_dir():
        raise CheckpointError(f"drafter checkpoint {path} does not exist (expected a folder with config.json and "
                              f"model.safetensors)")
    return path


def _require(cfg: dict, keys: list[str], where: Path) -> None:
    missing = [k for k in keys if k not in cfg]
    if missing:
        raise CheckpointError(f"{where / 'config.json'} is missing {', '.join(missing)}")


def _check(cond: bool, where: Path, message: str) -> None:
    if not cond:
        raise CheckpointError(f"drafter {where} does not fit the target: {message}")


def _load_state(module: torch.nn.Module, state: dict[str, torch.Tensor], where: Path, optional=()) -> None:
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    missing = sorted(k for k in set(expected) - set(state) if k not in optional)
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"drafter weights in {where} do not match the public layout: "
                              f"missing {missing[:4]}, unexpected {unexpected[:4]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(f"drafter weights in {where}: {name} has shape {list(tensor.shape)}, "
                                  f"the config implies {list(expected[name])}")
    module.load_state_dict(state, strict=False)


# ----- EAGLE-3 --------------------------------------------------------------------------------------------------
def eagle3_config(raw: dict, target: ModelConfig, where: Path) -> Eagle3Config:
    _require(raw, ["hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"], where)
    heads = int(raw["num_attention_heads"])
    aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    n = target.num_layers
    aux_ids = tuple(int(i) for i in aux) if aux else (2, n // 2, n - 3)
    # The drafter's own rope: never the target's (public LLaMA-3.1 EAGLE-3 config has no rope_theta -> 10000).
    rope = RopeConfig.from_hf({k: v for k, v in raw.items() if k in ("rope_theta", "rope_scaling", "rope_parameters")})
    cfg = Eagle3Config(
        hidden_size=int(raw["hidden_size"]), intermediate_size=int(raw["intermediate_size"]), num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), vocab_size=int(raw["vocab_size"]),
        draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
        target_hidden_size=int(raw.get("target_hidden_size") or raw["hidden_size"]),
        max_position_embeddings=max(int(raw.get("max_position_embeddings", 0)), target.max_position_embeddings),
        rope=rope, aux_layer_ids=aux_ids)
    _check(cfg.target_hidden_size == target.hidden_size, where,
           f"target_hidden_size {cfg.target_hidden_size} != target hidden size {target.hidden_size}")
    _check(cfg.hidden_size == target.hidden_size, where,
           f"hidden_size {cfg.hidden_size} != target hidden size {target.hidden_size} "
           f"(it embeds with the target's table)")
    _check(cfg.vocab_size == target.vocab_size, where,
           f"vocab_size {cfg.vocab_size} != target vocabulary {target.vocab_size}")
    _check(all(1 <= i <= n for i in aux_ids), where, f"aux layer ids {aux_ids} outside the target's {n} layers")
    return cfg


def _read_config(path: str | Path, parse, target: ModelConfig):
    """(folder, parsed config); a config that fails its own validation is reported against its file."""
    where = _folder(path)
    try:
        return where, parse(read_json(where / "config.json"), target, where)
    except ValueError as e:
        raise CheckpointError(f"{where / 'config.json'}: {e}") from None


def load_eagle3(path: str | Path, target: ModelConfig) -> Eagle3Drafter:
    where, cfg = _read_config(path, eagle3_config, target)
    raw = load_safetensors_dir(where)
    state = {}
    for k, v in raw.items():
        k = k.removeprefix("model.")
        state["midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k] = v
    state.pop("embed_tokens.weight", None)  # some exports carry the target's embedding: we use the target's own
    if "d2t" not in state and cfg.draft_vocab_size == cfg.vocab_size:
        state["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    drafter = Eagle3Drafter(cfg)
    _load_state(drafter, state, where)
    ids = torch.arange(cfg.draft_vocab_size) + drafter.d2t
    _check(bool(((ids >= 0) & (ids < cfg.vocab_size)).all()), where, "d2t maps draft ids outside the vocabulary")
    return drafter.eval().requires_grad_(False)


def save_eagle3(drafter: Eagle3Drafter, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = drafter.config
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.target_hidden_size,
        "max_position_embeddings": c.max_position_embeddings, "rope_theta": c.rope.theta, "hidden_act": "silu",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids)},
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: (v if k in ("d2t", "t2d") else v.to(dtype)).contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))


# ----- DFlash ---------------------------------------------------------------------------------------------------
def dflash_config(raw: dict, target: ModelConfig, where: Path) -> DFlashConfig:
    _require(raw, ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "block_size"],
             where)
    dcfg = raw.get("dflash_config") or {}
    if "mask_token_id" not in dcfg:
        raise CheckpointError(f"{where / 'config.json'} has no dflash_config.mask_token_id")
    heads, layers = int(raw["num_attention_heads"]), int(raw["num_hidden_layers"])
    num_target_layers = int(raw.get("num_target_layers") or target.num_layers)
    _check(num_target_layers == target.num_layers, where,
           f"trained for a {num_target_layers}-layer target, this target has {target.num_layers}")
    ids = dcfg.get("target_layer_ids") or default_target_layer_ids(num_target_layers, layers)
    cfg = DFlashConfig(
        hidden_size=int(raw["hidden_size"]), intermediate_size=int(raw["intermediate_size"]), num_layers=layers,
        num_heads=heads, num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), vocab_size=int(raw.get("vocab_size", target.vocab_size)),
        max_position_embeddings=max(int(raw.get("max_position_embeddings", 0)), target.max_position_embeddings),
        rope=RopeConfig.from_hf(raw), draft_block_len=int(raw["block_size"]),
        mask_token_id=int(dcfg["mask_token_id"]),
        target_layer_ids=tuple(int(i) for i in ids), attention_bias=bool(raw.get("attention_bias", False)),
        draft_vocab_size=int(raw["draft_vocab_size"]) if raw.get("draft_vocab_size") else None)
    _check(cfg.hidden_size == target.hidden_size, where,
           f"hidden_size {cfg.hidden_size} != target hidden size {target.hidden_size} (it uses the target's "
           f"embedding and lm_head)")
    _check(all(0 <= i < target.num_layers for i in cfg.target_layer_ids), where,
           f"target_layer_ids {cfg.target_layer_ids} outside the target's {target.num_layers} layers")
    _check(not cfg.attention_bias, where, "attention_bias drafters are not supported by KV-only prefill")
    return cfg


def load_dflash(path: str | Path, target: ModelConfig) -> DFlashDrafter:
    where, cfg = _read_config(path, dflash_config, target)
    state = {k.removeprefix("model."): v for k, v in load_safetensors_dir(where).items()}
    carries = cfg.mask_token_id >= target.vocab_size
    if carries and "mask_embedding" not in state:
        raise CheckpointError(
            f"drafter {where}: mask_token_id {cfg.mask_token_id} has no row in the target's embedding table "
            f"({target.vocab_size} rows) and the checkpoint carries no 'mask_embedding' tensor to stand for it")
    if not carries:
        state.pop("mask_embedding", None)
    drafter = DFlashDrafter(cfg, target.hidden_size, carries_mask_embedding=carries)
    _load_state(drafter, state, where)
    ids = drafter.draft_vocab()
    if ids is not None:
        inside = bool(((ids >= 0) & (ids < cfg.vocab_size)).all())
        _check(inside, where, "d2t maps draft ids outside the vocabulary")
        _check(bool(drafter.t2d[ids].all()) and int(drafter.t2d.sum()) == len(ids), where,
               "t2d does not mark exactly the ids d2t maps to")
    return drafter.eval().requires_grad_(False)


def save_dflash(drafter: DFlashDrafter, folder: str | Path, num_target_layers: int,
                dtype: torch.dtype = torch.bfloat16, draft_vocab: torch.Tensor | None = None) -> None:
    """The public layout, plus `draft_vocab_size` with d2t/t2d (EAGLE-3's convention) where the drafts are drawn
    from a subset of the vocabulary: `draft_vocab` (target ids; default: the drafter's own, if any). A loader
    without them reads the rest as a full-vocabulary drafter."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = drafter.config
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "num_hidden_layers": c.num_layers,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": c.rope.theta, "hidden_act": "silu", "attention_bias": False, "block_size": c.draft_block_len,
        "num_target_layers": num_target_layers,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)},
    }
    state = {k: v.to(dtype).contiguous() for k, v in drafter.state_dict().items() if k not in ("d2t", "t2d")}
    ids = drafter.draft_vocab() if draft_vocab is None else torch.as_tensor(draft_vocab, dtype=torch.long).sort().values
    if ids is not None:
        if ids.numel() == 0 or bool((ids[1:] == ids[:-1]).any()) or ids[0] < 0 or ids[-1] >= c.vocab_size:
            raise ValueError("a draft vocabulary is unique target ids inside the vocabulary")
        config["draft_vocab_size"] = ids.numel()
        state["d2t"] = (ids - torch.arange(ids.numel())).contiguous()
        state["t2d"] = torch.zeros(c.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, str(folder / "model.safetensors"))
