"""Seconds of one DFlash draft (per layer count and block size) and one EAGLE-3 tree draft next to the target
verify of the same number of tokens, through the runtime pieces, on this machine (bf16, one thread by default).

    python scripts/bench_drafter_rounds.py [--context 300] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from whiflash_trt.config import SpecConfig
from whiflash_trt.runtime.sequence import Sequence
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
        from whiflash_trt.models.drafter_checkpoints import save_dflash
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            save_dflash(make_dflash(target, capture, DFlashOptions(num_layers=layers, block_size=block)), d, n_layers)
            engine = make_engine(target, tok, dflash=d)
        ids = torch.randint(100, 40000, (args.context,)).tolist()
        seq = Sequence(ids, engine.allocator, engine.block_size)
        seq.reserve(args.context + block)
        out = engine.runner.step(seq, ids, capture=True)
        seq.commit(ids, 5, out.captured, {"dflash": 0})
        prop = engine.proposers["dflash"]
        prop.catch_up(seq)
        spec = SpecConfig(mode="dflash")
        draft = timed(lambda: prop.propose(seq, spec), args.repeats)
        verify = timed(lambda: engine.runner.step(seq, [5] * block, capture=True), args.repeats)
        one = timed(lambda: engine.runner.step(seq, [5], capture=True), args.repeats)
        seq.free()
        results.append({"drafter": "dflash", "layers": layers, "block_size": block, "draft_s": round(draft, 4),
                        "verify_s": round(verify, 4), "ar_step_s": round(one, 4)})
        print(json.dumps(results[-1]), flush=True)
    vocab = torch.arange(8192)
    import tempfile
    from whiflash_trt.models.drafter_checkpoints import save_eagle3
    with tempfile.TemporaryDirectory() as d:
        save_eagle3(make_eagle3(target, vocab, Eagle3Options()), d)
        engine = make_engine(target, tok, eagle3=d)
    ids = torch.randint(100, 40000, (args.context,)).tolist()
    seq = Sequence(ids, engine.allocator, engine.block_size)
    spec = SpecConfig(mode="eagle3")
    seq.reserve(args.context + spec.tree_total_tokens + spec.tree_depth * spec.tree_top_k)
    out = engine.runner.step(seq, ids, capture=True)
    seq.commit(ids, 5, out.captured, {"eagle3": 0})
    prop = engine.proposers["eagle3"]
    prop.catch_up(seq)
    proposal = prop.propose(seq, spec)
    tree = proposal.tree
    draft = timed(lambda: prop.propose(seq, spec), args.repeats)
    verify = timed(lambda: engine.runner.step(seq, tree.tokens, depths=tree.depths, tree_mask=tree.mask(),
                                              capture=True), args.repeats)
    seq.free()
    print(json.dumps({"drafter": "eagle3", "tree": [spec.tree_top_k, spec.tree_depth, spec.tree_total_tokens],
                      "draft_s": round(draft, 4), "verify_s": round(verify, 4)}), flush=True)


if __name__ == "__main__":
    main()
