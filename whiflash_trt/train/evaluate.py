"""Acceptance length through the real runtime: Engine.generate on validation prompts, greedy, per category.

The drafters are loaded from their public checkpoint folders (load_eagle3 / load_dflash), exactly as a built engine
loads them, so what is measured here is what `whiflash-run` will see. Every speculative output is checked against
the target-only output (lossless).
"""
from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

from whiflash_trt.config import (AR, DFLASH, EAGLE3, WHIFLASH, CacheConfig, DFlashTreeConfig, GenerationConfig,
                                 SpecConfig, TreeConfig)
from whiflash_trt.models.target import TargetModel
from whiflash_trt.runtime.engine import Engine
from whiflash_trt.runtime.loading import checkpoint_parts
from whiflash_trt.train.sources import PromptRecord
from whiflash_trt.runtime.tokenizer_policy import chat_ids


def make_engine(target: TargetModel, tokenizer, eagle3: Path | None = None, dflash: Path | None = None,
                router: Path | None = None, kv_budget_mb: int = 256) -> Engine:
    return Engine(checkpoint_parts(target, tokenizer, "cpu", eagle3, dflash, router),
                  CacheConfig(memory_budget_bytes=kv_budget_mb * 2**20))


def evaluate(engine: Engine, prompts: list[PromptRecord], specs: dict[str, SpecConfig], max_new_tokens: int = 96,
             progress=None) -> dict:
    """-> {name: {category: {"tau", "rounds", "tokens", "seconds", "tokens_per_s"}, ...,"mix": {...}}, "lossless"}."""
    gen = GenerationConfig(max_new_tokens=max_new_tokens)
    sums: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
    lossless = True
    items = list(prompts)
    for record in (progress(items) if progress else items):
        ids = chat_ids(engine.tokenizer, record.messages)
        reference = None
        for name, spec in specs.items():
            start = time.perf_counter()
            result = engine.generate(ids, gen, spec=spec)
            seconds = time.perf_counter() - start
            if spec.mode == AR:
                reference = result.token_ids
            elif reference is not None and result.token_ids != reference:
                lossless = False
            taus = result.stats.get("taus_raw") or [t for _, t in result.stats.get("trace", [])]
            for key in (record.category, "mix"):
                s = sums[name][key]
                s["tau_sum"] += sum(taus)
                s["rounds"] += len(taus)
                s["tokens"] += len(result.token_ids)
                s["seconds"] += seconds
                for d, n in result.stats.get("rounds_per_drafter", {}).items():
                    s[f"rounds_{d}"] += n
                for phase, sec in result.stats.get("phase_seconds", {}).items():
                    s[f"phase_{phase}"] += sec
    out: dict = {"lossless": lossless}
    for name, cats in sums.items():
        out[name] = {}
        for cat, s in cats.items():
            out[name][cat] = {"tau": round(s["tau_sum"] / s["rounds"], 3) if s["rounds"] else None,
                              "rounds": int(s["rounds"]), "tokens": int(s["tokens"]),
                              "seconds": round(s["seconds"], 2),
                              "tokens_per_s": round(s["tokens"] / s["seconds"], 2) if s["seconds"] else None}
            for k, v in s.items():
                if k.startswith("rounds_"):
                    out[name][cat][k] = int(v)
                if k.startswith("phase_") and cat == "mix":   # seconds per round in each phase
                    out[name][cat][k + "_per_round"] = round(v / max(1.0, s["rounds"]), 5)
    return out


def default_specs(has_eagle3: bool, has_dflash: bool, has_router: bool, tree: TreeConfig = TreeConfig(),
                  neural_threshold: float | None = None, dflash_tree: DFlashTreeConfig = DFlashTreeConfig()
                  ) -> dict[str, SpecConfig]:
    """One SpecConfig per mode the given parts allow; `tree` shapes EAGLE-3's drafts and `dflash_tree` DFlash's;
    `neural_threshold` overrides the router file's calibrated one."""
    specs = {AR: SpecConfig(mode=AR)}
    if has_eagle3:
        specs[EAGLE3] = SpecConfig(mode=EAGLE3, tree=tree)
    if has_dflash:
        specs[DFLASH] = SpecConfig(mode=DFLASH, dflash_tree=dflash_tree)
    if has_eagle3 and has_dflash:
        specs["whiflash-entropy"] = SpecConfig(mode=WHIFLASH, router="entropy", tree=tree, dflash_tree=dflash_tree)
        if has_router:
            specs["whiflash-neural"] = SpecConfig(mode=WHIFLASH, router="neural", threshold=neural_threshold,
                                                  tree=tree, dflash_tree=dflash_tree)
    return specs
