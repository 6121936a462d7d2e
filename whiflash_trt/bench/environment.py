"""What a result depends on besides the code: the machine, library versions, the engine (hashed), the load."""
from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from whiflash_trt import __version__, kernels
from whiflash_trt.runtime.device import cpu_model


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def git_commit() -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def describe(load_before: list[float] | None) -> dict:
    import tokenizers
    import transformers

    return {
        "machine": {"platform": platform.platform(), "cpu": cpu_model(), "cpu_count": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "python": sys.version.split()[0],
                    "gemm": kernels.gemm() if kernels.registered() else "oneDNN"},
        "versions": {"whiflash_trt": __version__, "git_commit": git_commit(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
        "load_average": {"before": load_before, "after": load_average(),
                         "note": "1/5/15-minute load averages; above the core count the timings are contended"},
    }


def engine_info(engine_dir: Path, engine, dtype: str) -> dict:
    from whiflash_trt.manifest import MANIFEST

    manifest = Path(engine_dir) / MANIFEST
    m = engine.manifest
    return {
        "path": str(Path(engine_dir).resolve()),
        "manifest_sha256": hashlib.sha256(manifest.read_bytes()).hexdigest(),
        "built_dtype": m.dtype, "run_dtype": dtype, "weights": m.weights,
        "target": m.source.get("requested"), "target_sha256": m.source.get("sha256"),
        "components": {name: c.get("sha256") for name, c in m.components.items()},
        "model": {"num_layers": m.model.num_layers, "hidden_size": m.model.hidden_size,
                  "vocab_size": m.model.vocab_size},
    }


def default_engine_dir() -> Path:
    """Like whiflash-run: the embedded default target's engine, built once into the cache folder."""
    from whiflash_trt.builder.default_engine import DEFAULT_CACHE_DIR, default_engine

    return default_engine(DEFAULT_CACHE_DIR)
