"""Loading what an Engine runs: from an engine directory (any backend) or from checkpoints beside a loaded target
(whiflash-train). Either way the result is one EngineParts record, the Engine's only input besides its KV budget."""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from whiflash_trt import kernels
from whiflash_trt.config import DFLASH, EAGLE3, GRAPH_BACKENDS, dtype_name, parse_dtype
from whiflash_trt.errors import CheckpointError, SpecError, WhiflashError, literal
from whiflash_trt.manifest import TARGET_WEIGHTS, TOKENIZER_DIR, Manifest
from whiflash_trt.models.checkpoints import Checkpoint, instantiate_target
from whiflash_trt.models.contracts import DFlash, Eagle3, Target
from whiflash_trt.models.drafter_checkpoints import load_dflash, load_eagle3
from whiflash_trt.models.layers import linear_path
from whiflash_trt.models.target import dense_replaced
from whiflash_trt.runtime.backends import engine_backend, load_graph_models
from whiflash_trt.spec.router_file import RouterFile, load_router


@dataclass(frozen=True)
class ComputePath:
    """What runs an engine's target linears here (compute_path): whiflash-run's one-line note and its --json stats."""
    note: str = ""    # in a few words; "" where not said
    slow_bf16: bool = False   # a bf16 CPU target without the engine's kernels (whiflash-run says so in one line)


@dataclass(frozen=True)
class EngineParts:
    """The models an Engine runs (on one device, in the target's dtype), its tokenizer and router weights."""
    target: Target
    tokenizer: Any
    eagle3: Eagle3 | None = None
    dflash: DFlash | None = None
    router: RouterFile | None = None
    manifest: Manifest | None = None    # the engine directory's; None for parts loaded from checkpoints
    linears: ComputePath = ComputePath()

    @property
    def compute(self) -> str:
        return self.linears.note

    @property
    def slow_bf16(self) -> bool:
        return self.linears.slow_bf16


def load_tokenizer(engine_dir: Path):
    from transformers import AutoTokenizer

    folder = engine_dir / TOKENIZER_DIR
    if not (folder / "tokenizer.json").is_file():
        raise CheckpointError(f"engine {engine_dir} has no tokenizer ({folder}/tokenizer.json is missing)")
    return AutoTokenizer.from_pretrained(str(folder))


def load_engine_kernels(engine_dir: Path, manifest: Manifest) -> None:
    """The engine's compiled kernels, where it carries them and they fit this machine and torch; otherwise its
    linears and attention run on torch (models.layers.FrozenLinear; lossless still, with another rounding: greedy
    tokens can differ at near-ties from the same engine run on the kernels), and the reason is printed."""
    entry = manifest.kernels
    if not entry or kernels.registered():
        return
    if entry.get("version") != kernels.build.version():
        kernels.report_unavailable("the engine's kernels were built for another torch or source version; "
                                   "rebuild the engine")
        return
    try:
        kernels.load(engine_dir / entry["path"])
    except OSError as e:
        kernels.report_unavailable(f"cannot load {entry['path']}: {e}")


def compiled_target(engine_dir: Path, manifest: Manifest, target, dtype: torch.dtype, device: str):
    from whiflash_trt.runtime.backends.compiled import CompiledTarget

    entry = manifest.compiled.get("target")
    if entry is None:
        raise SpecError(("backend",), f"engine {literal(engine_dir)} has no compiled target; rebuild it with "
                                      f"whiflash-build {{backend}} compiled or run it with {{backend}} torch")
    if device != "cpu" or dtype != parse_dtype(manifest.dtype):
        raise SpecError(("backend",), f"the compiled target runs on CPU in {manifest.dtype}; use {{backend}} torch "
                                      f"for {literal(device)} or another dtype")
    if not target.kernel_attention:
        raise SpecError(("backend",), "the compiled target needs the engine's kernels, which do not run here (see "
                                      "above); run the engine with {backend} torch")
    return CompiledTarget(target, engine_dir / entry["path"], tuple(entry["capture_layers"]))


def _for_inference(drafter):
    """An engine's drafter: frozen, its projections fused (and on the kernels where loaded)."""
    drafter.requires_grad_(False).eval()
    drafter.fuse_projections()
    return drafter


def checkpoint_parts(target: Target, tokenizer, device: str = "cpu", eagle3: Path | None = None,
                     dflash: Path | None = None, router: Path | None = None,
                     manifest: Manifest | None = None) -> EngineParts:
    """A torch target with the drafters and router weights read from their checkpoint paths."""
    cfg, dtype = target.config, target.dtype
    return EngineParts(target, tokenizer,
                       None if eagle3 is None else _for_inference(load_eagle3(eagle3, cfg).to(device, dtype)),
                       None if dflash is None else _for_inference(load_dflash(dflash, cfg).to(device, dtype)),
                       None if router is None else load_router(router, cfg.hidden_size), manifest)


def compute_path(backend: str, dtype: torch.dtype, device: str) -> ComputePath:
    """What runs an engine's target linears here, and whether that is bf16 on CPU without the engine's kernels."""
    if backend in GRAPH_BACKENDS:
        return ComputePath(f"{backend} graphs")
    if str(device) != "cpu":
        return ComputePath(f"torch on {device}")
    path = linear_path(dtype)
    slow_bf16 = dtype == torch.bfloat16 and not kernels.registered()
    return ComputePath(f"compiled step, {path}" if backend == "compiled" else path, slow_bf16)


def read_weights(path: Path, engine_dir: Path, skip: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file `path` but those named in `skip`, which are never read."""
    if not path.is_file():
        raise CheckpointError(f"engine {engine_dir} is incomplete: {path.name} is missing")
    try:
        if not skip:
            return load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys() if name not in skip}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read {path}: {e} (file corrupt or truncated?)") from None


def native_weights(engine_dir: Path, manifest: Manifest, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A native engine's packed blocks (models.target.pack_native's) where they run here: on the CPU in bf16 over the
    engine's kernels, packed in their layout (kernels.GGML_PACKING); else {} (and why, on stderr): the target then
    runs its dequantised weights."""
    if not manifest.native:
        return {}
    if device != "cpu" or dtype != torch.bfloat16 or not kernels.registered():
        where = f"{device}, {dtype_name(dtype)}" + ("" if kernels.registered() else ", no kernels")
        print(f"this engine's native weights run on its CPU kernels in bf16, not here ({where}): the target runs "
              f"its dequantised weights", file=sys.stderr)
        return {}
    if manifest.native.get("packing") != kernels.GGML_PACKING:
        print("this engine's native weights are packed for other kernels (rebuild it): the target runs its "
              "dequantised weights", file=sys.stderr)
        return {}
    return read_weights(engine_dir / manifest.native["path"], engine_dir)


def load_parts(engine_dir: Path, device: str = "cpu", dtype: str | None = None,
               backend: str | None = None) -> EngineParts:
    """`backend`: None = the one the engine was built for; "torch" runs the modules of any engine."""
    manifest = Manifest.read(engine_dir)
    backend = backend or engine_backend(manifest)
    parts = manifest.components
    paths = {name: engine_dir / parts[name]["path"] if name in parts else None for name in (EAGLE3, DFLASH, "router")}
    if backend in GRAPH_BACKENDS:
        if dtype is not None and dtype != manifest.dtype:
            raise WhiflashError(f"the {backend} graphs were built in {manifest.dtype}; rebuild for {dtype}")
        target, eagle3, dflash = load_graph_models(engine_dir, manifest, backend, device)
        router = None if paths["router"] is None else load_router(paths["router"], manifest.model.hidden_size)
        return EngineParts(target, load_tokenizer(engine_dir), eagle3, dflash, router, manifest,
                           compute_path(backend, parse_dtype(manifest.dtype), device))
    torch_dtype = parse_dtype(dtype or manifest.dtype)
    if device == "cpu" and torch_dtype == torch.float16:
        raise WhiflashError("fp16 is not supported on CPU; use bf16 or fp32 (fp16 is for CUDA)")
    if device == "cpu" and torch_dtype == torch.bfloat16:
        load_engine_kernels(engine_dir, manifest)
    native = native_weights(engine_dir, manifest, device, torch_dtype)
    weights = engine_dir / TARGET_WEIGHTS   # without the dense linears the native blocks replace: never read
    state = read_weights(weights, engine_dir, dense_replaced(manifest.model, native))
    target = instantiate_target(Checkpoint(manifest.model, state, str(weights)), torch_dtype, device, packed=native)
    if backend == "compiled":
        target = compiled_target(engine_dir, manifest, target, torch_dtype, device)
    parts = checkpoint_parts(target, load_tokenizer(engine_dir), device, paths[EAGLE3], paths[DFLASH],
                             paths["router"], manifest)
    if backend == "compiled":   # engines built before the drafters' packages have none
        from whiflash_trt.runtime.backends.compiled import CompiledDFlash, CompiledEagle3
        for name, wrap in ((EAGLE3, CompiledEagle3), (DFLASH, CompiledDFlash)):
            entry, drafter = manifest.compiled.get(name), getattr(parts, name)
            if entry is not None and drafter is not None:
                parts = dataclasses.replace(parts, **{name: wrap(drafter, engine_dir / entry["path"])})
    path = compute_path(backend, torch_dtype, device)
    if native:
        path = dataclasses.replace(path, note=f"{path.note}, over the GGUF's {'/'.join(manifest.native['types'])} "
                                              f"blocks")
    return dataclasses.replace(parts, linears=path)
