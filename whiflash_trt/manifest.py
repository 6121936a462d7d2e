"""The engine directory format, written by the builder and read by the runtime.

    ENGINE/manifest.json      format version, architecture, dtype, captured layers, KV layout, sources, options
    ENGINE/target.safetensors the target's weights (our module names) in the engine dtype
    ENGINE/target-native.safetensors  --weights native: the target's linears in their GGUF blocks, packed for the
                              kernels (uint8, models.target.pack_native: kernels.pack_ggml by fused linear), listed
                              under "native" with their packing (kernels.GGML_PACKING)
    ENGINE/tokenizer/         tokenizer.json + tokenizer_config.json (chat template)
    ENGINE/eagle3/, dflash/   drafter checkpoints (public formats), listed under "components"
    ENGINE/router.safetensors neural router weights, listed under "components"
    ENGINE/onnx/*.onnx        --backend onnx|tensorrt: exported graphs, listed with their signatures under "onnx"
    ENGINE/tensorrt/*.plan    --backend tensorrt: serialized TensorRT engines, listed under "tensorrt"
    ENGINE/compiled/*.pt2     --backend compiled: the target step as an AOTInductor package, listed under "compiled"
    ENGINE/kernels/*.so       bf16 engines on AVX-512 BF16 CPUs: the engine's compiled CPU kernels, listed under
                              "kernels" (whiflash_trt/kernels)

"written_files" lists every file the builder wrote (paths relative to the engine, manifest.json aside): a rebuild
with --overwrite deletes those and nothing else. Every path in the manifest stays inside the engine directory.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from whiflash_trt.config import ModelConfig
from whiflash_trt.errors import CheckpointError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TARGET_WEIGHTS = "target.safetensors"
NATIVE_WEIGHTS = "target-native.safetensors"
TOKENIZER_DIR = "tokenizer"
ONNX_DIR = "onnx"
TENSORRT_DIR = "tensorrt"
KERNELS_DIR = "kernels"
COMPILED_DIR = "compiled"
ROUTER_WEIGHTS = "router.safetensors"
# The sections whose "path" entries (at any depth) name files of the engine, relative to its directory.
PATH_SECTIONS = ("components", "onnx", "tensorrt", "kernels", "compiled", "native")


@dataclass(frozen=True)
class Manifest:
    model: ModelConfig
    dtype: str
    capture_layers: tuple[int, ...]
    block_size: int
    kv_pools: tuple[dict, ...]
    source: dict[str, Any]
    build_options: dict[str, Any]
    components: dict[str, Any] = field(default_factory=dict)
    onnx: dict[str, Any] = field(default_factory=dict)        # graphs of the onnx / tensorrt backends
    tensorrt: dict[str, Any] = field(default_factory=dict)
    kernels: dict[str, Any] = field(default_factory=dict)     # "path", "version" of the kernel library
    compiled: dict[str, Any] = field(default_factory=dict)    # "target": its package ("path", "capture_layers")
    native: dict[str, Any] = field(default_factory=dict)      # "path", "packing", "types": the linears' GGUF blocks
    written_files: tuple[str, ...] | None = None   # None: an engine built before the builder recorded its files
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        sections = (("onnx", self.onnx), ("tensorrt", self.tensorrt), ("kernels", self.kernels),
                    ("compiled", self.compiled), ("native", self.native))
        backends = {k: v for k, v in sections if v}
        written = {} if self.written_files is None else {"written_files": list(self.written_files)}
        return json.dumps({
            "format_version": self.format_version,
            "architecture": self.model.architecture,
            "dtype": self.dtype,
            "weights": self.weights,
            "model_config": self.model.to_dict(),
            "capture_layers": list(self.capture_layers),
            "kv_layout": {"block_size": self.block_size, "pools": list(self.kv_pools),
                          "shape": "[num_layers, num_blocks * block_size, num_kv_heads, head_dim] per K and V"},
            "source": self.source,
            "build_options": self.build_options,
            "components": self.components,
            "files": {"target_weights": TARGET_WEIGHTS, "tokenizer": TOKENIZER_DIR},
        } | backends | written, indent=2)

    @property
    def weights(self) -> str:
        """What the target's linears compute from: "native" (its GGUF blocks) or the engine dtype."""
        return "native" if self.native else self.dtype

    def write(self, engine_dir: Path) -> None:
        (engine_dir / MANIFEST).write_text(self.to_json() + "\n")

    @classmethod
    def read(cls, engine_dir: str | Path) -> "Manifest":
        engine_dir = Path(engine_dir)
        path = engine_dir / MANIFEST
        if not path.is_file():
            raise CheckpointError(f"{engine_dir} is not a whiflash engine directory: {MANIFEST} is missing "
                                  f"(build one with `whiflash-build --target NAME|PATH --output {engine_dir}`)")
        try:
            d = json.loads(path.read_text())
            version = d["format_version"]
            if version != FORMAT_VERSION:
                raise CheckpointError(f"{path}: engine format version {version} is not supported by this "
                                      f"whiflash-trt (expects {FORMAT_VERSION}); rebuild the engine")
            check_paths(engine_dir, d)
            written = d.get("written_files")
            return cls(model=ModelConfig.from_dict(d["model_config"]), dtype=d["dtype"],
                       capture_layers=tuple(d["capture_layers"]), block_size=d["kv_layout"]["block_size"],
                       kv_pools=tuple(d["kv_layout"]["pools"]), source=d["source"],
                       build_options=d["build_options"], components=d.get("components", {}),
                       onnx=d.get("onnx", {}), tensorrt=d.get("tensorrt", {}), kernels=d.get("kernels", {}),
                       compiled=d.get("compiled", {}), native=d.get("native", {}),
                       written_files=None if written is None else tuple(written),
                       format_version=version)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path} is corrupt or incomplete: {type(e).__name__}: {e}") from None


def check_paths(engine_dir: Path, d: dict) -> None:
    """Every path the manifest `d` names (its sections' "path" entries and written_files) lies inside `engine_dir`."""
    for section in PATH_SECTIONS:
        for where, rel in _section_paths(section, d.get(section, {})):
            check_inside(engine_dir, rel, where)
    written = d.get("written_files", [])
    if not isinstance(written, list):
        raise CheckpointError(f"{engine_dir / MANIFEST}: written_files is not a list")
    for rel in written:
        check_inside(engine_dir, rel, "written_files")


def _section_paths(where: str, value) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [found for k, v in value.items()
                for found in ([(where, v)] if k == "path" else _section_paths(f"{where}.{k}", v))]
    if isinstance(value, list):
        return [found for i, v in enumerate(value) for found in _section_paths(f"{where}[{i}]", v)]
    return []


def check_inside(engine_dir: Path, rel, where: str) -> None:
    """A CheckpointError unless `rel` is a relative path that stays inside `engine_dir`, symlinks followed."""
    bad = (not isinstance(rel, str) or not rel or Path(rel).is_absolute() or PurePosixPath(rel).is_absolute()
           or ".." in PurePosixPath(rel).parts or "\\" in rel)
    if not bad:
        root = Path(engine_dir).resolve()
        bad = not (root / rel).resolve().is_relative_to(root)
    if bad:
        raise CheckpointError(f"{Path(engine_dir) / MANIFEST}: {where} names {rel!r}, which leads outside the engine "
                              f"directory; refusing to read it (rebuild the engine)")


def file_sha256(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()
