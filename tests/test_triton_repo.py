"""The Triton repository writer and the server launcher's pieces, without a server (tests/test_triton.py has one)."""
from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest

from whiflash_trt.builder.triton_repo import (ENSEMBLE_NAME, INPUTS, MARKER, MODEL_NAME, MODEL_TEMPLATE, OUTPUTS,
                                              TritonRepoOptions, write_triton_repo)
from whiflash_trt.cli import build_main, serve_main
from whiflash_trt.config import ModelConfig
from whiflash_trt.errors import CheckpointError, WhiflashError
from whiflash_trt.manifest import Manifest
from whiflash_trt.serving.server import (ServerOptions, TritonDistribution, prepare_backends, server_command,
                                         server_environment)


@pytest.fixture
def engine_dir(tmp_path) -> Path:
    """An engine folder with just a manifest: all the writer reads."""
    model = ModelConfig(architecture="llama", vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256)
    folder = tmp_path / "engine dir"  # a space: the path must survive quoting in config.pbtxt
    folder.mkdir()
    Manifest(model=model, dtype="fp32", capture_layers=(), block_size=16, kv_pools=(), source={},
             build_options={}).write(folder)
    return folder


def parse_config(path: Path):
    """config.pbtxt through Triton's own ModelConfig message (catches syntax errors and unknown fields)."""
    text_format = pytest.importorskip("google.protobuf.text_format")
    model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def test_repository_has_the_tensorrt_llm_layout(engine_dir, tmp_path):
    repo = write_triton_repo(TritonRepoOptions(engine_dir=engine_dir, output=tmp_path / "repo", instance_count=3))
    assert (repo / ENSEMBLE_NAME / "1").is_dir()
    assert (repo / MODEL_NAME / "1" / "model.py").read_text() == MODEL_TEMPLATE.read_text()
    config = (repo / MODEL_NAME / "config.pbtxt").read_text()
    assert "decoupled: true" in config and "count: 3" in config
    assert f'string_value: "{engine_dir.resolve()}"' in config


def test_model_and_ensemble_configs_parse_and_agree(engine_dir, tmp_path):
    repo = write_triton_repo(TritonRepoOptions(engine_dir=engine_dir, output=tmp_path / "repo", instance_count=2,
                                               threads=1))
    model = parse_config(repo / MODEL_NAME / "config.pbtxt")
    ensemble = parse_config(repo / ENSEMBLE_NAME / "config.pbtxt")
    assert model.model_transaction_policy.decoupled
    assert model.instance_group[0].count == 2
    assert model.parameters["engine_dir"].string_value == str(engine_dir.resolve())
    assert model.parameters["threads"].string_value == "1"
    required = {i.name for i in model.input if not i.optional}
    assert required == {"text_input", "max_tokens"}
    assert {i.name: i.data_type for i in ensemble.input} == {i.name: i.data_type for i in model.input}
    assert {o.name for o in ensemble.output} == {t.name for t in OUTPUTS}
    step = ensemble.ensemble_scheduling.step[0]
    assert step.model_name == MODEL_NAME
    assert set(step.input_map) == {t.name for t in INPUTS} and set(step.output_map) == {t.name for t in OUTPUTS}


def test_rewriting_a_repository_keeps_other_models(engine_dir, tmp_path):
    repo = tmp_path / "repo"
    (repo / "other" / "1").mkdir(parents=True)
    write_triton_repo(TritonRepoOptions(engine_dir=engine_dir, output=repo))
    write_triton_repo(TritonRepoOptions(engine_dir=engine_dir, output=repo, instance_count=2))
    assert (repo / "other" / "1").is_dir()
    assert "count: 2" in (repo / MODEL_NAME / "config.pbtxt").read_text()


def test_repository_for_a_missing_engine_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        write_triton_repo(TritonRepoOptions(engine_dir=tmp_path / "nowhere", output=tmp_path / "repo"))
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize("kwargs, message", [
    ({"instance_count": 0}, "instance count"), ({"kv_budget_mb": 0}, "KV memory budget"), ({"device": ""}, "device"),
    ({"threads": -1}, "threads must be >= 0")])
def test_bad_repository_options_are_named(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        TritonRepoOptions(engine_dir=tmp_path, output=tmp_path / "repo", **kwargs)


def test_model_template_is_valid_python_that_reads_every_input():
    source = MODEL_TEMPLATE.read_text()
    ast.parse(source)
    for t in INPUTS + OUTPUTS:
        assert f'"{t.name}"' in source, f"model.py never mentions {t.name}"


def test_build_cli_writes_a_repository_for_an_existing_engine(engine_dir, tmp_path, capsys):
    assert build_main(["--engine", str(engine_dir), "--triton-repo", str(tmp_path / "repo")]) == 0
    assert (tmp_path / "repo" / ENSEMBLE_NAME / "config.pbtxt").is_file()
    assert "whiflash-serve --triton-repo" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--engine", "E"], ["--target", "T"], ["--engine", "E", "--triton-repo", "R",
                                                                          "--output", "O"],
                                  ["--target", "T", "--output", "O", "--triton-overwrite"]])
def test_build_cli_rejects_incomplete_option_sets(argv):
    with pytest.raises(SystemExit):
        build_main(argv)


def fake_distribution(root: Path) -> TritonDistribution:
    package = root / "site-packages" / "pytriton"
    dist = TritonDistribution(root=package / "tritonserver", libs=root / "site-packages" / "nvidia_pytriton.libs")
    for path in (dist.server, dist.root / "backends" / "python" / "libtriton_python.so",
                 dist.root / "backends" / "python" / "triton_python_backend_utils.py",
                 dist.stub(f"{sys.version_info.major}.{sys.version_info.minor}")):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(path.name)
    return dist


def test_backend_folder_links_the_python_backend_and_this_pythons_stub(tmp_path):
    dist = fake_distribution(tmp_path)
    backends = prepare_backends(dist, tmp_path / "backends")
    prepare_backends(dist, backends)  # twice: the links are replaced, not an error
    python_dir = backends / "python"
    assert sorted(p.name for p in python_dir.iterdir()) == [
        "libtriton_python.so", "triton_python_backend_stub", "triton_python_backend_utils.py"]
    assert (python_dir / "triton_python_backend_stub").read_text() == "triton_python_backend_stub"


def test_server_binds_loopback_and_finds_its_libraries_and_python(tmp_path):
    dist = fake_distribution(tmp_path)
    argv = server_command(dist, tmp_path / "backends", ServerOptions(tmp_path / "repo", 9000, 9001,
                                                                       extra_args=("--log-verbose=1",)))
    assert argv[0] == str(dist.server)
    assert {"--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--http-port=9000", "--grpc-port=9001",
            "--allow-metrics=false", "--log-verbose=1"} <= set(argv)
    env = server_environment(dist, {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/lib"})
    assert env["LD_LIBRARY_PATH"] == f"{dist.libs}:/opt/lib"
    assert env["PATH"] == f"{Path(sys.prefix) / 'bin'}:/usr/bin"


@pytest.mark.parametrize("kwargs, message", [({"http_port": 0}, "http-port"), ({"grpc_port": 70000}, "grpc-port"),
                                             ({"http_port": 9000, "grpc_port": 9000}, "must differ")])
def test_bad_server_ports_are_named(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerOptions(tmp_path, **kwargs)


def test_serve_cli_refuses_a_missing_repository(tmp_path, capsys):
    assert serve_main(["--triton-repo", str(tmp_path / "nowhere"), "--backends-dir", str(tmp_path / "b")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_model_folder_the_builder_did_not_write_is_kept_unless_overwrite(engine_dir, tmp_path, capsys):
    repo = tmp_path / "repo"
    (repo / ENSEMBLE_NAME / "1").mkdir(parents=True)   # e.g. TensorRT-LLM's own ensemble
    (repo / ENSEMBLE_NAME / "config.pbtxt").write_text('name: "ensemble"  # theirs')
    argv = ["--engine", str(engine_dir), "--triton-repo", str(repo)]
    assert build_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert f"{repo / ENSEMBLE_NAME} exists and was not written by whiflash-build" in err
    assert "--triton-overwrite" in err
    assert (repo / ENSEMBLE_NAME / "config.pbtxt").read_text() == 'name: "ensemble"  # theirs'
    assert not (repo / MODEL_NAME).exists(), "neither model may be written when one is refused"
    assert build_main(argv + ["--triton-overwrite"]) == 0
    assert f'name: "{ENSEMBLE_NAME}"\nplatform: "ensemble"' in (repo / ENSEMBLE_NAME / "config.pbtxt").read_text()


def test_a_folder_the_builder_wrote_is_replaced_without_overwrite(engine_dir, tmp_path):
    repo = tmp_path / "repo"
    write_triton_repo(TritonRepoOptions(engine_dir=engine_dir, output=repo))
    assert (repo / MODEL_NAME / MARKER).is_file() and (repo / ENSEMBLE_NAME / MARKER).is_file()
    (repo / MODEL_NAME / "1" / "stale.txt").write_text("from the last write")
    write_triton_repo(TritonRepoOptions(engine_dir=engine_dir, output=repo, instance_count=4))
    assert "count: 4" in (repo / MODEL_NAME / "config.pbtxt").read_text()
    assert not (repo / MODEL_NAME / "1" / "stale.txt").exists()


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_symlinked_model_folder_is_refused_and_not_written_through(engine_dir, tmp_path, overwrite):
    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    (elsewhere / "1").mkdir(parents=True)
    (elsewhere / "config.pbtxt").write_text("theirs")
    repo.mkdir()
    (repo / MODEL_NAME).symlink_to(elsewhere)
    with pytest.raises(WhiflashError, match=f"{repo / MODEL_NAME} is a symlink"):
        write_triton_repo(TritonRepoOptions(engine_dir=engine_dir, output=repo, overwrite=overwrite))
    assert (elsewhere / "config.pbtxt").read_text() == "theirs" and sorted(os.listdir(elsewhere)) == ["1",
                                                                                                   "config.pbtxt"]
    assert (repo / MODEL_NAME).is_symlink() and not (repo / ENSEMBLE_NAME).exists()
