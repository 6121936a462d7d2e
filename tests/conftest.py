"""Session fixtures: tiny random checkpoints, drafters and engines, each built once per test session.

The builders live in tiny_models.py (targets and their tokenizers, named by tiny_models.VARIANTS) and tiny_drafters.py
(drafters, routers, the engine builder); a test imports them by module name only to build something of its own.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

# tests/ is on sys.path (pytest's default "prepend" import mode for a rootdir without __init__.py)
from tiny_drafters import build_tiny_engine, save_drafters, save_straddling_router
from tiny_models import make_tiny_checkpoint

from whiflash_trt import kernels

# One intra-op thread: the tiny models gain nothing from more, and on a busy 2-core machine OpenMP workers that
# wait for a core made a tiny-model generate() 50x slower (2.5 s instead of 0.04 s) and SmolLM2 decoding 10x slower.
torch.set_num_threads(1)

# The engine's CPU kernels, compiled once into the user cache (~10 s) and loaded before any model is built, so every
# bf16 target of the session runs its linears as a bf16 engine does (where the CPU has AVX-512 BF16).
kernels.ensure_loaded()


def pytest_report_header(config) -> str:
    import whiflash_trt

    return f"whiflash_trt imported from {Path(whiflash_trt.__file__).parent}"


class _Built:
    """Calls make(folder, variant, **options) once per distinct (variant, options), each in its own folder."""

    def __init__(self, root: Path, make) -> None:
        self.root, self.make, self.done = root, make, {}

    def __call__(self, variant: str = "llama", **options):
        key = repr((variant, sorted(options.items())))
        if key not in self.done:
            self.done[key] = self.make(self.root / f"{variant}-{len(self.done)}", variant, **options)
        return self.done[key]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> _Built:
    """tiny_checkpoint(variant="llama", **config_overrides) -> folder of a Hugging Face checkpoint."""
    return _Built(tmp_path_factory.mktemp("tiny-checkpoints"), make_tiny_checkpoint)


@pytest.fixture(scope="session")
def tiny_drafters(tmp_path_factory, tiny_checkpoint) -> _Built:
    """tiny_drafters(variant="llama", **config_overrides) -> BuildOptions keywords of random EAGLE-3 and DFlash
    drafters and a router for tiny_checkpoint(variant, **config_overrides)."""
    return _Built(tmp_path_factory.mktemp("tiny-drafters"),
                  lambda folder, variant, **overrides: save_drafters(folder, tiny_checkpoint(variant, **overrides)))


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory, tiny_checkpoint, tiny_drafters) -> _Built:
    """tiny_engine(variant="llama", drafters=False, backend="torch", **config_overrides) -> an fp32 engine directory
    built from tiny_checkpoint(variant, **config_overrides), with tiny_drafters(...) when `drafters`."""
    def make(folder: Path, variant: str, drafters: bool = False, backend: str = "torch", **overrides) -> Path:
        extra = tiny_drafters(variant, **overrides) if drafters else {}
        return build_tiny_engine(tiny_checkpoint(variant, **overrides), folder, backend=backend, **extra)

    return _Built(tmp_path_factory.mktemp("tiny-engines"), make)


@pytest.fixture(scope="session")
def spec_engine_dir(tiny_engine) -> Path:
    """The "spec" target (8 layers, peaked next-token distributions) with both drafters and a router."""
    return tiny_engine("spec", drafters=True)


@pytest.fixture(scope="session")
def spec_engine(spec_engine_dir):
    """The loaded spec_engine_dir, shared: a test that changes its proposers or router restores them."""
    from whiflash_trt.runtime.engine import Engine

    return Engine.load(spec_engine_dir)


@pytest.fixture(scope="session")
def compiled_spec_engine_dir(tmp_path_factory, tiny_checkpoint, tiny_drafters) -> Path:
    """spec_engine_dir's target and drafters as a bf16 engine of the compiled backend (the export: ~20 s)."""
    from whiflash_trt.builder.build import BuildOptions, build_engine

    if not kernels.registered():
        pytest.skip("the compiled backend needs the engine's kernels (AVX-512 BF16 and a C++ compiler)")
    return build_engine(BuildOptions(target=str(tiny_checkpoint("spec")), dtype="bf16", backend="compiled",
                                     output=tmp_path_factory.mktemp("compiled") / "engine", show_progress=False,
                                     **tiny_drafters("spec")))


@pytest.fixture(scope="session")
def compiled_spec_engine(compiled_spec_engine_dir):
    from whiflash_trt.runtime.engine import Engine

    return Engine.load(compiled_spec_engine_dir)


@pytest.fixture(scope="session")
def onnx_engine_dirs(tiny_engine) -> tuple[Path, Path]:
    """(torch engine, onnx engine) of the "onnx" target with both drafters and a router (the export: ~1 min)."""
    return tiny_engine("onnx", drafters=True), tiny_engine("onnx", drafters=True, backend="onnx")


@pytest.fixture(scope="session")
def bench_engine_dir(tmp_path_factory, tiny_checkpoint) -> Path:
    """The "bench" target with both drafters and a router that switches between them within one sequence."""
    from whiflash_trt.bench.prompts import load_prompts

    root = tmp_path_factory.mktemp("bench-engine")
    target = tiny_checkpoint("bench")
    text = "\n".join(p.prompt for p in load_prompts(None, 1))
    router = save_straddling_router(root / "router.safetensors", target, text)
    return build_tiny_engine(target, root / "engine", router=router, **save_drafters(root, target, router=False))
