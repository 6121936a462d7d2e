"""Load a target (named, Hugging Face folder or GGUF) with its tokenizer for training, as the builder does."""
from __future__ import annotations

from whiflash_trt.builder.sources import load_checkpoint, load_tokenizer, resolve_target
from whiflash_trt.config import parse_dtype
from whiflash_trt.models.checkpoints import instantiate_target
from whiflash_trt.models.target import TargetModel


def load_target(target: str, dtype: str = "bf16") -> tuple[TargetModel, object]:
    source = resolve_target(target)
    model = instantiate_target(load_checkpoint(source), parse_dtype(dtype))
    return model, load_tokenizer(source)


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def eos_ids(model: TargetModel, tokenizer) -> tuple[int, ...]:
    ids = set(model.config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    # ChatML targets end a turn with <|im_end|>
    end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    if end is not None:
        ids.add(end)
    return tuple(sorted(ids))

