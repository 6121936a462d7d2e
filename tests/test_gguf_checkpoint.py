"""GGUF targets: a tiny llama GGUF written with the `gguf` package loads; one that lacks a required key, or is
truncated, gives one CheckpointError line naming the file and what is wrong (no TypeError traceback)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from whiflash_trt.errors import CheckpointError
from whiflash_trt.models.gguf_checkpoint import load_gguf_checkpoint

gguf = pytest.importorskip("gguf")

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 32, 64, 4, 2, 2, 48


def write_tiny_gguf(path: Path, skip_key: str | None = None) -> Path:
    """A random two-layer llama in GGUF (fp32 tensors); `skip_key` leaves that metadata key out."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    head_dim = HIDDEN // HEADS
    keys = {"llama.block_count": lambda: writer.add_block_count(LAYERS),
            "llama.context_length": lambda: writer.add_context_length(128),
            "llama.embedding_length": lambda: writer.add_embedding_length(HIDDEN),
            "llama.feed_forward_length": lambda: writer.add_feed_forward_length(FFN),
            "llama.attention.head_count": lambda: writer.add_head_count(HEADS),
            "llama.attention.head_count_kv": lambda: writer.add_head_count_kv(KV_HEADS),
            "llama.attention.layer_norm_rms_epsilon": lambda: writer.add_layer_norm_rms_eps(1e-5),
            "tokenizer.ggml.tokens": lambda: writer.add_token_list([f"t{i}" for i in range(VOCAB)])}
    for key, add in keys.items():
        if key != skip_key:
            add()
    tensors = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        tensors |= {f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                    f"blk.{i}.attn_q.weight": (HEADS * head_dim, HIDDEN),
                    f"blk.{i}.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
                    f"blk.{i}.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
                    f"blk.{i}.attn_output.weight": (HIDDEN, HEADS * head_dim),
                    f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
                    f"blk.{i}.ffn_down.weight": (HIDDEN, FFN)}
    for name, shape in tensors.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_tiny_gguf_loads_under_our_module_names(tmp_path):
    ckpt = load_gguf_checkpoint(write_tiny_gguf(tmp_path / "tiny.gguf"))
    cfg = ckpt.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (
        LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB)
    assert cfg.tie_word_embeddings and tuple(ckpt.state_dict["layers.1.mlp.down_proj.weight"].shape) == (HIDDEN, FFN)


@pytest.mark.parametrize("key", ["llama.block_count", "llama.embedding_length", "llama.attention.head_count",
                                 "llama.feed_forward_length", "tokenizer.ggml.tokens"])
def test_a_gguf_without_a_required_key_names_the_file_and_key(tmp_path, key):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", skip_key=key)
    with pytest.raises(CheckpointError) as e:
        load_gguf_checkpoint(path)
    assert str(e.value) == f"GGUF file {path} lacks the required key {key}"


@pytest.mark.parametrize("keep", [0.98, 0.5, 0.02])
def test_a_truncated_gguf_names_the_file(tmp_path, keep):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(CheckpointError) as e:
        load_gguf_checkpoint(path)
    message = str(e.value)
    assert message.startswith(f"cannot read GGUF file {path}: truncated or not a GGUF file (")
    assert len(message.splitlines()) == 1
