"""Console entry points: thin argument parsing around the builder and the runtime."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from whiflash_trt.builder.default_engine import DEFAULT_CACHE_DIR, default_engine
from whiflash_trt.config import (AUTO, BACKENDS, CATCH_UP, MODES, ROUTERS, CacheConfig, GenerationConfig,
                                 SamplingConfig, SpecConfig)
from whiflash_trt.errors import SpecError, WhiflashError
from whiflash_trt.help_format import DefaultsHelpFormatter
from whiflash_trt.prompt_lines import parse_prompt_lines
from whiflash_trt.runtime.device import check_device, default_threads, set_threads
from whiflash_trt.runtime.kv_cache import KVCacheExhausted
from whiflash_trt.runtime.plan import PARAMS
from whiflash_trt.runtime.text_stream import TextStream
from whiflash_trt.tree_options import add_tree_options, tree_settings

PROMPT_SEPARATOR = "-" * 40  # between the outputs of several prompts in plain-text mode

def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="whiflash-build", description="Compile a target into a whiflash engine directory and/or write a Triton "
        "model repository serving an engine.",
        epilog="Examples: whiflash-build --target smollm2-135m --output ENGINE [--triton-repo REPO]  |  "
               "whiflash-build --engine ENGINE --triton-repo REPO (repository for an existing engine)",
        formatter_class=DefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--target", help="named target (e.g. smollm2-135m, llama3-8b) or a path to a Hugging Face "
                                      "folder or .gguf file; needs --output")
    src.add_argument("--engine", type=Path, help="an existing engine directory (with --triton-repo)")
    p.add_argument("--output", type=Path, help="engine directory to write (with --target): a new or empty directory, "
                                               "or an existing engine with --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the engine already in --output (a directory holding anything else is never touched)")
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"],
                   help="engine dtype (default: bf16; fp32 for --backend onnx, whose CPU runtime has no bf16)")
    p.add_argument("--weights", choices=["native", "q8_0", "q4_1", "q4_0", "bf16", "fp32"],
                   help="what the target's linears compute from: native keeps a GGUF file's own Q4_0/Q4_1/Q8_0 "
                        "blocks (the engine's CPU kernels, bf16 activations; ~2.8x fewer bytes a token than bf16 for "
                        "a Q4_1 file); q8_0/q4_1/q4_0 quantise a Hugging Face target's into those blocks at build "
                        "time; bf16/fp32: dense weights in that dtype (default: the --dtype's)")
    p.add_argument("--block-size", type=int, default=CacheConfig.block_size, help="KV cache block size (tokens)")
    p.add_argument("--ar-drafter", type=Path, help="EAGLE-3 drafter (Hugging Face folder, public format)")
    p.add_argument("--dllm-drafter", type=Path, help="DFlash drafter (Hugging Face folder, public format)")
    p.add_argument("--router", type=Path, help="neural router weights (router.safetensors or its folder)")
    p.add_argument("--backend", default=AUTO, choices=list(BACKENDS) + [AUTO],
                   help="torch: weights only; compiled: also the target step compiled ahead of time over the "
                        "engine's CPU kernels (bf16, AVX-512 BF16 CPUs); onnx: also ONNX graphs run by onnxruntime "
                        "(needs --dtype fp32 on CPU); tensorrt: ONNX graphs + serialized TensorRT engines (needs "
                        "tensorrt and a GPU); auto (default): compiled where this machine can build it, else torch")
    t = p.add_argument_group("Triton model repository")
    t.add_argument("--triton-repo", type=Path, help="write a Triton model repository (models `ensemble` and "
                                                    "`whiflash`) serving the engine; see docs/triton.md")
    t.add_argument("--triton-instances", type=int, default=1, help="model instances (each its own engine)")
    t.add_argument("--triton-max-batch", type=int, default=8, help="requests each instance steps together")
    t.add_argument("--triton-device", default="cpu", help="device the served engine runs on (cpu, cuda, cuda:1)")
    t.add_argument("--triton-kv-budget-mb", type=int, default=256, help="KV memory of each instance")
    t.add_argument("--triton-threads", "--triton-torch-threads", type=int, default=0,
                   help="torch threads of each instance (0: half the server's cores, split over the instances)")
    t.add_argument("--triton-overwrite", action="store_true",
                   help="replace models `ensemble` / `whiflash` in --triton-repo that whiflash-build did not write "
                        "(those it wrote are replaced without it; symlinked model folders never are)")
    p.add_argument("--no-bundled", action="store_true",
                   help="do not add the drafters/router the package ships for a named target (smollm2-135m)")
    return p


def build_main(argv: list[str] | None = None) -> int:
    from whiflash_trt.builder.build import BuildOptions, build_engine
    from whiflash_trt.builder.triton_repo import TritonRepoOptions, check_models, write_triton_repo

    p = build_parser()
    args = p.parse_args(argv)
    if args.overwrite and args.output is None:
        p.error("--overwrite goes with --output")
    if args.target is not None and args.output is None:
        p.error("--target needs --output (the engine directory to write)")
    if args.triton_overwrite and args.triton_repo is None:
        p.error("--triton-overwrite goes with --triton-repo")
    if args.engine is not None and (args.triton_repo is None or args.output is not None):
        p.error("--engine writes a Triton repository for an existing engine: give --triton-repo and no --output")
    try:
        triton = None
        if args.triton_repo is not None:   # checked now, before any engine is built
            if args.triton_repo.exists() and not args.triton_repo.is_dir():
                raise WhiflashError(f"--triton-repo {args.triton_repo} is an existing file, not a directory")
            triton = TritonRepoOptions(engine_dir=args.engine or args.output, output=args.triton_repo,
                                       instance_count=args.triton_instances, device=args.triton_device,
                                       kv_budget_mb=args.triton_kv_budget_mb, threads=args.triton_threads,
                                       max_batch=args.triton_max_batch, overwrite=args.triton_overwrite)
            check_models(args.triton_repo, args.triton_overwrite)
        engine_dir = args.engine
        if args.target is not None:
            dense = args.weights if args.weights in ("bf16", "fp32") else None
            dtype = args.dtype or dense or ("fp32" if args.backend == "onnx" else "bf16")
            engine_dir = build_engine(BuildOptions(target=args.target, output=args.output, dtype=dtype,
                                                   weights=args.weights,
                                                   block_size=args.block_size, ar_drafter=args.ar_drafter,
                                                   dllm_drafter=args.dllm_drafter, router=args.router,
                                                   backend=args.backend, bundled=not args.no_bundled,
                                                   overwrite=args.overwrite))
            print(f"engine written to {engine_dir}")
        if triton is not None:
            repo = write_triton_repo(replace(triton, engine_dir=engine_dir))
            print(f"Triton model repository written to {repo} (serve it with whiflash-serve --triton-repo {repo})")
    except (WhiflashError, ValueError) as e:
        return _fail(str(e))
    return 0


def serve_parser() -> argparse.ArgumentParser:
    from whiflash_trt.serving.server import LOOPBACK

    p = argparse.ArgumentParser(
        prog="whiflash-serve", description="Start Triton Inference Server (nvidia-pytriton's bundled binary) on a "
        "model repository written by whiflash-build --triton-repo. Arguments after `--` go to tritonserver. "
        "Threads per model instance are set when the repository is written (whiflash-build --triton-threads). "
        "With --openai: an OpenAI-compatible HTTP server instead (see whiflash-serve --openai --help).",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("--openai", action="store_true", help="serve an OpenAI-compatible HTTP API (other options: "
                                                          "whiflash-serve --openai --help)")
    p.add_argument("--triton-repo", required=True, type=Path, help="model repository")
    p.add_argument("--http-port", type=int, default=8000, help="HTTP port")
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC port")
    p.add_argument("--address", default=LOOPBACK, help="address the server binds to (loopback only by default)")
    p.add_argument("--backends-dir", type=Path, default=DEFAULT_CACHE_DIR / "triton-backends",
                   help="where the backend folder (links into nvidia-pytriton plus the Python stub) is prepared")
    p.add_argument("server_args", nargs="*", help="extra tritonserver arguments (after --)")
    return p


def openai_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="whiflash-serve --openai", description="Serve an engine over an OpenAI-compatible HTTP API "
        "(/v1/models, /v1/completions, /v1/chat/completions, /health, /metrics; see docs/openai.md). Requests are "
        "batched: up to --max-batch share every round, each with its own drafter choice.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("--engine", type=Path, help="engine directory (default: the embedded SmolLM2-135M, built once "
                                               "into --cache-dir)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--address", default="127.0.0.1", help="address the server binds to (loopback only by default)")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="torch threads of the engine: half this machine's cores (see whiflash-run --help)")
    p.add_argument("--kv-budget-mb", type=int, default=256, help="memory for all KV pools together (MB); a request "
                   "holds its prompt + max_tokens of it from admission, and waits while it does not fit")
    p.add_argument("--max-batch", type=int, default=8, help="requests stepped together in one round")
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], help="override the engine's dtype")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--model-name", help="the model id clients send (default: the engine's target name, e.g. "
                                        "smollm2-135m)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help="where the default engine is built")
    _limit_options(p)
    return p


def _limit_options(p: argparse.ArgumentParser) -> None:
    """What the OpenAI server accepts (serving.openai_api.limits.ServerLimits; docs/openai.md)."""
    from whiflash_trt.serving.openai_api.limits import ServerLimits

    d = ServerLimits()
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="largest request body (413 above)")
    p.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars,
                   help="most characters in a prompt (all of a chat's messages), checked before tokenizing (400)")
    p.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars,
                   help="most characters in each stop string (up to 4 of them; 400)")
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="requests waiting for the engine; one more is answered 429")
    p.add_argument("--chat-max-tokens", type=int, default=d.chat_max_tokens,
                   help="max_tokens of a chat request that names none (capped by the context's room)")
    p.add_argument("--api-key", help="require Authorization: Bearer KEY on every route but /health (401 without); "
                                     "default: no key")


def _limits(args: argparse.Namespace):
    from whiflash_trt.serving.openai_api.limits import ServerLimits

    return ServerLimits(max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars,
                        max_stop_chars=args.max_stop_chars, max_queue=args.max_queue,
                        chat_max_tokens=args.chat_max_tokens, api_key=args.api_key)


def _openai_main(argv: list[str]) -> int:
    args = openai_parser().parse_args(argv)
    try:
        from whiflash_trt.serving.openai_api.server import OpenAIServerOptions, run_server
    except ImportError as e:
        return _fail(f"whiflash-serve --openai needs the serve extra ({e.name} is missing): "
                     f"bash scripts/install.sh serve")
    try:
        opts = OpenAIServerOptions(engine_dir=args.engine, address=args.address, port=args.port,
                                   threads=args.threads, kv_budget_mb=args.kv_budget_mb,
                                   max_batch=args.max_batch, dtype=args.dtype,
                                   device=args.device, model_name=args.model_name, limits=_limits(args))
        check_device(args.device)
        engine_dir = args.engine if args.engine is not None else default_engine(args.cache_dir)
        run_server(replace(opts, engine_dir=engine_dir))
    except SpecError as e:
        return _fail(e.spelled(_flag))
    except (WhiflashError, ValueError, OSError) as e:
        return _fail(str(e))
    return 0


def serve_main(argv: list[str] | None = None) -> int:
    from whiflash_trt.serving.server import ServerOptions, check_python, exec_server

    argv = sys.argv[1:] if argv is None else list(argv)
    own = argv[:argv.index("--")] if "--" in argv else argv   # arguments after `--` belong to tritonserver
    if "--openai" in own:
        argv.remove("--openai")
        return _openai_main(argv)
    args = serve_parser().parse_args(argv)
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


def _read_prompts(args) -> list[str]:
    """Every prompt, checked before any is generated (an empty one names its file line)."""
    if args.prompts_file is None:
        if not args.prompt:
            raise WhiflashError("--prompt is empty")
        return [args.prompt]
    try:
        lines = Path(args.prompts_file).read_text().splitlines()
    except OSError as e:
        raise WhiflashError(f"cannot read the prompts file {args.prompts_file}: {e.strerror or e}") from None
    return [record["prompt"] for _, record in parse_prompt_lines(lines, str(args.prompts_file), non_empty=True)]


class _StreamPrinter:
    """Prints text as tokens arrive (runtime.text_stream: a stop string never reaches the screen); `finish` prints
    the rest of the final text."""

    def __init__(self, decode, stop_strings: tuple[str, ...] = (), out=None) -> None:
        self.text, self.out = TextStream(decode, stop_strings), out or sys.stdout

    def __call__(self, new_ids: list[int]) -> None:
        delta = self.text.add(new_ids)
        if delta:
            self.out.write(delta)
            self.out.flush()

    def finish(self, final_text: str) -> None:
        self.out.write(self.text.rest(final_text) + "\n")
        self.out.flush()


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="whiflash-run", description="Generate text with a whiflash engine.",
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--engine", type=Path, help="engine directory (default: the embedded SmolLM2-135M, built once "
                                               "into --cache-dir)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompts-file", type=Path, help='JSON lines, one {"prompt": ...} per line')
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", help="system message for --chat")
    p.add_argument("--max-new-tokens", type=int, default=128, help="most tokens generated per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (so is any temperature below 1e-5, "
                   "config.GREEDY_BELOW_TEMPERATURE)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off; with --temperature)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--seed", type=int, help="sampling seed (default: a random one)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--mode", default=AUTO, choices=[AUTO, *MODES],
                   help="ar: target only; eagle3 / dflash: one learned drafter; suffix: the parameter-free drafter "
                        "(what followed the text's suffix before); whiflash: all three routed per round; auto: "
                        "whiflash when the engine has both learned drafters, else its one drafter, else ar")
    p.add_argument("--router", default=AUTO, choices=[AUTO, *ROUTERS],
                   help="whiflash routing policy; auto: neural when the engine has router weights, else entropy")
    p.add_argument("--threshold", type=float, help="router threshold (default: the engine's calibrated one)")
    p.add_argument("--catch-up", choices=list(CATCH_UP),
                   help="whiflash: lazy (the default) updates a drafter only when chosen; eager updates both every "
                        "round")
    add_tree_options(p)
    p.add_argument("--stream", action="store_true", help="print text as it is generated (not with --json)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], help="override the engine's dtype")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="torch threads: half this machine's cores; lower it when other jobs share the CPU, raise it "
                        "to every core on a quiet one (with every core in use a single busy core halts decoding)")
    p.add_argument("--backend", choices=list(BACKENDS), help="run the engine with this backend (default: the one it "
                                                             "was built for; torch runs any engine)")
    p.add_argument("--kv-budget-mb", type=int, default=256, help="memory for all KV pools together (MB)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help="where the default engine is built")
    return p


def run_main(argv: list[str] | None = None) -> int:
    args = run_parser().parse_args(argv)
    try:
        return _run(args)
    except KVCacheExhausted as e:
        return _fail(f"{e}; run with --kv-budget-mb {e.needed_mb} or more")
    except SpecError as e:
        return _fail(e.spelled(_flag))
    except (WhiflashError, ValueError) as e:
        return _fail(str(e))


def _flag(param: str) -> str:
    """whiflash-run's flag of a speculation or load setting (runtime.plan.PARAMS, "device", "threads", "backend"): its
    neutral name with dashes. whiflash-serve --openai spells its load settings the same way."""
    return "--" + param.replace("_", "-")


def _requested_spec(args) -> SpecConfig:
    """The speculation settings given on the command line (validated), before the engine resolves "auto"."""
    if args.stream and args.json:
        raise WhiflashError("--stream and --json do not combine: --json prints one object per prompt when it is done")
    if args.kv_budget_mb <= 0:
        raise WhiflashError(f"--kv-budget-mb must be positive, got {args.kv_budget_mb}")
    return SpecConfig(mode=args.mode, router=args.router, threshold=args.threshold,
                      catch_up=args.catch_up or SpecConfig.catch_up, **tree_settings(args))


def _given(args) -> list[str]:
    """The speculation settings the command line names (argparse keeps each under its neutral name)."""
    defaults = {"mode": AUTO, "router": AUTO}
    return [p for p in PARAMS if getattr(args, p) != defaults.get(p)]


def _run(args) -> int:
    from whiflash_trt.runtime.engine import Engine

    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_strings=tuple(args.stop),
                           sampling=SamplingConfig(temperature=args.temperature, top_k=args.top_k,
                                                   top_p=args.top_p, seed=args.seed))
    requested = _requested_spec(args)
    check_device(args.device)
    set_threads(args.threads)
    prompts = _read_prompts(args)
    engine_dir = args.engine if args.engine is not None else default_engine(args.cache_dir)
    engine = Engine.load(engine_dir, device=args.device, dtype=args.dtype, kv_budget_bytes=args.kv_budget_mb * 2**20,
                         backend=args.backend)
    first = engine.plan(requested, given=_given(args))   # every prompt's settings, checked before any output
    if engine.slow_bf16:   # the one case a user loses the engine's speed without asking for it
        print(f"whiflash: linears on {engine.compute}", file=sys.stderr, flush=True)
    for i, prompt in enumerate(prompts):
        plan = first if i == 0 else engine.plan(first.spec)   # one plan per request: its router's state is its own
        ids = engine.encode(prompt, chat=args.chat, system=args.system)
        printer = _StreamPrinter(engine.decode, tuple(args.stop)) if args.stream else None
        if i and not args.json:
            print(PROMPT_SEPARATOR, flush=True)
        result = engine.generate(ids, gen, on_tokens=printer, spec=plan)
        if args.json:
            out = result.to_json()
            out["stats"]["compute"] = engine.compute
            print(json.dumps(out), flush=True)
        elif printer is not None:
            printer.finish(result.text)
        else:
            print(result.text, flush=True)
    return 0
