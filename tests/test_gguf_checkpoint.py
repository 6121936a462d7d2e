"""GGUF targets: a tiny llama GGUF written with the `gguf` package loads; one that lacks a required key, or is
truncated, gives one CheckpointError line naming the file and what is wrong (no TypeError traceback); a quantized
one loads its linears' own blocks too (a native engine's), which the kernels then compute from."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from whiflash_trt.errors import CheckpointError
from whiflash_trt.models.gguf_checkpoint import load_gguf_checkpoint

gguf = pytest.importorskip("gguf")

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 32, 64, 4, 2, 2, 48


def write_tiny_gguf(path: Path, skip_key: str | None = None, quant: str | None = None) -> Path:
    """A random two-layer llama in GGUF (fp32 tensors; `quant`: its linears and token embedding in that ggml type);
    `skip_key` leaves that metadata key out."""
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
        w = rng.standard_normal(shape).astype(np.float32)
        if quant is None or len(shape) == 1:
            writer.add_tensor(name, w)
        else:
            kind = getattr(gguf.GGMLQuantizationType, quant)
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)
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


def test_a_quantized_gguf_loads_its_linears_blocks_as_the_dequantised_weights(tmp_path):
    """Each native tensor is its dequantised weight's blocks, rows in the same order (q and k unpermuted alike)."""
    ckpt = load_gguf_checkpoint(write_tiny_gguf(tmp_path / "q.gguf", quant="Q4_1"), native=True)
    assert len(ckpt.native) == 7 * LAYERS + 1 and "embed_tokens.weight" in ckpt.native
    for name, blocks in ckpt.native.items():
        raw = blocks.reshape(blocks.shape[0], -1).numpy()
        dense = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1))
        assert np.array_equal(dense, ckpt.state_dict[name].numpy()), name
    assert not load_gguf_checkpoint(tmp_path / "q.gguf").native   # only asked for


def test_a_type_the_kernels_do_not_compute_from_is_refused_in_one_line(tmp_path):
    path = write_tiny_gguf(tmp_path / "q5.gguf", quant="Q5_0")
    with pytest.raises(CheckpointError, match=r"is Q5_0: native weights compute from Q4_0, Q4_1, Q8_0") as e:
        load_gguf_checkpoint(path, native=True)
    assert "\n" not in str(e.value)
    assert load_gguf_checkpoint(path).state_dict   # dequantised, it loads


@pytest.mark.parametrize("quant", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_native_target_runs_its_blocks_on_the_kernels(tmp_path, quant):
    """The target over the file's blocks: every linear's weight is a GGML one, and its logits are the dequantised
    target's up to the 8-bit activations (a 1-row step equals that row of a longer call, bit for bit)."""
    import torch

    from whiflash_trt import kernels
    from whiflash_trt.models.checkpoints import Checkpoint, instantiate_target
    from whiflash_trt.models.target import pack_native

    if not kernels.registered():
        pytest.skip("the kernels are not loaded on this machine")
    ckpt = load_gguf_checkpoint(write_tiny_gguf(tmp_path / "q.gguf", quant=quant), native=True)
    native = instantiate_target(ckpt, torch.bfloat16, packed=pack_native(ckpt.config, ckpt.native))
    dense = instantiate_target(Checkpoint(ckpt.config, ckpt.state_dict, ckpt.source), torch.bfloat16)
    layer = native.layers[0]
    assert layer.norms_in_gemms and native.head.kernel_weight.dtype == torch.uint8
    assert layer.self_attn.qkv.kernel_weight.dtype == layer.mlp.down.kernel_weight.dtype == torch.uint8
    ids = torch.arange(6) % VOCAB

    def logits(model, rows):
        cfg = model.config
        pool = torch.zeros(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16)
        mask = torch.ones(rows, rows, dtype=torch.bool).tril()
        return model(ids[:rows], torch.arange(rows), pool, pool.clone(), torch.arange(rows), torch.arange(rows),
                     mask).logits

    got, want = logits(native, 6).float(), logits(dense, 6).float()
    assert ((got - want).norm() / want.norm()).item() < 0.15   # random weights: large activations, 8 bits
    assert torch.equal(logits(native, 3)[2], logits(native, 6)[2])
