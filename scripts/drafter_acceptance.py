"""Per-position acceptance of the DFlash chain and an EAGLE-3 chain on held-out prompts (issue 13, item 1).

    python scripts/drafter_acceptance.py --per-category 6 --max-new-tokens 64 --threads 1

Prints JSON lines:
- runtime: Engine.generate in `dflash` (block chain) and `eagle3` (tree top_k 1, depth 8) mode, greedy; from each round's
  accepted drafts, P(draft k accepted | drafts 1..k-1 accepted), k = 1..depth, and mean tau;
- offline: the same curves with every response position as a round start (train.acceptance), plus for DFlash how often
  a draft lies outside its training-loss vocabulary, and the first-slot hit rate when the argmax is taken over that
  vocabulary only (what the training log's acc1 measures) instead of all of the target's LM-head rows.
The training-loss vocabulary is not saved with the DFlash checkpoint (it lives in the training run's state); both
trainers choose it the same way (the 8192 most frequent tokens of the same data), so EAGLE-3's draft vocabulary (its
t2d mask) stands in for it: `--loss-vocab` says which.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from whiflash_trt.builder.default_engine import DEFAULT_CACHE_DIR, default_engine
from whiflash_trt.config import DFLASH, EAGLE3, DFlashTreeConfig, GenerationConfig, SpecConfig, TreeConfig
from whiflash_trt.runtime.engine import Engine
from whiflash_trt.spec.tree import DraftTree
from whiflash_trt.train.acceptance import conditional_acceptance, greedy_responses, held_out_prompts, round_starts
from whiflash_trt.train.dflash_trainer import DFlashLoss, DFlashOptions
from whiflash_trt.train.router_trainer import accepted_length

EAGLE3_CHAIN = TreeConfig(top_k=1, depth=8, total_tokens=9)


def runtime_curves(engine: Engine, responses, max_new_tokens: int) -> dict:
    chain = DFlashTreeConfig(total_tokens=engine.proposers[DFLASH].draft_block_len, top_k=1)   # the whole block
    specs = {DFLASH: SpecConfig(mode=DFLASH, dflash_tree=chain),
             EAGLE3: SpecConfig(mode=EAGLE3, tree=EAGLE3_CHAIN)}
    depth = {DFLASH: engine.proposers[DFLASH].draft_block_len - 1, EAGLE3: EAGLE3_CHAIN.depth}
    out = {}
    for name, spec in specs.items():
        accepted, same, seconds, tokens = [], True, 0.0, 0
        for r in responses:
            result = engine.generate(r.prompt_ids, GenerationConfig(max_new_tokens=max_new_tokens), spec=spec)
            accepted += [t - 1 for _, t in result.stats["trace"]]
            same &= result.token_ids == r.response_ids
            seconds, tokens = seconds + result.stats["seconds"], tokens + len(result.token_ids)
        out[name] = {"curve": conditional_acceptance(accepted, depth[name]), "rounds": len(accepted),
                     "tau": round(1 + sum(accepted) / len(accepted), 3), "equals_ar": same,
                     "tokens_per_s": round(tokens / seconds, 2)}
    return out


def offline_curves(engine: Engine, responses, loss_vocab: torch.Tensor) -> dict:
    df, e3 = engine.proposers[DFLASH], engine.proposers[EAGLE3].with_tree(EAGLE3_CHAIN)
    depth = max(df.draft_block_len - 1, EAGLE3_CHAIN.depth)
    in_vocab = torch.zeros(engine.target.config.vocab_size, dtype=torch.bool)
    in_vocab[loss_vocab] = True
    acc = {DFLASH: [], EAGLE3: []}
    walked = {DFLASH: [], EAGLE3: []}     # the positions a runtime round sequence visits: n -> n + accepted + 1
    n = {"drafts": 0, "drafts_oov": 0, "first_oov": 0, "first_hit": 0, "first_hit_loss_vocab": 0, "label_oov": 0,
         "first_oov_and_label_in_vocab": 0}
    for r in responses:
        first = len(acc[DFLASH])
        for seq, cont in round_starts(engine, r, depth, slack=EAGLE3_CHAIN.total_tokens + EAGLE3_CHAIN.depth):
            logits = df.block_logits(seq).float()                               # [B-1, vocab]
            drafts = logits.argmax(-1)
            acc[DFLASH].append(accepted_length(DraftTree.chain(seq.pending, drafts.tolist()), cont) - 1)
            acc[EAGLE3].append(accepted_length(e3.propose(seq).tree, cont) - 1)
            oov = ~in_vocab[drafts]
            restricted = logits.masked_fill(~in_vocab, float("-inf")).argmax(-1)
            n["drafts"] += len(drafts)
            n["drafts_oov"] += int(oov.sum())
            n["first_oov"] += int(oov[0])
            n["first_hit"] += int(drafts[0] == cont[0])
            n["first_hit_loss_vocab"] += int(restricted[0] == cont[0])
            n["label_oov"] += int(not in_vocab[cont[0]])
            n["first_oov_and_label_in_vocab"] += int(oov[0] and in_vocab[cont[0]])
        for name in walked:
            walked[name] += rounds_walk(acc[name][first:])
    positions = len(acc[DFLASH])
    return {"positions": positions,
            **{name: {"curve": conditional_acceptance(acc[name], d), "tau": round(1 + sum(acc[name]) / positions, 3),
                      "walk_curve": conditional_acceptance(walked[name], d),
                      "walk_tau": round(1 + sum(walked[name]) / len(walked[name]), 3)}
               for name, d in ((DFLASH, df.draft_block_len - 1), (EAGLE3, EAGLE3_CHAIN.depth))},
            "dflash_vocab": {"draft_oov_rate": round(n["drafts_oov"] / n["drafts"], 4),
                             "first_draft_oov_rate": round(n["first_oov"] / positions, 4),
                             "first_draft_oov_while_label_in_vocab": round(n["first_oov_and_label_in_vocab"]
                                                                           / positions, 4),
                             "label_oov_rate": round(n["label_oov"] / positions, 4),
                             "acc1_full_vocab": round(n["first_hit"] / positions, 4),
                             "acc1_loss_vocab_argmax": round(n["first_hit_loss_vocab"] / positions, 4)}}


def training_forward(engine: Engine, responses, loss_vocab: torch.Tensor) -> dict:
    """The DFlash trainer's own forward (DFlashLoss.forward_blocks, an fp32 copy of the drafter, every response
    position an anchor) on the runtime's captured features: how often its first-slot argmax equals the runtime
    block forward's, and the training log's acc1 metric (argmax over the loss vocabulary, labels outside it count
    as misses, mean per sequence) on these sequences."""
    df = engine.proposers[DFLASH]
    opts = DFlashOptions(num_layers=df.model.config.num_layers, draft_block_len=df.draft_block_len)
    loss = DFlashLoss(copy.deepcopy(df.model).float(), engine.target, torch.arange(len(df.cols)), opts, loss_vocab)
    agree = total = 0
    per_seq = []
    for r in responses:
        tokens = torch.tensor(r.prompt_ids + r.response_ids)
        runtime_first = [int(df.block_logits(seq)[0].float().argmax())
                         for seq, _ in round_starts(engine, r, 1, slack=df.draft_block_len)]
        with engine.scratch_sequence(tokens.tolist()) as seq:
            feats = engine.runner.step(seq, tokens.tolist(), logits_rows=[len(tokens) - 1], capture=True).captured
        anchors = torch.arange(len(r.prompt_ids), len(tokens) - 2)
        with torch.no_grad():
            first = loss.forward_blocks(feats[:, df.cols.cpu()].float(), tokens, anchors)[:, 1]    # [A, H]
        agree += int((first @ loss.full_head.T).argmax(-1).eq(torch.tensor(runtime_first)).sum())
        total += len(anchors)
        labels = loss.to_row[tokens[anchors + 1]]
        per_seq.append(float(((first @ loss.head.T).argmax(-1).eq(labels) & (labels >= 0)).float().mean()))
    return {"first_slot_argmax_agreement": round(agree / total, 4),
            "acc1_training_metric": round(sum(per_seq) / len(per_seq), 4)}


def rounds_walk(accepted: list[int]) -> list[int]:
    """The accepted counts of the rounds a decode starting at the first position would run (`accepted`: per
    consecutive position): runtime rounds start right after a rejection, all-position averages do not."""
    out, n = [], 0
    while n < len(accepted):
        out.append(accepted[n])
        n += accepted[n] + 1
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", type=Path, help="engine directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--split", default="val", choices=["val", "router", "train"], help="which prompts")
    p.add_argument("--per-category", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--responses", type=Path, help="JSON lines cache of the target's greedy responses (read if it "
                                                   "exists, else written)")
    p.add_argument("--skip-runtime", action="store_true", help="offline curves only")
    p.add_argument("--training-forward", action="store_true",
                   help="also compare the DFlash trainer's forward and acc1 metric with the runtime's")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.load(args.engine or default_engine(DEFAULT_CACHE_DIR), dtype=args.dtype)
    start = time.time()
    responses = greedy_responses(engine, held_out_prompts(args.split, args.per_category), args.max_new_tokens,
                                 args.responses)
    loss_vocab = engine.proposers[EAGLE3].model.t2d.nonzero().flatten().cpu()
    head = {"split": args.split, "prompts": len(responses), "max_new_tokens": args.max_new_tokens,
            "dtype": args.dtype, "threads": args.threads, "loss_vocab": f"EAGLE-3 t2d ({len(loss_vocab)} tokens)"}
    print(json.dumps({"setup": head}), flush=True)
    if not args.skip_runtime:
        print(json.dumps({"runtime": runtime_curves(engine, responses, args.max_new_tokens)}), flush=True)
    print(json.dumps({"offline": offline_curves(engine, responses, loss_vocab)}), flush=True)
    if args.training_forward:
        print(json.dumps({"training_forward": training_forward(engine, responses, loss_vocab)}), flush=True)
    print(json.dumps({"seconds": round(time.time() - start, 1)}), flush=True)


if __name__ == "__main__":
    main()
