"""The real `whiflash-train` console script, in a subprocess: a missing prompt package ends `whiflash-train data`
with one `error:` line naming the command that installs it (exit 2, no traceback), before anything is loaded or
written."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("module, install", [
    ("reasoning_gym", "pip install reasoning-gym==0.1.25"),
    ("bfcl_eval", "pip install --no-deps bfcl-eval==2026.3.23"),
])
def test_train_data_without_a_prompt_package_names_its_install_command(tmp_path, module, install):
    script = Path(sys.executable).with_name("whiflash-train")
    assert script.is_file(), f"no whiflash-train console script beside {sys.executable}: install the project"
    site = tmp_path / "site"
    site.mkdir()
    # Python runs sitecustomize at start-up; a None entry in sys.modules makes the package unimportable
    # (import raises ModuleNotFoundError, importlib.util.find_spec returns None), installed or not.
    (site / "sitecustomize.py").write_text(f"import sys\nsys.modules[{module!r}] = None\n")
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    output = tmp_path / "data"
    # A target that does not exist: were it read before the packages are checked, the error would name it instead.
    proc = subprocess.run([str(script), "data", "--target", str(tmp_path / "no-such-target"), "--output",
                           str(output)], capture_output=True, text=True, env=env, timeout=300)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and install in lines[0], proc.stderr
    assert not output.exists()
