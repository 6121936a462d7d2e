"""Tiny random targets on disk, in the Hugging Face layout `whiflash-build --target FOLDER` reads.

Not tests: the builders behind conftest.py's `tiny_checkpoint` fixture. A checkpoint is config.json +
model.safetensors (fp32, random weights from a fixed seed) + a byte-level BPE tokenizer trained on a small corpus
(tokenizer.json, tokenizer_config.json, with a ChatML chat template but for "onnx"). The model's vocabulary is exactly
the tokenizer's. VARIANTS names the targets the tests use:

    folder = make_tiny_checkpoint(tmp_path / "llama", "llama3.1")
    folder = make_tiny_checkpoint(tmp_path / "ctx64", max_position_embeddings=64)
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from whiflash_trt.bench.prompts import DATA_DIR

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A tiny model reads a tiny text and writes another one.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
{"name": "whiflash", "tokens": [1, 2, 3], "ok": true}
Speculative decoding drafts tokens with a cheap model and verifies them with the target in one pass.
Question: what is 12 plus 30? Answer: 42. Question: what is 7 times 6? Answer: 42.
Hello world! How are you today? I am fine, thank you. The weather is nice and the sun is shining.
The cache holds keys and values in blocks; every sequence has a table of blocks.
"""
_ONNX_CORPUS = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.",
                '{"name": "x", "value": 1}']
_TRAIN_CORPUS = [
    "def add(a, b):\n    return a + b\n", '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "The quick brown fox jumps over the lazy dog.", "Compute 12 + 30 = 42. The answer is 42.",
    "import json\nprint(json.dumps({'a': 1}))", "Explain what the function does in plain English.",
]


def make_tokenizer(corpus: list[str] | None = None, vocab_size: int = 384,
                   special_tokens: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                   eos_token: str = "<|im_end|>", bos_token: str | None = None, pad_token: str | None = "<|endoftext|>",
                   chat_template: str | None = CHAT_TEMPLATE):
    """A byte-level BPE (PreTrainedTokenizerFast) trained on `corpus` (default: _CORPUS); ChatML by default."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus or _CORPUS.splitlines(keepends=True) * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token, bos_token=bos_token, pad_token=pad_token)
    fast.chat_template = chat_template
    return fast


def peaked_weights(model) -> None:
    """Larger weights than the default init: peaked next-token distributions whose entropy varies (~0 to ~3 nats)."""
    for name, p in model.named_parameters():
        if p.dim() == 2:
            p.normal_(0.0, 0.6 if name == "lm_head.weight" else 0.15)


def sharp_lm_head(model) -> None:
    """Sharper logits than the default init, so greedy text is not flat noise."""
    model.lm_head.weight.mul_(8.0)


# Named targets: keyword overrides for make_tiny_checkpoint ("tokenizer": make_tokenizer's keywords; "init": a function
# that reshapes the random weights; the rest: transformers config keywords).
VARIANTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "llama_tied": {"tie_word_embeddings": True},
    # Llama-3.1 style: theta 500000 and "llama3" frequency scaling. original_max_position_embeddings is small so the
    # scaling changes the angles at the positions a test reaches (and stays below max_position_embeddings).
    "llama3.1": {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
    # Qwen3: per-head q_norm/k_norm and an explicit head_dim (32) different from hidden/heads (64/4 = 16).
    "qwen3": {"architecture": "qwen3", "head_dim": 32},
    # Speculative decoding: 8 layers, so the drafters' default feature layers are distinct, and peaked weights, so the
    # routers switch at entropy thresholds in ~0..3 nats.
    "spec": {"num_hidden_layers": 8, "max_position_embeddings": 512, "init": peaked_weights},
    # The benchmark: a tokenizer trained on the benchmark's own prompt files (so prompts stay a few hundred tokens).
    "bench": {"num_hidden_layers": 8, "max_position_embeddings": 4096, "initializer_range": 0.02, "tokenizer": {
        "corpus": [line for f in sorted(DATA_DIR.glob("*.jsonl")) for line in f.read_text().splitlines()],
        "vocab_size": 512, "special_tokens": ("<|im_end|>", "<|im_start|>"), "bos_token": "<|im_start|>",
        "pad_token": None}},
    # The onnx backend: a near-uniform target (default init, 300 tokens: entropy ~5.6906 nats), no chat template.
    "onnx": {"num_hidden_layers": 8, "max_position_embeddings": 512, "initializer_range": 0.02, "bos_token_id": 1,
             "tokenizer": {"corpus": _ONNX_CORPUS * 50, "vocab_size": 300, "special_tokens": ("<eos>",),
                           "eos_token": "<eos>", "pad_token": None, "chat_template": None}},
    # Training: tied embeddings with a sharp lm_head; 512 positions, which the json training prompts exceed.
    "train": {"num_hidden_layers": 8, "max_position_embeddings": 512, "initializer_range": 0.02,
              "tie_word_embeddings": True, "init": sharp_lm_head,
              "tokenizer": {"corpus": _TRAIN_CORPUS * 20, "vocab_size": 320, "bos_token": "<|im_start|>"}},
}


def make_tiny_checkpoint(folder: str | Path, variant: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write the random checkpoint + tokenizer VARIANTS[variant] names into `folder` and return it.

    The target: Llama (or Qwen3), hidden 64, 3 layers, 4 heads / 2 KV heads (GQA), 256 positions, fp32, unless the
    variant or `overrides` (transformers config keywords: num_hidden_layers, head_dim, tie_word_embeddings,
    rope_parameters, max_position_embeddings, eos_token_id, ...) say otherwise. Same arguments, same weights.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    folder = Path(folder)
    options = {**VARIANTS[variant], **overrides}
    architecture, init = options.pop("architecture", "llama"), options.pop("init", None)
    tokenizer = make_tokenizer(**options.pop("tokenizer", {}))
    config = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
        # Larger than the usual 0.02 so logits spread over O(1) and a wrong rotary angle or norm shows in them.
        initializer_range=0.1, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None)
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[
        architecture]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**config, **options})).float().eval()
    if init is not None:
        with torch.no_grad():
            init(model)
    model.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder), save_jinja_files=False)  # chat template inside tokenizer_config.json
    return folder


def load_hf_model(folder: str | Path):
    """The transformers model of a tiny checkpoint, fp32, eager attention (the reference the tests compare to)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
