"""Tiny random target + drafters with matching shapes, built into a real engine directory (CPU, fp32).

The target (8 layers, so the drafters' default feature layers are distinct) has larger-than-usual weights so its
next-token entropy varies between ~0 and ~3 nats and the routers switch at thresholds in that range."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tiny_models import make_tokenizer
from whiflash_trt.builder.build import BuildOptions, build_engine
from whiflash_trt.config import ModelConfig, RopeConfig
from whiflash_trt.models.dflash import DFlashConfig, DFlashDrafter
from whiflash_trt.models.drafter_checkpoints import save_dflash, save_eagle3
from whiflash_trt.models.eagle3 import Eagle3Config, Eagle3Drafter
from whiflash_trt.spec.router import RouterMLP
from whiflash_trt.spec.router_file import save_router

def make_target(folder: Path, seed: int = 0, num_layers: int = 8, max_positions: int = 512) -> ModelConfig:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer()
    tok.save_pretrained(str(folder), save_jinja_files=False)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      eos_token_id=tok.eos_token_id, bos_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the default init: peaked, varied next-token distributions
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.6 if name == "lm_head.weight" else 0.15)
    model.save_pretrained(str(folder))
    return ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))


def make_eagle3(target: ModelConfig, seed: int = 1, std: float = 0.3) -> Eagle3Drafter:
    torch.manual_seed(seed)
    v, h = target.vocab_size, target.hidden_size
    n = target.num_layers
    drafter = Eagle3Drafter(Eagle3Config(hidden_size=h, intermediate_size=2 * h, num_heads=4, num_kv_heads=2,
                                         head_dim=h // 4, rms_norm_eps=1e-6, vocab_size=v, draft_vocab_size=v // 2,
                                         target_hidden_size=h, max_position_embeddings=target.max_position_embeddings,
                                         rope=RopeConfig(), aux_layer_ids=(2, n // 2, n - 3)))
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=std)
    # Draft vocabulary: every other target id (d -> 2d), a real non-trivial d2t offset table.
    drafter.d2t.copy_(torch.arange(v // 2))
    drafter.t2d.zero_()
    drafter.t2d[torch.arange(v // 2) * 2] = True
    return drafter


def make_dflash(target: ModelConfig, seed: int = 2, block_size: int = 6, std: float = 0.3) -> DFlashDrafter:
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


def make_engine(root: Path, seed: int = 0) -> Path:
    """Target, both drafters and a router, built by the real builder into root/engine."""
    src = root / "target"
    cfg = make_target(src, seed=seed)
    save_eagle3(make_eagle3(cfg), root / "eagle3", dtype=torch.float32)
    save_dflash(make_dflash(cfg), root / "dflash", cfg.num_layers, dtype=torch.float32)
    torch.manual_seed(seed + 3)
    save_router(RouterMLP(cfg.hidden_size, 16), root / "router.safetensors", threshold=0.0, entropy_threshold=3.0)
    return build_engine(BuildOptions(target=str(src), output=root / "engine", dtype="fp32", show_progress=False,
                                     ar_drafter=root / "eagle3", dllm_drafter=root / "dflash",
                                     router=root / "router.safetensors"))


@pytest.fixture(scope="session")
def spec_engine_dir(tmp_path_factory) -> Path:
    return make_engine(tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="session")
def spec_engine(spec_engine_dir):
    from whiflash_trt.runtime.engine import Engine

    return Engine.load(spec_engine_dir)
