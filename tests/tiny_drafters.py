"""Random EAGLE-3 and DFlash drafters and neural routers shaped for a tiny target, and the one engine builder.

Not tests: the builders behind conftest.py's engine fixtures. `save_drafters` writes the drafters (and a router) for
a target checkpoint in their public formats; `build_tiny_engine` is `whiflash-build --dtype fp32`, in process.

    engine = build_tiny_engine(target, tmp_path / "engine", **save_drafters(tmp_path, target))
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from whiflash_trt.builder.build import BuildOptions, build_engine
from whiflash_trt.config import ModelConfig, RopeConfig
from whiflash_trt.models.dflash import DFlashConfig, DFlashDrafter
from whiflash_trt.models.drafter_checkpoints import save_dflash, save_eagle3
from whiflash_trt.models.eagle3 import Eagle3Config, Eagle3Drafter
from whiflash_trt.spec.router import RouterMLP
from whiflash_trt.spec.router_file import save_router


def make_eagle3(target: ModelConfig, seed: int = 1, std: float = 0.3) -> Eagle3Drafter:
    """Feature layers (2, n/2, n-3); draft vocabulary: every other target id (d -> 2d)."""
    torch.manual_seed(seed)
    v, h = target.vocab_size, target.hidden_size
    n = target.num_layers
    drafter = Eagle3Drafter(Eagle3Config(hidden_size=h, intermediate_size=2 * h, num_heads=4, num_kv_heads=2,
                                         head_dim=h // 4, rms_norm_eps=1e-6, vocab_size=v, draft_vocab_size=v // 2,
                                         target_hidden_size=h, max_position_embeddings=target.max_position_embeddings,
                                         rope=RopeConfig(), aux_layer_ids=(2, n // 2, n - 3)))
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=std)
    # a real non-trivial d2t offset table
    drafter.d2t.copy_(torch.arange(v // 2))
    drafter.t2d.zero_()
    drafter.t2d[torch.arange(v // 2) * 2] = True
    return drafter


def make_dflash(target: ModelConfig, seed: int = 2, block_size: int = 6, std: float = 0.3) -> DFlashDrafter:
    """Two layers, target layers (1, n-3), a mask token past the target's vocabulary."""
    torch.manual_seed(seed)
    h = target.hidden_size
    cfg = DFlashConfig(hidden_size=h, intermediate_size=2 * h, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=h // 4, rms_norm_eps=1e-6, vocab_size=target.vocab_size,
                       max_position_embeddings=target.max_position_embeddings, rope=RopeConfig(theta=50000.0),
                       draft_block_len=block_size, mask_token_id=target.vocab_size,
                       target_layer_ids=(1, target.num_layers - 3))
    drafter = DFlashDrafter(cfg, h, carries_mask_embedding=True)
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=std)
    return drafter


def make_router(hidden: int, seed: int = 3, width: int = 16) -> RouterMLP:
    torch.manual_seed(seed)
    return RouterMLP(hidden, width)


def read_config(target: Path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((Path(target) / "config.json").read_text()))


def save_drafters(folder: Path, target: Path, router: bool = True) -> dict[str, Path]:
    """make_eagle3, make_dflash and (with `router`) make_router for the checkpoint at `target`, saved under `folder`
    (router thresholds: prediction 0, entropy 3 nats) -> the BuildOptions keywords that build them in."""
    cfg = read_config(target)
    save_eagle3(make_eagle3(cfg), folder / "eagle3", dtype=torch.float32)
    save_dflash(make_dflash(cfg), folder / "dflash", cfg.num_layers, dtype=torch.float32)
    drafters = {"ar_drafter": folder / "eagle3", "dllm_drafter": folder / "dflash"}
    if router:
        drafters["router"] = folder / "router.safetensors"
        save_router(make_router(cfg.hidden_size), drafters["router"], threshold=0.0, entropy_threshold=3.0)
    return drafters


def save_straddling_router(path: Path, target: Path, text: str) -> Path:
    """A random router shifted so that its prediction straddles 0 on the target's own hidden states over `text`: with
    the default threshold 0 it then routes to both drafters within one sequence. Its entropy threshold sits just under
    log(vocab), where a near-uniform random target's entropy is."""
    import math

    from transformers import AutoTokenizer, LlamaForCausalLM

    router = make_router(read_config(target).hidden_size, seed=2, width=32)
    model = LlamaForCausalLM.from_pretrained(str(target))
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :1024]
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[-1][0]   # [T, H] after the final norm
        router.fc2.weight *= 100   # token-to-token variation well above the slow drift along a sequence
        router.fc2.bias -= router(hidden).median()
    save_router(router, path, threshold=0.0, entropy_threshold=math.log(len(tokenizer)) - 0.01)
    return path


def build_tiny_engine(target: Path, output: Path, backend: str = "torch", **drafters) -> Path:
    """`whiflash-build --target TARGET --output OUTPUT --dtype fp32 --backend BACKEND [drafters]`, in process."""
    return build_engine(BuildOptions(target=str(target), output=Path(output), dtype="fp32", backend=backend,
                                     show_progress=False, **drafters))
