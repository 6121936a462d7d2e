"""`whiflash-build`: the builder never deletes what it did not write, checks --output before any heavy work, leaves an
engine whose files have the modes any new file gets, and builds a named target with the drafters shipped for it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from whiflash_trt.builder.build import BuildOptions, build_engine
from whiflash_trt.cli import build_main
from whiflash_trt.errors import WhiflashError
from whiflash_trt.runtime.engine import Engine

WHIFLASH_BUILD = str(Path(sys.executable).parent / "whiflash-build")


def one_line_error(capsys, argv: list) -> str:
    capsys.readouterr()
    rc = build_main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    return err


def test_a_non_empty_directory_that_is_not_an_engine_is_refused_and_kept(capsys, tmp_path, tiny_checkpoint):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    for extra in ([], ["--overwrite"]):
        err = one_line_error(capsys, ["--target", tiny_checkpoint(), "--output", out, *extra])
        assert "not empty and is not a whiflash engine" in err and "notes.txt" in err
    assert (out / "notes.txt").read_text() == "my notes" and sorted(os.listdir(out)) == ["notes.txt"]
    assert not list(tmp_path.glob(".mine.*")), "no staging folder may be left behind"


def test_output_dot_in_a_working_folder_is_refused(tmp_path, tiny_checkpoint):
    (tmp_path / "work.py").write_text("print('mine')")
    proc = subprocess.run([WHIFLASH_BUILD, "--target", str(tiny_checkpoint()), "--output", "."], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "not empty and is not a whiflash engine" in proc.stderr and "work.py" in proc.stderr
    assert os.listdir(tmp_path) == ["work.py"]


def test_output_naming_a_file_fails_at_once_before_loading_the_target(tmp_path):
    file = tmp_path / "engine.bin"
    file.write_text("x")
    start = time.perf_counter()
    proc = subprocess.run([WHIFLASH_BUILD, "--target", "smollm2-135m", "--output", str(file)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"error: --output {file} is an existing file, not a directory; name a new or " \
                                  f"empty directory"
    assert "dequantising" not in proc.stderr and time.perf_counter() - start < 30
    assert file.read_text() == "x"


def test_missing_drafter_path_fails_before_loading_the_target(capsys, tmp_path, tiny_checkpoint):
    err = one_line_error(capsys, ["--target", tiny_checkpoint(), "--output", tmp_path / "e",
                                  "--ar-drafter", tmp_path / "nowhere"])
    assert f"--ar-drafter {tmp_path / 'nowhere'} does not exist" in err
    assert not (tmp_path / "e").exists()


def test_bundled_drafters_are_used_by_default_and_versioned(tmp_path, monkeypatch):
    from whiflash_trt.builder import bundled
    from whiflash_trt.builder.build import with_bundled

    folder = tmp_path / "assets" / "tiny"
    (folder / "eagle3").mkdir(parents=True)
    (folder / "eagle3" / "config.json").write_text("{}")
    monkeypatch.setattr(bundled, "ASSETS", tmp_path / "assets")
    b = bundled.bundled_for("tiny")
    assert b.eagle3 == folder / "eagle3" and b.dflash is None and b.router is None
    v1 = b.version()
    (folder / "eagle3" / "config.json").write_text('{"changed": 1}')
    assert bundled.bundled_for("tiny").version() != v1
    opts = with_bundled(BuildOptions(target="tiny", output=tmp_path / "e"))
    assert opts.ar_drafter == folder / "eagle3"
    assert with_bundled(BuildOptions(target="tiny", output=tmp_path / "e", bundled=False)).ar_drafter is None


def test_an_engine_is_replaced_only_with_overwrite(capsys, tmp_path, tiny_checkpoint):
    out = tmp_path / "engine"
    argv = ["--target", tiny_checkpoint(), "--output", out, "--dtype", "fp32"]
    assert build_main([str(a) for a in argv]) == 0
    first = (out / "manifest.json").stat().st_mtime_ns
    err = one_line_error(capsys, argv)
    assert "already holds a whiflash engine; pass --overwrite" in err
    assert (out / "manifest.json").stat().st_mtime_ns == first
    assert build_main([str(a) for a in argv + ["--overwrite"]]) == 0
    assert (out / "manifest.json").stat().st_mtime_ns != first
    Engine.load(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"], "no staging or old folder may be left behind"


def test_an_engine_holding_foreign_files_is_never_replaced(capsys, tmp_path, tiny_checkpoint):
    out = tmp_path / "engine"
    build_engine(BuildOptions(target=str(tiny_checkpoint()), output=out, dtype="fp32", show_progress=False))
    (out / "results.csv").write_text("1,2,3")
    err = one_line_error(capsys, ["--target", tiny_checkpoint(), "--output", out, "--overwrite"])
    assert "files the builder did not write (results.csv)" in err
    assert (out / "results.csv").read_text() == "1,2,3"


def test_an_empty_existing_directory_is_built_into(tmp_path, tiny_checkpoint):
    out = tmp_path / "empty"
    out.mkdir()
    assert build_engine(BuildOptions(target=str(tiny_checkpoint()), output=out, dtype="fp32",
                                     show_progress=False)) == out.resolve()
    Engine.load(out)


def test_a_failed_build_leaves_the_old_engine_and_no_staging_folder(tmp_path, tiny_checkpoint):
    out = tmp_path / "engine"
    build_engine(BuildOptions(target=str(tiny_checkpoint()), output=out, dtype="fp32", show_progress=False))
    before = sorted(p.name for p in out.iterdir())
    bad_router = tmp_path / "router.safetensors"
    bad_router.write_bytes(b"not a safetensors file")
    with pytest.raises(WhiflashError):
        build_engine(BuildOptions(target=str(tiny_checkpoint()), output=out, dtype="fp32", show_progress=False,
                                  router=bad_router, overwrite=True))
    assert sorted(p.name for p in out.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine", "router.safetensors"]


def test_engine_files_get_the_modes_of_any_new_file(tmp_path, tiny_checkpoint):
    out = build_engine(BuildOptions(target=str(tiny_checkpoint()), output=tmp_path / "engine", dtype="fp32",
                                    show_progress=False))
    reference = tmp_path / "reference"
    reference.write_text("")
    file_mode = reference.stat().st_mode & 0o777
    (tmp_path / "reference-dir").mkdir()
    dir_mode = (tmp_path / "reference-dir").stat().st_mode & 0o777
    assert (out.stat().st_mode & 0o777) == dir_mode
    for path in out.rglob("*"):
        assert path.stat().st_mode & 0o777 == (dir_mode if path.is_dir() else file_mode), path


def test_triton_options_are_checked_before_the_engine_is_built(capsys, tmp_path, tiny_checkpoint):
    file = tmp_path / "repo"
    file.write_text("x")
    err = one_line_error(capsys, ["--target", tiny_checkpoint(), "--output", tmp_path / "e", "--triton-repo", file])
    assert "--triton-repo" in err and "is an existing file" in err
    err = one_line_error(capsys, ["--target", tiny_checkpoint(), "--output", tmp_path / "e", "--triton-repo",
                                  tmp_path / "r", "--triton-instances", 0])
    assert "instance count must be >= 1, got 0" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]


def drop_during_build(monkeypatch, path: Path, text: str = "mine") -> None:
    """Write the user file `path` while the engine is being built (after --output was checked, before the install)."""
    from whiflash_trt.builder import build

    real = build.add_components

    def dropping(*args):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return real(*args)

    monkeypatch.setattr(build, "add_components", dropping)


def test_a_user_file_written_into_output_during_the_build_is_kept(capsys, monkeypatch, tmp_path, tiny_checkpoint):
    out = tmp_path / "engine"
    drop_during_build(monkeypatch, out / "notes.txt")
    err = one_line_error(capsys, ["--target", tiny_checkpoint(), "--output", out, "--dtype", "fp32"])
    assert "not empty and is not a whiflash engine (notes.txt)" in err
    assert os.listdir(out) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"], "no staging or old folder may be left behind"


def test_a_user_file_written_into_the_old_engine_during_an_overwrite_build_is_kept(capsys, monkeypatch, tmp_path,
                                                                                    tiny_checkpoint):
    out = tmp_path / "engine"
    build_engine(BuildOptions(target=str(tiny_checkpoint()), output=out, dtype="fp32", show_progress=False))
    before = (out / "manifest.json").read_text()
    drop_during_build(monkeypatch, out / "tokenizer" / "late.txt")
    err = one_line_error(capsys, ["--target", tiny_checkpoint(), "--output", out, "--dtype", "fp32", "--overwrite"])
    assert "files the builder did not write (tokenizer/late.txt)" in err
    assert (out / "tokenizer" / "late.txt").read_text() == "mine" and (out / "manifest.json").read_text() == before
    Engine.load(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"], "no staging or old folder may be left behind"


def test_user_files_inside_an_engine_subfolder_block_overwrite(capsys, tmp_path, tiny_checkpoint):
    out = tmp_path / "engine"
    build_engine(BuildOptions(target=str(tiny_checkpoint()), output=out, dtype="fp32", show_progress=False))
    (out / "tokenizer" / "my-vocab.txt").write_text("mine")
    (tmp_path / "data").mkdir()
    (out / "tokenizer" / "link").symlink_to(tmp_path / "data")
    err = one_line_error(capsys, ["--target", tiny_checkpoint(), "--output", out, "--dtype", "fp32", "--overwrite"])
    assert "files the builder did not write (tokenizer/link, tokenizer/my-vocab.txt)" in err
    assert (out / "tokenizer" / "my-vocab.txt").read_text() == "mine" and (out / "tokenizer" / "link").is_symlink()


def test_the_manifest_lists_every_file_the_builder_wrote(tmp_path, tiny_checkpoint):
    out = build_engine(BuildOptions(target=str(tiny_checkpoint()), output=tmp_path / "engine", dtype="fp32",
                                    show_progress=False))
    on_disk = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    listed = json.loads((out / "manifest.json").read_text())["written_files"]
    assert listed == [p for p in on_disk if p != "manifest.json"]
    assert "target.safetensors" in listed and "tokenizer/tokenizer.json" in listed


def test_an_engine_without_a_file_list_is_never_replaced(capsys, tmp_path, tiny_checkpoint):
    out = tmp_path / "engine"
    build_engine(BuildOptions(target=str(tiny_checkpoint()), output=out, dtype="fp32", show_progress=False))
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["written_files"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    err = one_line_error(capsys, ["--target", tiny_checkpoint(), "--output", out, "--dtype", "fp32", "--overwrite"])
    assert "built before whiflash-build listed the files it writes" in err
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before
