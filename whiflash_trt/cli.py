"""Console entry points: thin argument parsing around the builder and the runtime."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from whiflash_trt.config import CATCH_UP, MODES, ROUTERS, CacheConfig, GenerationConfig, SamplingConfig, SpecConfig
from whiflash_trt.errors import WhiflashError

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "whiflash-trt"


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def build_main(argv: list[str] | None = None) -> int:
    from whiflash_trt.builder.build import BuildOptions, build_engine

    p = argparse.ArgumentParser(prog="whiflash-build", description="Compile a target into a whiflash engine directory.")
    p.add_argument("--target", required=True, help="named target (e.g. smollm2-135m, llama3-8b) or a path to a "
                                                   "Hugging Face folder or .gguf file")
    p.add_argument("--output", required=True, type=Path, help="engine directory to write")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    p.add_argument("--block-size", type=int, default=CacheConfig.block_size, help="KV cache block size (tokens)")
    p.add_argument("--ar-drafter", type=Path, help="EAGLE-3 drafter (Hugging Face folder, public format)")
    p.add_argument("--dllm-drafter", type=Path, help="DFlash drafter (Hugging Face folder, public format)")
    p.add_argument("--router", type=Path, help="neural router weights (router.safetensors or its folder)")
    p.add_argument("--no-bundled", action="store_true",
                   help="do not add the drafters/router the package ships for a named target (smollm2-135m)")
    args = p.parse_args(argv)
    try:
        out = build_engine(BuildOptions(target=args.target, output=args.output, dtype=args.dtype,
                                        block_size=args.block_size, ar_drafter=args.ar_drafter,
                                        dllm_drafter=args.dllm_drafter, router=args.router,
                                        bundled=not args.no_bundled))
    except (WhiflashError, ValueError) as e:
        return _fail(str(e))
    print(f"engine written to {out}")
    return 0


def default_engine(cache_dir: Path) -> Path:
    """The embedded default target's engine, built once into the cache folder."""
    from whiflash_trt.builder.build import BuildOptions, build_engine
    from whiflash_trt.builder.bundled import bundled_for
    from whiflash_trt.builder.sources import DEFAULT_TARGET
    from whiflash_trt.manifest import MANIFEST

    # The folder name carries the shipped drafters' hash: retrained drafters never reuse an old engine.
    engine_dir = cache_dir / "engines" / f"{DEFAULT_TARGET}-bf16-{bundled_for(DEFAULT_TARGET).version()}"
    if not (engine_dir / MANIFEST).is_file():
        print(f"building the default engine ({DEFAULT_TARGET}, bf16) into {engine_dir} (once)", file=sys.stderr)
        build_engine(BuildOptions(target=DEFAULT_TARGET, output=engine_dir, dtype="bf16"))
    return engine_dir


def _read_prompts(args) -> list[dict]:
    if args.prompts_file is None:
        return [{"prompt": args.prompt}]
    prompts = []
    for n, line in enumerate(Path(args.prompts_file).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise WhiflashError(f"{args.prompts_file}:{n}: not valid JSON ({e})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise WhiflashError(f'{args.prompts_file}:{n}: expected an object with a string "prompt"')
        prompts.append(record)
    if not prompts:
        raise WhiflashError(f"{args.prompts_file} holds no prompts")
    return prompts


class _StreamPrinter:
    """Prints text as tokens arrive, holding back an incomplete UTF-8 sequence."""

    def __init__(self, decode) -> None:
        self.decode, self.ids, self.printed = decode, [], 0

    def __call__(self, new_ids: list[int]) -> None:
        self.ids += new_ids
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        sys.stdout.write(text[self.printed:])
        sys.stdout.flush()
        self.printed = len(text)


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="whiflash-run", description="Generate text with a whiflash engine.")
    p.add_argument("--engine", type=Path, help="engine directory (default: the embedded SmolLM2-135M, built once)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompts-file", type=Path, help='JSON lines, one {"prompt": ...} per line')
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", help="system message for --chat")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--mode", default="auto", choices=["auto", *MODES],
                   help="ar: target only; eagle3 / dflash: one drafter; whiflash: routed per round; auto "
                        "(default): whiflash when the engine has both drafters, else its one drafter, else ar")
    p.add_argument("--router", default="auto", choices=["auto", *ROUTERS],
                   help="whiflash routing policy; auto (default): neural when the engine has router weights")
    p.add_argument("--threshold", type=float, help="router threshold (default: the engine's calibrated one)")
    p.add_argument("--catch-up", default="lazy", choices=list(CATCH_UP),
                   help="lazy: update a drafter only when chosen; eager: update both every round")
    p.add_argument("--tree-top-k", type=int, default=SpecConfig.tree_top_k, help="EAGLE-3 tree branching (1 = chain)")
    p.add_argument("--tree-depth", type=int, default=SpecConfig.tree_depth)
    p.add_argument("--tree-total-tokens", type=int, default=SpecConfig.tree_total_tokens)
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], help="override the engine's dtype")
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-budget-mb", type=int, default=256, help="memory for all KV pools together")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help="where the default engine is built")
    return p


def resolve_auto(mode: str, router: str, drafters: set[str], has_router: bool) -> tuple[str, str]:
    """'auto' mode/router -> what the engine can do best: both drafters routed, else one, else target-only."""
    if mode == "auto":
        mode = ("whiflash" if {"eagle3", "dflash"} <= drafters else "eagle3" if "eagle3" in drafters
                else "dflash" if "dflash" in drafters else "ar")
    if router == "auto":
        router = "neural" if has_router else "entropy"
    return mode, router


def run_main(argv: list[str] | None = None) -> int:
    args = run_parser().parse_args(argv)
    try:
        return _run(args)
    except (WhiflashError, ValueError) as e:
        return _fail(str(e))


def _run(args) -> int:
    from whiflash_trt.runtime.engine import Engine

    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_strings=tuple(args.stop),
                           sampling=SamplingConfig(temperature=args.temperature, top_k=args.top_k,
                                                   top_p=args.top_p, seed=args.seed))
    prompts = _read_prompts(args)
    engine_dir = args.engine if args.engine is not None else default_engine(args.cache_dir)
    engine = Engine.load(engine_dir, device=args.device, dtype=args.dtype, kv_budget_bytes=args.kv_budget_mb * 2**20)
    mode, router = resolve_auto(args.mode, args.router, set(engine.proposers), engine.router_file is not None)
    spec = SpecConfig(mode=mode, router=router, threshold=args.threshold, catch_up=args.catch_up,
                      tree_top_k=args.tree_top_k, tree_depth=args.tree_depth,
                      tree_total_tokens=args.tree_total_tokens)
    for record in prompts:
        ids = engine.encode(record["prompt"], chat=args.chat, system=args.system)
        printer = _StreamPrinter(engine.decode) if args.stream and not args.json else None
        result = engine.generate(ids, gen, on_tokens=printer, spec=spec)
        if args.json:
            print(json.dumps(result.to_json()), flush=True)
        elif printer is not None:
            print(flush=True)
        else:
            print(result.text, flush=True)
    return 0
