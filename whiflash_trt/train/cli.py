"""`whiflash-train data|keep|features|eagle3|dflash|router|eval`: thin argument parsing around the trainers."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from whiflash_trt.errors import WhiflashError
from whiflash_trt.help_format import DefaultsHelpFormatter


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1 is fastest on a shared, loaded CPU)")
    p.add_argument("--seed", type=int, default=0, help="random seed (prompt order, anchors, initialisation)")


def _data(sub) -> None:
    p = sub.add_parser("data", help="self-distillation data: prompts, the target's responses, cached features")
    p.add_argument("--target", default="smollm2-135m", help="named target, Hugging Face folder or .gguf")
    p.add_argument("--output", type=Path, required=True, help="data folder (grown if it exists)")
    p.add_argument("--capture-layers", default=None,
                   help="comma-separated 0-based target layers to cache (default: EAGLE-3's 1, L/2-1, L-4)")
    p.add_argument("--per-category", type=int, default=600, help="training prompts per category (larger grows DATA)")
    p.add_argument("--num-val", type=int, default=12, help="held-out validation prompts per category")
    p.add_argument("--num-router", type=int, default=24, help="held-out router prompts per category")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are skipped")
    p.add_argument("--max-new-tokens", type=int, default=160, help="response tokens per prompt at most")
    p.add_argument("--lanes", type=int, default=64, help="responses generated together (one batched forward)")
    p.add_argument("--shard-size", type=int, default=64, help="sequences per data shard (the unit of resuming)")
    p.add_argument("--sampled-fraction", type=float, default=0.15,
                   help="share of responses sampled (temperature) rather than greedy")
    p.add_argument("--max-sequences", type=int, help="stop after this many sequences (resumable)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="target dtype for generation")
    p.add_argument("--split", default="train", choices=["train", "router"],
                   help="router: responses to the held-out router prompts (written to OUTPUT/router/)")
    _common(p)


def _run_data(args) -> None:
    from whiflash_trt.train.data import DataOptions, generate_data

    layers = tuple(int(x) for x in args.capture_layers.split(",")) if args.capture_layers else None
    generate_data(DataOptions(
        target=args.target, output=args.output, capture_layers=layers, per_category=args.per_category,
        num_val=args.num_val, num_router=args.num_router, max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens, lanes=args.lanes, shard_size=args.shard_size,
        sampled_fraction=args.sampled_fraction, max_sequences=args.max_sequences, seed=args.seed, dtype=args.dtype,
        split=args.split))


def _keep(sub) -> None:
    p = sub.add_parser("keep", help="copy a data folder's token level (no features: a few MB) to keep it")
    p.add_argument("--data", type=Path, required=True, help="data folder written by whiflash-train data")
    p.add_argument("--output", type=Path, required=True, help="folder to hold the token level (e.g. data/<target>)")
    _common(p)


def _run_keep(args) -> None:
    from whiflash_trt.train.kept import copy_token_level

    print(f"{copy_token_level(args.data, args.output)} files of {args.data}'s token level copied to {args.output}")


def _features(sub) -> None:
    p = sub.add_parser("features", help="recompute the target features a data folder lacks from its tokens")
    p.add_argument("--data", type=Path, required=True, help="data folder (created from --tokens-from if given)")
    p.add_argument("--tokens-from", type=Path, help="a kept token level (whiflash-train keep) to copy into DATA")
    p.add_argument("--target", default=None, help="default: the target the data was made with")
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per target forward at most")
    p.add_argument("--capture-layers", help="comma-separated 0-based target layers to capture instead of the data's "
                                            "(a DATA without features yet)")
    _common(p)


def _run_features(args) -> None:
    from whiflash_trt.train.kept import copy_token_level, recompute_features

    if args.tokens_from:
        copy_token_level(args.tokens_from, args.data)
    layers = tuple(int(x) for x in args.capture_layers.split(",")) if args.capture_layers else None
    written = recompute_features(args.data, args.target, args.batch_tokens, layers)
    print(f"{written} feature shards written in {args.data}")


def _loop_args(p: argparse.ArgumentParser, steps: int, lr: float, seqs: int) -> None:
    p.add_argument("--data", type=Path, required=True, help="folder written by whiflash-train data")
    p.add_argument("--output", type=Path, required=True, help="run folder (resumed if it holds a checkpoint)")
    p.add_argument("--target", default=None, help="default: the target the data was made with")
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps in all (a resumed run continues)")
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate (AdamW)")
    p.add_argument("--warmup-steps", type=int, default=20, help="linear warm-up steps")
    p.add_argument("--decay-from", type=int, default=None,
                   help="from this step the lr falls linearly to --min-lr-ratio x lr at --steps (default: constant)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr with --decay-from")
    p.add_argument("--seqs-per-step", type=int, default=seqs, help="sequences per optimizer step")
    p.add_argument("--save-every", type=float, default=300.0, help="seconds between checkpoints")
    p.add_argument("--max-seconds", type=float, help="stop (resumably) after this much training time")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: the forward under bf16 autocast (fp32 weights and optimizer; faster on CPUs with bf16)")
    _common(p)


def _loop_options(args):
    from whiflash_trt.train.loop import LoopOptions
    return LoopOptions(max_steps=args.steps, lr=args.lr, warmup_steps=args.warmup_steps,
                       decay_from=args.decay_from, min_lr_ratio=args.min_lr_ratio,
                       seqs_per_step=args.seqs_per_step, save_every_s=args.save_every, max_seconds=args.max_seconds,
                       seed=args.seed, show_progress=not args.no_progress, precision=args.precision)


def _data_target(args):
    from whiflash_trt.train.data import read_manifest
    from whiflash_trt.train.target import load_target

    manifest = read_manifest(args.data)
    model, _ = load_target(args.target or manifest["target"], manifest["dtype"])
    return model


def _eagle3(sub) -> None:
    p = sub.add_parser("eagle3", help="train an EAGLE-3 drafter (public EAGLE-3 checkpoint format)")
    _loop_args(p, steps=2000, lr=6e-4, seqs=4)
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary: the most frequent target tokens")
    p.add_argument("--ttt-steps", type=int, default=4, help="training-time-test steps unrolled on own outputs")
    p.add_argument("--prompt-weight", type=float, default=0.2, help="loss weight of predictions inside the prompt")
    p.add_argument("--max-positions", type=int, default=768, help="longest window of a sequence per step")
    p.add_argument("--init-from", type=Path, help="start from this EAGLE-3 checkpoint's weights and draft vocabulary "
                                                  "(same shape; e.g. the shipped drafter, trained further)")


def _run_eagle3(args) -> None:
    from whiflash_trt.train.eagle3_trainer import Eagle3Options, train_eagle3

    opts = Eagle3Options(draft_vocab_size=args.draft_vocab, ttt_steps=args.ttt_steps,
                         prompt_weight=args.prompt_weight, max_positions=args.max_positions,
                         init_from=str(args.init_from) if args.init_from else None)
    out = train_eagle3(args.data, args.output, _data_target(args), opts, _loop_options(args))
    print(f"EAGLE-3 drafter written to {out}")


def _dflash(sub) -> None:
    p = sub.add_parser("dflash", help="train a DFlash drafter (public DFlash checkpoint format)")
    _loop_args(p, steps=2000, lr=6e-4, seqs=4)
    p.add_argument("--layers", type=int, default=3, help="drafter decoder layers")
    p.add_argument("--draft-block-len", "--block-size", type=int, default=8,
                   help="tokens per drafted block, bonus + drafts (--block-size is the old name)")
    p.add_argument("--gamma", type=float, help="loss weight decay exp(-(k-1)/gamma) over block positions "
                                               "(default: the DFlash recipe's for the block size)")
    p.add_argument("--anchors", type=int, default=24, help="random block anchors per sequence")
    p.add_argument("--loss-vocab", type=int, default=16384, help="CE over the most frequent tokens (0 = full vocab)")
    p.add_argument("--prompt-weight", type=float, default=0.3, help="loss weight of blocks inside the prompt")
    p.add_argument("--soft-labels", action="store_true",
                   help="cross-entropy to the target's distribution (over the loss vocabulary), not its greedy token")
    p.add_argument("--init-from", type=Path, help="start from this DFlash checkpoint's weights (e.g. the shipped "
                                                  "drafter, trained further on new data); one with fewer layers "
                                                  "than --layers grows: new layers start as identities")


def _run_dflash(args) -> None:
    from whiflash_trt.train.dflash_trainer import DFlashOptions, train_dflash

    opts = DFlashOptions(num_layers=args.layers, draft_block_len=args.draft_block_len, gamma=args.gamma,
                         anchors=args.anchors, loss_vocab_size=args.loss_vocab, prompt_weight=args.prompt_weight,
                         soft_labels=args.soft_labels, init_from=str(args.init_from) if args.init_from else None)
    out = train_dflash(args.data, args.output, _data_target(args), opts, _loop_options(args))
    print(f"DFlash drafter written to {out}")


def _router(sub) -> None:
    p = sub.add_parser("router", help="fit the neural router and calibrate both routers' thresholds")
    p.add_argument("--data", type=Path, required=True, help="data folder; uses DATA/router/ (--split router)")
    p.add_argument("--eagle3", type=Path, required=True, help="EAGLE-3 checkpoint folder")
    p.add_argument("--dflash", type=Path, required=True, help="DFlash checkpoint folder")
    p.add_argument("--output", type=Path, required=True, help="router.safetensors to write (+ .json report)")
    p.add_argument("--target", default=None, help="default: the target the data was made with")
    p.add_argument("--width", type=int, default=16, help="hidden width of the router MLP")
    p.add_argument("--max-states", type=int, help="measure at most this many states (default: all)")
    p.add_argument("--cost-prompts", type=int, default=4, help="validation prompts to time one round of each")
    p.add_argument("--walks", type=int, default=4, help="random routings per sequence (the history features' rows)")
    p.add_argument("--states", help="measured states file: read if it exists, else written after measuring; several "
                                    "comma-separated existing files are read together (e.g. with "
                                    "scripts/router_states_from_signals.py's), DATA/router is then not measured")
    p.add_argument("--round-seconds", help="seconds per round instead of timing them here: none=S,eagle3=S,dflash=S "
                                           "or a whiflash-bench --oracle results.json (its oracle.round_seconds)")
    _common(p)


def _run_router(args) -> None:
    import json

    from whiflash_trt.config import WHIFLASH, SpecConfig
    from whiflash_trt.train.data import TrainingData, read_manifest, read_prompts
    from whiflash_trt.train.evaluate import make_engine
    from whiflash_trt.train.router_trainer import (load_states, measure_states, round_costs, save_states,
                                                   train_router)
    from whiflash_trt.runtime.tokenizer_policy import chat_ids
    from whiflash_trt.train.target import load_engine_target

    manifest = read_manifest(args.data)
    target, tokenizer = load_engine_target(args.target or manifest["target"], manifest["dtype"])
    engine = make_engine(target, tokenizer, args.eagle3, args.dflash)
    spec = SpecConfig(mode=WHIFLASH)
    val = read_prompts(args.data / "prompts.val.jsonl")
    picks = [next(r for r in val if r.category == c) for c in sorted({r.category for r in val})][:args.cost_prompts]
    if args.round_seconds is None:
        cost = round_costs(engine, [chat_ids(tokenizer, r.messages) for r in picks], spec)
    elif args.round_seconds.endswith(".json"):
        cost = json.loads(Path(args.round_seconds).read_text())["oracle"]["round_seconds"]
    else:
        cost = {k: float(v) for k, v in (kv.split("=") for kv in args.round_seconds.split(","))}
    data = TrainingData(args.data / "router")
    paths = [Path(x) for x in args.states.split(",")] if args.states else []
    if paths and all(p.is_file() for p in paths):
        records = [r for p in paths for r in load_states(p)]
    elif len(paths) > 1:
        raise SystemExit(f"--states: {', '.join(str(p) for p in paths if not p.is_file())} do not exist")
    else:
        records = measure_states(engine, data, spec, args.max_states)
        if paths:
            save_states(records, paths[0])
    report = train_router(engine, data, args.output, spec, cost, width=args.width, seed=args.seed,
                          walks=args.walks, records=records)
    args.output.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "selection"}, indent=1))
    print(json.dumps(report["selection"], indent=1))


def _eval(sub) -> None:
    p = sub.add_parser("eval", help="acceptance length per category on the validation prompts, via the runtime")
    p.add_argument("--data", type=Path, required=True, help="data folder (its validation prompts are used)")
    p.add_argument("--eagle3", type=Path, help="EAGLE-3 checkpoint folder")
    p.add_argument("--dflash", type=Path, help="DFlash checkpoint folder")
    p.add_argument("--router", type=Path, help="router.safetensors (adds whiflash-neural)")
    p.add_argument("--target", default=None, help="default: the target the data was made with")
    p.add_argument("--per-category", type=int, default=3, help="validation prompts per category")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens per prompt and mode")
    p.add_argument("--modes", default=None, help="comma-separated: ar,eagle3,dflash,whiflash-entropy,whiflash-neural")
    p.add_argument("--tree", default=None, help="EAGLE-3 tree as TOP_K,DEPTH,TOTAL_TOKENS[,MIN_PROB] (default: the "
                                                "runtime's; without MIN_PROB, the runtime's probability floor)")
    p.add_argument("--dflash-tree-total-tokens", type=int, default=None,
                   help="DFlash tree (DDTree): nodes verified per round, root included (default: the runtime's)")
    p.add_argument("--dflash-tree-top-k", type=int, default=None,
                   help="DFlash tree: children per node at most, 1 = the block's chain (default: no limit)")
    p.add_argument("--neural-threshold", type=float, default=None,
                   help="whiflash-neural threshold (default: the one calibrated in the router file)")
    p.add_argument("--output", type=Path, help="JSON report")
    _common(p)


def _parse_tree(text: str | None):
    """The EAGLE-3 tree of --tree TOP_K,DEPTH,TOTAL_TOKENS[,MIN_PROB] (the default tree where it is not given);
    a malformed or invalid value exits with the reason."""
    from whiflash_trt.config import TreeConfig

    if not text:
        return TreeConfig()
    parts = text.split(",")
    try:
        values = [int(x) for x in parts[:3]] + [float(x) for x in parts[3:]]
    except ValueError:
        values = []
    if len(values) not in (3, 4):
        raise SystemExit(f"--tree wants TOP_K,DEPTH,TOTAL_TOKENS[,MIN_PROB] (three integers, then a probability), "
                         f"got {text!r}")
    try:
        return TreeConfig(*values)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def _eval_prompts(data: Path, tokenizer, limit: int, per_category: int) -> tuple[list, dict]:
    """The validation prompts to evaluate: the first `per_category` of each category whose chat fits the data's
    prompt-token limit, with the count taken per category."""
    from whiflash_trt.runtime.tokenizer_policy import chat_ids
    from whiflash_trt.train.data import read_prompts

    seen: dict = {}
    prompts = []
    for r in read_prompts(data / "prompts.val.jsonl"):
        if seen.get(r.category, 0) < per_category and len(chat_ids(tokenizer, r.messages)) <= limit:
            seen[r.category] = seen.get(r.category, 0) + 1
            prompts.append(r)
    return prompts, seen


def _run_eval(args) -> None:
    import json

    from dataclasses import asdict

    from tqdm import tqdm

    from whiflash_trt.config import DFLASH, EAGLE3, MODE_DRAFTERS, DFlashTreeConfig
    from whiflash_trt.train.data import read_manifest
    from whiflash_trt.train.evaluate import default_specs, evaluate, make_engine
    from whiflash_trt.train.target import load_engine_target

    manifest = read_manifest(args.data)
    target, tokenizer = load_engine_target(args.target or manifest["target"], manifest["dtype"])
    engine = make_engine(target, tokenizer, args.eagle3, args.dflash, args.router)
    tree = _parse_tree(args.tree)
    try:
        dflash_tree = DFlashTreeConfig(args.dflash_tree_total_tokens, args.dflash_tree_top_k)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    specs = default_specs(args.eagle3 is not None, args.dflash is not None, args.router is not None, tree,
                          args.neural_threshold, dflash_tree)
    if args.modes:
        specs = {k: v for k, v in specs.items() if k in args.modes.split(",")}
    prompts, seen = _eval_prompts(args.data, tokenizer, manifest["options"]["max_prompt_tokens"], args.per_category)
    report = evaluate(engine, prompts, specs, args.max_new_tokens, progress=lambda xs: tqdm(xs, desc="eval"))
    report["prompts"] = dict(seen)
    if "whiflash-neural" in specs:
        report["neural_threshold"] = args.neural_threshold if args.neural_threshold is not None else "router file"
    if any(EAGLE3 in MODE_DRAFTERS[spec.mode] for spec in specs.values()):
        report["tree"] = asdict(tree)
    if any(DFLASH in MODE_DRAFTERS[spec.mode] for spec in specs.values()):
        report["dflash_tree"] = asdict(dflash_tree)
    for folder in (args.eagle3, args.dflash):   # snapshots carry their training progress (learning curves)
        if folder is not None and (folder / "progress.json").is_file():
            report["progress"] = json.loads((folder / "progress.json").read_text())
    text = json.dumps(report, indent=1)
    if args.output:
        args.output.write_text(text + "\n")
    print(text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="whiflash-train", description="Train EAGLE-3, DFlash and the router.",
                                formatter_class=DefaultsHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, help="the step to run")
    for add in (_data, _keep, _features, _eagle3, _dflash, _router, _eval):
        add(sub)
    for command in sub.choices.values():
        command.formatter_class = DefaultsHelpFormatter
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    try:
        {"data": _run_data, "keep": _run_keep, "features": _run_features, "eagle3": _run_eagle3,
         "dflash": _run_dflash, "router": _run_router,
         "eval": _run_eval}[args.command](args)
    except (WhiflashError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
