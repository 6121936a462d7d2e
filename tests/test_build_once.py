"""Concurrent first uses of a shared engine path (the default engine's cache folder) build it once: the others wait
for that build and use its result, and none deletes or corrupts another's engine."""
from __future__ import annotations

import hashlib
import subprocess
import sys
import time

from whiflash_trt.runtime.engine import Engine

# Each process, once imported, says so and waits for the start file: both ask for the engine within milliseconds of
# each other, well inside the other's build.
BUILDER = """
import hashlib, sys, time
from pathlib import Path
from whiflash_trt.builder.build import BuildOptions
from whiflash_trt.builder.build_once import build_once
target, out, ready, start = sys.argv[1:]
Path(ready).write_text("")
while not Path(start).exists():
    time.sleep(0.005)
path = build_once(BuildOptions(target=target, output=Path(out), dtype="fp32", show_progress=False),
                  announce="building")
print(hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest())
"""


def test_two_processes_build_the_shared_engine_once_and_both_use_it(tmp_path, tiny_checkpoint):
    out, start = tmp_path / "cache" / "engine", tmp_path / "start"
    ready = [tmp_path / f"ready-{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER, str(tiny_checkpoint()), str(out), str(r), str(start)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in ready]
    deadline = time.monotonic() + 120
    while not all(r.exists() for r in ready) and time.monotonic() < deadline \
            and all(p.poll() is None for p in procs):
        time.sleep(0.01)
    start.write_text("")
    results = [p.communicate(timeout=300) for p in procs]
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0, stderr
    assert sum("building" in stderr for _, stderr in results) == 1, [stderr for _, stderr in results]
    manifest = hashlib.sha256((out / "manifest.json").read_bytes()).hexdigest()
    assert [stdout.strip() for stdout, _ in results] == [manifest, manifest]
    assert sorted(p.name for p in out.parent.iterdir()) == [".engine.lock", "engine"]
    Engine.load(out)
