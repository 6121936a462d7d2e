"""Load a target (named, Hugging Face folder or GGUF) with its tokenizer for training, as the builder does."""
from __future__ import annotations

from whiflash_trt import kernels
from whiflash_trt.builder.sources import load_checkpoint, load_tokenizer, resolve_target
from whiflash_trt.config import parse_dtype
from whiflash_trt.models.checkpoints import instantiate_target
from whiflash_trt.models.target import TargetModel


def load_target(target: str, dtype: str = "bf16") -> tuple[TargetModel, object]:
    source = resolve_target(target)
    model = instantiate_target(load_checkpoint(source), parse_dtype(dtype))
    return model, load_tokenizer(source)


def load_engine_target(target: str, dtype: str = "bf16") -> tuple[TargetModel, object]:
    """The target as the engine runs it: the kernels loaded (else torch's attention, several times slower) and the
    projections fused, so tokens and features computed with it have the runtime's bits."""
    kernels.ensure_loaded()
    model, tokenizer = load_target(target, dtype)
    model.fuse_projections()
    return model, tokenizer
