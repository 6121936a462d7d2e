"""DFlash drafter: a few Qwen3-style layers that draft a whole block in one bidirectional forward.

Context never runs through the layers: each layer's own k_proj/v_proj (+k_norm, RoPE) applied to
hidden_norm(fc(target features)) gives the context K/V (written by KV-only prefill into the drafter's pool).
A block [b, MASK x (B-1)] at positions N..N+B-1 attends to all context and to the whole block; outputs at slots
1..B-1 predict the tokens at those positions through the target's (frozen) lm_head. No embedding or head of its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from whiflash_trt import kernels
from whiflash_trt.config import ModelConfig, RopeConfig
from whiflash_trt.models.attention import AttentionContext, RowKeys, row_keys
from whiflash_trt.models.contracts import DFlash, Segment
from whiflash_trt.models.layers import RMSNorm, RotaryTable, SwiGLU, apply_rope, paged_attention
from whiflash_trt.models.packed_kv_prefill import PackedKVPrefill
from whiflash_trt.models.target import Attention
from whiflash_trt.plugins.kv_prefill import kv_only_prefill


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    rope: RopeConfig
    draft_block_len: int        # B: tokens per draft block, root included (the checkpoint's `block_size`)
    mask_token_id: int
    target_layer_ids: tuple[int, ...]   # 0-based target layer outputs (HF hidden_states[id + 1])
    attention_bias: bool = False
    draft_vocab_size: int | None = None  # drafts drawn from this many target ids (d2t/t2d); None: the whole vocab

    def __post_init__(self) -> None:
        if self.draft_block_len < 2:
            raise ValueError(f"DFlash block_size must be >= 2, got {self.draft_block_len}")
        if not self.target_layer_ids:
            raise ValueError("DFlash needs at least one target layer id")
        if self.mask_token_id < 0:
            raise ValueError(f"mask_token_id must be >= 0, got {self.mask_token_id}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return tuple(self.target_layer_ids)

    def layer_config(self) -> ModelConfig:
        return ModelConfig(architecture="qwen3", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=self.num_layers,
                           num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position_embeddings,
                           rope=self.rope, attention_bias=self.attention_bias)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """round(1 + i * (L - 4) / (n - 1)) for i in 0..n-1 (the reference default)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclass
class BlockReads:
    """DFlash's torch attention (a context's keys): block i of S blocks (B rows each) attends to its context at
    reads[i] and, bidirectionally, to itself. The block's own K/V are scratch: appended after the gathered context,
    never written to the pool."""
    reads: list[torch.Tensor]

    def attend(self, q, k, v, ctx: AttentionContext, layer: int, scale: float) -> torch.Tensor:
        """q [S * B, heads, D], k and v [S * B, kv, D] (not rotated) -> [S * B, heads * D], block by block."""
        q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        b = q.shape[0] // len(self.reads)
        outs = []
        for i, read_slots in enumerate(self.reads):
            rows = slice(i * b, (i + 1) * b)
            n = read_slots.numel()
            k_all = torch.cat([ctx.k_cache[layer].index_select(0, read_slots), k[rows]])
            v_all = torch.cat([ctx.v_cache[layer].index_select(0, read_slots), v[rows]])
            slots = torch.arange(n + b, device=q.device)
            mask = torch.ones(b, n + b, dtype=torch.bool, device=q.device)
            outs.append(paged_attention(q[rows], k_all, v_all, slots, mask, scale))
        return torch.cat(outs)


class DFlashAttention(Attention):
    """The target's attention projections (Qwen3-style q/k norms); each block attends to its context and,
    bidirectionally, to itself: on the engine's kernel (RowKeys, see block_keys) with the block's K/V at its
    scratch slots of the pool, or on torch (BlockReads), which never writes the pool."""

    def forward(self, x, ctx: AttentionContext, layer: int):
        if not isinstance(ctx.keys, BlockReads):
            return super().forward(x, ctx, layer)
        out = self.attend(x.shape[:-1], *self.projections(x), ctx, layer)
        return self.o(out) if self.qkv is not None else self.o_proj(out)


class DFlashLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ctx: AttentionContext, layer: int):
        x = x + self.self_attn(self.input_layernorm(x), ctx, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


def block_keys(reads: list[torch.Tensor], writes: list[torch.Tensor]) -> RowKeys:
    """Each block row's keys for the kernel: its sequence's context (reads[i]), then the whole block (writes[i], the
    block's scratch slots: bidirectional)."""
    segments = []
    for r, w in zip(reads, writes):
        keys = torch.cat([r, w])   # each row reads all of them
        segments.append(Segment(keys, lengths=torch.full((w.numel(),), keys.numel(), device=keys.device)))
    return row_keys(segments)


class DFlashDrafter(nn.Module, DFlash):
    def __init__(self, cfg: DFlashConfig, target_hidden_size: int, carries_mask_embedding: bool) -> None:
        super().__init__()
        self.config = cfg
        lc = cfg.layer_config()
        self.fc = nn.Linear(len(cfg.target_layer_ids) * target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(lc) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # A target whose embedding table has no spare row for mask_token_id: the drafter carries that row.
        self.mask_embedding = nn.Parameter(torch.zeros(cfg.hidden_size)) if carries_mask_embedding else None
        self.rotary = RotaryTable(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        self.kv_prefill: PackedKVPrefill | None = None   # set by fuse_projections where the kernels are loaded
        self.kernel_attention = False                    # likewise
        if cfg.draft_vocab_size is not None:   # EAGLE-3's convention: target id = d + d2t[d]; t2d marks them
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def draft_vocab(self) -> torch.Tensor | None:
        """The target ids a draft is drawn from, by draft id ([draft_vocab_size] int64; None: the whole vocabulary,
        the public format's only case)."""
        if self.config.draft_vocab_size is None:
            return None
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def fuse_projections(self, int8: bool | None = None) -> None:
        """Inference-only (an engine's drafter; training runs the plain modules): each layer's q/k/v and gate/up
        fused, its linears FrozenLinears (on the engine's bf16 kernel where it is loaded). `int8` (default: where it
        pays, kernels.int8_layers_pay): on the kernels, the layers' and the KV-only prefill's bf16 weights quantised
        per output row, so a round streams half their bytes."""
        int8 = kernels.int8_layers_pay() if int8 is None else int8
        for layer in self.layers:
            layer.self_attn.fuse(int8=int8)
            layer.mlp.fuse(int8=int8)
        self._kv_weights = self._stacked_kv_weights()   # frozen from here on: stacked once, not per catch-up
        self.kernel_attention = kernels.registered()
        k_weight, v_weight, k_norm_weight = self._kv_weights
        if PackedKVPrefill.supported(self.fc.weight, k_weight[0]):
            self.kv_prefill = PackedKVPrefill(self.fc.weight, self.hidden_norm.weight, k_weight.new_empty(0),
                                              k_weight, v_weight, k_norm_weight, self.config.rms_norm_eps, int8)

    def forward(
        self,
        block_embeds: torch.Tensor,  # [B, H] embeddings of [b, MASK, ..., MASK]
        positions: torch.Tensor,     # [B] N..N+B-1
        k_cache: torch.Tensor,       # [num_layers, num_slots, kv_heads, head_dim] (context K/V, filled to N)
        v_cache: torch.Tensor,
        read_slots: torch.Tensor,    # [N] context slots in logical order
    ) -> torch.Tensor:
        """-> [B, H] final-norm hidden states; slots 1..B-1 go through the target's lm_head."""
        return self.forward_many(block_embeds, positions, k_cache, v_cache, [read_slots])

    def forward_many(self, block_embeds, positions, k_cache, v_cache, reads: list[torch.Tensor],
                     writes: list[torch.Tensor] | None = None) -> torch.Tensor:
        """S sequences' blocks at once: block_embeds, positions [S * B, ...], block i over the context at reads[i].
        A fused drafter on the engine's kernels writes block i's K/V at its scratch slots writes[i] [B] of the pool
        (given; else the torch attention runs, which never writes it)."""
        if self.kernel_attention and writes is not None:
            write_slots, keys = torch.cat(writes), block_keys(reads, writes)
        else:
            write_slots, keys = None, BlockReads(reads)
        ctx = AttentionContext.at(self.rotary, positions, block_embeds.dtype, write_slots, keys, k_cache, v_cache)
        return self.run(block_embeds, ctx)

    def run(self, block_embeds, ctx: AttentionContext) -> torch.Tensor:
        """The one block forward: forward_many and the compiled step (builder/compile_dflash.py) build `ctx` and
        call it."""
        x = block_embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, i)
        return self.norm(x)

    def _stacked_kv_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn = [layer.self_attn for layer in self.layers]
        return (torch.stack([a.k_proj.weight for a in attn]), torch.stack([a.v_proj.weight for a in attn]),
                torch.stack([a.k_norm.weight for a in attn]))

    def kv_only(self, feats: torch.Tensor, positions: torch.Tensor):
        cos, sin = self.rotary(positions, feats.dtype)
        empty = feats.new_empty(feats.shape[0], 0)
        k_weight, v_weight, k_norm_weight = getattr(self, "_kv_weights", None) or self._stacked_kv_weights()
        return kv_only_prefill(feats, self.fc.weight, self.hidden_norm.weight, empty, empty[0], k_weight, v_weight,
                               k_norm_weight, cos[:, 0], sin[:, 0], self.config.rms_norm_eps)

    def write_kv_only(self, feats: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        if self.kv_prefill is None:
            return DFlash.write_kv_only(self, feats, positions, k_cache, v_cache, slots)
        cos, sin = self.rotary.rows(positions, feats.dtype)
        self.kv_prefill.write(feats, feats[:, :0], cos, sin, k_cache, v_cache, slots)
