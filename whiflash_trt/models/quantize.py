"""A dense checkpoint's linears quantised at build time into ggml's blocks (round to nearest per block of 32 inputs,
gguf's reference quantiser), for a native engine of a Hugging Face target (`whiflash-build --weights q8_0|q4_1|q4_0`):
the same kernels then run them as they run a GGUF file's own blocks."""
from __future__ import annotations

import numpy as np
import torch

from whiflash_trt.errors import CheckpointError
from whiflash_trt.models.checkpoints import Checkpoint

QUANTIZED_WEIGHTS = {"q8_0": "Q8_0", "q4_1": "Q4_1", "q4_0": "Q4_0"}   # --weights -> ggml type
_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")


def quantize_linears(ckpt: Checkpoint, weights: str) -> Checkpoint:
    """The checkpoint with its layers' linears and LM head (a tied head: the embedding table) in `weights`' blocks
    (Checkpoint.native) beside its dense weights; in_features must be a multiple of 32."""
    import gguf
    from gguf.quants import quantize

    from whiflash_trt.kernels import ggml_blocks

    kind = QUANTIZED_WEIGHTS[weights]
    cfg = ckpt.config
    names = [f"layers.{i}.{linear}.weight" for i in range(cfg.num_layers) for linear in _LINEARS]
    names.append("embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
    native = {}
    for name in names:
        w = ckpt.state_dict[name]
        if w.shape[1] % 32:
            raise CheckpointError(f"--weights {weights} quantises blocks of 32 inputs; {name} has {w.shape[1]}")
        raw = quantize(w.float().numpy(), getattr(gguf.GGMLQuantizationType, kind))
        native[name] = ggml_blocks(torch.from_numpy(np.ascontiguousarray(raw)), kind)
    return Checkpoint(ckpt.config, ckpt.state_dict, ckpt.source, native)
