"""Which target-only decode configuration is fastest on this machine? (the `ar` baseline of whiflash-bench must be)

Decodes the same chat prompt greedily with the engine's target alone, in configurations interleaved round by round:

    engine-ar   Engine.generate(mode="ar"): the real baseline, round loop and stats included
    step1       a bare loop of 1-token target steps (runner.step, argmax, commit)
    step1-sig   step1 plus what the engine's ar round computes but ar never needs (entropy of the logits)
    step2-pad   2-token steps [pending, pending]: the second row is padding whose K/V is overwritten next step
    stepQ       raw time of one step of q new tokens (q = 1..4) on the same context, without decoding

each at every torch thread count asked for, and reports the median decode time per token, plus whether each
configuration reproduces step1's tokens.

    python scripts/bench_ar_step.py [--engine DIR] [--dtype bf16] [--tokens 64] [--rounds 5] [--threads 1,2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch


def decode_loop(engine, prompt: list[int], num_tokens: int, width: int, entropy: bool) -> tuple[float, list[int]]:
    """Greedy target-only decode with `width`-token steps (width - 1 rows of padding). -> (s/token, tokens)."""
    from whiflash_trt.spec.router import entropy_of

    with engine.scratch_sequence(prompt) as seq:
        out = engine.runner.step(seq, prompt, logits_rows=[len(prompt) - 1])
        seq.commit(prompt, int(out.logits[-1].argmax()))
        tokens = [seq.pending]
        start = time.perf_counter()
        for _ in range(num_tokens - 1):
            seq.reserve(seq.num_committed + width)
            out = engine.runner.step(seq, [seq.pending] * width, logits_rows=[0])
            if entropy:
                entropy_of(out.logits[0])
            seq.commit([seq.pending], int(out.logits[0].argmax()))
            tokens.append(seq.pending)
        return (time.perf_counter() - start) / (num_tokens - 1), tokens


def engine_ar(engine, prompt: list[int], num_tokens: int) -> tuple[float, list[int]]:
    from whiflash_trt.config import GenerationConfig, SpecConfig

    r = engine.generate(prompt, GenerationConfig(max_new_tokens=num_tokens, ignore_eos=True), spec=SpecConfig())
    s = r.stats
    return (s["seconds"] - s["prefill_seconds"]) / (len(r.token_ids) - 1), r.token_ids


def step_time(engine, prompt: list[int], q: int, iters: int) -> float:
    with engine.scratch_sequence(prompt, len(prompt) + q) as seq:
        engine.runner.step(seq, prompt)
        seq.commit(prompt, 0)
        start = time.perf_counter()
        for _ in range(iters):
            engine.runner.step(seq, prompt[:q], logits_rows=[0])
        return (time.perf_counter() - start) / iters


def main() -> None:
    from whiflash_trt.builder.default_engine import DEFAULT_CACHE_DIR, default_engine
    from whiflash_trt.runtime.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded per configuration per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20, help="steps per raw step timing")
    ap.add_argument("--threads", default=str(torch.get_num_threads()),
                    help="comma-separated torch thread counts to compare (default: torch's choice)")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    engine = Engine.load(args.engine or default_engine(DEFAULT_CACHE_DIR), dtype=args.dtype)
    prompt = engine.encode("Explain how a hash map works, then write a short Python example that counts words.",
                           chat=True)
    print(f"torch {torch.__version__}, threads {threads}, dtype {args.dtype}, prompt {len(prompt)} tokens, "
          f"{args.tokens} tokens per run, {args.rounds} rounds, load average {os.getloadavg()}", flush=True)
    kinds = {
        "engine-ar": lambda: engine_ar(engine, prompt, args.tokens),
        "step1": lambda: decode_loop(engine, prompt, args.tokens, 1, entropy=False),
        "step1-sig": lambda: decode_loop(engine, prompt, args.tokens, 1, entropy=True),
        "step2-pad": lambda: decode_loop(engine, prompt, args.tokens, 2, entropy=False),
    }
    configs = [(t, k) for t in threads for k in kinds]
    times: dict[tuple, list[float]] = {c: [] for c in configs}
    tokens: dict[tuple, list[int]] = {}
    for t, k in configs:
        torch.set_num_threads(t)
        kinds[k]()  # warm-up
    for r in range(args.rounds):
        for t, k in configs[r % len(configs):] + configs[:r % len(configs)]:
            torch.set_num_threads(t)
            seconds, tokens[(t, k)] = kinds[k]()
            times[(t, k)].append(seconds)
    ref = tokens[(threads[0], "step1")]
    base = statistics.median(times[(threads[0], "step1")])
    print(f"threads config     ms/token  tokens/s  vs step1@{threads[0]}  same tokens as step1@{threads[0]}")
    for t, k in configs:
        med = statistics.median(times[(t, k)])
        print(f"{t:7} {k:10} {med * 1e3:9.2f} {1 / med:9.2f} {base / med:10.3f}x  {tokens[(t, k)] == ref}",
              flush=True)
    print("raw step time on the prompt's context (q new tokens, logits for one row):")
    for t in threads:
        torch.set_num_threads(t)
        raw = {q: [] for q in (1, 2, 3, 4)}
        for _ in range(args.rounds):
            for q in raw:
                raw[q].append(step_time(engine, prompt, q, args.iters))
        one = statistics.median(raw[1])
        print(f"  threads {t}: " + ", ".join(f"q={q} {statistics.median(ts) * 1e3:.2f} ms "
                                               f"({statistics.median(ts) / one:.3f}x)" for q, ts in raw.items()),
              flush=True)
    print(f"load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
