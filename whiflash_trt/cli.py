"""Console entry points: thin argument parsing around the builder and the runtime."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from whiflash_trt.config import (BACKENDS, CATCH_UP, MODES, ROUTERS, CacheConfig, GenerationConfig, SamplingConfig,
                                 SpecConfig)
from whiflash_trt.builder.default_engine import DEFAULT_CACHE_DIR, default_engine
from whiflash_trt.errors import WhiflashError
from whiflash_trt.prompt_lines import parse_prompt_lines



def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def build_main(argv: list[str] | None = None) -> int:
    from whiflash_trt.builder.build import BuildOptions, build_engine
    from whiflash_trt.builder.triton_repo import TritonRepoOptions, write_triton_repo

    p = argparse.ArgumentParser(
        prog="whiflash-build", description="Compile a target into a whiflash engine directory and/or write a Triton "
        "model repository serving an engine.",
        epilog="Examples: whiflash-build --target smollm2-135m --output ENGINE [--triton-repo REPO]  |  "
               "whiflash-build --engine ENGINE --triton-repo REPO (repository for an existing engine)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--target", help="named target (e.g. smollm2-135m, llama3-8b) or a path to a Hugging Face "
                                      "folder or .gguf file; needs --output")
    src.add_argument("--engine", type=Path, help="an existing engine directory (with --triton-repo)")
    p.add_argument("--output", type=Path, help="engine directory to write (with --target)")
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"],
                   help="engine dtype (default: bf16; fp32 for --backend onnx, whose CPU runtime has no bf16)")
    p.add_argument("--block-size", type=int, default=CacheConfig.block_size, help="KV cache block size (tokens)")
    p.add_argument("--ar-drafter", type=Path, help="EAGLE-3 drafter (Hugging Face folder, public format)")
    p.add_argument("--dllm-drafter", type=Path, help="DFlash drafter (Hugging Face folder, public format)")
    p.add_argument("--router", type=Path, help="neural router weights (router.safetensors or its folder)")
    p.add_argument("--backend", default="torch", choices=list(BACKENDS),
                   help="torch: weights only; onnx: also ONNX graphs run by onnxruntime (needs --dtype fp32 on CPU); "
                        "tensorrt: ONNX graphs + serialized TensorRT engines (needs tensorrt and a GPU)")
    t = p.add_argument_group("Triton model repository")
    t.add_argument("--triton-repo", type=Path, help="write a Triton model repository (models `ensemble` and "
                                                    "`whiflash`) serving the engine; see docs/triton.md")
    t.add_argument("--triton-instances", type=int, default=1, help="model instances (requests served at once)")
    t.add_argument("--triton-device", default="cpu", help="device the served engine runs on (cpu, cuda, cuda:1)")
    t.add_argument("--triton-kv-budget-mb", type=int, default=256, help="KV memory of each instance")
    t.add_argument("--triton-torch-threads", type=int, default=0,
                   help="torch intra-op threads of each instance (0: torch's default, all cores; on a CPU server "
                        "with N instances, cores / N)")
    p.add_argument("--no-bundled", action="store_true",
                   help="do not add the drafters/router the package ships for a named target (smollm2-135m)")
    args = p.parse_args(argv)
    if args.target is not None and args.output is None:
        p.error("--target needs --output (the engine directory to write)")
    if args.engine is not None and (args.triton_repo is None or args.output is not None):
        p.error("--engine writes a Triton repository for an existing engine: give --triton-repo and no --output")
    try:
        engine_dir = args.engine
        if args.target is not None:
            dtype = args.dtype or ("fp32" if args.backend == "onnx" else "bf16")
            engine_dir = build_engine(BuildOptions(target=args.target, output=args.output, dtype=dtype,
                                                   block_size=args.block_size, ar_drafter=args.ar_drafter,
                                                   dllm_drafter=args.dllm_drafter, router=args.router,
                                                   backend=args.backend, bundled=not args.no_bundled))
            print(f"engine written to {engine_dir}")
        if args.triton_repo is not None:
            repo = write_triton_repo(TritonRepoOptions(
                engine_dir=engine_dir, output=args.triton_repo, instance_count=args.triton_instances,
                device=args.triton_device, kv_budget_mb=args.triton_kv_budget_mb,
                torch_threads=args.triton_torch_threads))
            print(f"Triton model repository written to {repo} (serve it with whiflash-serve --triton-repo {repo})")
    except (WhiflashError, ValueError) as e:
        return _fail(str(e))
    return 0


def serve_main(argv: list[str] | None = None) -> int:
    from whiflash_trt.serve import LOOPBACK, ServerOptions, check_python, exec_server

    p = argparse.ArgumentParser(
        prog="whiflash-serve", description="Start Triton Inference Server (nvidia-pytriton's bundled binary) on a "
        "model repository written by whiflash-build --triton-repo. Arguments after `--` go to tritonserver.")
    p.add_argument("--triton-repo", required=True, type=Path, help="model repository")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--address", default=LOOPBACK, help="address the server binds to (default: loopback only)")
    p.add_argument("--backends-dir", type=Path, default=DEFAULT_CACHE_DIR / "triton-backends",
                   help="where the backend folder (links into nvidia-pytriton plus the Python stub) is prepared")
    p.add_argument("server_args", nargs="*", help="extra tritonserver arguments (after --)")
    args = p.parse_args(argv)
    try:
        opts = ServerOptions(model_repository=args.triton_repo, http_port=args.http_port, grpc_port=args.grpc_port,
                             address=args.address, extra_args=tuple(args.server_args))
        warning = check_python()
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
        exec_server(opts, args.backends_dir)
    except (WhiflashError, ValueError, OSError) as e:
        return _fail(str(e))
    return 0  # not reached: exec_server replaces this process


def _read_prompts(args) -> list[dict]:
    if args.prompts_file is None:
        return [{"prompt": args.prompt}]
    try:
        lines = Path(args.prompts_file).read_text().splitlines()
    except OSError as e:
        raise WhiflashError(f"cannot read the prompts file {args.prompts_file}: {e.strerror or e}") from None
    return [record for _, record in parse_prompt_lines(lines, str(args.prompts_file))]


class _StreamPrinter:
    """Prints text as tokens arrive. Holds back an incomplete UTF-8 sequence and any tail that could be the start
    of a stop string, so a stop string never reaches the screen; `finish` prints the rest of the final text."""

    def __init__(self, decode, stop_strings: tuple[str, ...] = (), out=None) -> None:
        self.decode, self.stops, self.out = decode, tuple(s for s in stop_strings if s), out or sys.stdout
        self.ids, self.printed = [], 0

    def _safe_length(self, text: str) -> int:
        """Length of the prefix of `text` that no stop string can still claim."""
        safe = len(text)
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0:
                safe = min(safe, at)
            for k in range(min(len(stop) - 1, len(text)), 0, -1):   # a tail that begins this stop string
                if text.endswith(stop[:k]):
                    safe = min(safe, len(text) - k)
                    break
        return safe

    def __call__(self, new_ids: list[int]) -> None:
        self.ids += new_ids
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        safe = self._safe_length(text)
        if safe > self.printed:
            self.out.write(text[self.printed:safe])
            self.out.flush()
            self.printed = safe

    def finish(self, final_text: str) -> None:
        self.out.write(final_text[self.printed:] + "\n")
        self.out.flush()


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
    p.add_argument("--backend", choices=list(BACKENDS), help="run the engine with this backend (default: the one it "
                                                             "was built for; torch runs any engine)")
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
    engine = Engine.load(engine_dir, device=args.device, dtype=args.dtype, kv_budget_bytes=args.kv_budget_mb * 2**20,
                         backend=args.backend)
    mode, router = resolve_auto(args.mode, args.router, set(engine.proposers), engine.router_file is not None)
    spec = SpecConfig(mode=mode, router=router, threshold=args.threshold, catch_up=args.catch_up,
                      tree_top_k=args.tree_top_k, tree_depth=args.tree_depth,
                      tree_total_tokens=args.tree_total_tokens)
    for record in prompts:
        ids = engine.encode(record["prompt"], chat=args.chat, system=args.system)
        printer = _StreamPrinter(engine.decode, tuple(args.stop)) if args.stream and not args.json else None
        result = engine.generate(ids, gen, on_tokens=printer, spec=spec)
        if args.json:
            print(json.dumps(result.to_json()), flush=True)
        elif printer is not None:
            printer.finish(result.text)
        else:
            print(result.text, flush=True)
    return 0
