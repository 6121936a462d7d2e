"""The training loop both drafter trainers share: data order, optimizer, checkpoints, logs, progress bar.

A trainer supplies the model and `loss_of(sequence, generator) -> (loss, num_positions, metrics)`; the loop does
AdamW(0.9, 0.95) with warmup (and an optional linear decay to the last step), gradient clipping, an optimizer step
every `seqs_per_step` sequences, a checkpoint every `save_every_s` seconds (and at the end), and stops after
`max_steps` steps or `max_seconds` of training. `precision` bf16 runs the forward under bf16 autocast (weights,
gradients and optimizer state stay fp32): 2.4x the positions per second of fp32 on an AVX-512 BF16 CPU, with the same
loss on the same batch.
SIGTERM or Ctrl-C ends the run after the step in flight, with a checkpoint, so nothing trained is lost.
"""
from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from whiflash_trt.train.checkpointing import (DataCursor, RunState, append_log, epoch_order, load_state, save_state,
                                              truncate_log)
from whiflash_trt.train.data import TrainingData


@dataclass(frozen=True)
class LoopOptions:
    max_steps: int
    lr: float = 6e-4
    warmup_steps: int = 20
    decay_from: int | None = None   # from this step the lr falls linearly to min_lr_ratio * lr at max_steps
    min_lr_ratio: float = 0.1
    seqs_per_step: int = 4
    grad_clip: float = 0.5
    weight_decay: float = 0.0
    save_every_s: float = 300.0
    max_seconds: float | None = None
    seed: int = 0
    show_progress: bool = True
    precision: str = "fp32"         # "bf16": forward under bf16 autocast (fp32 weights and optimizer)


    def __post_init__(self) -> None:
        if self.max_steps <= 0 or self.seqs_per_step <= 0:
            raise ValueError(f"max_steps and seqs_per_step must be positive, got {self.max_steps}, "
                             f"{self.seqs_per_step}")
        if self.decay_from is not None and not 0 <= self.decay_from < self.max_steps:
            raise ValueError(f"decay_from must be in [0, max_steps), got {self.decay_from} (max_steps "
                             f"{self.max_steps})")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be fp32 or bf16, got {self.precision!r}")


LossFn = Callable[[object, torch.Generator], tuple[torch.Tensor, int, dict]]


def _lr(opts: LoopOptions, step: int) -> float:
    """A pure function of the step, so a resumed run follows the same schedule."""
    lr = opts.lr * min(1.0, (step + 1) / max(1, opts.warmup_steps))
    if opts.decay_from is not None and step >= opts.decay_from:
        done = (step - opts.decay_from) / (opts.max_steps - opts.decay_from)
        lr *= 1.0 - (1.0 - opts.min_lr_ratio) * done
    return lr


def _snapshot(run_dir: Path, state: RunState) -> None:
    """Keep a copy of the exported drafter at this step (learning curves: tau against training tokens)."""
    import shutil

    dst = run_dir / "snapshots" / f"step-{state.step:06d}"
    if not dst.exists():
        shutil.copytree(run_dir / "export", dst)
        (dst / "progress.json").write_text(f'{{"step": {state.step}, "tokens": {state.tokens}, '
                                           f'"seconds": {state.seconds:.1f}}}\n')


@contextmanager
def _stop_requests():
    """Turn SIGTERM / SIGINT into a flag the loop checks between steps (main thread only; elsewhere: no flag)."""
    flag = {"stop": False}
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        flag["stop"] = True

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


class _Epoch:
    """The training data of the current epoch and its shuffled order, handing out the sequences at the cursor in
    turn; at the end of an epoch it reloads the data folder, so shards written since join the next epoch."""

    def __init__(self, data_folder: Path, seed: int, state: RunState):
        self.folder, self.seed = data_folder, seed
        self.data = TrainingData(data_folder, state.cursor.num_shards)
        if state.cursor.num_shards is None:
            state.cursor.num_shards = len(self.data.manifest["shards"])
        self.order = epoch_order(len(self.data), seed, state.cursor.epoch)

    def next(self, state: RunState):
        """The sequence at the run's cursor, moving the cursor on (into the next epoch where this one is done)."""
        if state.cursor.position >= len(self.order):   # next epoch: pick up shards written since
            self.data = None                            # (one copy of the features in memory at a time)
            self.data = TrainingData(self.folder)
            state.cursor = DataCursor(state.cursor.epoch + 1, 0, len(self.data.manifest["shards"]))
            self.order = epoch_order(len(self.data), self.seed, state.cursor.epoch)
        seq = self.data[self.order[state.cursor.position]]
        state.cursor.position += 1
        return seq


def _accumulate(epoch: _Epoch, loss_of: LossFn, generator: torch.Generator, state: RunState,
                opts: LoopOptions) -> tuple[float, int, dict]:
    """Run the backward pass of one optimiser step's `seqs_per_step` sequences, accumulating their gradients, and
    return the summed loss, the trained positions and the summed metrics (sequences with no positions add nothing)."""
    total, positions, metrics_sum = 0.0, 0, {}
    for _ in range(opts.seqs_per_step):
        seq = epoch.next(state)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=opts.precision == "bf16"):
            loss, n, metrics = loss_of(seq, generator)
        if n == 0:
            continue
        (loss / opts.seqs_per_step).backward()
        total += float(loss.detach())
        positions += n
        for k, v in metrics.items():
            metrics_sum[k] = metrics_sum.get(k, 0.0) + v
    return total, positions, metrics_sum


def train_loop(run_dir: Path, model: torch.nn.Module, data_folder: Path, loss_of: LossFn, opts: LoopOptions,
               export: Callable[[], None], extra: dict) -> RunState:
    run_dir.mkdir(parents=True, exist_ok=True)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=opts.lr, betas=(0.9, 0.95), weight_decay=opts.weight_decay)
    generator = torch.Generator().manual_seed(opts.seed)
    state = load_state(run_dir, model, optimizer, generator)
    if state is None:
        state = RunState(extra=extra)
        torch.manual_seed(opts.seed)
    truncate_log(run_dir, state.step)
    epoch = _Epoch(data_folder, opts.seed, state)
    bar = tqdm(total=opts.max_steps, initial=state.step, desc=run_dir.name, disable=not opts.show_progress,
               mininterval=5)
    last_save, session_start, session_tokens = time.perf_counter(), time.perf_counter(), 0
    model.train()
    with _stop_requests() as stop:
        while state.step < opts.max_steps and not stop["stop"]:
            if opts.max_seconds is not None and state.seconds >= opts.max_seconds:
                break
            t0 = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = _lr(opts, state.step)
            optimizer.zero_grad(set_to_none=True)
            total, positions, metrics_sum = _accumulate(epoch, loss_of, generator, state, opts)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, opts.grad_clip))
            optimizer.step()
            dt = time.perf_counter() - t0
            state.step += 1
            state.tokens += positions
            state.seconds += dt
            session_tokens += positions
            record = {"step": state.step, "loss": round(total / opts.seqs_per_step, 5), "positions": positions,
                      "tokens": state.tokens, "seconds": round(state.seconds, 2), "grad_norm": round(grad_norm, 4),
                      "lr": _lr(opts, state.step - 1), "epoch": state.cursor.epoch}
            record.update({k: round(v / opts.seqs_per_step, 5) for k, v in metrics_sum.items()})
            append_log(run_dir, record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}",
                            tok_s=f"{session_tokens / (time.perf_counter() - session_start):.0f}")
            if time.perf_counter() - last_save >= opts.save_every_s:
                save_state(run_dir, model, optimizer, state, generator)
                export()
                _snapshot(run_dir, state)
                last_save = time.perf_counter()
    bar.close()
    save_state(run_dir, model, optimizer, state, generator)
    export()
    return state
