"""Tiny random checkpoints on disk, in the Hugging Face layout `whiflash-build --target FOLDER` reads.

Not tests: helpers shared by the test files (parity, speculative decoding, benchmarks). A checkpoint is
config.json + model.safetensors (fp32, random weights from a fixed seed) + a byte-level BPE tokenizer trained on a
small in-code corpus (tokenizer.json, tokenizer_config.json with a ChatML-like chat template). The model's vocabulary
is exactly the tokenizer's.

    folder = make_tiny_checkpoint(tmp_path / "llama", **VARIANTS["llama3.1"])
    folder = make_tiny_checkpoint(tmp_path / "ctx64", max_position_embeddings=64)
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", EOS_TOKEN)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOKENIZER_VOCAB = 384

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

# Named variants: keyword overrides for make_tiny_checkpoint.
VARIANTS: dict[str, dict[str, Any]] = {
    "llama": {"architecture": "llama"},
    "llama_tied": {"architecture": "llama", "tie_word_embeddings": True},
    # Llama-3.1 style: theta 500000 and "llama3" frequency scaling. original_max_position_embeddings is small so the
    # scaling changes the angles at the positions a test reaches (and stays below max_position_embeddings).
    "llama3.1": {"architecture": "llama", "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
    # Qwen3: per-head q_norm/k_norm and an explicit head_dim (32) different from hidden/heads (64/4 = 16).
    "qwen3": {"architecture": "qwen3", "head_dim": 32},
}


def make_tokenizer(vocab_size: int = TOKENIZER_VOCAB):
    """A byte-level BPE (PreTrainedTokenizerFast) trained on _CORPUS, with ChatML specials; EOS is <|im_end|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True) * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_hf_config(architecture: str = "llama", vocab_size: int = TOKENIZER_VOCAB, eos_token_id: int | None = None,
                   **overrides: Any):
    """A transformers LlamaConfig / Qwen3Config: hidden 64, 3 layers, 4 heads / 2 KV heads (GQA), fp32."""
    from transformers import LlamaConfig, Qwen3Config

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
        # Larger than the usual 0.02 so logits spread over O(1) and a wrong rotary angle or norm shows in them.
        initializer_range=0.1, bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None)
    kwargs.update(overrides)
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[architecture]
    return cls(**kwargs)


def make_tiny_checkpoint(folder: str | Path, architecture: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a random checkpoint + tokenizer into `folder` and return it.

    `overrides` are transformers config keywords (num_hidden_layers, head_dim, tie_word_embeddings,
    rope_parameters, max_position_embeddings, eos_token_id, ...). The same seed and overrides give the same weights.
    """
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    folder = Path(folder)
    tokenizer = make_tokenizer()
    overrides.setdefault("eos_token_id", tokenizer.eos_token_id)
    config = tiny_hf_config(architecture, vocab_size=len(tokenizer), **overrides)
    model_cls = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}[architecture]
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder), save_jinja_files=False)  # chat template inside tokenizer_config.json
    return folder


def load_hf_model(folder: str | Path):
    """The transformers model of a tiny checkpoint, fp32, eager attention (the reference the tests compare to)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()


def build_tiny_engine(folder: str | Path, output: str | Path, dtype: str = "fp32") -> Path:
    """`whiflash-build --target FOLDER --output OUTPUT --dtype fp32`, in process."""
    from whiflash_trt.builder.build import BuildOptions, build_engine

    return build_engine(BuildOptions(target=str(folder), output=Path(output), dtype=dtype, show_progress=False))
