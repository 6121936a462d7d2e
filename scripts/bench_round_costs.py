"""What one speculative round costs on this CPU, split into draft and verify, with random-weight drafters of the
sizes we intend to train for the embedded SmolLM2-135M target; and the KV-only catch-up cost per backlog token.

    python scripts/bench_round_costs.py [--dflash-layers 2] [--block-size 8] [--draft-vocab 8192] [--tokens 48]

Random drafters accept almost nothing (tau ~ 1), so a round here is one draft plus one verify of the full tree or
block: exactly the cost a trained drafter pays per round. Divide by the ar step time to see the tau each needs.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from whiflash_trt.config import CacheConfig, GenerationConfig, RopeConfig, SpecConfig, TreeConfig
from whiflash_trt.models.dflash import DFlashConfig, DFlashDrafter, default_target_layer_ids
from whiflash_trt.models.eagle3 import Eagle3Config, Eagle3Drafter
from whiflash_trt.runtime.engine import Engine
from whiflash_trt.runtime.loading import EngineParts


def drafters(target, args, dtype):
    h, n = target.hidden_size, target.num_layers
    torch.manual_seed(0)
    eagle = Eagle3Drafter(Eagle3Config(h, target.intermediate_size, target.num_heads, target.num_kv_heads,
                                       target.head_dim, target.rms_norm_eps, target.vocab_size, args.draft_vocab, h,
                                       target.max_position_embeddings, RopeConfig(), (2, n // 2, n - 3)))
    eagle.d2t.zero_()
    dflash = DFlashDrafter(DFlashConfig(h, target.intermediate_size, args.dflash_layers, target.num_heads,
                                        target.num_kv_heads, target.head_dim, target.rms_norm_eps, target.vocab_size,
                                        target.max_position_embeddings, RopeConfig(theta=target.rope.theta),
                                        args.block_size, target.vocab_size,
                                        default_target_layer_ids(n, args.dflash_layers)), h, True)
    return eagle.to(dtype=dtype), dflash.to(dtype=dtype)


def per_round(engine, prompt, spec, tokens, repeats):
    rows = []
    for _ in range(repeats):
        r = engine.generate(prompt, GenerationConfig(max_new_tokens=tokens, ignore_eos=True), spec=spec)
        rounds = max(r.stats["rounds"], 1)
        rows.append({k: v / rounds * 1000 for k, v in r.stats["phase_seconds"].items()})
    return {k: statistics.median(row[k] for row in rows) for k in rows[0]}


def catch_up_ms(engine, proposer, backlog, repeats=5):
    prompt = list(range(100, 100 + backlog + 2))
    times = []
    for _ in range(repeats):
        with engine.scratch_sequence(prompt, len(prompt) + 1) as seq:
            out = engine.runner.step(seq, prompt, logits_rows=[len(prompt) - 1], capture=True)
            seq.commit(prompt, 5, out.captured, {proposer.name: 0})
            t = time.perf_counter()
            proposer.catch_up(seq)
            times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main() -> None:
    from whiflash_trt.builder.default_engine import DEFAULT_CACHE_DIR, default_engine

    ap = argparse.ArgumentParser()
    ap.add_argument("--dflash-layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base = Engine.load(default_engine(DEFAULT_CACHE_DIR))
    eagle, dflash = drafters(base.target.config, args, base.target.dtype)
    engine = Engine(EngineParts(base.target, base.tokenizer, eagle, dflash, manifest=base.manifest), CacheConfig())
    prompt = engine.encode("Write a Python function that parses a CSV line into a list of fields.", chat=True)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, dtype "
          f"{engine.target.dtype}, prompt {len(prompt)} tokens")
    specs = {"ar": SpecConfig("ar"),
             "eagle3 tree k4 d5 n16": SpecConfig("eagle3", tree=TreeConfig(4, 5, 16)),
             "eagle3 chain d4": SpecConfig("eagle3", tree=TreeConfig(1, 4, 5)),
             f"dflash B={args.block_size} L={args.dflash_layers}": SpecConfig("dflash")}
    engine.generate(prompt, GenerationConfig(max_new_tokens=8), spec=specs["ar"])  # warm-up
    results = {name: per_round(engine, prompt, spec, args.tokens, args.repeats) for name, spec in specs.items()}
    ar_ms = results["ar"]["verify"]
    print(f"{'mode':28} {'draft ms':>9} {'verify ms':>10} {'round ms':>9} {'x ar step':>9}  tau to break even")
    for name, r in results.items():
        total = sum(r.values())
        print(f"{name:28} {r['draft']:9.2f} {r['verify']:10.2f} {total:9.2f} {total / ar_ms:9.2f}  {total / ar_ms:.2f}")
    for name, proposer in engine.proposers.items():
        costs = {b: catch_up_ms(engine, proposer, b) for b in (1, 8, 32, 128)}
        print(f"catch-up {name}: " + ", ".join(f"backlog {b}: {ms:.2f} ms ({ms / b:.3f} ms/token)"
                                               for b, ms in costs.items()))


if __name__ == "__main__":
    main()
