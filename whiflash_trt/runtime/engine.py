"""The engine: a loaded engine directory (target, drafters, router, tokenizer, KV pools) and the round loop.

Generation keeps the invariant of runtime.sequence: after prefill and after every round, the committed tokens are
cached and one bonus token is pending. A round is route -> catch up -> propose -> verify -> commit; target-only
decoding (`ar`) is the round with an empty draft. Only commit changes the Sequence.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from whiflash_trt.config import CacheConfig, GenerationConfig, SpecConfig, parse_dtype
from whiflash_trt.errors import CheckpointError, WhiflashError
from whiflash_trt.manifest import TARGET_WEIGHTS, TOKENIZER_DIR, Manifest
from whiflash_trt.models.checkpoints import Checkpoint, instantiate_target
from whiflash_trt.models.dflash import DFlashDrafter
from whiflash_trt.models.drafter_checkpoints import load_dflash, load_eagle3
from whiflash_trt.models.eagle3 import Eagle3Drafter
from whiflash_trt.models.target import TargetModel
from whiflash_trt.runtime.backends import engine_backend, load_graph_models
from whiflash_trt.runtime.drafters import DFlashProposer, Eagle3Proposer
from whiflash_trt.runtime.policy import resolve_spec
from whiflash_trt.runtime.kv_cache import BlockAllocator, KVCacheExhausted, KVLayout, KVPool, num_blocks_for_budget
from whiflash_trt.runtime.sequence import Sequence
from whiflash_trt.runtime.stats import RoundStats
from whiflash_trt.runtime.stopping import StopChecker
from whiflash_trt.runtime.target_runner import TargetRunner
from whiflash_trt.spec.router import (DEFAULT_ENTROPY_THRESHOLD, EntropyRouter, NeuralRouter, RouterFile,
                                      RouteSignal, entropy_of, load_router)
from whiflash_trt.spec.sampling import target_probs
from whiflash_trt.spec.tree import DraftTree
from whiflash_trt.spec.verify import verify_greedy, verify_sampling


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


def _router(engine_dir: Path, manifest: Manifest) -> RouterFile | None:
    part = manifest.components.get("router")
    return None if part is None else load_router(engine_dir / part["path"], manifest.model.hidden_size)


def _cache(manifest: Manifest, kv_budget_bytes: int | None) -> CacheConfig:
    budget = CacheConfig.memory_budget_bytes if kv_budget_bytes is None else kv_budget_bytes
    return CacheConfig(block_size=manifest.block_size, memory_budget_bytes=budget)


class Engine:
    def __init__(self, target: TargetModel, tokenizer, manifest: Manifest, cache: CacheConfig,
                 device: torch.device | str = "cpu", eagle3: Eagle3Drafter | None = None,
                 dflash: DFlashDrafter | None = None, router: RouterFile | None = None) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.manifest = manifest
        self.device = torch.device(device)
        self.router_file = router
        cfg = target.config
        dtype = target.embed_tokens.weight.dtype
        layouts = {"target": KVLayout("target", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)}
        if eagle3 is not None:
            c = eagle3.config
            layouts["eagle3"] = KVLayout("eagle3", 1, c.num_kv_heads, c.head_dim, dtype)
        if dflash is not None:
            c = dflash.config
            layouts["dflash"] = KVLayout("dflash", c.num_layers, c.num_kv_heads, c.head_dim, dtype)
        self.block_size = cache.block_size
        self.bytes_per_block_id = sum(layout.bytes_per_block(cache.block_size) for layout in layouts.values())
        num_blocks = num_blocks_for_budget(cache.memory_budget_bytes, cache.block_size, list(layouts.values()))
        # One allocator; every model's pool has a block for each block id.
        self.allocator = BlockAllocator(num_blocks)
        self.pools = {name: KVPool(layout, num_blocks, cache.block_size, self.device)
                      for name, layout in layouts.items()}
        self.target_pool = self.pools["target"]
        # Every verify captures the union of the layers both drafters need, whichever drafter drafted.
        union = tuple(sorted({layer for m in (eagle3, dflash) if m is not None for layer in m.config.capture_layers}))
        self.runner = TargetRunner(target, self.target_pool, union)
        self.proposers = {}
        if eagle3 is not None:
            self.proposers["eagle3"] = Eagle3Proposer(eagle3.to(self.device, dtype), self.pools["eagle3"], target,
                                                      union)
        if dflash is not None:
            self.proposers["dflash"] = DFlashProposer(dflash.to(self.device, dtype), self.pools["dflash"], target,
                                                      union)

    @classmethod
    def load(cls, engine_dir: str | Path, device: str = "cpu", dtype: str | None = None,
             kv_budget_bytes: int | None = None, backend: str | None = None) -> "Engine":
        """Load an engine directory; the KV pools share `kv_budget_bytes` (default CacheConfig's). `backend`:
        None = the one it was built for; "torch" runs the modules of any engine (see runtime.backends)."""
        engine_dir = Path(engine_dir)
        manifest = Manifest.read(engine_dir)
        backend = backend or engine_backend(manifest)
        if backend != "torch":
            if dtype is not None and dtype != manifest.dtype:
                raise WhiflashError(f"the {backend} graphs were built in {manifest.dtype}; rebuild for {dtype}")
            models = load_graph_models(engine_dir, manifest, backend, device)
            return cls(models[0], load_tokenizer(engine_dir), manifest, _cache(manifest, kv_budget_bytes), device,
                       *models[1:], router=_router(engine_dir, manifest))
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
        parts = manifest.components
        eagle3 = load_eagle3(engine_dir / parts["eagle3"]["path"], manifest.model) if "eagle3" in parts else None
        dflash = load_dflash(engine_dir / parts["dflash"]["path"], manifest.model) if "dflash" in parts else None
        return cls(target, load_tokenizer(engine_dir), manifest, _cache(manifest, kv_budget_bytes), device, eagle3,
                   dflash, _router(engine_dir, manifest))

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

    # ----- modes -------------------------------------------------------------------------------------------------
    def resolve_spec(self, spec: SpecConfig | None = None) -> SpecConfig:
        """`spec` (default: all "auto") with auto mode/router resolved to what this engine holds (runtime.policy)."""
        return resolve_spec(spec or SpecConfig(), set(self.proposers), self.router_file is not None)

    def proposers_for(self, spec: SpecConfig) -> dict:
        needed = {"ar": [], "eagle3": ["eagle3"], "dflash": ["dflash"], "whiflash": ["eagle3", "dflash"]}[spec.mode]
        missing = [n for n in needed if n not in self.proposers]
        if missing:
            flag = {"eagle3": "--ar-drafter", "dflash": "--dllm-drafter"}
            raise WhiflashError(f"mode {spec.mode!r} needs the {' and '.join(missing)} drafter, which this engine "
                                f"does not have; rebuild it with " + " ".join(f"{flag[m]} PATH" for m in missing))
        return {n: self.proposers[n] for n in needed}

    def router_for(self, spec: SpecConfig):
        if spec.mode != "whiflash":
            return None
        if spec.router == "neural":
            if self.router_file is None:
                raise WhiflashError("--router neural needs router weights, and this engine has none; rebuild it "
                                    "with --router PATH (train them with whiflash-train router), or use --router "
                                    "entropy")
            threshold = self.router_file.threshold if spec.threshold is None else spec.threshold
            return NeuralRouter(self.router_file.mlp.to(self.device), threshold)
        default = (self.router_file.entropy_threshold if self.router_file is not None
                   and self.router_file.entropy_threshold is not None else DEFAULT_ENTROPY_THRESHOLD)
        return EntropyRouter(default if spec.threshold is None else spec.threshold)

    # ----- generation --------------------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], gen: GenerationConfig,
                 on_tokens: Callable[[list[int]], None] | None = None,
                 spec: SpecConfig | None = None) -> GenerationResult:
        """Generate with the mode in `spec` (default: the engine's own, see resolve_spec). Greedy output equals
        target-only output token for token; sampled output has the target's distribution. `on_tokens` receives each
        round's newly final tokens (streaming)."""
        spec = self.resolve_spec(spec)
        proposers, router = self.proposers_for(spec), self.router_for(spec)
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
        stats = RoundStats()
        start = time.perf_counter()
        try:
            signal = self._prefill(seq, gen, generator, proposers)
            prefill_s = time.perf_counter() - start
            output, emitted = [seq.pending], 0
            decision = stopper.check(output, 1)
            while True:
                if on_tokens and decision.keep > emitted:
                    on_tokens(output[emitted:decision.keep])
                    emitted = decision.keep
                if decision.reason is not None:
                    break
                signal, new = self._round(seq, gen, spec, generator, proposers, router, signal, stats)
                output += new
                decision = stopper.check(output, len(new))
        except KVCacheExhausted as e:
            total = len(prompt_ids) + gen.max_new_tokens
            needed = self._budget_mb_for(total, spec)
            raise KVCacheExhausted(f"{e} at {seq.num_committed} of this request's up to {total} tokens; on its own "
                                   f"it needs {needed} MB of KV memory", needed) from None
        finally:
            seq.free()
        seconds = time.perf_counter() - start
        tokens = output[:decision.keep]
        result_stats = {"mode": spec.mode, "rounds": len(stats.taus), "new_tokens": len(tokens),
                        "seconds": round(seconds, 4), "prefill_seconds": round(prefill_s, 4),
                        "tokens_per_s": round(len(tokens) / seconds, 2) if seconds > 0 else 0.0,
                        "threads": torch.get_num_threads()}
        if spec.mode == "whiflash":
            result_stats.update(router=spec.router, threshold=router.threshold, catch_up=spec.catch_up)
        result_stats.update(stats.to_dict())
        return GenerationResult(tokens, stopper.final_text(tokens, decision.reason), len(prompt_ids),
                                decision.reason, result_stats)

    def _budget_mb_for(self, num_tokens: int, spec: SpecConfig) -> int:
        """KV memory (MB, rounded up) one request of `num_tokens` needs, a round's draft slots included."""
        proposers = self.proposers_for(spec).values()
        slack = max((max(p.max_tree_tokens(spec), p.scratch_slots(spec) + 1) for p in proposers), default=1)
        blocks = -(-(num_tokens + slack) // self.block_size)
        return -(-blocks * self.bytes_per_block_id // 2**20)

    def _choose(self, logits: torch.Tensor, gen: GenerationConfig, generator) -> int:
        tree = DraftTree([0], [-1], [0])
        if gen.sampling.greedy:
            return verify_greedy(tree, logits).bonus
        return verify_sampling(tree, target_probs(logits, gen.sampling), generator).bonus

    def _prefill(self, seq: Sequence, gen: GenerationConfig, generator, proposers: dict) -> RouteSignal:
        """Target over the prompt; every drafter of the mode starts at frontier 0 with the whole prompt as backlog
        (its KV-only prefill runs when it is first chosen, or every round with eager catch-up)."""
        prompt = seq.prompt_ids
        seq.reserve(len(prompt))
        out = self.runner.step(seq, prompt, logits_rows=[len(prompt) - 1], capture=bool(proposers))
        seq.commit(prompt, self._choose(out.logits, gen, generator), out.captured, {name: 0 for name in proposers})
        return RouteSignal(entropy_of(out.logits[-1]), out.hidden[-1])

    def _round(self, seq, gen, spec, generator, proposers, router, signal, stats) -> tuple[RouteSignal, list[int]]:
        times, t0 = {}, time.perf_counter()
        # route
        name = router.choose(signal) if router is not None else next(iter(proposers), None)
        n, max_pos = seq.num_committed, self.target.config.max_position_embeddings
        proposer = proposers.get(name)
        if proposer is not None and n + proposer.max_tree_tokens(spec) > max_pos:
            proposer = None  # no room left in the context window for a draft: a target-only round
        t1 = time.perf_counter()
        times["route"] = t1 - t0
        # catch up: the chosen drafter only (lazy) or every drafter (eager)
        frontiers = {}
        for p in (proposers.values() if spec.catch_up == "eager" else [proposer] if proposer else []):
            stats.catch_up_tokens += p.backlog(seq)
            frontiers[p.name] = p.catch_up(seq)
        t2 = time.perf_counter()
        times["catch_up"] = t2 - t1
        # propose
        if proposer is None:
            tree = DraftTree([seq.pending], [-1], [0])
            seq.reserve(n + 1)
        else:
            seq.reserve(n + max(proposer.max_tree_tokens(spec), proposer.scratch_slots(spec) + 1))
            proposal = proposer.propose(seq, spec)
            tree, frontiers[proposer.name] = proposal.tree, proposal.frontier
        t3 = time.perf_counter()
        times["draft"] = t3 - t2
        # verify
        chain = tree.is_chain
        out = self.runner.step(seq, tree.tokens, depths=None if chain else tree.depths,
                               tree_mask=None if chain else tree.mask(), capture=bool(proposers))
        verdict = (verify_greedy(tree, out.logits) if gen.sampling.greedy
                   else verify_sampling(tree, target_probs(out.logits, gen.sampling), generator))
        t4 = time.perf_counter()
        times["verify"] = t4 - t3
        # commit
        if not chain:
            self.target_pool.copy_slots(*seq.compaction(verdict.path))
        path = torch.tensor(verdict.path, device=self.device)
        features = None if out.captured is None else out.captured.index_select(0, path)
        seq.commit(verdict.tokens, verdict.bonus, features, frontiers)
        last = verdict.path[-1]
        signal = RouteSignal(entropy_of(out.logits[last]), out.hidden[last])
        times["commit"] = time.perf_counter() - t4
        stats.record(proposer.name if proposer else "none", verdict.num_accepted, times)
        return signal, verdict.tokens[1:] + [verdict.bonus]
