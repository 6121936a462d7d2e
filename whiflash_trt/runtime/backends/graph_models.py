"""The target and both drafters over exported graphs, implementing the model contracts (models.contracts).

A graph is any callable `graph(*inputs) -> tuple of tensors` with the inputs and outputs listed in
whiflash_trt.builder.onnx_export (an onnxruntime session or a TensorRT engine). Graphs never write the KV pools: the
steps return the new K/V and these objects scatter them into the pool, which is what the torch forwards do in place.
"""
from __future__ import annotations

from typing import Callable

import torch

from whiflash_trt.config import ModelConfig
from whiflash_trt.errors import WhiflashError
from whiflash_trt.models.contracts import DFlash, Eagle3, Segment, Target, TargetOutput, feature_columns
from whiflash_trt.models.dflash import DFlashConfig
from whiflash_trt.models.eagle3 import Eagle3Config

Graph = Callable[..., tuple[torch.Tensor, ...]]


def _single(graph: Graph | None, what: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A one-output graph as a function; a graph the engine was built without fails when called."""
    def call(x: torch.Tensor) -> torch.Tensor:
        if graph is None:
            raise WhiflashError(f"this engine has no {what} graph (it was built without drafters)")
        return graph(x)[0]
    return call


def _scatter(k_cache, v_cache, write_slots, k_new, v_new) -> None:
    k_cache[:, write_slots] = k_new
    v_cache[:, write_slots] = v_new


class GraphTarget(Target):
    def __init__(self, config: ModelConfig, graphs: dict[str, Graph], capture_layers: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        self.config, self._dtype = config, dtype
        self.step = graphs["target_step"]
        self.capture_layers = capture_layers    # the layers target_step captures, in this order
        self._embed = _single(graphs.get("target_embed"), "target_embed")
        self._lm_head = _single(graphs.get("target_lm_head"), "target_lm_head")

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._embed(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._lm_head(hidden)

    def __call__(self, input_ids, positions, k_cache, v_cache, write_slots, read_slots, attn_mask,
                 capture_layers: tuple[int, ...] = (), logits_indices=None) -> TargetOutput:
        if logits_indices is None:
            logits_indices = torch.arange(input_ids.shape[0], device=input_ids.device)
        logits, hidden, *captured, k_new, v_new = self.step(input_ids, positions, k_cache, v_cache, write_slots,
                                                            read_slots, attn_mask, logits_indices)
        _scatter(k_cache, v_cache, write_slots, k_new, v_new)
        feats = captured[0] if capture_layers else None
        if feats is not None and tuple(capture_layers) != self.capture_layers:   # a subset of what was exported
            cols = feature_columns(tuple(capture_layers), self.capture_layers, self.config.hidden_size)
            feats = feats[:, cols.to(feats.device)]
        return TargetOutput(logits=logits, hidden=hidden, captured=feats)

    def forward_segments(self, input_ids, positions, k_cache, v_cache, write_slots, segments: list[Segment],
                         capture_layers: tuple[int, ...] = (), logits_indices=None) -> TargetOutput:
        """The exported step takes one sequence: one call per segment (logits_indices ascending)."""
        outs, first = [], 0
        for seg in segments:
            rows = slice(first, first + seg.rows)
            own = None
            if logits_indices is not None:
                own = logits_indices[(logits_indices >= rows.start) & (logits_indices < rows.stop)] - first
            outs.append(self(input_ids[rows], positions[rows], k_cache, v_cache, write_slots[rows], seg.read_slots,
                             seg.visible(), capture_layers, own))
            first = rows.stop
        captured = None if outs[0].captured is None else torch.cat([o.captured for o in outs])
        return TargetOutput(torch.cat([o.logits for o in outs]), torch.cat([o.hidden for o in outs]), captured)


class GraphEagle3(Eagle3):
    def __init__(self, config: Eagle3Config, graphs: dict[str, Graph], d2t: torch.Tensor) -> None:
        self.config, self.d2t = config, d2t
        self.step, self.head, self.prefill = graphs["eagle3_step"], graphs["eagle3_head"], graphs["eagle3_kv_prefill"]
        self.fc = _single(graphs["eagle3_fc"], "eagle3_fc")

    def __call__(self, embeds, hidden, positions, k_cache, v_cache, write_slots, read_slots, attn_mask):
        out, k_new, v_new = self.step(embeds, hidden, positions, k_cache, v_cache, write_slots, read_slots, attn_mask)
        _scatter(k_cache, v_cache, write_slots, k_new, v_new)
        return out

    def forward_segments(self, embeds, hidden, positions, k_cache, v_cache, write_slots,
                         segments: list[Segment]) -> torch.Tensor:
        """The exported step takes one sequence: one call per segment."""
        outs, first = [], 0
        for seg in segments:
            rows = slice(first, first + seg.rows)
            outs.append(self(embeds[rows], hidden[rows], positions[rows], k_cache, v_cache, write_slots[rows],
                             seg.read_slots, seg.visible()))
            first = rows.stop
        return torch.cat(outs)

    def draft_logprobs(self, out_hidden: torch.Tensor) -> torch.Tensor:
        return self.head(out_hidden)[0]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t.to(draft_ids.device)[draft_ids]

    def kv_only(self, feats, embeds, positions):
        return self.prefill(feats, embeds, positions)


class GraphDFlash(DFlash):
    def __init__(self, config: DFlashConfig, graphs: dict[str, Graph], mask_embedding: torch.Tensor | None) -> None:
        self.config, self.mask_embedding = config, mask_embedding
        self.block, self.prefill = graphs["dflash_block"], graphs["dflash_kv_prefill"]

    def __call__(self, block_embeds, positions, k_cache, v_cache, read_slots):
        return self.block(block_embeds, positions, k_cache, v_cache, read_slots)[0]

    def forward_many(self, block_embeds, positions, k_cache, v_cache, reads: list[torch.Tensor],
                     writes: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The exported block takes one sequence: one call per block (it never writes the pool)."""
        b = block_embeds.shape[0] // len(reads)
        return torch.cat([self(block_embeds[i * b:(i + 1) * b], positions[i * b:(i + 1) * b], k_cache, v_cache, r)
                          for i, r in enumerate(reads)])

    def kv_only(self, feats, positions):
        return self.prefill(feats, positions)
