"""Session fixtures: tiny random checkpoints and their engines, each written once per test session."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

# tests/ is on sys.path (pytest's default "prepend" import mode for a rootdir without __init__.py)
from tiny_models import VARIANTS, build_tiny_engine, make_tiny_checkpoint

# One intra-op thread: the tiny models gain nothing from more, and on a busy 2-core machine OpenMP workers that
# wait for a core made a tiny-model generate() 50x slower (2.5 s instead of 0.04 s) and SmolLM2 decoding 10x slower.
torch.set_num_threads(1)


def pytest_report_header(config) -> str:
    import whiflash_trt

    return f"whiflash_trt imported from {Path(whiflash_trt.__file__).parent}"


class _Store:
    """Builds each (variant, overrides) once under one session temp folder."""

    def __init__(self, root: Path, make) -> None:
        self.root, self.make, self.done = root, make, {}

    def __call__(self, variant: str = "llama", **overrides) -> Path:
        key = repr((variant, sorted(overrides.items())))
        if key not in self.done:
            self.done[key] = self.make(self.root / f"{variant}-{len(self.done)}", variant, overrides)
        return self.done[key]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> _Store:
    """tiny_checkpoint(variant="llama", **config_overrides) -> folder of a Hugging Face checkpoint."""
    return _Store(tmp_path_factory.mktemp("tiny-checkpoints"),
                  lambda folder, variant, overrides: make_tiny_checkpoint(folder, **{**VARIANTS[variant], **overrides}))


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory, tiny_checkpoint) -> _Store:
    """tiny_engine(variant="llama", **config_overrides) -> an fp32 engine directory built from tiny_checkpoint."""
    return _Store(tmp_path_factory.mktemp("tiny-engines"),
                  lambda folder, variant, overrides: build_tiny_engine(tiny_checkpoint(variant, **overrides), folder))
