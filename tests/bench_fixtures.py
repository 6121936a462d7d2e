"""A tiny random engine for the benchmark's tests: a Llama target (hidden 64, 8 layers, 4 heads / 2 KV heads) with a
BPE tokenizer and a ChatML chat template, random EAGLE-3 and DFlash drafters, and a random neural router."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VOCAB = 512
HIDDEN = 64
NUM_LAYERS = 8
CONTEXT = 4096


def make_tokenizer(folder: Path):
    """Byte-level BPE trained on the benchmark's own prompt files (so prompts stay a few hundred tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from whiflash_trt.bench.prompts import DATA_DIR

    corpus = [line for f in sorted(DATA_DIR.glob("*.jsonl")) for line in f.read_text().splitlines()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|im_end|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return fast


def make_target(folder: Path, vocab: int, eos_id: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                      eos_token_id=eos_id, bos_token_id=eos_id + 1)
    LlamaForCausalLM(cfg).save_pretrained(str(folder))


def make_drafters(folder: Path, target_dir: Path) -> tuple[Path, Path]:
    from spec_fixtures import make_dflash, make_eagle3
    from whiflash_trt.config import ModelConfig
    from whiflash_trt.models.drafter_checkpoints import save_dflash, save_eagle3

    target = ModelConfig.from_hf(json.loads((target_dir / "config.json").read_text()))
    save_eagle3(make_eagle3(target), folder / "eagle3", dtype=torch.float32)
    save_dflash(make_dflash(target), folder / "dflash", NUM_LAYERS, dtype=torch.float32)
    return folder / "eagle3", folder / "dflash"


def make_router(folder: Path, target_dir: Path, tokenizer) -> Path:
    """A random router shifted so that its prediction straddles 0 on the target's own hidden states: with the
    default threshold 0 it then routes to both drafters within one sequence."""
    from transformers import LlamaForCausalLM

    from whiflash_trt.spec.router import RouterMLP
    from whiflash_trt.spec.router_file import save_router

    from whiflash_trt.bench.prompts import load_prompts

    torch.manual_seed(2)
    router = RouterMLP(HIDDEN, 32)
    target = LlamaForCausalLM.from_pretrained(str(target_dir))
    text = "\n".join(p.prompt for p in load_prompts(None, 1))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :1024]
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states[-1][0]   # [T, H] after the final norm
        router.fc2.weight *= 100   # token-to-token variation well above the slow drift along a sequence
        router.fc2.bias -= router(hidden).median()
    # A near-uniform random target has entropy just under log(vocab): put the entropy threshold there.
    path = folder / "router.safetensors"
    save_router(router, path, threshold=0.0, entropy_threshold=math.log(len(tokenizer)) - 0.01)
    return path


def build_tiny_engine(root: Path) -> Path:
    """-> an fp32 engine directory with both drafters and a router."""
    from whiflash_trt.builder.build import BuildOptions, build_engine

    src = root / "tiny-target"
    src.mkdir(parents=True)
    tok = make_tokenizer(src)
    make_target(src, len(tok), tok.convert_tokens_to_ids("<|im_end|>"))
    eagle, dflash = make_drafters(root, src)
    router = make_router(root, src, tok)
    return build_engine(BuildOptions(target=str(src), output=root / "engine", dtype="fp32", ar_drafter=eagle,
                                     dllm_drafter=dflash, router=router, show_progress=False))
