"""The engine: a loaded engine directory (target, tokenizer, KV pools) and the generation loop.

Generation keeps the invariant of runtime.sequence: after prefill and after every round, the committed tokens are
cached and one bonus token is pending. Target-only decoding (`ar`) is the round with an empty draft.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from whiflash_trt.config import CacheConfig, GenerationConfig, parse_dtype
from whiflash_trt.errors import CheckpointError, WhiflashError
from whiflash_trt.manifest import TARGET_WEIGHTS, TOKENIZER_DIR, Manifest
from whiflash_trt.models.checkpoints import Checkpoint, instantiate_target
from whiflash_trt.models.target import TargetModel
from whiflash_trt.runtime.kv_cache import BlockAllocator, KVLayout, KVPool, num_blocks_for_budget
from whiflash_trt.runtime.sequence import Sequence
from whiflash_trt.runtime.stopping import StopChecker
from whiflash_trt.runtime.target_runner import TargetRunner
from whiflash_trt.spec.sampling import next_token


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    prompt_tokens: int
    finish_reason: str
    stats: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_tokens": self.prompt_tokens,
                "finish_reason": self.finish_reason, "stats": self.stats}


def load_tokenizer(engine_dir: Path):
    from transformers import AutoTokenizer

    folder = engine_dir / TOKENIZER_DIR
    if not (folder / "tokenizer.json").is_file():
        raise CheckpointError(f"engine {engine_dir} has no tokenizer ({folder}/tokenizer.json is missing)")
    return AutoTokenizer.from_pretrained(str(folder))


class Engine:
    def __init__(self, target: TargetModel, tokenizer, manifest: Manifest, cache: CacheConfig,
                 device: torch.device | str = "cpu") -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.manifest = manifest
        self.device = torch.device(device)
        cfg = target.config
        dtype = target.embed_tokens.weight.dtype
        layouts = [KVLayout("target", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)]
        self.block_size = cache.block_size
        num_blocks = num_blocks_for_budget(cache.memory_budget_bytes, cache.block_size, layouts)
        self.allocator = BlockAllocator(num_blocks)
        self.target_pool = KVPool(layouts[0], num_blocks, cache.block_size, self.device)
        self.runner = TargetRunner(target, self.target_pool, manifest.capture_layers)

    @classmethod
    def load(cls, engine_dir: str | Path, device: str = "cpu", cache: CacheConfig | None = None,
             dtype: str | None = None) -> "Engine":
        engine_dir = Path(engine_dir)
        manifest = Manifest.read(engine_dir)
        weights = engine_dir / TARGET_WEIGHTS
        if not weights.is_file():
            raise CheckpointError(f"engine {engine_dir} is incomplete: {TARGET_WEIGHTS} is missing")
        try:
            state = load_file(str(weights))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {weights}: {e} (file corrupt or truncated?)") from None
        torch_dtype = parse_dtype(dtype or manifest.dtype)
        if device == "cpu" and torch_dtype == torch.float16:
            raise WhiflashError("fp16 is not supported on CPU; use bf16 or fp32 (fp16 is for CUDA)")
        target = instantiate_target(Checkpoint(manifest.model, state, str(weights)), torch_dtype, device)
        cache = cache or CacheConfig(block_size=manifest.block_size)
        return cls(target, load_tokenizer(engine_dir), manifest, cache, device)

    # ----- text <-> tokens -------------------------------------------------------------------------------------
    def encode(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        if not prompt:
            raise WhiflashError("prompt is empty")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise WhiflashError("--chat: this model's tokenizer has no chat template")
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        ids = set(self.target.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    # ----- generation --------------------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], gen: GenerationConfig,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        """Target-only generation. `on_tokens` receives each round's newly final tokens (streaming)."""
        max_pos = self.target.config.max_position_embeddings
        if not prompt_ids:
            raise WhiflashError("prompt is empty")
        if len(prompt_ids) >= max_pos:
            raise WhiflashError(f"prompt has {len(prompt_ids)} tokens; the model's context is {max_pos} tokens")
        vocab = self.target.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise WhiflashError(f"prompt holds token ids outside the vocabulary [0, {vocab})")
        generator = torch.Generator(device=self.device)
        generator.manual_seed(gen.sampling.seed if gen.sampling.seed is not None else torch.seed())
        stopper = StopChecker(gen, self.eos_ids, self.decode, max_pos - len(prompt_ids))
        seq = Sequence(prompt_ids, self.allocator, self.block_size)
        start = time.perf_counter()
        try:
            seq.reserve(len(prompt_ids))
            out = self.runner.step(seq, prompt_ids, logits_rows=[len(prompt_ids) - 1])
            seq.commit(prompt_ids, int(next_token(out.logits[-1], gen.sampling, generator)))
            prefill_s = time.perf_counter() - start
            output, rounds, emitted = [seq.pending], 0, 0
            decision = stopper.check(output, 1)
            while True:
                if on_tokens and decision.keep > emitted:
                    on_tokens(output[emitted:decision.keep])
                    emitted = decision.keep
                if decision.reason is not None:
                    break
                b = seq.pending
                seq.reserve(seq.num_committed + 1)
                out = self.runner.step(seq, [b])
                seq.commit([b], int(next_token(out.logits[-1], gen.sampling, generator)))
                output.append(seq.pending)
                rounds += 1
                decision = stopper.check(output, 1)
        finally:
            seq.free()
        seconds = time.perf_counter() - start
        tokens = output[:decision.keep]
        stats = {"rounds": rounds, "new_tokens": len(tokens), "seconds": round(seconds, 4),
                 "prefill_seconds": round(prefill_s, 4),
                 "tokens_per_s": round(len(tokens) / seconds, 2) if seconds > 0 else 0.0}
        return GenerationResult(tokens, stopper.final_text(tokens, decision.reason), len(prompt_ids),
                                decision.reason, stats)
