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
from whiflash_trt.runtime.kv_cache import KVLayout


@dataclass(frozen=True)
class BuildOptions:
    target: str
    output: Path
    dtype: str = "bf16"
    block_size: int = CacheConfig.block_size
    show_progress: bool = True

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        CacheConfig(block_size=self.block_size)


def build_engine(opts: BuildOptions) -> Path:
    """Write the engine into a temporary sibling folder and rename it at the end: never a half-built engine."""
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
        layout = KVLayout("target", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)
        Manifest(
            model=cfg,
            dtype=dtype_name(dtype),
            capture_layers=(),
            block_size=opts.block_size,
            kv_pools=(layout.to_dict(),),
            source={"kind": source.kind, "requested": source.requested, "path": str(source.path),
                    "sha256": file_sha256(source.files)},
            build_options={"dtype": opts.dtype, "block_size": opts.block_size, "backend": "torch",
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
