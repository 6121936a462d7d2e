"""Resumable training state: model, optimizer, step, data position and every RNG, saved atomically.

A run folder holds `state.pt` (the latest training state), `log.jsonl` (one line per optimizer step) and `export/`
(the drafter in its public format, rewritten at every checkpoint). Resuming loads state.pt and continues the same
run: same data order, same random anchors, same loss sequence as an uninterrupted run.
"""
from __future__ import annotations

import json
import pickle
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from whiflash_trt.errors import CheckpointError

STATE = "state.pt"
LOG = "log.jsonl"


@dataclass
class DataCursor:
    """Where the run is in its data: epoch, position in that epoch's permutation, shards the epoch uses."""
    epoch: int = 0
    position: int = 0
    num_shards: int | None = None


@dataclass
class RunState:
    step: int = 0
    tokens: int = 0              # training positions seen (for learning curves)
    seconds: float = 0.0         # training wall time so far
    cursor: DataCursor = field(default_factory=DataCursor)
    extra: dict = field(default_factory=dict)   # trainer-specific (e.g. the draft vocabulary)


def epoch_order(num_items: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_items, generator=g).tolist()


def save_state(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: RunState,
               generator: torch.Generator) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    payload = {
        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "run": asdict(state), "generator": generator.get_state(),
        "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
    }
    tmp = folder / (STATE + ".tmp")
    torch.save(payload, tmp)
    tmp.rename(folder / STATE)


def load_state(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               generator: torch.Generator) -> RunState | None:
    path = folder / STATE
    if not path.is_file():
        return None
    payload = read_state(path)
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    generator.set_state(payload["generator"])
    torch.set_rng_state(payload["torch_rng"])
    random.setstate(payload["python_rng"])
    run = payload["run"]
    run["cursor"] = DataCursor(**run["cursor"])
    return RunState(**run)


def peek_extra(folder: Path) -> dict | None:
    """The trainer-specific part of a saved state (needed before the model can be built), or None."""
    path = folder / STATE
    if not path.is_file():
        return None
    return read_state(path)["run"]["extra"]


def read_state(path: Path) -> dict:
    """A saved training state, unpickled with weights_only=True: tensors, dicts, lists, tuples, numbers and strings
    only, so a state.pt from elsewhere cannot run code when it is loaded."""
    try:
        return torch.load(path, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot load the training state {path}: {reason}") from None


def append_log(folder: Path, record: dict) -> None:
    with open(folder / LOG, "a") as f:
        f.write(json.dumps(record) + "\n")


def truncate_log(folder: Path, step: int) -> None:
    """Drop log lines past `step` (written after the checkpoint a resumed run restarts from)."""
    path = folder / LOG
    if not path.is_file():
        return
    lines = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in lines))


def read_log(folder: Path) -> list[dict]:
    path = Path(folder) / LOG
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []
