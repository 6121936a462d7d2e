"""This machine's memory roofline for an engine's decode step: the streaming rates it reaches (a plain read and the
best matrix-vector kernel), the bytes one step reads, and the limit in ms per step and tokens/s. Then the floor of a
T-row verify: its bytes, or T rows of GEMM multiply-adds at the bf16 GEMM's measured compute rate, whichever is
slower (the GEMMs only). With --decode-turns N, the engine's own decode step against the plain read, timed in N
alternating turns: the step as a multiple of the roofline, side by side (the read rate of a shared machine swings).

    python scripts/roofline.py [--engine DIR] [--threads 2] [--context 512] [--decode-turns 15]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from whiflash_trt.bench.environment import cpu_model, default_engine_dir
from whiflash_trt.bench.roofline import (interleaved_decode, measure_gemm_compute, measure_stream_rates,
                                       native_weight_bytes, roofline, verify_floor)
from whiflash_trt.config import parse_dtype
from whiflash_trt.manifest import Manifest
from whiflash_trt.runtime.loading import load_engine_kernels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", help="engine directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--context", type=int, default=512, help="tokens in the KV cache a step attends to")
    p.add_argument("--decode-turns", type=int, default=0, help="time the engine's decode step against the plain read "
                   "in this many alternating turns (0: not)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine_dir = args.engine or default_engine_dir()
    manifest = Manifest.read(engine_dir)
    load_engine_kernels(Path(engine_dir), manifest)   # its bf16 GEMM is one of the kernels measured
    cfg = manifest.model
    rates = measure_stream_rates(cfg.hidden_size, cfg.intermediate_size)
    dtype = parse_dtype(manifest.dtype)
    engine = None
    if args.decode_turns or manifest.weights == "native":
        from whiflash_trt.runtime.engine import Engine
        engine = Engine.load(engine_dir)
    weights = engine and native_weight_bytes(engine)
    result = roofline(cfg, dtype, args.context, rates, weights)
    compute = measure_gemm_compute(cfg.hidden_size)
    result["gemm_compute"] = {"gmacs": compute.gmacs, "kernel": compute.kernel, "threads": compute.threads}
    result["verify_floor"] = verify_floor(cfg, dtype, args.context, rates, compute, weights=weights)
    if args.decode_turns:
        result["decode"] = interleaved_decode(engine, args.context, args.decode_turns)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    b = result["bytes"]
    print(f"CPU: {cpu_model()}, {args.threads} threads")
    print(f"plain read {rates.plain_read} GB/s; " + "; ".join(f"{k} {v} GB/s" for k, v in rates.kernels.items()))
    print(f"one step reads {b['weights'] / 1e6:.1f} MB of weights ({manifest.weights}) + {b['kv_cache'] / 1e6:.1f} MB "
          f"of KV at {args.context} tokens")
    print(f"roofline: {result['limit_ms_per_step']} ms per step = {result['limit_tokens_per_s']} tokens/s")
    print(f"GEMM compute ({compute.kernel}, {cfg.hidden_size}x{cfg.hidden_size} weight in cache, 64 rows): "
          f"{compute.gmacs} G multiply-adds/s")
    for t, f in result["verify_floor"].items():
        print(f"a {t}-row step: >= {f['floor_ms']} ms ({f['memory_ms']} ms of bytes, {f['compute_ms']} ms of GEMM "
              f"multiply-adds) = {f['floor_ms'] / result['limit_ms_per_step']:.2f}x the decode roofline")
    if args.decode_turns:
        d = result["decode"]
        lo, hi = d["step_over_roofline_range"]
        print(f"the engine's decode step at {d['context']} tokens against the plain read, {d['turns']} alternating "
              f"turns: step {d['step_ms']} ms, roofline {d['roofline_ms']} ms (read {d['plain_read_gbs']} GB/s); step / "
              f"roofline {d['step_over_roofline']} (median of turns; {lo}-{hi})")


if __name__ == "__main__":
    main()
