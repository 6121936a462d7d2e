"""Runs the target over Sequences' paged caches: builds slots, positions and masks for prefill, chain and tree steps,
for one sequence or several in one forward."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from whiflash_trt.models.contracts import Segment, Target, TargetOutput
from whiflash_trt.runtime.kv_cache import KVPool
from whiflash_trt.runtime.sequence import Sequence


@dataclass
class Feed:
    """One sequence's new tokens in a target step, fed at logical slots [N, N + T) where N = seq.num_committed.

    Chain (no depths): token i is at position N + i and sees everything before it. Tree: token i is at position
    N + depths[i] and sees all context plus the nodes tree_mask[i] allows ([T, T] bool, ancestors and itself). The
    caller must have reserved the slots. logits_rows: the rows to compute logits for (None = every row)."""
    seq: Sequence
    tokens: list[int]
    depths: list[int] | None = None
    tree_mask: torch.Tensor | None = None
    logits_rows: list[int] | None = None


class TargetRunner:
    def __init__(self, model: Target, pool: KVPool, capture_layers: tuple[int, ...] = ()) -> None:
        num_layers = model.config.num_layers
        bad = [i for i in capture_layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"capture layers {bad} out of range for a {num_layers}-layer target")
        self.model = model
        self.pool = pool
        self.capture_layers = tuple(capture_layers)
        self.device = pool.k.device

    def step(self, seq: Sequence, tokens: list[int], depths: list[int] | None = None,
             tree_mask: torch.Tensor | None = None, logits_rows: list[int] | None = None,
             capture: bool = False) -> TargetOutput:
        """One sequence's Feed. With `capture`, the outputs of the drafters' layers (self.capture_layers) come back in
        TargetOutput.captured."""
        return self.step_many([Feed(seq, tokens, depths, tree_mask, logits_rows)], capture)[0]

    @torch.inference_mode()
    def step_many(self, feeds: list[Feed], capture: bool = False) -> list[TargetOutput]:
        """Every feed in one target forward; each sequence's outputs equal those of its own step."""
        dev = self.device
        ids, positions, writes, segments, rows, counts = [], [], [], [], [], []
        first = 0
        for f in feeds:
            start, t = f.seq.num_committed, len(f.tokens)
            mask = torch.ones(t, start + t, dtype=torch.bool, device=dev)
            if f.tree_mask is None:
                positions.append(torch.arange(start, start + t, device=dev))
                mask[:, start:] = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
            else:
                positions.append(start + torch.tensor(f.depths, device=dev))
                mask[:, start:] = f.tree_mask.to(dev)
            ids += f.tokens
            writes.append(f.seq.slots(start, start + t))
            segments.append(Segment(f.seq.slots(0, start + t).to(dev), mask))
            wanted = range(t) if f.logits_rows is None else f.logits_rows
            rows += [first + r for r in wanted]
            counts.append((t, len(wanted)))
            first += t
        out = self.model.forward_segments(
            torch.tensor(ids, device=dev), torch.cat(positions), self.pool.k, self.pool.v, torch.cat(writes).to(dev),
            segments, self.capture_layers if capture else (),
            None if len(rows) == first else torch.tensor(rows, device=dev))
        return _split(out, counts)


def _split(out: TargetOutput, counts: list[tuple[int, int]]) -> list[TargetOutput]:
    """One TargetOutput per feed: counts[i] = (its rows, its logits rows)."""
    logits = out.logits.split([n for _, n in counts])
    hidden = out.hidden.split([n for _, n in counts])
    captured = [None] * len(counts) if out.captured is None else out.captured.split([t for t, _ in counts])
    return [TargetOutput(lg, h, c) for lg, h, c in zip(logits, hidden, captured)]
