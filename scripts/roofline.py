"""This machine's memory roofline for an engine's decode step: the streaming rates it reaches (a plain read and the
best matrix-vector kernel), the bytes one step reads, and the limit in ms per step and tokens/s.

    python scripts/roofline.py [--engine DIR] [--threads 2] [--context 512]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from whiflash_trt.bench.environment import cpu_model, default_engine_dir
from whiflash_trt.bench.roofline import measure_stream_rates, roofline
from whiflash_trt.config import parse_dtype
from whiflash_trt.manifest import Manifest
from whiflash_trt.runtime.loading import load_engine_kernels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", help="engine directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--context", type=int, default=512, help="tokens in the KV cache a step attends to")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine_dir = args.engine or default_engine_dir()
    manifest = Manifest.read(engine_dir)
    load_engine_kernels(Path(engine_dir), manifest)   # its bf16 GEMM is one of the kernels measured
    cfg = manifest.model
    rates = measure_stream_rates(cfg.hidden_size, cfg.intermediate_size)
    result = roofline(cfg, parse_dtype(manifest.dtype), args.context, rates)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    b = result["bytes"]
    print(f"CPU: {cpu_model()}, {args.threads} threads")
    print(f"plain read {rates.plain_read} GB/s; " + "; ".join(f"{k} {v} GB/s" for k, v in rates.kernels.items()))
    print(f"one step reads {b['weights'] / 1e6:.1f} MB of weights ({manifest.dtype}) + {b['kv_cache'] / 1e6:.1f} MB "
          f"of KV at {args.context} tokens")
    print(f"roofline: {result['limit_ms_per_step']} ms per step = {result['limit_tokens_per_s']} tokens/s")


if __name__ == "__main__":
    main()
