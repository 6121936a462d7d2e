"""`whiflash-build`: turn a target checkpoint into an engine directory (see whiflash_trt.manifest)."""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from whiflash_trt import __version__
from whiflash_trt.builder.sources import load_checkpoint, load_tokenizer, resolve_target
from whiflash_trt.config import CacheConfig, dtype_name, parse_dtype
from whiflash_trt.manifest import TARGET_WEIGHTS, TOKENIZER_DIR, Manifest, file_sha256
from whiflash_trt.models.checkpoints import validate_state_dict
from whiflash_trt.models.drafter_checkpoints import load_dflash, load_eagle3
from whiflash_trt.runtime.kv_cache import KVLayout
from whiflash_trt.spec.router import load_router


@dataclass(frozen=True)
class BuildOptions:
    target: str
    output: Path
    dtype: str = "bf16"
    block_size: int = CacheConfig.block_size
    show_progress: bool = True
    ar_drafter: Path | None = None     # EAGLE-3 checkpoint folder (public format)
    dllm_drafter: Path | None = None   # DFlash checkpoint folder (public format)
    router: Path | None = None         # neural router weights (safetensors)
    bundled: bool = True               # named target: use the drafters/router the package ships for it

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        CacheConfig(block_size=self.block_size)


def add_components(opts: BuildOptions, cfg, dtype: torch.dtype, engine_dir: Path) -> tuple[dict, list[KVLayout]]:
    """Validate the drafters and router against the target, copy them into the engine, describe them."""
    components: dict = {}
    layouts: list[KVLayout] = []
    if opts.ar_drafter is not None:
        drafter = load_eagle3(opts.ar_drafter, cfg)
        c = drafter.config
        components["eagle3"] = _copy_folder(Path(opts.ar_drafter), engine_dir / "eagle3") | {
            "capture_layers": list(c.capture_layers), "draft_vocab_size": c.draft_vocab_size,
            "rope_theta": c.rope.theta}
        layouts.append(KVLayout("eagle3", 1, c.num_kv_heads, c.head_dim, dtype))
    if opts.dllm_drafter is not None:
        drafter = load_dflash(opts.dllm_drafter, cfg)
        c = drafter.config
        components["dflash"] = _copy_folder(Path(opts.dllm_drafter), engine_dir / "dflash") | {
            "capture_layers": list(c.capture_layers), "block_size": c.block_size, "num_layers": c.num_layers,
            "mask_token_id": c.mask_token_id, "carries_mask_embedding": drafter.mask_embedding is not None}
        layouts.append(KVLayout("dflash", c.num_layers, c.num_kv_heads, c.head_dim, dtype))
    if opts.router is not None:
        router = Path(opts.router)
        file = router / "router.safetensors" if router.is_dir() else router
        loaded = load_router(file, cfg.hidden_size)
        shutil.copyfile(file, engine_dir / "router.safetensors")
        components["router"] = {"path": "router.safetensors", "source": str(file.resolve()),
                                "sha256": file_sha256([file]), "threshold": loaded.threshold,
                                "entropy_threshold": loaded.entropy_threshold}
    return components, layouts


def _copy_folder(src: Path, dst: Path) -> dict:
    if src.is_file():
        src = src.parent
    files = [p for p in sorted(src.iterdir()) if p.suffix in (".json", ".safetensors") or p.name.endswith(".md")]
    dst.mkdir()
    for p in files:
        shutil.copyfile(p, dst / p.name)
    return {"path": dst.name, "source": str(src.resolve()), "sha256": file_sha256(files)}


def with_bundled(opts: BuildOptions) -> BuildOptions:
    """Fill in the package's drafters/router for a named target where the user gave none."""
    from dataclasses import replace

    from whiflash_trt.builder.bundled import bundled_for

    if not opts.bundled:
        return opts
    bundle = bundled_for(opts.target)
    return replace(opts, ar_drafter=opts.ar_drafter or bundle.eagle3, dllm_drafter=opts.dllm_drafter or bundle.dflash,
                   router=opts.router or bundle.router)


def build_engine(opts: BuildOptions) -> Path:
    """Write the engine into a temporary sibling folder and rename it at the end: never a half-built engine."""
    opts = with_bundled(opts)
    out = Path(opts.output)
    source = resolve_target(opts.target)
    start = time.perf_counter()
    progress = (lambda it: tqdm(it, desc="dequantising", unit="tensor")) if opts.show_progress else None
    ckpt = load_checkpoint(source, progress=progress)
    state = validate_state_dict(ckpt.config, ckpt.state_dict, ckpt.source)
    dtype = parse_dtype(opts.dtype)
    tokenizer = load_tokenizer(source)

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tensors = {k: v.to(dtype).contiguous() for k, v in state.items()}
        save_file(tensors, str(tmp / TARGET_WEIGHTS))
        tokenizer.save_pretrained(str(tmp / TOKENIZER_DIR))
        cfg = ckpt.config
        components, layouts = add_components(opts, cfg, dtype, tmp)
        layouts.insert(0, KVLayout("target", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype))
        Manifest(
            model=cfg,
            dtype=dtype_name(dtype),
            capture_layers=tuple(sorted({i for c in components.values() for i in c.get("capture_layers", ())})),
            block_size=opts.block_size,
            kv_pools=tuple(layout.to_dict() for layout in layouts),
            components=components,
            source={"kind": source.kind, "requested": source.requested, "path": str(source.path),
                    "sha256": file_sha256(source.files)},
            build_options={"dtype": opts.dtype, "block_size": opts.block_size, "backend": "torch",
                           "ar_drafter": str(opts.ar_drafter) if opts.ar_drafter else None,
                           "dllm_drafter": str(opts.dllm_drafter) if opts.dllm_drafter else None,
                           "router": str(opts.router) if opts.router else None,
                           "whiflash_trt_version": __version__, "torch_version": torch.__version__,
                           "build_seconds": round(time.perf_counter() - start, 2)},
        ).write(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
