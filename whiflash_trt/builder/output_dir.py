"""Where `whiflash-build` writes an engine: --output is checked before any heavy work, the engine is built in a
temporary sibling folder, and only a finished engine is moved into place. Nothing the builder did not write is ever
deleted: an existing directory is replaced only when it holds a whiflash engine whose manifest lists every file in it,
and --overwrite was given. The install checks again, atomically: it moves the old directory aside, verifies what it
moved, and puts it back if it holds anything the builder did not write.
"""
from __future__ import annotations

import errno
import os
import sys
import tempfile
from pathlib import Path

from whiflash_trt.errors import CheckpointError, WhiflashError
from whiflash_trt.manifest import MANIFEST, Manifest


def check_output(path: Path, overwrite: bool) -> Path:
    """The absolute engine directory `path` names, or a WhiflashError saying why the builder will not write it."""
    if not str(path).strip():
        raise WhiflashError("--output is empty; name the engine directory to write")
    out = Path(path).expanduser().resolve()
    if out.parent == out:
        raise WhiflashError(f"--output {path} is the filesystem root; name a directory for the engine")
    if out.exists() and not out.is_dir():
        raise WhiflashError(f"--output {path} is an existing file, not a directory; name a new or empty directory")
    if out.is_dir() and any(out.iterdir()):
        check_replaceable(out, str(path))
        if not overwrite:
            raise WhiflashError(f"--output {path} already holds a whiflash engine; pass --overwrite to replace it")
    return out


def check_replaceable(folder: Path, name: str) -> tuple[str, ...]:
    """The files the engine in `folder` lists as written by the builder, or a WhiflashError unless that is every file
    in it (so deleting what the manifest lists deletes the whole folder and nothing else)."""
    entries = sorted(p.name for p in folder.iterdir())
    if not (folder / MANIFEST).is_file():
        raise WhiflashError(f"--output {name} is not empty and is not a whiflash engine ({_listing(entries)}); "
                            f"name a new or empty directory (the builder never deletes files it did not write)")
    try:
        written = Manifest.read(folder).written_files
    except CheckpointError as e:
        raise WhiflashError(f"--output {name} holds an unreadable engine ({e}); delete it yourself or name another "
                            f"directory") from None
    if written is None:
        raise WhiflashError(f"--output {name} holds an engine built before whiflash-build listed the files it "
                            f"writes, so it cannot tell them from yours; delete it yourself or name another directory")
    foreign = foreign_files(folder, written)
    if foreign:
        raise WhiflashError(f"--output {name} holds an engine plus files the builder did not write "
                            f"({_listing(foreign)}); move them away or name another directory")
    return written


def written_files(folder: Path) -> tuple[str, ...]:
    """Every file under `folder` (relative POSIX paths, sorted), manifest.json aside: the manifest's written_files."""
    return tuple(sorted(rel for rel in _walk(folder) if rel != MANIFEST))


def foreign_files(folder: Path, written: tuple[str, ...]) -> list[str]:
    """What under `folder` the builder did not write: files not in `written`, and any symlink (it writes none)."""
    ours = set(written) | {MANIFEST}
    return [rel for rel in _walk(folder) if rel not in ours or (folder / rel).is_symlink()]


def _walk(folder: Path) -> list[str]:
    """Files, symlinks and empty folders under `folder`, relative; symlinked folders are listed, not entered."""
    found = []
    for root, dirs, files in os.walk(folder):
        base = Path(root).relative_to(folder)
        links = [d for d in dirs if os.path.islink(os.path.join(root, d))]
        dirs[:] = [d for d in dirs if d not in links]
        found += [(base / name).as_posix() for name in files + links]
        if not dirs and not files and not links and root != str(folder):
            found.append(base.as_posix() + "/")
    return sorted(found)


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:3])
    return f"{shown}, ... {len(names)} entries" if len(names) > 3 else shown


def staging_dir(out: Path) -> Path:
    """A new, empty, hidden folder beside `out` to build into (same filesystem, so the final move is a rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))


def install(staged: Path, out: Path, overwrite: bool) -> None:
    """Move the finished engine `staged` to `out`. A rename replaces only an absent or empty `out`; anything else is
    moved aside first, checked (an engine listing every file in it, and `overwrite`), and put back if it fails."""
    _set_default_modes(staged)
    try:
        staged.rename(out)
        return
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise WhiflashError(f"cannot move the engine into --output {out}: {e.strerror}") from None
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    old = aside / out.name
    try:
        out.rename(old)
    except FileNotFoundError:   # `out` went away since the first rename: try that again
        aside.rmdir()
        return install(staged, out, overwrite)
    try:
        written = check_replaceable(old, str(out))
        if not overwrite:
            raise WhiflashError(f"--output {out} now holds a whiflash engine (written while this one was built); "
                                f"pass --overwrite to replace it")
        staged.rename(out)
    except BaseException:
        _put_back(old, out)
        aside.rmdir()
        raise
    if remove_written(old, written):
        aside.rmdir()


def _put_back(old: Path, out: Path) -> None:
    try:
        old.rename(out)
    except OSError as e:   # something took `out` meanwhile: the old folder stays where it is, and says so
        raise WhiflashError(f"--output {out} changed during the install ({e.strerror}); what it held before is "
                            f"kept in {old}") from None


def remove_written(folder: Path, written: tuple[str, ...]) -> bool:
    """Delete the files `written` lists and the manifest, then the folders they leave empty. Anything else stays, in
    the folders that hold it (named on stderr); -> whether `folder` is gone."""
    for rel in (*written, MANIFEST):
        path = folder / rel
        if path.is_file() and not path.is_symlink():
            path.unlink()
    for root, dirs, files in os.walk(folder, topdown=False):
        for d in dirs:
            _rmdir_if_empty(Path(root) / d)
    if _rmdir_if_empty(folder):
        return True
    print(f"warning: the replaced engine's folder {folder} still holds files the builder did not write "
          f"({_listing(_walk(folder))}); they were kept there", file=sys.stderr)
    return False


def _rmdir_if_empty(folder: Path) -> bool:
    try:
        folder.rmdir()
    except OSError:
        return False
    return True


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
