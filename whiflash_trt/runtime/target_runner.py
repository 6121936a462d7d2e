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
        """Every feed in one target forward; each sequence's outputs equal those of its own step. The inputs are
        built from Python lists with few torch ops: after the weights stream through, a round's host ops run with
        cold caches (~20-40 us each on the AMD EPYC, 2 threads, where a warm loop takes a few)."""
        dev = self.device
        ids, positions, writes, segments, rows, counts = [], [], [], [], [], []
        first = 0
        for f in feeds:
            start, t = f.seq.num_committed, len(f.tokens)
            read = f.seq.slots(0, start + t).to(dev)
            if f.tree_mask is None:
                positions += range(start, start + t)
                segments.append(Segment(read, lengths=torch.arange(start + 1, start + t + 1, device=dev)))
            else:
                positions += [start + d for d in f.depths]
                segments.append(tree_segment(read, start, f.tree_mask))
            ids += f.tokens
            writes.append(f.seq.slots(start, start + t))
            wanted = range(t) if f.logits_rows is None else f.logits_rows
            rows += [first + r for r in wanted]
            counts.append((t, len(wanted)))
            first += t
        out = self.model.forward_segments(
            torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), self.pool.k, self.pool.v,
            joined(writes).to(dev), segments,
            self.capture_layers if capture else (), None if len(rows) == first else torch.tensor(rows, device=dev))
        return [out] if len(feeds) == 1 else _split(out, counts)


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat of the sequences' parts of a batched call, without the copy when there is one sequence (each host op
    of a round costs ~20-40 us)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def tree_segment(read_slots: torch.Tensor, start: int, tree_mask: torch.Tensor) -> Segment:
    """The layout of a tree's rows after `start` context keys: row i sees the context, then its ancestors and itself
    (tree_mask [T, T]: ancestors and self) in tree order, which is logical order (parents precede children)."""
    allowed = tree_mask.tolist()
    own = [[start + j for j, seen in enumerate(row) if seen] for row in allowed]
    width = max(len(keys) for keys in own)
    pad = [keys + keys[:1] * (width - len(keys)) for keys in own]   # padding repeats a visible key
    dev = read_slots.device
    order = torch.cat([torch.arange(start, device=dev).expand(len(own), start), torch.tensor(pad, device=dev)], 1)
    return Segment(read_slots, order=order, lengths=torch.tensor([start + len(k) for k in own], device=dev))


def _split(out: TargetOutput, counts: list[tuple[int, int]]) -> list[TargetOutput]:
    """One TargetOutput per feed: counts[i] = (its rows, its logits rows)."""
    logits = out.logits.split([n for _, n in counts])
    hidden = out.hidden.split([n for _, n in counts])
    captured = [None] * len(counts) if out.captured is None else out.captured.split([t for t, _ in counts])
    return [TargetOutput(lg, h, c) for lg, h, c in zip(logits, hidden, captured)]
