"""A tiny random Llama target (Hugging Face folder with a ChatML tokenizer) for the training tests."""
from __future__ import annotations

import json
from pathlib import Path

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = [
    "def add(a, b):\n    return a + b\n", '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "The quick brown fox jumps over the lazy dog.", "Compute 12 + 30 = 42. The answer is 42.",
    "import json\nprint(json.dumps({'a': 1}))", "Explain what the function does in plain English.",
]


def make_tiny_target(folder: Path, num_layers: int = 8, hidden: int = 64, seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": "<|im_start|>",
        "pad_token": "<|endoftext|>", "chat_template": CHATML}))
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512,
                      rope_theta=10000.0, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():   # sharper logits than a default init, so greedy text is not flat noise
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(str(folder))
    return folder
