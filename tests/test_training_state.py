"""train/checkpointing: what save_state writes loads with torch.load(weights_only=True) and resumes every piece of
state; a state.pt holding anything else (a pickle that runs code) is refused with one CheckpointError line."""
from __future__ import annotations

import os
import random

import pytest
import torch

from whiflash_trt.errors import CheckpointError
from whiflash_trt.train.checkpointing import DataCursor, RunState, load_state, peek_extra, save_state


class RunsOnLoad:
    """Unpickling this creates the folder `marker`: what a state.pt from elsewhere could do with weights_only=False."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (self.marker,)


def trained_pieces(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer, torch.Generator().manual_seed(seed)


def test_a_saved_state_loads_with_weights_only_and_resumes_everything(tmp_path):
    model, optimizer, generator = trained_pieces(0)
    extra = {"options": {"target_layer_ids": (1, 2), "init_from": None, "gamma": 0.5, "soft_labels": False},
             "vocab_ids": [3, 1, 2], "num_shards_vocab": 2}
    state = RunState(step=7, tokens=123, seconds=4.5, cursor=DataCursor(epoch=1, position=5, num_shards=2),
                     extra=extra)
    random.seed(11)
    save_state(tmp_path, model, optimizer, state, generator)
    expected = (random.random(), torch.rand(1), torch.rand(1, generator=generator))
    torch.load(tmp_path / "state.pt", weights_only=True)   # raises if anything saved is not plain data

    fresh_model, fresh_optimizer, fresh_generator = trained_pieces(1)
    loaded = load_state(tmp_path, fresh_model, fresh_optimizer, fresh_generator)
    assert loaded == state and peek_extra(tmp_path) == extra
    assert torch.equal(fresh_model.weight, model.weight)
    moments = [o.state_dict()["state"][0]["exp_avg"] for o in (fresh_optimizer, optimizer)]
    assert torch.equal(*moments)
    assert (random.random(), torch.rand(1), torch.rand(1, generator=fresh_generator)) == expected


def test_a_state_file_that_would_run_code_is_refused_and_never_runs_it(tmp_path):
    model, optimizer, generator = trained_pieces(0)
    marker = tmp_path / "code-ran"
    torch.save({"model": model.state_dict(), "run": RunsOnLoad(str(marker))}, tmp_path / "state.pt")
    for load in (lambda: load_state(tmp_path, model, optimizer, generator), lambda: peek_extra(tmp_path)):
        with pytest.raises(CheckpointError) as e:
            load()
        message = str(e.value)
        assert message.startswith(f"cannot load the training state {tmp_path / 'state.pt'}: ")
        assert len(message.splitlines()) == 1
    assert not marker.exists()
