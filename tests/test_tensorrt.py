"""The TensorRT path: a clear failure where TensorRT is absent; build + parity where it (and a GPU) is present."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from whiflash_trt.plugins.tensorrt_plugin import INSTALL_HINT

HAVE_TENSORRT = importlib.util.find_spec("tensorrt") is not None
NO_TENSORRT = f"tensorrt is not installed: {INSTALL_HINT}"


def test_tensorrt_modules_import_without_tensorrt():
    code = ("import sys, whiflash_trt.builder.build, whiflash_trt.builder.tensorrt_build, "
            "whiflash_trt.plugins.tensorrt_plugin, whiflash_trt.runtime.backends.tensorrt_graph; "
            "assert 'tensorrt' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(HAVE_TENSORRT, reason="tensorrt is installed here")
def test_backend_tensorrt_fails_at_once_saying_what_to_install(tmp_path, capsys):
    from whiflash_trt.cli import build_main

    # the target does not exist: failing on it would mean work started before the TensorRT check
    code = build_main(["--target", str(tmp_path / "nowhere"), "--output", str(tmp_path / "e"),
                       "--backend", "tensorrt"])
    err = capsys.readouterr().err
    assert code == 2
    assert "pip install tensorrt --extra-index-url https://pypi.nvidia.com" in err
    assert not (tmp_path / "e").exists()


@pytest.mark.skipif(not HAVE_TENSORRT, reason=NO_TENSORRT)
@pytest.mark.gpu
def test_tensorrt_engine_greedy_tokens_equal_torch_engine(tmp_path, tiny_checkpoint):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("the tensorrt backend needs CUDA")
    from tiny_drafters import save_drafters
    from whiflash_trt.builder.build import BuildOptions, build_engine
    from whiflash_trt.config import GenerationConfig, SpecConfig
    from whiflash_trt.runtime.engine import Engine

    ckpt = tiny_checkpoint("onnx")
    common = dict(target=str(ckpt), dtype="fp32", show_progress=False, **save_drafters(tmp_path, ckpt, router=False))
    trt_dir = build_engine(BuildOptions(output=tmp_path / "trt", backend="tensorrt", **common))
    trt_engine = Engine.load(trt_dir, device="cuda")
    torch_engine = Engine.load(trt_dir, device="cuda", backend="torch")
    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    prompt = [5, 17, 42, 7, 99]
    reference = torch_engine.generate(prompt, gen, spec=SpecConfig("ar")).token_ids
    for spec in (SpecConfig("ar"), SpecConfig(mode="eagle3"), SpecConfig(mode="dflash"), SpecConfig(mode="whiflash")):
        assert trt_engine.generate(prompt, gen, spec=spec).token_ids == reference
