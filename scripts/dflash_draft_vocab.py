"""DFlash drafting from its draft vocabulary against the whole vocabulary, side by side (issue 13, item 3).

The default engine's DFlash proposer runs in turn with its draft-vocabulary head (the target lm_head's rows of the
checkpoint's d2t ids) and with the target's full lm_head, on held-out benchmark prompts (prompts SKIP.. of each
category: whiflash-bench measures the first ones), in alternating order per prompt; both outputs must equal each
other (each equals `ar`'s). Prints tau, tokens/s and draft ms per round per category.

    python scripts/dflash_draft_vocab.py --num-prompts 5 --max-new-tokens 96 --threads 2
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from whiflash_trt.bench.prompts import add_held_out_options, held_out_prompts
from whiflash_trt.builder.default_engine import default_engine
from whiflash_trt.config import DFLASH, GenerationConfig, SpecConfig
from whiflash_trt.runtime.device import cpu_model
from whiflash_trt.runtime.engine import Engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_held_out_options(p)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.load(default_engine())
    proposer = engine.proposers[DFLASH]
    if proposer.vocab is None:
        raise SystemExit("this engine's DFlash has no draft vocabulary")
    heads = {"draft vocab": (proposer.vocab, proposer.head), "full vocab": (None, None)}
    spec, gen = SpecConfig(mode="dflash"), GenerationConfig(max_new_tokens=args.max_new_tokens)
    prompts = held_out_prompts(args.num_prompts, args.skip)
    print(f"{cpu_model()}, {args.threads} threads; draft vocabulary {len(proposer.vocab)} ids")
    engine.generate(engine.encode(prompts[0].prompt, chat=True), GenerationConfig(max_new_tokens=16), spec=spec)
    sums: dict = defaultdict(lambda: defaultdict(float))
    for i, prompt in enumerate(prompts):
        ids, outputs = engine.encode(prompt.prompt, chat=True), {}
        for name in (list(heads) if i % 2 == 0 else list(heads)[::-1]):
            proposer.vocab, proposer.head = heads[name]
            start = time.perf_counter()
            out = engine.generate(ids, gen, spec=spec)
            seconds = time.perf_counter() - start
            outputs[name] = out.token_ids
            for cat in (prompt.category, "all"):
                s = sums[(cat, name)]
                s["tokens"] += len(out.token_ids)
                s["rounds"] += out.stats["rounds"]
                s["seconds"] += seconds
                s["draft"] += out.stats["phase_seconds"]["draft"]
        assert len(set(map(tuple, outputs.values()))) == 1, f"{prompt.id}: the outputs differ"
    proposer.vocab, proposer.head = heads["draft vocab"]
    print("| category | head | tau | tokens/s | draft ms / round |\n|---|---|---|---|---|")
    for (cat, name), s in sums.items():
        print(f"| {cat} | {name} | {s['tokens'] / s['rounds']:.3f} | {s['tokens'] / s['seconds']:.1f} | "
              f"{1e3 * s['draft'] / s['rounds']:.2f} |")


if __name__ == "__main__":
    main()
