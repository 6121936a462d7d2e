"""An engine manifest names files inside its engine directory only: `../`, absolute paths and symlinks that lead out
are refused with one CheckpointError line, before anything is read through them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from whiflash_trt.config import ModelConfig
from whiflash_trt.errors import CheckpointError
from whiflash_trt.manifest import Manifest


def write_engine(folder: Path, **sections) -> Path:
    model = ModelConfig(architecture="llama", vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256)
    folder.mkdir(exist_ok=True)
    Manifest(model=model, dtype="fp32", capture_layers=(), block_size=16, kv_pools=(), source={},
             build_options={}, **sections).write(folder)
    return folder


def test_paths_inside_the_engine_are_read(tmp_path):
    engine = write_engine(tmp_path / "engine", components={"router": {"path": "router.safetensors"}},
                          onnx={"graphs": {"prefill": {"path": "onnx/prefill.onnx"}}},
                          written_files=("onnx/prefill.onnx", "router.safetensors"))
    manifest = Manifest.read(engine)
    assert manifest.components["router"]["path"] == "router.safetensors"
    assert manifest.written_files == ("onnx/prefill.onnx", "router.safetensors")


@pytest.mark.parametrize("sections, where", [
    ({"components": {"eagle3": {"path": "../eagle3"}}}, "components.eagle3"),
    ({"components": {"router": {"path": "/etc/passwd"}}}, "components.router"),
    ({"onnx": {"graphs": {"prefill": {"path": "onnx/../../prefill.onnx"}}}}, "onnx.graphs.prefill"),
    ({"kernels": {"path": "kernels/../../../lib.so"}}, "kernels"),
    ({"written_files": ["tokenizer/../../notes.txt"]}, "written_files"),
])
def test_a_path_leaving_the_engine_is_refused(tmp_path, sections, where):
    engine = write_engine(tmp_path / "engine")
    manifest = json.loads((engine / "manifest.json").read_text())
    (engine / "manifest.json").write_text(json.dumps(manifest | sections))
    with pytest.raises(CheckpointError) as e:
        Manifest.read(engine)
    message = str(e.value)
    assert len(message.splitlines()) == 1 and f"{where} names" in message
    assert "leads outside the engine directory" in message


def test_a_symlink_leading_out_of_the_engine_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "router.safetensors").write_bytes(b"not ours")
    engine = write_engine(tmp_path / "engine", components={"router": {"path": "parts/router.safetensors"}})
    (engine / "parts").symlink_to(outside)
    with pytest.raises(CheckpointError, match="components.router names 'parts/router.safetensors', which leads "
                                              "outside the engine directory"):
        Manifest.read(engine)
