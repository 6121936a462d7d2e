"""Llama-architecture GGUF files (llama.cpp) dequantised to float tensors under our module names, and, for a native
engine, the linears' own quantized blocks beside them.

llama.cpp's converter permutes the rows of q_proj and k_proj (interleaved rotary halves); we undo it so the weights
use the rotate-half convention of the Hugging Face checkpoints and of our attention (in the blocks too: a row's
blocks are that row's).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from whiflash_trt.config import ModelConfig, RopeConfig
from whiflash_trt.errors import CheckpointError
from whiflash_trt.models.checkpoints import Checkpoint

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _required(reader, key: str, path: Path):
    value = _field(reader, key)
    if value is None:
        raise CheckpointError(f"GGUF file {path} lacks the required key {key}")
    return value


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(reader, path: Path) -> ModelConfig:
    arch = _required(reader, "general.architecture", path)
    if arch != "llama":
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported (only llama)")
    heads = int(_required(reader, "llama.attention.head_count", path))
    hidden = int(_required(reader, "llama.embedding_length", path))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    vocab = _field(reader, "llama.vocab_size") or len(_required(reader, "tokenizer.ggml.tokens", path))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture="llama",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_required(reader, "llama.feed_forward_length", path)),
        num_layers=int(_required(reader, "llama.block_count", path)),
        num_heads=heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, "llama.context_length", 8192)),
        rope=RopeConfig(theta=float(_field(reader, "llama.rope.freq_base", 10000.0))),
        tie_word_embeddings=not has_output,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def native_blocks(t, name: str) -> torch.Tensor | None:
    """A linear's blocks as the kernels read them (kernels.ggml_blocks), None for a float tensor (a norm); a
    quantization the kernels do not compute from is refused in one line naming it."""
    from whiflash_trt.kernels import GGML_BLOCK_BYTES, ggml_blocks

    kind = t.tensor_type.name
    if kind in ("F32", "F16", "BF16"):
        return None
    if kind not in GGML_BLOCK_BYTES:
        raise CheckpointError(f"{name} is {kind}: native weights compute from {', '.join(GGML_BLOCK_BYTES)} blocks "
                              f"only; build with --weights bf16")
    return ggml_blocks(torch.from_numpy(np.array(t.data)), kind)   # a writable copy


def load_gguf_checkpoint(path: str | Path, progress=None, native: bool = False) -> Checkpoint:
    """Read and dequantise every tensor; `progress` wraps the tensor iterator (e.g. tqdm). `native`: the linears'
    quantized blocks too (Checkpoint.native; the token embedding's for a tied LM head)."""
    import gguf
    from gguf.quants import dequantize

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OSError) as e:   # what gguf raises where the data ends early
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot read GGUF file {path}: truncated or not a GGUF file ({reason})") from None
    try:
        cfg = gguf_config(reader, path)
    except ValueError as e:   # a value ModelConfig rejects
        raise CheckpointError(f"GGUF file {path}: {e}") from None
    state: dict[str, torch.Tensor] = {}
    blocks: dict[str, torch.Tensor] = {}
    tensors = reader.tensors if progress is None else progress(reader.tensors)
    for t in tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", t.name)
        if m and m.group(2) in _LAYER_NAMES:
            name = f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"
        elif t.name.removesuffix(".weight") in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[t.name.removesuffix(".weight")] + ".weight"
        else:
            continue  # e.g. rope_freqs: recomputed from the config
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))  # a writable copy
        q = native_blocks(t, t.name) if native else None
        heads = cfg.num_heads if name.endswith("q_proj.weight") else cfg.num_kv_heads
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            w, q = _unpermute(w, heads), None if q is None else _unpermute(q, heads).contiguous()
        state[name] = w
        if q is not None:
            blocks[name] = q
    return Checkpoint(config=cfg, state_dict=state, source=str(path.resolve()), native=blocks)
