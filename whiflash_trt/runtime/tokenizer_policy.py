"""One tokenizer policy for the runtime, the servers and training: how a prompt or a conversation becomes token ids
(the tokenizer's own chat template), and which token ids end generation."""
from __future__ import annotations

from whiflash_trt.config import ModelConfig
from whiflash_trt.errors import WhiflashError

CHATML_END = "<|im_end|>"   # ChatML targets end a turn with it, whatever their tokenizer names as EOS


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """[{"role", "content"}, ...] -> ids through the chat template, ready for the assistant's turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise WhiflashError("this model's tokenizer has no chat template")
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def prompt_ids(tokenizer, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
    """A raw prompt (the tokenizer adds its special tokens), or one user turn after an optional system message."""
    if not prompt:
        raise WhiflashError("prompt is empty")
    if not chat:
        return tokenizer.encode(prompt)
    return chat_ids(tokenizer, ([{"role": "system", "content": system}] if system else [])
                    + [{"role": "user", "content": prompt}])


def eos_ids(config: ModelConfig, tokenizer) -> tuple[int, ...]:
    """The config's EOS ids, the tokenizer's EOS and, where the vocabulary has it, the ChatML end of turn."""
    ids = set(config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if CHATML_END in tokenizer.get_vocab():
        ids.add(tokenizer.convert_tokens_to_ids(CHATML_END))
    return tuple(sorted(ids))
