"""Draft-tree shapes side by side: EAGLE-3's (top-k, depth, nodes) and DFlash's nodes, against `ar`, in one process.

Every variant runs on every prompt in a rotating order (the machine is shared and noisy: compare within a run), on
held-out benchmark prompts (prompts SKIP.. of each category; whiflash-bench measures the first ones), greedy, so
every variant's output is `ar`'s (checked). Prints per variant: tokens/s of the decode rounds (the tokens they made
over their time; prefill left out), ms per round, draft ms per round, tau and the speed-up over `ar`. This is how
the default trees (config.TreeConfig, runtime.tree_defaults) were chosen. A shape may end in @P, its
probability floor (min_prob; without it the tree has none).

    python scripts/compare_tree_shapes.py --eagle3 3,4,6 3,2,6 3,3,10@0.05 --dflash 6 5 8@0.05 --num-prompts 5 \
        --threads 2
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from whiflash_trt.bench.prompts import add_held_out_options, held_out_prompts
from whiflash_trt.builder.default_engine import default_engine
from whiflash_trt.config import AR, DFLASH, EAGLE3, DFlashTreeConfig, GenerationConfig, SpecConfig, TreeConfig
from whiflash_trt.runtime.device import cpu_model
from whiflash_trt.runtime.engine import Engine


def variants(eagle3: list[str], dflash: list[str]) -> dict[str, SpecConfig]:
    """ar, then "eagle3 k,d,n[@p]" for each top-k,depth,nodes (and floor) and "dflash n[@p]" for each node count."""
    specs = {AR: SpecConfig(mode=AR)}
    for shape in eagle3:
        sizes, _, floor = shape.partition("@")
        top_k, depth, nodes = (int(x) for x in sizes.split(","))
        specs[f"{EAGLE3} {shape}"] = SpecConfig(mode=EAGLE3, tree=TreeConfig(top_k, depth, nodes, float(floor or 0)))
    for shape in dflash:
        nodes, _, floor = shape.partition("@")
        specs[f"{DFLASH} {shape}"] = SpecConfig(mode=DFLASH, dflash_tree=DFlashTreeConfig(
            total_tokens=int(nodes), min_prob=float(floor or 0)))
    return specs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--eagle3", nargs="*", default=[], metavar="K,D,N[@P]",
                   help="EAGLE-3 trees: top-k,depth,nodes[@probability floor]")
    p.add_argument("--dflash", nargs="*", default=[], metavar="N[@P]", help="DFlash trees: nodes[@probability floor]")
    add_held_out_options(p)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.load(default_engine())
    specs = variants(args.eagle3, args.dflash)
    names = list(specs)
    prompts = held_out_prompts(args.num_prompts, args.skip)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)
    warm = engine.encode(prompts[0].prompt, chat=True)
    for spec in specs.values():
        engine.generate(warm, GenerationConfig(max_new_tokens=16), spec=spec)
    seconds, draft, rounds, tokens = (defaultdict(float) for _ in range(4))
    for i, prompt in enumerate(prompts):
        ids = engine.encode(prompt.prompt, chat=True)
        outputs = {}
        for j in range(len(names)):
            name = names[(i + j) % len(names)]
            result = engine.generate(ids, gen, spec=specs[name])
            phases = result.stats["phase_seconds"]
            seconds[name] += sum(phases.values())
            draft[name] += phases["draft"]
            rounds[name] += result.stats["rounds"]
            tokens[name] += result.stats["tau"] * result.stats["rounds"]   # the tokens the rounds made
            outputs[name] = result.token_ids
        if any(out != outputs[AR] for out in outputs.values()):
            raise SystemExit(f"prompt {prompt.id}: a variant's output differs from ar's")
    print(f"{cpu_model()}, {args.threads} threads, {len(prompts)} prompts, {args.max_new_tokens} new tokens")
    base = tokens[AR] / seconds[AR]
    for name in names:
        rate = tokens[name] / seconds[name]
        print(f"{name:20s} tok/s {rate:7.1f}  ms/round {1e3 * seconds[name] / rounds[name]:6.2f}  draft "
              f"{1e3 * draft[name] / rounds[name]:5.2f}  tau {tokens[name] / rounds[name]:.3f}  speed-up "
              f"{rate / base:.3f}")


if __name__ == "__main__":
    main()
