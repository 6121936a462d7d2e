"""Write a Triton Inference Server model repository that serves one whiflash engine.

The layout follows TensorRT-LLM's convention, so clients written for it (text_input / max_tokens / stream ->
text_output, model `ensemble`) work unchanged:

    REPO/whiflash/config.pbtxt    decoupled Python-backend model: text in, text out (streamed or whole)
    REPO/whiflash/1/model.py      a copy of whiflash_trt/serving/triton_model.py; loads the engine named in the config
    REPO/ensemble/config.pbtxt    the model clients call; one step that forwards every input and output to `whiflash`
    REPO/ensemble/1/              (empty: Triton wants a version folder)
    REPO/*/.whiflash-model        our marker: a rewrite replaces a model folder only if it carries one (or with
                                  overwrite), since TensorRT-LLM's repositories hold their own `ensemble`

Every request carries batch size 1 (max_batch_size 1, so tensors are [1, 1]), as in TensorRT-LLM's in-flight
batching models: each instance batches the requests it holds itself (up to max_batch of them share every round).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from whiflash_trt import serving
from whiflash_trt.errors import WhiflashError
from whiflash_trt.manifest import Manifest

MODEL_NAME = "whiflash"
ENSEMBLE_NAME = "ensemble"
MODEL_TEMPLATE = Path(serving.__file__).with_name("triton_model.py")
MARKER = ".whiflash-model"


@dataclass(frozen=True)
class Tensor:
    name: str
    data_type: str
    optional: bool = False


INPUTS = (
    Tensor("text_input", "TYPE_STRING"),
    Tensor("max_tokens", "TYPE_INT32"),
    Tensor("stream", "TYPE_BOOL", optional=True),
    Tensor("temperature", "TYPE_FP32", optional=True),   # 0 (default) = greedy
    Tensor("top_p", "TYPE_FP32", optional=True),
    Tensor("top_k", "TYPE_INT32", optional=True),
    Tensor("seed", "TYPE_UINT64", optional=True),
    Tensor("mode", "TYPE_STRING", optional=True),         # ar | eagle3 | dflash | whiflash
    Tensor("router", "TYPE_STRING", optional=True),       # entropy | neural
    Tensor("threshold", "TYPE_FP32", optional=True),
)
# In a stream, text_output is each response's new text; num_new_tokens counts the tokens so far, and the other
# statistics are filled in the last response only (zeros before).
OUTPUTS = (
    Tensor("text_output", "TYPE_STRING"),
    Tensor("finish_reason", "TYPE_STRING"),               # "" until the last response; then eos | stop | length ...
    Tensor("num_new_tokens", "TYPE_INT32"),
    Tensor("num_rounds", "TYPE_INT32"),
    Tensor("acceptance_length", "TYPE_FP32"),             # tau: mean tokens committed per target forward
    Tensor("tokens_per_s", "TYPE_FP32"),
)


@dataclass(frozen=True)
class TritonRepoOptions:
    engine_dir: Path
    output: Path
    instance_count: int = 1
    device: str = "cpu"
    kv_budget_mb: int = 256
    threads: int = 0              # torch threads of each instance; 0 = half the server's cores split over instances
    max_batch: int = 8            # requests each instance steps together
    overwrite: bool = False       # replace model folders named whiflash / ensemble that carry no marker of ours

    def __post_init__(self) -> None:
        if self.instance_count < 1:
            raise ValueError(f"triton instance count must be >= 1, got {self.instance_count}")
        if self.kv_budget_mb <= 0:
            raise ValueError(f"KV memory budget must be positive, got {self.kv_budget_mb} MB")
        if self.max_batch < 1:
            raise ValueError(f"triton max batch must be >= 1, got {self.max_batch}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0 = the default: half the cores split over instances), "
                             f"got {self.threads}")
        if not self.device:
            raise ValueError("device must be non-empty (cpu, cuda, cuda:1 ...)")


def _tensor_block(kind: str, tensors: tuple[Tensor, ...], all_optional: bool = False) -> str:
    entries = []
    for t in tensors:
        optional = "\n    optional: true" if t.optional or all_optional else ""
        entries.append(f'  {{\n    name: "{t.name}"\n    data_type: {t.data_type}\n    dims: [ 1 ]{optional}\n  }}')
    return f"{kind} [\n" + ",\n".join(entries) + "\n]\n"


def _parameters(params: dict[str, str]) -> str:
    # json.dumps gives a quoted, escaped string that protobuf text format reads back unchanged
    return "".join(f'parameters {{ key: "{k}" value: {{ string_value: {json.dumps(v)} }} }}\n'
                   for k, v in params.items())


def model_config(opts: TritonRepoOptions, engine_dir: Path) -> str:
    return (f'name: "{MODEL_NAME}"\nbackend: "python"\nmax_batch_size: 1\n'
            "model_transaction_policy { decoupled: true }\n"
            + _tensor_block("input", INPUTS) + _tensor_block("output", OUTPUTS)
            + f"instance_group [ {{ count: {opts.instance_count} kind: KIND_CPU }} ]\n"
            + _parameters({"engine_dir": str(engine_dir), "device": opts.device,
                           "kv_budget_mb": str(opts.kv_budget_mb), "threads": str(opts.threads),
                           "max_batch": str(opts.max_batch)}))


def ensemble_config() -> str:
    def maps(kind: str, tensors: tuple[Tensor, ...]) -> str:
        return "".join(f'      {kind} {{ key: "{t.name}" value: "{t.name}" }}\n' for t in tensors)

    step = (f'    {{\n      model_name: "{MODEL_NAME}"\n      model_version: -1\n'
            + maps("input_map", INPUTS) + maps("output_map", OUTPUTS) + "    }\n")
    # Every ensemble input is declared optional, the required ones included: Triton (2.51) checks only how many
    # inputs a request has, and an ensemble whose step lacks a required input never runs that step and completes
    # with no response at all (an empty final one over gRPC). Declared optional, the missing input reaches the
    # `whiflash` model, which answers with an error naming it.
    return (f'name: "{ENSEMBLE_NAME}"\nplatform: "ensemble"\nmax_batch_size: 1\n'
            + _tensor_block("input", INPUTS, all_optional=True) + _tensor_block("output", OUTPUTS)
            + "ensemble_scheduling {\n  step [\n" + step + "  ]\n}\n")


def check_models(repo: Path, overwrite: bool) -> None:
    """A WhiflashError unless each of our model folders in `repo` is absent, ours (it carries MARKER), or
    `overwrite`; a symlink is refused either way (writing through it would change the folder it points to)."""
    for name in (MODEL_NAME, ENSEMBLE_NAME):
        _check_replaceable(Path(repo) / name, overwrite)


def _check_replaceable(folder: Path, overwrite: bool) -> None:
    if folder.is_symlink():
        raise WhiflashError(f"--triton-repo: {folder} is a symlink; the builder does not write through links "
                            f"(remove the link or name another repository)")
    if folder.exists() and not (folder / MARKER).is_file() and not overwrite:
        raise WhiflashError(f"--triton-repo: {folder} exists and was not written by whiflash-build (it has no "
                            f"{MARKER}); pass --triton-overwrite to replace it, or name another repository")


def write_triton_repo(opts: TritonRepoOptions) -> Path:
    """Write (or rewrite) the two models under opts.output; other models already there are left alone."""
    engine_dir = Path(opts.engine_dir).resolve()
    Manifest.read(engine_dir)  # fail now, not when the server loads the model
    repo = Path(opts.output)
    models = ((MODEL_NAME, model_config(opts, engine_dir)), (ENSEMBLE_NAME, ensemble_config()))
    check_models(repo, opts.overwrite)   # both checked before either is touched
    for name, config in models:
        folder = repo / name
        if folder.is_dir():
            shutil.rmtree(folder)
        elif folder.exists():
            folder.unlink()   # a file in the folder's place, with overwrite
        (folder / "1").mkdir(parents=True)
        (folder / MARKER).write_text("written by whiflash-build --triton-repo; a rebuild replaces this folder\n")
        (folder / "config.pbtxt").write_text(config)
    shutil.copyfile(MODEL_TEMPLATE, repo / MODEL_NAME / "1" / "model.py")
    return repo
