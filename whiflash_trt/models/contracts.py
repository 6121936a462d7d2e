"""What the engine needs of a target and of each drafter, whatever runs them: the torch modules (models.target,
models.eagle3, models.dflash) and the exported graphs (runtime.backends.graph_models) both subclass these. A member a
torch module holds as a submodule or parameter (fc, mask_embedding) is an annotation: a method would shadow it.
Shapes: T new tokens, S keys they may read, H hidden size, L a model's layers; K/V pools are [L, slots, kv, D].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import torch

if TYPE_CHECKING:   # the models implement these contracts, so they import this module
    from whiflash_trt.config import ModelConfig
    from whiflash_trt.models.dflash import DFlashConfig
    from whiflash_trt.models.eagle3 import Eagle3Config


@dataclass
class TargetOutput:
    logits: torch.Tensor          # [len(logits_indices), vocab]
    hidden: torch.Tensor          # [len(logits_indices), hidden] final-norm output at those rows
    captured: torch.Tensor | None  # [T, len(capture_layers) * hidden] outputs of the requested layers, concatenated


@dataclass
class Segment:
    """One sequence's part of a batched target forward: its rows (the call's next `rows` rows) see only keys at
    `read_slots` [S] (pool slots in logical order). Which ones, given either way:
    - `mask` [rows, S] bool: the keys each row may see;
    - `lengths` [rows] int64: row i sees read_slots[:lengths[i]] (prefill, decode, a chain), or with `order`
      [rows, K]: read_slots[order[i, :lengths[i]]], each row's visible indices in logical order (a tree node: the
      context, its ancestors, itself); `order` alone: every row sees K keys.
    The engine's kernel reads the layout as it is; visible() gives the mask the torch attention and the exported
    graphs take (built on demand: a round's host ops run with cold caches after the weights stream, ~20-40 us
    each). Entries of `order` past a row's length are padding and must repeat one of its visible indices."""
    read_slots: torch.Tensor
    mask: torch.Tensor | None = None
    order: torch.Tensor | None = None
    lengths: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.mask is None and self.order is None and self.lengths is None:
            raise ValueError("a Segment needs its rows' keys: a mask, an order or lengths")

    @property
    def rows(self) -> int:
        return next(x for x in (self.mask, self.order, self.lengths) if x is not None).shape[0]

    def visible(self) -> torch.Tensor:
        """[rows, S] bool: the keys each row sees."""
        if self.mask is not None:
            return self.mask
        width, dev = self.read_slots.shape[0], self.read_slots.device
        if self.order is None:
            return torch.arange(width, device=dev) < self.lengths[:, None]
        return torch.zeros(self.rows, width, dtype=torch.bool, device=dev).scatter_(1, self.order, True)


def feature_columns(layers: tuple[int, ...], captured: tuple[int, ...], hidden_size: int) -> torch.Tensor:
    """Columns of the features of `layers` inside a capture of the `captured` layers (TargetOutput.captured:
    [T, len(captured) * H], concatenated in `captured` order) -> [len(layers) * H] int64."""
    missing = [i for i in layers if i not in captured]
    if missing:
        raise ValueError(f"target layers {missing} are not among the captured layers {list(captured)}")
    return torch.cat([torch.arange(captured.index(i) * hidden_size, (captured.index(i) + 1) * hidden_size)
                      for i in layers])


class Target(Protocol):
    """The target model: one forward for prefill, decode and chain or tree verification; `dtype` is its activations'
    (every KV pool and drafter of an engine shares it); embed: ids [T] -> [T, H]; logits: final-norm hidden [T, H] ->
    [T, vocab] through its lm_head."""
    config: ModelConfig
    native: bool = False   # its linears run a GGUF's own blocks on the kernels (TargetModel.fuse_projections)

    @property
    def dtype(self) -> torch.dtype: ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, write_slots: torch.Tensor, read_slots: torch.Tensor, attn_mask: torch.Tensor,
                 capture_layers: tuple[int, ...] = (), logits_indices: torch.Tensor | None = None) -> TargetOutput:
        """ids, positions, write_slots [T]; read_slots [S]; attn_mask [T, S] bool; logits at `logits_indices`
        (None = every row); outputs of `capture_layers` concatenated in TargetOutput.captured."""

    def forward_segments(self, input_ids: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, write_slots: torch.Tensor, segments: list[Segment],
                         capture_layers: tuple[int, ...] = (),
                         logits_indices: torch.Tensor | None = None) -> TargetOutput:
        """Several sequences in one call: the rows of segments[i] follow those of segments[:i] and see only their
        own keys. Each row's result equals the same row in a call of its own."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def head_weight(self) -> torch.Tensor | None:
        """The lm_head's weight [vocab, H] where the target holds it as a tensor (a drafter drawing from part of the
        vocabulary slices its own head from it); None where it does not (an exported graph)."""
        return None


class Eagle3(Protocol):
    """EAGLE-3: fc over three target layers, one decoder layer stepped through the draft tree, a draft-vocab head.
    A step maps embeds and g [T, H] (fc(features), or the previous step's output) to [T, H]; draft_logprobs gives
    [T, draft_vocab] log-probabilities, to_target_ids maps draft ids to target ids; kv_only gives the context K/V
    ([1, T, kv, D] each) of positions whose feature and next token are known."""
    config: Eagle3Config
    fc: Callable[[torch.Tensor], torch.Tensor]   # [T, 3 * target H] captured features -> [T, H] g

    def __call__(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, write_slots: torch.Tensor, read_slots: torch.Tensor,
                 attn_mask: torch.Tensor) -> torch.Tensor: ...

    def forward_segments(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, write_slots: torch.Tensor,
                         segments: list[Segment]) -> torch.Tensor:
        """Several sequences' steps in one call (the Target's forward_segments rule)."""

    def draft_logprobs(self, out_hidden: torch.Tensor) -> torch.Tensor: ...

    def draft_step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, write_slots: torch.Tensor,
                   segments: list[Segment]) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft depth: forward_segments, then draft_logprobs of its output -> (out hidden [T, H], log-probs
        [T, draft_vocab]). The compiled backend runs both as one graph."""
        out = self.forward_segments(embeds, hidden, positions, k_cache, v_cache, write_slots, segments)
        return out, self.draft_logprobs(out)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor: ...

    def kv_only(self, feats: torch.Tensor, embeds: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def write_kv_only(self, feats: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """kv_only's K/V written at `slots` [T] of the pools [1, slots, kv, D] (a fused drafter on the engine's
        kernels does both in one op)."""
        k, v = self.kv_only(feats, embeds, positions)
        k_cache[:, slots], v_cache[:, slots] = k, v


class DFlash(Protocol):
    """DFlash: a few layers drafting a whole block at once over context K/V injected from target features. A call
    maps block_embeds [B, H] at positions [B], over the context at read_slots [N], to final-norm hidden [B, H];
    kv_only gives the context K/V ([L, T, kv, D] each) of backlog positions from their target features."""
    config: DFlashConfig
    mask_embedding: torch.Tensor | None   # [H] the mask token's row when the target's table has none

    def __call__(self, block_embeds: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, read_slots: torch.Tensor) -> torch.Tensor: ...

    def forward_many(self, block_embeds: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, reads: list[torch.Tensor],
                     writes: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Several sequences' blocks in one call ([S * B, ...]), block i over the context at reads[i]; writes[i]
        [B]: block i's scratch slots, where an implementation may put the block's own K/V (past the context: they
        are never read as context)."""

    def kv_only(self, feats: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def draft_vocab(self) -> torch.Tensor | None:
        """The target ids its drafts are drawn from (None: the whole vocabulary)."""
        return None

    def write_kv_only(self, feats: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """kv_only's K/V written at `slots` [T] of the pools [L, slots, kv, D] (see Eagle3.write_kv_only)."""
        k, v = self.kv_only(feats, positions)
        k_cache[:, slots], v_cache[:, slots] = k, v
