"""Batched self-distillation decoding: many sequences advance one token per target step.

Each of `lanes` sequences is a runtime Sequence over one paged KV pool; a step feeds every active lane's pending token
in ONE target forward (TargetRunner.step_many), and a new prompt is prefilled in a call of its own. It is the
runtime's own forward, so tokens and captured features are exactly what the engine computes for the same sequence
alone (same dtype, same bits): the drafters train on the states they will see.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from whiflash_trt.config import CacheConfig, SamplingConfig
from whiflash_trt.models.contracts import feature_columns
from whiflash_trt.models.target import TargetModel
from whiflash_trt.runtime.kv_cache import BlockAllocator, KVLayout, KVPool
from whiflash_trt.runtime.sequence import Sequence
from whiflash_trt.runtime.target_runner import Feed, TargetRunner
from whiflash_trt.spec import sampling


@dataclass
class Lane:
    index: int
    seq: Sequence                                    # its cached tokens: prompt + response fed so far
    prompt_len: int
    feats: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def finished(self, meta: dict) -> "Finished":
        feats, hidden = torch.cat(self.feats), torch.cat(self.hidden)
        n = min(self.seq.num_committed, feats.shape[0], hidden.shape[0])   # an interrupted step may be half-recorded
        return Finished(self.seq.tokens[:n], self.prompt_len, feats[:n], hidden[:n], meta)


@dataclass
class Finished:
    tokens: list[int]            # [T] fed tokens (prompt + response, the final sampled token dropped)
    prompt_len: int
    features: torch.Tensor       # [T, len(capture) * H] captured target layer outputs
    hidden: torch.Tensor         # [T, H] final-norm hidden (logits = lm_head(hidden) predict the next token)
    meta: dict


class BatchedGenerator:
    def __init__(self, model: TargetModel, capture: tuple[int, ...], lanes: int, max_len: int,
                 eos_ids: tuple[int, ...]) -> None:
        cfg = model.config
        block_size = CacheConfig().block_size
        num_blocks = lanes * -(-max_len // block_size)
        layout = KVLayout("target", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype)
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        # The last layer is captured too: its final norm is the hidden state the logits come from.
        self.capture = tuple(capture)
        run_capture = self.capture + ((cfg.num_layers - 1,) if cfg.num_layers - 1 not in capture else ())
        self.last_cols = feature_columns((cfg.num_layers - 1,), run_capture, cfg.hidden_size)
        self.runner = TargetRunner(model, KVPool(layout, num_blocks, block_size), run_capture)
        self.model, self.max_len, self.eos = model, max_len, set(eos_ids)
        self.free = list(range(lanes))[::-1]
        self.active: list[Lane] = []

    def _advance(self, lanes: list[Lane], tokens: list[list[int]], generator: torch.Generator) -> None:
        """Feed each lane its tokens in one forward, keep their features and hidden states, sample the next token."""
        outs = self.runner.step_many([Feed(ln.seq, t, logits_rows=[len(t) - 1]) for ln, t in zip(lanes, tokens)],
                                     capture=True)
        for lane, fed, out in zip(lanes, tokens, outs):
            feats, hidden = self._split_capture(out.captured)
            lane.feats.append(feats)
            lane.hidden.append(hidden)
            temperature = SamplingConfig(lane.meta.get("temperature", 0.0))
            lane.seq.commit(fed, sampling.next_token(out.logits[-1], temperature, generator))

    def _split_capture(self, captured: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A forward's captured columns -> (features of the capture layers, final-norm hidden states)."""
        width = len(self.capture) * self.model.config.hidden_size
        return captured[:, :width], self.model.norm(captured[:, self.last_cols])

    def features_of(self, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(features, hidden) of whole token sequences fed in one forward (a data folder's features recomputed from
        its tokens). A row's bits do not depend on how its sequence is fed (the kernels are row-invariant), so these
        are the bits generation recorded one token at a time."""
        seqs: list[Sequence] = []
        try:
            for ids in sequences:
                seqs.append(Sequence(ids, self.allocator, self.block_size))
                seqs[-1].reserve(len(ids))
            outs = self.runner.step_many([Feed(s, list(ids), logits_rows=[len(ids) - 1])
                                          for s, ids in zip(seqs, sequences)], capture=True)
            return [self._split_capture(out.captured) for out in outs]
        finally:
            for seq in seqs:
                seq.free()

    def add(self, prompt_ids: list[int], meta: dict, generator: torch.Generator) -> None:
        if len(prompt_ids) >= self.max_len:
            raise ValueError(f"a {len(prompt_ids)}-token prompt leaves no room in lanes of {self.max_len} tokens")
        seq = Sequence(prompt_ids, self.allocator, self.block_size)
        seq.reserve(self.max_len)
        lane = Lane(self.free.pop(), seq, len(prompt_ids), meta=meta)
        self._advance([lane], [list(prompt_ids)], generator)
        self.active.append(lane)

    def _release(self, lane: Lane) -> None:
        lane.seq.free()
        self.free.append(lane.index)

    def drain(self) -> list[Finished]:
        """End every active sequence where it is (a truncated response is still the target's own text)."""
        out = [ln.finished(ln.meta | {"truncated": True}) for ln in self.active
               if ln.seq.num_committed > ln.prompt_len]
        for ln in self.active:
            self._release(ln)
        self.active = []
        return out

    def step(self, max_new_tokens: int, generator: torch.Generator) -> list[Finished]:
        """Feed every active lane's pending token; return the sequences that finished."""
        self._advance(self.active, [[ln.seq.pending] for ln in self.active], generator)
        done, keep = [], []
        for lane in self.active:
            seq = lane.seq
            new = seq.num_committed - lane.prompt_len
            if seq.tokens[-1] in self.eos or new >= max_new_tokens or seq.num_committed >= self.max_len:
                done.append(lane.finished(lane.meta))
                self._release(lane)
            else:
                keep.append(lane)
        self.active = keep
        return done
