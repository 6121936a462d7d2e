"""`whiflash-build`: turn a target checkpoint into an engine directory (see whiflash_trt.manifest)."""
from __future__ import annotations

import copy
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from whiflash_trt import __version__, kernels
from whiflash_trt.builder.sources import load_checkpoint, load_tokenizer, resolve_target
from whiflash_trt.builder.tensorrt_build import build_tensorrt_engines
from whiflash_trt.plugins.tensorrt_plugin import import_tensorrt
from whiflash_trt.errors import WhiflashError
from whiflash_trt.config import (AUTO, BACKENDS, DFLASH, EAGLE3, GRAPH_BACKENDS, CacheConfig, dtype_name,
                                 parse_dtype)
from whiflash_trt.builder.output_dir import check_output, install, staging_dir, written_files
from whiflash_trt.manifest import (COMPILED_DIR, KERNELS_DIR, NATIVE_WEIGHTS, ONNX_DIR, ROUTER_WEIGHTS,
                                   TARGET_WEIGHTS, TOKENIZER_DIR, Manifest, file_sha256)
from whiflash_trt.models.checkpoints import Checkpoint, instantiate_target, validate_state_dict
from whiflash_trt.models.drafter_checkpoints import load_dflash, load_eagle3
from whiflash_trt.models.quantize import QUANTIZED_WEIGHTS, quantize_linears
from whiflash_trt.models.target import pack_native
from whiflash_trt.runtime.kv_cache import kv_layouts
from whiflash_trt.spec.router_file import load_router


NATIVE = "native"


@dataclass(frozen=True)
class BuildOptions:
    target: str
    output: Path
    dtype: str = "bf16"
    # what the target's linears compute from: "native" (a GGUF's own Q4_0/Q4_1/Q8_0 blocks, on the kernels; bf16
    # activations), "q8_0" / "q4_1" / "q4_0" (a Hugging Face target's quantised so at build time, then run as native)
    # or dense weights in the engine dtype ("bf16" / "fp32"; None: the dtype's)
    weights: str | None = None
    block_size: int = CacheConfig.block_size
    show_progress: bool = True
    ar_drafter: Path | None = None     # EAGLE-3 checkpoint folder (public format)
    dllm_drafter: Path | None = None   # DFlash checkpoint folder (public format)
    router: Path | None = None         # neural router weights (safetensors)
    # torch | compiled (the target step compiled ahead of time over the engine's kernels; bf16) | onnx (graphs for
    # onnxruntime) | tensorrt (graphs + TensorRT engines) | auto (compiled where this machine can build it, else torch)
    backend: str = "torch"
    bundled: bool = True               # named target: use the drafters/router the package ships for it
    overwrite: bool = False            # replace an existing engine at `output` (never anything else)

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        CacheConfig(block_size=self.block_size)
        if self.backend not in BACKENDS + (AUTO,):
            raise ValueError(f"unknown backend {self.backend!r}; expected one of {', '.join(BACKENDS + (AUTO,))}")
        if self.backend == "compiled" and self.dtype != "bf16":
            raise ValueError("--backend compiled needs --dtype bf16 (its GEMM kernel is bf16)")
        if self.weights not in (None, NATIVE, "bf16", "fp32", *QUANTIZED_WEIGHTS):
            raise ValueError(f"unknown --weights {self.weights!r}; expected native, {', '.join(QUANTIZED_WEIGHTS)}, "
                             f"bf16 or fp32")
        if self.weights in ("bf16", "fp32") and self.weights != self.dtype:
            raise ValueError(f"--weights {self.weights} are dense weights in the engine dtype, which is {self.dtype}")
        if self.blocks and (self.dtype != "bf16" or self.backend not in ("torch", "compiled", AUTO)):
            raise ValueError(f"--weights {self.weights} runs on the engine's CPU kernels: it needs --dtype bf16 and "
                             f"--backend torch or compiled")
        if self.backend == "onnx" and self.dtype == "bf16":
            raise ValueError("--backend onnx needs --dtype fp32 (onnxruntime's CPU provider has no bfloat16 "
                             "MatMul/Gemm kernels) or fp16 (GPU providers)")

    @property
    def blocks(self) -> bool:
        """The target's linears run on ggml blocks: the GGUF's own, or quantised at build time."""
        return self.weights == NATIVE or self.weights in QUANTIZED_WEIGHTS


def add_components(opts: BuildOptions, cfg, engine_dir: Path) -> tuple[dict, dict]:
    """Validate the drafters and router against the target, copy them into the engine, describe them.
    -> (manifest components, the drafters by name)"""
    components, drafters = {}, {}
    if opts.ar_drafter is not None:
        drafter = load_eagle3(opts.ar_drafter, cfg)
        c = drafter.config
        components[EAGLE3] = _copy_folder(Path(opts.ar_drafter), engine_dir / EAGLE3) | {
            "capture_layers": list(c.capture_layers), "draft_vocab_size": c.draft_vocab_size,
            "rope_theta": c.rope.theta}
        drafters[EAGLE3] = drafter
    if opts.dllm_drafter is not None:
        drafter = load_dflash(opts.dllm_drafter, cfg)
        c = drafter.config
        components[DFLASH] = _copy_folder(Path(opts.dllm_drafter), engine_dir / DFLASH) | {
            "capture_layers": list(c.capture_layers), "draft_block_len": c.draft_block_len, "num_layers": c.num_layers,
            "mask_token_id": c.mask_token_id, "carries_mask_embedding": drafter.mask_embedding is not None}
        drafters[DFLASH] = drafter
    if opts.router is not None:
        router = Path(opts.router)
        file = router / "router.safetensors" if router.is_dir() else router
        loaded = load_router(file, cfg.hidden_size)
        shutil.copyfile(file, engine_dir / ROUTER_WEIGHTS)
        components["router"] = {"path": ROUTER_WEIGHTS, "source": str(file.resolve()),
                                "sha256": file_sha256([file]), "threshold": loaded.threshold,
                                "entropy_threshold": loaded.entropy_threshold}
    return components, drafters


def _copy_folder(src: Path, dst: Path) -> dict:
    if src.is_file():
        src = src.parent
    files = [p for p in sorted(src.iterdir()) if p.suffix in (".json", ".safetensors") or p.name.endswith(".md")]
    dst.mkdir()
    for p in files:
        shutil.copyfile(p, dst / p.name)
    return {"path": dst.name, "source": str(src.resolve()), "sha256": file_sha256(files)}


def export_graphs(ckpt: Checkpoint, drafters: dict, dtype: torch.dtype, engine_dir: Path, show_progress: bool) -> dict:
    """The onnx section: every graph the runtime needs, exported from the models in the engine dtype."""
    from whiflash_trt.builder.onnx_export import export_engine_graphs

    target = instantiate_target(ckpt, dtype, use_kernels=False)   # ONNX graphs of torch ops, not of our kernels
    eagle3, dflash = (None if m is None else m.to(dtype) for m in (drafters.get(EAGLE3), drafters.get(DFLASH)))
    folder = engine_dir / ONNX_DIR
    folder.mkdir()
    progress = (lambda name: print(f"exporting {name}", flush=True)) if show_progress else None
    section = export_engine_graphs(target, eagle3, dflash, folder, progress)
    for graph in section["graphs"].values():
        graph["path"] = f"{ONNX_DIR}/{graph['path']}"
    return section


def add_native(ckpt: Checkpoint, engine_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The manifest's native section: the target's linears in their GGUF blocks (Checkpoint.native), saved packed
    for the kernels (models.target.pack_native: the same bytes on every CPU, so a load packs nothing), the layout
    they are packed in (kernels.GGML_PACKING) and the count of GGUF tensors of each block type -> (the section, the
    packed blocks, which the compiled target's step is traced over)."""
    if not ckpt.native:
        raise WhiflashError(f"{ckpt.source} has no quantized linears to keep (--weights native): build it with "
                            f"--weights bf16")
    packed = pack_native(ckpt.config, ckpt.native)
    save_file(packed, str(engine_dir / NATIVE_WEIGHTS))
    types: dict[str, int] = {}
    for blocks in ckpt.native.values():
        kind = kernels.ggml_kind(blocks)
        types[kind] = types.get(kind, 0) + 1
    return {"path": NATIVE_WEIGHTS, "packing": kernels.GGML_PACKING, "types": dict(sorted(types.items()))}, packed


def add_kernels(engine_dir: Path, required: bool) -> dict:
    """The manifest's kernels section: the compiled CPU kernels copied into the engine, or, where this machine cannot
    build them, an error if `required`, else {} (and why, on stderr): the engine then runs on torch and oneDNN."""
    try:
        library = kernels.build.compile_library(kernels.DEFAULT_CACHE)
    except kernels.KernelBuildError as e:
        if required:
            raise WhiflashError(f"--backend compiled and --weights native run on the engine's CPU kernels, which "
                                f"cannot be built here: {e}; build with --backend torch --weights bf16") from None
        kernels.report_unavailable(str(e))
        return {}
    (engine_dir / KERNELS_DIR).mkdir()
    shutil.copyfile(library, engine_dir / KERNELS_DIR / kernels.LIBRARY)
    return {"path": f"{KERNELS_DIR}/{kernels.LIBRARY}", "version": kernels.build.version(),
            "ops": ["whiflash::linear_bf16", "whiflash::linear_fp32", "whiflash::paged_attention"]}


def add_compiled_target(ckpt: Checkpoint, packed: dict[str, torch.Tensor], capture_layers: tuple[int, ...],
                        engine_dir: Path, drafters: dict, show_progress: bool) -> dict:
    """The manifest's compiled section: the target step, EAGLE-3's draft step and DFlash's block forward compiled
    ahead of time (~1 minute on 2 cores). `packed`: the native blocks add_native saved ({} for dense linears)."""
    from whiflash_trt.builder.compile_dflash import compile_dflash
    from whiflash_trt.builder.compile_eagle3 import compile_eagle3
    from whiflash_trt.builder.compile_target import compile_target

    kernels.load(engine_dir / KERNELS_DIR / kernels.LIBRARY)
    if show_progress:
        # stderr: `whiflash-run --json` builds the default engine on its first run, and its stdout is JSON lines
        print("compiling the target step (torch.export + AOTInductor)", file=sys.stderr, flush=True)
    (engine_dir / COMPILED_DIR).mkdir()
    target = instantiate_target(ckpt, torch.bfloat16, packed=packed)
    entry = compile_target(target, capture_layers, engine_dir / COMPILED_DIR / "target.pt2")
    section = {"target": entry | {"path": f"{COMPILED_DIR}/{entry['path']}"}}
    steps = {EAGLE3: ("EAGLE-3's draft step", compile_eagle3), DFLASH: ("DFlash's block forward", compile_dflash)}
    for name, (what, compile_step) in steps.items():
        if name not in drafters:
            continue
        if show_progress:
            print(f"compiling {what}", file=sys.stderr, flush=True)
        drafter = copy.deepcopy(drafters[name]).to(torch.bfloat16).requires_grad_(False).eval()
        drafter.fuse_projections()   # the engine's layout, over the kernels loaded above
        entry = compile_step(drafter, engine_dir / COMPILED_DIR / f"{name}.pt2")
        section[name] = entry | {"path": f"{COMPILED_DIR}/{entry['path']}"}
    return section


def resolve_backend(opts: BuildOptions) -> str:
    """auto: compiled for bf16 where the engine's kernels can be built and loaded here (the CPU runs one of their
    ISAs, AVX2 at least, and a C++ compiler is found), else torch."""
    if opts.backend != AUTO:
        return opts.backend
    return "compiled" if opts.dtype == "bf16" and kernels.can_build() else "torch"


def with_bundled(opts: BuildOptions) -> BuildOptions:
    """Fill in the package's drafters/router for a named target where the user gave none."""
    from dataclasses import replace

    from whiflash_trt.builder.bundled import bundled_for

    if not opts.bundled:
        return opts
    bundle = bundled_for(opts.target)
    return replace(opts, ar_drafter=opts.ar_drafter or bundle.eagle3, dllm_drafter=opts.dllm_drafter or bundle.dflash,
                   router=opts.router or bundle.router)


def _check_inputs(opts: BuildOptions) -> None:
    """Every path the build reads exists: fail in a second, not after dequantising the target."""
    for flag, path in (("--ar-drafter", opts.ar_drafter), ("--dllm-drafter", opts.dllm_drafter),
                       ("--router", opts.router)):
        if path is not None and not Path(path).exists():
            raise WhiflashError(f"{flag} {path} does not exist")


def _build_options(opts: BuildOptions, backend: str, start: float) -> dict:
    """The build options the manifest records: the requested dtype, block size and components, the backend the build
    settled on, the versions that built it and the seconds since `start`, so an engine says how it was made."""
    return {"dtype": opts.dtype, "weights": opts.weights or opts.dtype, "block_size": opts.block_size,
            "backend": backend,
            "ar_drafter": str(opts.ar_drafter) if opts.ar_drafter else None,
            "dllm_drafter": str(opts.dllm_drafter) if opts.dllm_drafter else None,
            "router": str(opts.router) if opts.router else None,
            "whiflash_trt_version": __version__, "torch_version": torch.__version__,
            "build_seconds": round(time.perf_counter() - start, 2)}


def _load_target(opts: BuildOptions, source) -> Checkpoint:
    """The target's checkpoint as the engine holds it: validated, its linears' blocks kept (a GGUF's, --weights
    native) or made (--weights q8_0|q4_1|q4_0, a Hugging Face target's, quantised here)."""
    if opts.weights in QUANTIZED_WEIGHTS and source.kind == "gguf":
        raise WhiflashError(f"--weights {opts.weights} quantises a Hugging Face target; a GGUF keeps its own blocks "
                            f"(--weights native)")
    progress = (lambda it: tqdm(it, desc="dequantising", unit="tensor")) if opts.show_progress else None
    ckpt = load_checkpoint(source, progress=progress, native=opts.weights == NATIVE)
    state = validate_state_dict(ckpt.config, ckpt.state_dict, ckpt.source)
    if opts.weights in QUANTIZED_WEIGHTS:
        return quantize_linears(Checkpoint(ckpt.config, state, ckpt.source), opts.weights)
    return Checkpoint(ckpt.config, state, ckpt.source, ckpt.native if opts.blocks else {})


def _add_backend(opts: BuildOptions, backend: str, target: Checkpoint, packed: dict[str, torch.Tensor],
                 dtype: torch.dtype, drafters: dict, capture_layers: tuple[int, ...],
                 engine_dir: Path) -> tuple[str, dict]:
    """The sections of what runs the engine: its graphs (onnx, tensorrt), its kernels and compiled steps ->
    (the backend it settled on, the sections). An auto build whose kernels do not build here is a torch one.
    `packed`: the target's native blocks as add_native saved them."""
    sections = {}
    if backend in GRAPH_BACKENDS:
        sections["onnx"] = export_graphs(Checkpoint(target.config, target.state_dict, target.source), drafters, dtype,
                                         engine_dir, opts.show_progress)
    if backend in ("torch", "compiled") and dtype == torch.bfloat16:
        sections["kernels"] = add_kernels(engine_dir, required=backend == "compiled" or opts.blocks)
    if backend == "compiled" and not sections["kernels"]:   # auto, where the kernels did not build
        backend = "torch"
    if backend == "compiled":
        sections["compiled"] = add_compiled_target(target, packed, capture_layers, engine_dir, drafters,
                                                   opts.show_progress)
    if backend == "tensorrt":
        sections["tensorrt"] = build_tensorrt_engines(engine_dir, sections["onnx"],
                                                      target.config.max_position_embeddings, opts.block_size,
                                                      opts.show_progress)
    return backend, sections


def build_engine(opts: BuildOptions) -> Path:
    """Write the engine into a temporary sibling folder and move it in at the end: never a half-built engine, and
    never a file the builder did not write deleted (see builder.output_dir)."""
    out = check_output(opts.output, opts.overwrite)
    opts = with_bundled(opts)
    _check_inputs(opts)
    backend = resolve_backend(opts)
    if backend == "tensorrt":
        import_tensorrt()   # fail at once, before any work, where TensorRT is not installed
    source = resolve_target(opts.target)
    start = time.perf_counter()
    target = _load_target(opts, source)
    dtype, cfg = parse_dtype(opts.dtype), target.config
    tokenizer = load_tokenizer(source)

    tmp = staging_dir(out)
    try:
        save_file({k: v.to(dtype).contiguous() for k, v in target.state_dict.items()}, str(tmp / TARGET_WEIGHTS))
        tokenizer.save_pretrained(str(tmp / TOKENIZER_DIR))
        sections, packed = {}, {}
        if opts.blocks:
            sections["native"], packed = add_native(target, tmp)
        components, drafters = add_components(opts, cfg, tmp)
        layouts = kv_layouts({"target": cfg, **{name: m.config for name, m in drafters.items()}}, dtype)
        capture_layers = tuple(sorted({i for c in components.values() for i in c.get("capture_layers", ())}))
        backend, graphs = _add_backend(opts, backend, target, packed, dtype, drafters, capture_layers, tmp)
        Manifest(
            model=cfg,
            dtype=dtype_name(dtype),
            capture_layers=capture_layers,
            block_size=opts.block_size,
            kv_pools=tuple(layout.to_dict() for layout in layouts),
            components=components,
            source={"kind": source.kind, "requested": source.requested, "path": str(source.path),
                    "sha256": file_sha256(source.files)},
            **sections, **graphs,
            build_options=_build_options(opts, backend, start),
            written_files=written_files(tmp),
        ).write(tmp)
        install(tmp, out, opts.overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
