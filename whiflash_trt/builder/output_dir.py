"""Where `whiflash-build` writes an engine: --output is checked before any heavy work, the engine is built in a
temporary sibling folder, and only a finished engine is moved into place. Nothing the builder did not write is ever
deleted: an existing directory is replaced only when it holds a whiflash engine and nothing else, and --overwrite
was given."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from whiflash_trt.errors import WhiflashError
from whiflash_trt.manifest import ENGINE_ENTRIES, MANIFEST


def check_output(path: Path, overwrite: bool) -> Path:
    """The absolute engine directory `path` names, or a WhiflashError saying why the builder will not write it."""
    if not str(path).strip():
        raise WhiflashError("--output is empty; name the engine directory to write")
    out = Path(path).expanduser().resolve()
    if out.parent == out:
        raise WhiflashError(f"--output {path} is the filesystem root; name a directory for the engine")
    if out.exists() and not out.is_dir():
        raise WhiflashError(f"--output {path} is an existing file, not a directory; name a new or empty directory")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not entries:
        return out
    if not (out / MANIFEST).is_file():
        raise WhiflashError(f"--output {path} is not empty and is not a whiflash engine ({_listing(entries)}); "
                            f"name a new or empty directory (the builder never deletes files it did not write)")
    foreign = [e for e in entries if e not in ENGINE_ENTRIES]
    if foreign:
        raise WhiflashError(f"--output {path} holds an engine plus files the builder did not write "
                            f"({_listing(foreign)}); move them away or name another directory")
    if not overwrite:
        raise WhiflashError(f"--output {path} already holds a whiflash engine; pass --overwrite to replace it")
    return out


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:3])
    return f"{shown}, ... {len(names)} entries" if len(names) > 3 else shown


def staging_dir(out: Path) -> Path:
    """A new, empty, hidden folder beside `out` to build into (same filesystem, so the final move is a rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))


def install(staged: Path, out: Path) -> None:
    """Move the finished engine `staged` to `out`, replacing the empty folder or engine check_output accepted."""
    _set_default_modes(staged)
    if not out.exists():
        staged.rename(out)
        return
    if not any(out.iterdir()):
        out.rmdir()
        staged.rename(out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    out.rename(old / out.name)
    try:
        staged.rename(out)
    except BaseException:
        (old / out.name).rename(out)
        raise
    shutil.rmtree(old)


def _set_default_modes(folder: Path) -> None:
    """mkdtemp makes a 0700 folder: give the engine the modes any new file gets (0666/0777 less the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o777 & ~umask)
        for f in files:
            os.chmod(os.path.join(root, f), 0o666 & ~umask)
