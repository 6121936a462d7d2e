"""Seconds of one DFlash draft (per layer count and block size) and one EAGLE-3 tree draft next to the target
verify of the same number of tokens, through the runtime pieces, on this machine (bf16, one thread by default).

    python scripts/bench_drafter_rounds.py [--context 300] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from whiflash_trt.config import DFLASH, EAGLE3, TreeConfig
from whiflash_trt.models.drafter_checkpoints import save_dflash, save_eagle3
from whiflash_trt.train.dflash_trainer import DFlashOptions, make_drafter as make_dflash
from whiflash_trt.train.eagle3_trainer import Eagle3Options, make_drafter as make_eagle3
from whiflash_trt.train.evaluate import make_engine
from whiflash_trt.train.target import load_target


def timed(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target, tok = load_target(args.target, "bf16")
    n_layers = target.config.num_layers
    capture = (1, n_layers // 2 - 1, n_layers - 4)
    results = []
    for layers, block in [(1, 8), (2, 8), (3, 8), (2, 16), (4, 16)]:
        with tempfile.TemporaryDirectory() as d:
            opts = DFlashOptions(num_layers=layers, draft_block_len=block)
            save_dflash(make_dflash(target, capture, opts), d, n_layers)
            engine = make_engine(target, tok, dflash=d)
        ids = torch.randint(100, 40000, (args.context,)).tolist()
        with engine.scratch_sequence(ids, args.context + block) as seq:
            out = engine.runner.step(seq, ids, capture=True)
            seq.commit(ids, 5, out.captured, {DFLASH: 0})
            prop = engine.proposers[DFLASH]
            prop.catch_up(seq)
            draft = timed(lambda: prop.propose(seq), args.repeats)
            verify = timed(lambda: engine.runner.step(seq, [5] * block, capture=True), args.repeats)
            one = timed(lambda: engine.runner.step(seq, [5], capture=True), args.repeats)
        results.append({"drafter": "dflash", "layers": layers, "block_size": block, "draft_s": round(draft, 4),
                        "verify_s": round(verify, 4), "ar_step_s": round(one, 4)})
        print(json.dumps(results[-1]), flush=True)
    vocab = torch.arange(8192)
    with tempfile.TemporaryDirectory() as d:
        save_eagle3(make_eagle3(target, vocab, Eagle3Options()), d)
        engine = make_engine(target, tok, eagle3=d)
    ids = torch.randint(100, 40000, (args.context,)).tolist()
    shape = TreeConfig()
    with engine.scratch_sequence(ids, args.context + shape.total_tokens + shape.depth * shape.top_k) as seq:
        out = engine.runner.step(seq, ids, capture=True)
        seq.commit(ids, 5, out.captured, {EAGLE3: 0})
        prop = engine.proposers[EAGLE3].with_tree(shape)
        prop.catch_up(seq)
        tree = prop.propose(seq).tree
        draft = timed(lambda: prop.propose(seq), args.repeats)
        verify = timed(lambda: engine.runner.step(seq, tree.tokens, depths=tree.depths, tree_mask=tree.mask(),
                                                  capture=True), args.repeats)
    print(json.dumps({"drafter": "eagle3", "tree": [shape.top_k, shape.depth, shape.total_tokens],
                      "draft_s": round(draft, 4), "verify_s": round(verify, 4)}), flush=True)


if __name__ == "__main__":
    main()
