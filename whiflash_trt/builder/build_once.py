"""An engine built once into a shared path (the default engine's cache folder). Concurrent callers, threads or
processes, take an exclusive lock on a file beside it: one builds, the others wait and then use its result."""
from __future__ import annotations

import fcntl
import sys
from pathlib import Path

from whiflash_trt.builder.build import BuildOptions, build_engine
from whiflash_trt.manifest import MANIFEST


def lock_path(out: Path) -> Path:
    return out.with_name(f".{out.name}.lock")


def build_once(opts: BuildOptions, announce: str | None = None) -> Path:
    """The engine at opts.output, built first (printing `announce` on stderr) unless a finished one is there. The
    install is one rename, so an engine with a manifest is complete."""
    out = Path(opts.output).expanduser().resolve()
    if (out / MANIFEST).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path(out), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes, or when the process dies
        if not (out / MANIFEST).is_file():   # else another caller built it while this one waited
            if announce is not None:
                print(announce, file=sys.stderr, flush=True)
            build_engine(opts)
    return out
