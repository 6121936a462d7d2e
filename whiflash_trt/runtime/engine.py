"""The engine: a loaded engine directory (target, drafters, router, tokenizer, KV pools), each request's plan, and
generation as a batch of one (runtime.batch admits requests; runtime.round runs their rounds)."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
from collections.abc import Collection, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

from whiflash_trt.config import (DFLASH, EAGLE3, MODE_DRAFTERS, WHIFLASH, CacheConfig, DFlashTreeConfig,
                                 GenerationConfig, SpecConfig, TreeConfig)
from whiflash_trt.errors import SpecError, WhiflashError
from whiflash_trt.runtime.batch import Batch
from whiflash_trt.runtime.drafter_kinds import FREE, LEARNED
from whiflash_trt.runtime.drafters import Proposer
from whiflash_trt.runtime.kv_cache import KVCache, kv_layouts
from whiflash_trt.runtime.loading import EngineParts, load_parts
from whiflash_trt.runtime.plan import Plan, check_options_apply
from whiflash_trt.runtime import tokenizer_policy
from whiflash_trt.runtime.policy import resolve_spec
from whiflash_trt.runtime.request import GenerationResult, Request
from whiflash_trt.runtime.sequence import Sequence
from whiflash_trt.runtime.stopping import StopChecker
from whiflash_trt.runtime.round import slots_per_round
from whiflash_trt.runtime.target_runner import TargetRunner
from whiflash_trt.runtime.round_costs import (DEFAULT_CACHE as ROUND_COSTS_CACHE, LiveRoundSeconds,
                                             cached_round_seconds)
from whiflash_trt.spec.router import (DEFAULT_ENTROPY_THRESHOLD, EntropyRouter, NeuralRouter, Router,
                                      ThroughputRouter)


class Engine:
    def __init__(self, parts: EngineParts, cache: CacheConfig, device: torch.device | str = "cpu",
                 round_costs_cache: Path | None = ROUND_COSTS_CACHE) -> None:
        """`parts` (runtime.loading) on `device`; the KV pools of all its models share `cache`'s budget. A v2 router's
        round costs are measured once per engine and machine and kept in `round_costs_cache` (None: every load)."""
        self.target, self.tokenizer, self.manifest = parts.target, parts.tokenizer, parts.manifest
        self.router_file = parts.router
        self.compute, self.slow_bf16 = parts.compute, parts.slow_bf16   # runtime.loading.compute_path
        self.device = torch.device(device)
        drafters = {name: m for name, m in ((EAGLE3, parts.eagle3), (DFLASH, parts.dflash)) if m is not None}
        self.kv = KVCache(kv_layouts({"target": self.target.config, **{n: m.config for n, m in drafters.items()}},
                                     self.target.dtype), cache, self.device)
        # Every verify captures the union of the layers both drafters need, whichever drafter drafted.
        union = tuple(sorted({layer for m in drafters.values() for layer in m.config.capture_layers}))
        self.runner = TargetRunner(self.target, self.kv.pools["target"], union)
        self.proposers: dict[str, Proposer] = {
            name: LEARNED[name](m, self.kv.pools[name], self.target, union) for name, m in drafters.items()}
        verify = (self.device, self.target.dtype, self.target.native)
        self.proposers |= {name: kind(*verify) for name, kind in FREE.items()}
        # The throughput router (a v2 router file) weighs each choice by its seconds per round on this machine:
        # calibrated at load, then kept current by the rounds a request runs alone (runtime.round)
        self.round_seconds = LiveRoundSeconds()
        self._warned_trees: set[str] = set()
        if self.router_file is not None and self.router_file.version == 2 and len(drafters) == 2:
            self.round_seconds = cached_round_seconds(self, round_costs_cache)

    @property
    def round_seconds(self) -> LiveRoundSeconds:
        return self._round_seconds

    @round_seconds.setter
    def round_seconds(self, seconds: Mapping[str, float]) -> None:
        """Seed the costs (choice -> seconds per round) that the rounds then keep current (a LiveRoundSeconds is
        taken as it is: with alpha 0 the costs stay fixed)."""
        self._round_seconds = seconds if isinstance(seconds, LiveRoundSeconds) else LiveRoundSeconds(seconds)

    @classmethod
    def load(cls, engine_dir: str | Path, device: str = "cpu", dtype: str | None = None,
             kv_budget_bytes: int | None = None, backend: str | None = None,
             round_costs_cache: Path | None = ROUND_COSTS_CACHE) -> "Engine":
        """Load an engine directory; the KV pools share `kv_budget_bytes` (default CacheConfig's). `backend`:
        None = the one it was built for; "torch" runs the modules of any engine (see runtime.backends)."""
        parts = load_parts(Path(engine_dir), device, dtype, backend)
        budget = CacheConfig.memory_budget_bytes if kv_budget_bytes is None else kv_budget_bytes
        return cls(parts, CacheConfig(parts.manifest.block_size, budget), device, round_costs_cache)

    @contextmanager
    def scratch_sequence(self, token_ids: list[int], num_slots: int | None = None) -> Iterator[Sequence]:
        """A Sequence over this engine's KV pools with `token_ids` as its prompt and slots [0, num_slots) reserved
        (default: the prompt's), freed on exit: for tools that drive the target or a proposer themselves."""
        seq = Sequence(token_ids, self.kv.allocator, self.kv.block_size)
        try:
            seq.reserve(num_slots or len(token_ids))
            yield seq
        finally:
            seq.free()

    def target_logits(self, token_ids: list[int]) -> torch.Tensor:
        """[vocab] the target's logits after the last of `token_ids` (one prefill over a scratch sequence)."""
        with self.scratch_sequence(token_ids) as seq:
            return self.runner.step(seq, token_ids, logits_rows=[len(token_ids) - 1]).logits[-1]

    # ----- text <-> tokens -------------------------------------------------------------------------------------
    def encode(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        return tokenizer_policy.prompt_ids(self.tokenizer, prompt, chat, system)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """A whole conversation ([{"role", "content"}, ...]) through the chat template."""
        return tokenizer_policy.chat_ids(self.tokenizer, messages)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @functools.cached_property
    def eos_ids(self) -> tuple[int, ...]:
        """Computed once: the ChatML check reads the tokenizer's whole vocabulary (~40 ms for SmolLM2's 49k), which
        every request paid before its first token."""
        return tokenizer_policy.eos_ids(self.target.config, self.tokenizer)

    # ----- modes -------------------------------------------------------------------------------------------------
    def resolve_spec(self, spec: SpecConfig | None = None) -> SpecConfig:
        """`spec` (default: all "auto") with auto mode/router resolved to what this engine holds (runtime.policy)."""
        return resolve_spec(spec or SpecConfig(), set(self.proposers), self.router_file is not None)

    def plan(self, spec: SpecConfig | None = None, given: Collection[str] = ()) -> Plan:
        """One request's plan (runtime.plan): `spec` resolved, its drafters and router built, checked once. `given`
        names the settings the request set explicitly (runtime.plan.PARAMS); one its mode would ignore is a
        SpecError, as is a mode or router this engine cannot run."""
        spec = self.resolve_spec(spec)
        check_options_apply(spec.mode, given)
        return Plan(spec, self.proposers_for(spec), self.router_for(spec))

    def proposers_for(self, spec: SpecConfig) -> dict[str, Proposer]:
        """The drafters `spec.mode` runs, each shaped by its tree settings (`spec.tree`, `spec.dflash_tree`)."""
        needed = MODE_DRAFTERS[spec.mode]
        missing = [n for n in needed if n not in self.proposers]
        if missing:
            raise SpecError(("mode",), f"{{mode}} {spec.mode} needs the {' and '.join(missing)} drafter, which this "
                            f"engine does not have; rebuild it with whiflash-build and that drafter's checkpoint")
        return {n: self.proposers[n].for_spec(spec) for n in needed}

    def router_for(self, spec: SpecConfig) -> Router | None:
        """The router of a resolved whiflash `spec` (None in the other modes); it keeps one request's state."""
        if spec.mode != WHIFLASH:
            return None
        if spec.router == "neural":
            if self.router_file is None:
                raise SpecError(("router",), "{router} neural needs router weights, and this engine has none; "
                                "rebuild it with whiflash-build --router PATH (train them with whiflash-train "
                                "router), or use {router} entropy")
            f = self.router_file
            threshold = f.threshold if spec.threshold is None else spec.threshold
            if f.version == 1:
                return NeuralRouter(f.mlp.to(self.device), threshold)
            self._check_router_trees(spec)
            return ThroughputRouter(f.predictor, self.round_seconds or f.round_seconds, threshold, f.priors,
                                    f.alpha, f.relax)
        f = self.router_file
        default = f.entropy_threshold if f is not None and f.entropy_threshold is not None else \
            DEFAULT_ENTROPY_THRESHOLD
        if spec.threshold is not None:   # an explicit threshold: the two-way rule it names
            return EntropyRouter(spec.threshold)
        return EntropyRouter(default, none_threshold=f.entropy_none_threshold if f is not None else math.inf)

    def tree_shapes(self, spec: SpecConfig) -> dict[str, dict]:
        """The draft trees `spec` makes each drafter of this engine grow, as a router file records them: a node count
        the request leaves to the machine (runtime.tree_defaults) stays None."""
        trees = {EAGLE3: spec.tree, DFLASH: spec.dflash_tree}
        return {d: dataclasses.asdict(trees[d]) for d in (EAGLE3, DFLASH) if d in self.proposers}

    def resolved_tree_shapes(self, shapes: dict[str, dict]) -> dict[str, dict]:
        """`shapes` (tree_shapes, or a router file's) with each node count as this engine's drafters resolve it; a
        file from before the trees' probability floor records none: its trees had none (0)."""
        resolved = {}
        for d, shape in shapes.items():
            if d in self.proposers:
                tree = (TreeConfig if d == EAGLE3 else DFlashTreeConfig)(**{"min_prob": 0.0, **shape})
                nodes = self.proposers[d].with_tree(tree).max_tree_tokens()
                resolved[d] = {**dataclasses.asdict(tree), "total_tokens": nodes}
        return resolved

    def _check_router_trees(self, spec: SpecConfig) -> None:
        """Say once per tree shape when the router was fit for other draft trees: its predicted acceptance (and so
        its choices) may then be off, though output stays exact."""
        shapes = self.resolved_tree_shapes(self.tree_shapes(spec))
        fitted = self.resolved_tree_shapes(self.router_file.trees)
        key = json.dumps(shapes, sort_keys=True)
        if fitted and fitted != shapes and key not in self._warned_trees:
            self._warned_trees.add(key)
            print(f"whiflash: the router was fit for draft trees {json.dumps(fitted, sort_keys=True)} and this "
                  f"request drafts {key}: its routing may be off (retrain it: whiflash-train router)", file=sys.stderr)

    # ----- generation --------------------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], gen: GenerationConfig,
                 on_tokens: Callable[[list[int]], None] | None = None,
                 spec: SpecConfig | Plan | None = None) -> GenerationResult:
        """Generate with the mode in `spec` (a Plan, or the settings it is planned from; default: the engine's own,
        see resolve_spec). Greedy output equals target-only output token for token; sampled output has the target's
        distribution. `on_tokens` receives each round's newly final tokens (streaming). A batch of one
        (runtime.batch runs many)."""
        batch = Batch(self)
        req = batch.submit(self.request(prompt_ids, gen, spec, on_tokens))
        batch.run()
        return req.result()

    def request(self, prompt_ids: list[int], gen: GenerationConfig, spec: SpecConfig | Plan | None = None,
                on_tokens: Callable[[list[int]], None] | None = None) -> Request:
        """A checked prompt's state before prefill (nothing allocated yet). `spec` is this request's Plan, or the
        settings it is planned from (self.plan)."""
        plan = spec if isinstance(spec, Plan) else self.plan(spec)
        max_pos, vocab = self.target.config.max_position_embeddings, self.target.config.vocab_size
        if not prompt_ids:
            raise WhiflashError("prompt is empty")
        if len(prompt_ids) >= max_pos:
            raise WhiflashError(f"prompt has {len(prompt_ids)} tokens; the model's context is {max_pos} tokens")
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise WhiflashError(f"prompt holds token ids outside the vocabulary [0, {vocab})")
        generator = torch.Generator(device=self.device)
        generator.manual_seed(gen.sampling.seed if gen.sampling.seed is not None else torch.seed())
        stopper = StopChecker(gen, self.eos_ids, self.decode, max_pos - len(prompt_ids))
        seq = Sequence(prompt_ids, self.kv.allocator, self.kv.block_size)
        return Request(seq, gen, plan.spec, plan.proposers, plan.router, generator, stopper, on_tokens)

    def slots_needed(self, req: Request) -> int:
        """KV slots `req` can ever use: a round starts with at most prompt + limit - 2 tokens committed (the output,
        its pending bonus included, is still below the limit) and writes its draft past them."""
        prompt = len(req.seq.prompt_ids)
        limit = min(req.gen.max_new_tokens, self.target.config.max_position_embeddings - prompt)
        slack = max((slots_per_round(p) for p in req.proposers.values()), default=1)
        return max(prompt, prompt + limit - 2 + slack)

    def kv_mb(self, num_slots: int) -> int:
        """KV memory (MB, rounded up) that `num_slots` slots take in every pool."""
        blocks = -(-num_slots // self.kv.block_size)
        return -(-blocks * self.kv.bytes_per_block_id // 2**20)
