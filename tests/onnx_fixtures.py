"""Tiny random checkpoints (Llama target, EAGLE-3, DFlash, router) and their torch / onnx engines, made once per
test process (exporting the graphs takes most of a minute on two cores)."""
from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

HIDDEN, LAYERS = 64, 8
EAGLE3_AUX = (2, 4, 5)          # hidden_states indices -> target layers 1, 3, 4
DFLASH_LAYERS = (1, 5)
DFLASH_BLOCK = 6


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.",
              '{"name": "x", "value": 1}'] * 50
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def make_checkpoints(out: Path) -> Path:
    """out/: HF Llama target + tokenizer; out/eagle3, out/dflash (public formats); out/router/router.safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from spec_fixtures import make_dflash, make_eagle3
    from whiflash_trt.config import ModelConfig
    from whiflash_trt.models.drafter_checkpoints import save_dflash, save_eagle3
    from whiflash_trt.spec.router import RouterMLP
    from whiflash_trt.spec.router_file import save_router

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    vocab = len(tokenizer)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, eos_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tokenizer.save_pretrained(out)
    target = ModelConfig.from_hf(cfg.to_dict())
    save_eagle3(make_eagle3(target), out / "eagle3", dtype=torch.float32)      # aux ids (2, 4, 5) = EAGLE3_AUX
    save_dflash(make_dflash(target, block_size=DFLASH_BLOCK), out / "dflash", LAYERS, dtype=torch.float32)
    torch.manual_seed(3)
    router = RouterMLP(HIDDEN, 16)
    (out / "router").mkdir(exist_ok=True)
    save_router(router, out / "router" / "router.safetensors", threshold=0.0, entropy_threshold=3.0)
    return out


@dataclass(frozen=True)
class TinyEngines:
    checkpoints: Path
    torch_engine: Path
    onnx_engine: Path
    export_seconds: float


@functools.cache
def tiny_engines() -> TinyEngines:
    """Build the checkpoints, a torch engine and an onnx engine (fp32, both drafters, router) once per process."""
    import time

    from whiflash_trt.builder.build import BuildOptions, build_engine

    root = Path(tempfile.mkdtemp(prefix="whiflash-onnx-tests-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    ckpt = make_checkpoints(root / "tiny")
    common = dict(target=str(ckpt), dtype="fp32", show_progress=False, ar_drafter=ckpt / "eagle3",
                  dllm_drafter=ckpt / "dflash", router=ckpt / "router")
    torch_engine = build_engine(BuildOptions(output=root / "engine-torch", **common))
    start = time.perf_counter()
    onnx_engine = build_engine(BuildOptions(output=root / "engine-onnx", backend="onnx", **common))
    return TinyEngines(ckpt, torch_engine, onnx_engine, time.perf_counter() - start)


def manifest_json(engine: Path) -> dict:
    return json.loads((engine / "manifest.json").read_text())
