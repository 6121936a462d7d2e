"""The bf16 GEMM over SmolLM2-135M's linears (30 layers: fused QKV 960 x 576, o_proj 576 x 576, gate_up 3072 x 576,
down 576 x 1536; the LM head 49152 x 576), against torch's fp32 F.linear on the same shapes, at 1 and 6 rows.
Every weight is its own memory (269 MB bf16, 538 MB fp32), so both stream from memory as an engine's step does; the
two run alternated in one process, `turns` times, and the medians are printed with the bytes read per second.

    HOME=... python -m whiflash_trt.kernels.bench [--threads 2] [--turns 9]

With --native FILE (a native engine's target-native.safetensors: its GGUF blocks packed for ggml_gemm.h) it times
those blocks instead, by kind of linear, against the bytes they stream.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from whiflash_trt import kernels

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152
SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * LAYERS + [
    (VOCAB, HIDDEN)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--turns", type=int, default=9)
    p.add_argument("--rows", default="1,6", help="row counts, comma-separated")
    p.add_argument("--no-torch", action="store_true", help="time the kernel only")
    p.add_argument("--native", type=Path, metavar="FILE",
                   help="time a native engine's GGUF blocks (its target-native.safetensors)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    row_counts = [int(r) for r in args.rows.split(",")]
    if not kernels.ensure_loaded():
        raise SystemExit("the kernels cannot be loaded here")
    if args.native:
        return time_native(args.native, row_counts, args.turns)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).bfloat16() for n, k in SHAPES]
    packed = [kernels.pack_weight(w) for w in weights]
    fp32 = [] if args.no_torch else [w.float() for w in weights]
    bf16_bytes = sum(w.numel() * 2 for w in weights)
    xs = {rows: {k: torch.randn(rows, k, generator=gen).bfloat16() for k in (HIDDEN, INTERMEDIATE)}
          for rows in row_counts}

    def kernel(rows: int) -> None:
        for (n, k), w in zip(SHAPES, packed):
            kernels.linear(xs[rows][k], w, None, n)

    def reference(rows: int) -> None:
        for (n, k), w in zip(SHAPES, fp32):
            F.linear(xs[rows][k].float(), w)

    timed = {"kernel": kernel} if args.no_torch else {"kernel": kernel, "torch": reference}
    runs = {(name, rows): [] for name in timed for rows in row_counts}
    for _ in range(args.turns):
        for rows in row_counts:
            for name, fn in timed.items():
                start = time.perf_counter()
                fn(rows)
                runs[name, rows].append(time.perf_counter() - start)
    print(f"ISA {kernels.loaded_isa()}, GEMM loop {kernels.gemm()}, {args.threads} threads, "
          f"{kernels.cpuinfo('model name')}")
    for (name, rows), seconds in runs.items():
        med = statistics.median(seconds)
        read = bf16_bytes * (2 if name == "torch" else 1)
        print(f"{name:6} {rows} rows: {med * 1e3:7.2f} ms (min {min(seconds) * 1e3:.2f}), {read / med / 1e9:5.1f} GB/s "
              f"of weights ({'fp32' if name == 'torch' else 'bf16'})")


def time_native(path: Path, row_counts: list[int], turns: int) -> None:
    """ms per step of each kind of linear (summed over the layers) and of all, over an engine's packed blocks (`path`),
    every weight its own memory (96 MB for SmolLM2): the kinds take turns, all rows alike."""
    from safetensors.torch import load_file

    if not path.is_file():
        raise SystemExit(f"{path}: no such file (a native engine's target-native.safetensors)")
    blocks = load_file(str(path))
    kinds: dict[str, list[torch.Tensor]] = {}
    for name, w in blocks.items():
        kinds.setdefault(name.rsplit(".", 1)[-1], []).append(w)
    gen = torch.Generator().manual_seed(0)
    runs = {(kind, rows): [] for kind in kinds for rows in row_counts}
    for _ in range(turns):
        for rows in row_counts:
            for kind, ws in kinds.items():
                x = torch.randn(rows, ws[0].shape[1] * 32, generator=gen).bfloat16()
                start = time.perf_counter()
                for w in ws:
                    kernels.linear(x, w, None, w.shape[0] * 8)
                runs[kind, rows].append(time.perf_counter() - start)
    print(f"ISA {kernels.loaded_isa()}, {torch.get_num_threads()} threads, {kernels.cpuinfo('model name')}")
    for rows in row_counts:
        total = 0.0
        for kind, ws in kinds.items():
            med, read = statistics.median(runs[kind, rows]), sum(w.numel() for w in ws)
            total += med
            print(f"{rows} rows {kind:9} x{len(ws):3}: {med * 1e3:6.2f} ms, {read / med / 1e9:5.1f} GB/s of blocks")
        print(f"{rows} rows all: {total * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
