"""Bad input gets a clear error that names the problem: from the library a WhiflashError/ValueError with that
message, from the CLIs exit code 2 and an `error: ...` line on stderr, never a traceback."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from whiflash_trt.builder.build import BuildOptions, build_engine
from whiflash_trt.cli import build_main, run_main
from whiflash_trt.config import GenerationConfig, SamplingConfig
from whiflash_trt.errors import CheckpointError, WhiflashError
from whiflash_trt.runtime.engine import Engine

REPO = Path(__file__).resolve().parents[1]


def cli_error(capsys, main, argv: list[str]) -> str:
    """Run a CLI entry point that must fail; returns its stderr."""
    capsys.readouterr()  # drop what fixtures printed
    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert rc == 2, f"exit code {rc}, stderr: {captured.err}"
    assert captured.err.startswith("error: ")
    assert "Traceback" not in captured.err
    return captured.err


def copy_of(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# ----- engine directories ------------------------------------------------------------------------------------------

def test_missing_engine_dir(capsys, tmp_path):
    missing = tmp_path / "no-such-engine"
    err = cli_error(capsys, run_main, ["--engine", missing, "--prompt", "hi"])
    assert str(missing) in err and "manifest.json is missing" in err and "whiflash-build" in err


def test_engine_dir_without_manifest(capsys, tmp_path, tiny_engine):
    engine = copy_of(tiny_engine("llama"), tmp_path)
    (engine / "manifest.json").unlink()
    err = cli_error(capsys, run_main, ["--engine", engine, "--prompt", "hi"])
    assert "not a whiflash engine directory: manifest.json is missing" in err


def test_corrupt_manifest(capsys, tmp_path, tiny_engine):
    engine = copy_of(tiny_engine("llama"), tmp_path)
    (engine / "manifest.json").write_text('{"format_version": 1, "dtype"')
    err = cli_error(capsys, run_main, ["--engine", engine, "--prompt", "hi"])
    assert "manifest.json is corrupt or incomplete" in err


def test_truncated_engine_weights(capsys, tmp_path, tiny_engine):
    engine = copy_of(tiny_engine("llama"), tmp_path)
    truncate(engine / "target.safetensors")
    with pytest.raises(CheckpointError, match=r"cannot read .*target\.safetensors.*corrupt or truncated"):
        Engine.load(engine)
    err = cli_error(capsys, run_main, ["--engine", engine, "--prompt", "hi"])
    assert "target.safetensors" in err and "corrupt or truncated" in err


def test_engine_manifest_that_does_not_match_its_weights(capsys, tmp_path, tiny_engine):
    engine = copy_of(tiny_engine("llama"), tmp_path)
    manifest = json.loads((engine / "manifest.json").read_text())
    manifest["model_config"]["intermediate_size"] = 96
    (engine / "manifest.json").write_text(json.dumps(manifest))
    err = cli_error(capsys, run_main, ["--engine", engine, "--prompt", "hi"])
    assert "do not match their config" in err and "mlp.gate_proj.weight" in err and "[96, 64]" in err


# ----- source checkpoints (whiflash-build) -------------------------------------------------------------------------

def test_truncated_checkpoint_weights(capsys, tmp_path, tiny_checkpoint):
    folder = copy_of(tiny_checkpoint("llama"), tmp_path)
    truncate(folder / "model.safetensors")
    err = cli_error(capsys, build_main, ["--target", folder, "--output", tmp_path / "engine", "--dtype", "fp32"])
    assert "model.safetensors" in err and "corrupt or truncated" in err
    assert not (tmp_path / "engine").exists() and not (tmp_path / "engine.partial").exists()


def test_checkpoint_without_config(capsys, tmp_path, tiny_checkpoint):
    folder = copy_of(tiny_checkpoint("llama"), tmp_path)
    (folder / "config.json").unlink()
    err = cli_error(capsys, build_main, ["--target", folder, "--output", tmp_path / "engine"])
    assert str(folder) in err and "config.json is missing" in err


def test_checkpoint_config_that_does_not_match_the_weights(capsys, tmp_path, tiny_checkpoint):
    folder = copy_of(tiny_checkpoint("llama"), tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["hidden_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    err = cli_error(capsys, build_main, ["--target", folder, "--output", tmp_path / "engine"])
    assert "do not match their config" in err and "embed_tokens.weight" in err
    assert not (tmp_path / "engine").exists()


def test_checkpoint_with_a_missing_tensor(capsys, tmp_path, tiny_checkpoint):
    folder = copy_of(tiny_checkpoint("llama"), tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    err = cli_error(capsys, build_main, ["--target", folder, "--output", tmp_path / "engine"])
    assert "do not match their config: missing 1 tensors (e.g. layers.1.mlp.up_proj.weight)" in err


def test_checkpoint_with_an_unknown_architecture(capsys, tmp_path, tiny_checkpoint):
    folder = copy_of(tiny_checkpoint("llama"), tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "mamba"
    (folder / "config.json").write_text(json.dumps(config))
    err = cli_error(capsys, build_main, ["--target", folder, "--output", tmp_path / "engine"])
    assert "unsupported model_type 'mamba'" in err


def test_unknown_named_target(capsys, tmp_path):
    err = cli_error(capsys, build_main, ["--target", "llama9-1t", "--output", tmp_path / "engine"])
    assert "unknown target 'llama9-1t'" in err and "llama3-8b" in err and "smollm2-135m" in err


def test_target_path_that_does_not_exist(capsys, tmp_path):
    missing = tmp_path / "weights" / "model.gguf"
    err = cli_error(capsys, build_main, ["--target", missing, "--output", tmp_path / "engine"])
    assert str(missing) in err and "does not exist" in err


def test_named_target_offline_without_weights_says_how_to_provide_them(tmp_path):
    # huggingface_hub reads HF_HUB_CACHE when imported, hence a fresh interpreter with an empty cache
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_CACHE": str(tmp_path / "hub"),
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    code = "import sys; from whiflash_trt.cli import build_main; sys.exit(build_main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", code, "--target", "llama3-8b", "--output", str(tmp_path / "e")],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    err = proc.stderr
    assert "meta-llama/Meta-Llama-3-8B-Instruct" in err and "not in the local Hugging Face cache" in err
    assert str(tmp_path / "hub") in err                        # where it looked
    assert "--target /path/to/folder" in err and "hf download meta-llama/Meta-Llama-3-8B-Instruct" in err
    assert not (tmp_path / "e").exists()


# ----- prompts and generation settings ----------------------------------------------------------------------------

def test_empty_prompt(capsys, tiny_engine):
    engine_dir = tiny_engine("llama")
    assert "prompt is empty" in cli_error(capsys, run_main, ["--engine", engine_dir, "--prompt", ""])
    engine = Engine.load(engine_dir)
    with pytest.raises(WhiflashError, match="prompt is empty"):
        engine.generate([], GenerationConfig())
    assert engine.kv.allocator.num_free == engine.kv.allocator.num_blocks


def test_empty_prompt_in_a_prompts_file(capsys, tmp_path, tiny_engine):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"prompt": ""}\n')
    capsys.readouterr()
    assert run_main(["--engine", str(tiny_engine("llama")), "--prompts-file", str(prompts)]) == 2
    out = capsys.readouterr()
    assert 'prompts.jsonl:2: expected an object with a non-empty string "prompt"' in out.err
    assert out.out == "", "no prompt may be generated before the file is checked"


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "a"}\nnot json\n', "prompts.jsonl:2: not valid JSON"),
    ('{"text": "a"}\n', 'prompts.jsonl:1: expected an object with a non-empty string "prompt"'),
    ("\n\n", "holds no prompts"),
])
def test_malformed_prompts_file(capsys, tmp_path, tiny_engine, content, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    assert message in cli_error(capsys, run_main, ["--engine", tiny_engine("llama"), "--prompts-file", prompts])


def test_missing_prompts_file(capsys, tmp_path, tiny_engine):
    missing = tmp_path / "nope.jsonl"
    err = cli_error(capsys, run_main, ["--engine", tiny_engine("llama"), "--prompts-file", missing])
    assert f"cannot read the prompts file {missing}: No such file or directory" in err


def test_prompt_longer_than_the_context(capsys, tiny_engine):
    engine_dir = tiny_engine("llama", max_position_embeddings=64)
    engine = Engine.load(engine_dir)
    prompt = "The quick brown fox jumps over the lazy dog. " * 10
    n = len(engine.encode(prompt))
    assert n > 64
    err = cli_error(capsys, run_main, ["--engine", engine_dir, "--prompt", prompt])
    assert f"prompt has {n} tokens; the model's context is 64 tokens" in err
    with pytest.raises(WhiflashError, match="the model's context is 64 tokens"):
        engine.generate(list(range(3, 67)), GenerationConfig())   # exactly 64: no room for one new token
    engine.generate(list(range(3, 66)), GenerationConfig(max_new_tokens=5, ignore_eos=True))  # 63 fits


def test_prompt_ids_outside_the_vocabulary(tiny_engine):
    engine = Engine.load(tiny_engine("llama"))
    vocab = engine.target.config.vocab_size
    with pytest.raises(WhiflashError, match=rf"outside the vocabulary \[0, {vocab}\)"):
        engine.generate([5, vocab], GenerationConfig())
    with pytest.raises(WhiflashError, match="outside the vocabulary"):
        engine.generate([-1, 5], GenerationConfig())


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-0.5"], "temperature must be >= 0, got -0.5"),
    (["--temperature", "nan"], "temperature must be >= 0, got nan"),
    (["--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
    (["--top-p", "1.5"], "top_p must be in (0, 1], got 1.5"),
    (["--top-k", "-3"], "top_k must be >= 0 (0 disables it), got -3"),
    (["--max-new-tokens", "0"], "max_new_tokens must be positive, got 0"),
    (["--stop", ""], "stop strings must be non-empty"),
    (["--kv-budget-mb", "0"], "--kv-budget-mb must be positive, got 0"),
])
def test_invalid_generation_settings(capsys, tiny_engine, flags, message):
    err = cli_error(capsys, run_main, ["--engine", tiny_engine("llama"), "--prompt", "hello", *flags])
    assert message in err


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1.0}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.01}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, "top_k must be >= 0"),
])
def test_invalid_sampling_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


def test_kv_budget_too_small_for_the_request(capsys, tiny_engine):
    # head_dim 512: 24 KiB of K and V per token, so 1 MiB holds 2 blocks of 16 tokens
    engine_dir = tiny_engine("llama", head_dim=512)
    err = cli_error(capsys, run_main, ["--engine", engine_dir, "--prompt", "hello", "--kv-budget-mb", "1",
                                       "--max-new-tokens", "100"])
    assert "KV cache exhausted" in err and "run with --kv-budget-mb" in err


def test_invalid_build_dtype_and_block_size(capsys, tmp_path, tiny_checkpoint):
    folder = tiny_checkpoint("llama")
    err = cli_error(capsys, build_main, ["--target", folder, "--output", tmp_path / "e", "--block-size", "12"])
    assert "block_size must be a positive power of two, got 12" in err
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        build_engine(BuildOptions(target=str(folder), output=tmp_path / "e", dtype="fp8"))
