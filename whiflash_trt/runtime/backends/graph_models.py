"""The target and both drafters over exported graphs, with the call signatures the engine and proposers use.

A graph is any callable `graph(*inputs) -> tuple of tensors` with the inputs and outputs listed in
whiflash_trt.builder.onnx_export (an onnxruntime session or a TensorRT engine). Graphs never write the KV pools: the
steps return the new K/V and these objects scatter them into the pool, which is what the torch forwards do in place.
"""
from __future__ import annotations

from typing import Callable

import torch

from whiflash_trt.config import ModelConfig
from whiflash_trt.errors import WhiflashError
from whiflash_trt.models.dflash import DFlashConfig
from whiflash_trt.models.eagle3 import Eagle3Config
from whiflash_trt.models.target import TargetOutput

Graph = Callable[..., tuple[torch.Tensor, ...]]


class _Single:
    """A one-output graph as a module-like callable (target.lm_head, drafter.fc)."""

    def __init__(self, graph: Graph | None, what: str) -> None:
        self.graph, self.what = graph, what

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.graph is None:
            raise WhiflashError(f"this engine has no {self.what} graph (it was built without drafters)")
        return self.graph(x)[0]


class GraphEmbedding(_Single):
    """target.embed_tokens: ids [T] -> [T, H]. `weight` is an empty [0, H] tensor that only tells the engine the
    dtype and device (the table itself lives in the graph)."""

    def __init__(self, graph: Graph | None, hidden_size: int, dtype: torch.dtype, device) -> None:
        super().__init__(graph, "target_embed")
        self.weight = torch.empty(0, hidden_size, dtype=dtype, device=device)


def _scatter(k_cache, v_cache, write_slots, k_new, v_new) -> None:
    k_cache[:, write_slots] = k_new
    v_cache[:, write_slots] = v_new


class GraphTarget:
    def __init__(self, config: ModelConfig, graphs: dict[str, Graph], capture_layers: tuple[int, ...],
                 dtype: torch.dtype, device) -> None:
        self.config = config
        self.step = graphs["target_step"]
        self.capture_layers = capture_layers    # the layers target_step captures, in this order
        self.embed_tokens = GraphEmbedding(graphs.get("target_embed"), config.hidden_size, dtype, device)
        self.lm_head = _Single(graphs.get("target_lm_head"), "target_lm_head")

    def __call__(self, input_ids, positions, k_cache, v_cache, write_slots, read_slots, attn_mask,
                 capture_layers: tuple[int, ...] = (), logits_indices=None) -> TargetOutput:
        if logits_indices is None:
            logits_indices = torch.arange(input_ids.shape[0], device=input_ids.device)
        logits, hidden, *captured, k_new, v_new = self.step(input_ids, positions, k_cache, v_cache, write_slots,
                                                            read_slots, attn_mask, logits_indices)
        _scatter(k_cache, v_cache, write_slots, k_new, v_new)
        return TargetOutput(logits=logits, hidden=hidden, captured=self._select(captured, tuple(capture_layers)))

    def _select(self, captured: list[torch.Tensor], layers: tuple[int, ...]) -> torch.Tensor | None:
        if not layers:
            return None
        if layers == self.capture_layers:
            return captured[0]
        missing = [i for i in layers if i not in self.capture_layers]
        if missing:
            raise WhiflashError(f"target layers {missing} were not captured when this engine's graphs were exported "
                                f"(captured: {list(self.capture_layers)})")
        h = self.config.hidden_size
        cols = torch.cat([torch.arange(self.capture_layers.index(i) * h, (self.capture_layers.index(i) + 1) * h)
                          for i in layers])
        return captured[0][:, cols.to(captured[0].device)]


class _GraphDrafter:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def to(self, device=None, dtype: torch.dtype | None = None):
        """The engine moves drafters to its device and dtype; graphs are fixed at export, so only check."""
        if dtype is not None and dtype != self.dtype:
            raise WhiflashError(f"drafter graphs were exported in {self.dtype}, the engine runs {dtype}; rebuild "
                                f"the engine with that --dtype")
        return self


class GraphEagle3(_GraphDrafter):
    def __init__(self, config: Eagle3Config, graphs: dict[str, Graph], d2t: torch.Tensor, dtype: torch.dtype):
        super().__init__(dtype)
        self.config, self.d2t = config, d2t
        self.step, self.head, self.prefill = graphs["eagle3_step"], graphs["eagle3_head"], graphs["eagle3_kv_prefill"]
        self.fc = _Single(graphs["eagle3_fc"], "eagle3_fc")

    def __call__(self, embeds, hidden, positions, k_cache, v_cache, write_slots, read_slots, attn_mask):
        out, k_new, v_new = self.step(embeds, hidden, positions, k_cache, v_cache, write_slots, read_slots, attn_mask)
        _scatter(k_cache, v_cache, write_slots, k_new, v_new)
        return out

    def draft_logprobs(self, out_hidden: torch.Tensor) -> torch.Tensor:
        return self.head(out_hidden)[0]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t.to(draft_ids.device)[draft_ids]

    def kv_only(self, feats, embeds, positions):
        k, v = self.prefill(feats, embeds, positions)
        return k, v


class GraphDFlash(_GraphDrafter):
    def __init__(self, config: DFlashConfig, graphs: dict[str, Graph], mask_embedding: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__(dtype)
        self.config, self.mask_embedding = config, mask_embedding
        self.block, self.prefill = graphs["dflash_block"], graphs["dflash_kv_prefill"]

    def __call__(self, block_embeds, positions, k_cache, v_cache, read_slots):
        return self.block(block_embeds, positions, k_cache, v_cache, read_slots)[0]

    def kv_only(self, feats, positions):
        k, v = self.prefill(feats, positions)
        return k, v
