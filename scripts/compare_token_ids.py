"""Greedy token ids of the bench's prompts in every mode, as JSON, to check that a refactor changes no output.

    python scripts/compare_token_ids.py --out before.json      # on the old checkout (PYTHONPATH=old-checkout)
    python scripts/compare_token_ids.py --out after.json       # on the new one
    python scripts/compare_token_ids.py --compare before.json after.json

Each run also checks every speculative mode against `ar` (they must be equal: greedy decoding is lossless).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from whiflash_trt.bench.prompts import load_prompts
from whiflash_trt.builder.default_engine import default_engine
from whiflash_trt.config import GenerationConfig, SpecConfig
from whiflash_trt.runtime.engine import Engine

SPECS = {"ar": SpecConfig(mode="ar"), "eagle3": SpecConfig(mode="eagle3"), "dflash": SpecConfig(mode="dflash"),
         "suffix": SpecConfig(mode="suffix"),
         "whiflash-entropy": SpecConfig(mode="whiflash", router="entropy"),
         "whiflash-neural": SpecConfig(mode="whiflash", router="neural"),
         "whiflash-eager": SpecConfig(mode="whiflash", router="entropy", catch_up="eager")}


def token_ids(dtype: str, per_category: int, max_new_tokens: int) -> dict[str, list[int]]:
    """prompt id / mode -> greedy token ids, on the default engine (fp32 on its torch modules)."""
    engine = Engine.load(default_engine(), dtype=dtype, backend=None if dtype == "bf16" else "torch")
    gen = GenerationConfig(max_new_tokens=max_new_tokens)
    result = {}
    for prompt in load_prompts(None, per_category):
        ids = engine.encode(prompt.prompt, chat=True)
        for mode, spec in SPECS.items():
            result[f"{prompt.id}/{mode}"] = engine.generate(ids, gen, spec=spec).token_ids
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--per-category", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.compare:
        before, after = (json.load(open(path)) for path in args.compare)
        differ = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        print(f"{len(before)} / {len(after)} runs, {sum(map(len, before.values()))} tokens; differ: {differ}")
        return 1 if differ else 0
    if not args.out:
        parser.error("--out or --compare is needed")
    torch.set_num_threads(args.threads)
    result = token_ids(args.dtype, args.per_category, args.max_new_tokens)
    with open(args.out, "w") as f:
        json.dump(result, f)
    ar = {k.rsplit("/", 1)[0]: v for k, v in result.items() if k.endswith("/ar")}
    lossy = [k for k, v in result.items() if v != ar[k.rsplit("/", 1)[0]]]
    print(f"{args.out}: {len(result)} runs; differ from ar: {lossy}")
    return 1 if lossy else 0


if __name__ == "__main__":
    sys.exit(main())
