"""Time of whiflash::paged_attention over SmolLM2-135M's 30 layers (9 query heads, 3 KV heads of 64, bf16) for a
call of R rows over a context of N keys: R rows of one sequence, each seeing the context and the rows before it (a
verify's chain). Before each turn a 64 MB write evicts the pools from cache, as a decode step's weights do; the
median of --turns is printed per (rows, keys) as `rows keys ms`.

    HOME=... python scripts/bench_attention.py --rows 1,3,6 --keys 128,512,1024 --threads 2

To compare two versions of the kernel, run it from each checkout in turn (alternating processes: the library is
loaded once per process).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from whiflash_trt import kernels

LAYERS, SLOTS, KV_HEADS, HEADS, DIM = 30, 2048, 3, 9, 64


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,3,6", help="rows per call, comma-separated")
    p.add_argument("--keys", default="128,512,1024", help="context keys, comma-separated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--turns", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.ensure_loaded():
        raise SystemExit("the kernels cannot be loaded here")
    gen = torch.Generator().manual_seed(0)
    pools = [torch.randn(LAYERS, SLOTS, KV_HEADS, DIM, generator=gen).bfloat16() for _ in range(2)]
    evict = torch.ones(16 * 2 ** 20)
    for rows in (int(r) for r in args.rows.split(",")):
        q = torch.randn(rows, HEADS, DIM, generator=gen).bfloat16()
        k, v = (torch.randn(rows, KV_HEADS, DIM, generator=gen).bfloat16() for _ in range(2))
        cos, sin = (torch.randn(rows, DIM, generator=gen).bfloat16() for _ in range(2))
        for keys in (int(n) for n in args.keys.split(",")):
            slots = torch.arange(keys + rows).repeat(rows, 1)
            lengths, write = torch.arange(keys + 1, keys + rows + 1), torch.arange(keys, keys + rows)
            times = []
            for _ in range(args.turns):
                evict.add_(1.0)
                start = time.perf_counter()
                for layer in range(LAYERS):
                    kernels.paged_attention(q, k, v, *pools, layer, write, slots, lengths, DIM ** -0.5, cos, sin)
                times.append(time.perf_counter() - start)
            print(f"{rows} {keys} {statistics.median(times) * 1e3:.3f}")


if __name__ == "__main__":
    main()
