"""Runs the target over a Sequence's paged cache: builds slots, positions and masks for prefill, chain and tree steps."""
from __future__ import annotations

import torch

from whiflash_trt.models.contracts import Target, TargetOutput
from whiflash_trt.runtime.kv_cache import KVPool
from whiflash_trt.runtime.sequence import Sequence


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

    @torch.inference_mode()
    def step(self, seq: Sequence, tokens: list[int], depths: list[int] | None = None,
             tree_mask: torch.Tensor | None = None, logits_rows: list[int] | None = None,
             capture: bool = False) -> TargetOutput:
        """Feed `tokens` at logical slots [kv_len, kv_len + T) where kv_len = seq.num_committed.

        Chain (default): token i is at position kv_len + i and sees everything before it.
        Tree: token i is at position kv_len + depths[i] and sees all context plus the nodes tree_mask[i] allows
        ([T, T] bool, ancestors and itself). The caller must have reserved the slots. With `capture`, the outputs
        of the drafters' layers (self.capture_layers) come back in TargetOutput.captured.
        """
        start, t = seq.num_committed, len(tokens)
        dev = self.device
        write = seq.slots(start, start + t).to(dev)
        read = seq.slots(0, start + t).to(dev)
        mask = torch.ones(t, start + t, dtype=torch.bool, device=dev)
        if tree_mask is None:
            positions = torch.arange(start, start + t, device=dev)
            mask[:, start:] = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        else:
            positions = start + torch.tensor(depths, device=dev)
            mask[:, start:] = tree_mask.to(dev)
        rows = None if logits_rows is None else torch.tensor(logits_rows, device=dev)
        return self.model(torch.tensor(tokens, device=dev), positions, self.pool.k, self.pool.v, write, read, mask,
                          self.capture_layers if capture else (), rows)
