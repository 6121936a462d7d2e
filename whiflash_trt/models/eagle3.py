"""EAGLE-3 drafter: fc over three target layers, one decoder "midlayer" on [embed(x); hidden], a draft-vocab head.

Input at drafter position t is the pair (feature g_t, token x_{t+1}); its output predicts x_{t+2}. g_t is
fc(target features at t) for context positions and the drafter's own output hidden state inside the draft tree.
The embedding is the target's (frozen, not in the checkpoint); module names follow the public checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from whiflash_trt import kernels
from whiflash_trt.config import ModelConfig, RopeConfig
from whiflash_trt.models.attention import AttentionContext, attention_keys
from whiflash_trt.models.contracts import Eagle3, Segment
from whiflash_trt.models.layers import FrozenLinear, RMSNorm, RotaryTable, SwiGLU
from whiflash_trt.models.packed_kv_prefill import PackedKVPrefill
from whiflash_trt.models.target import Attention
from whiflash_trt.plugins.kv_prefill import kv_only_prefill


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int             # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    max_position_embeddings: int
    rope: RopeConfig
    aux_layer_ids: tuple[int, ...]  # Hugging Face hidden_states indices (0 = embeddings) of the 3 target features

    def __post_init__(self) -> None:
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"EAGLE-3 uses 3 target features, got aux layer ids {self.aux_layer_ids}")
        if any(i < 1 for i in self.aux_layer_ids):
            raise ValueError(f"aux layer ids are hidden_states indices >= 1, got {self.aux_layer_ids}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in (0, vocab_size {self.vocab_size}]")

    @property
    def num_layers(self) -> int:
        return 1    # the midlayer

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Target layer indices (0-based layer outputs) whose outputs the drafter needs, low to high."""
        return tuple(i - 1 for i in self.aux_layer_ids)

    def layer_config(self) -> ModelConfig:
        return ModelConfig(architecture="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_heads,
                           num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
                           max_position_embeddings=self.max_position_embeddings, rope=self.rope)


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        lc = cfg.layer_config()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(lc, in_features=2 * cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)


class Eagle3Drafter(nn.Module, Eagle3):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rotary = RotaryTable(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        self.head: FrozenLinear | None = None   # the lm_head, kernel_attention and kv_prefill: fuse_projections
        self.kernel_attention = False
        self.kv_prefill: PackedKVPrefill | None = None

    def fuse_projections(self, int8: bool | None = None) -> None:
        """Inference-only (an engine's drafter; training runs the plain modules): the midlayer's q/k/v and gate/up
        fused, its linears, fc and the draft head FrozenLinears, its attention on the engine's kernel where loaded.
        `int8` (default: kernels.int8_layers_pay): on the kernels, the midlayer's weights quantised per output row, in
        the int8 loop for few rows (a draft step's 1-3 rows; its SwiGLU after the GEMM), and so are fc (the root's
        1 row) and the KV-only prefill's fc and k/v, both faster in int8 (docs/measurements.md, "Models")."""
        int8 = kernels.int8_layers_pay() if int8 is None else int8
        self.midlayer.self_attn.fuse(int8=int8, many_rows=False)
        self.midlayer.mlp.fuse(int8=int8, many_rows=False)
        self.head = FrozenLinear(self.lm_head.weight, int8=True)   # quantised on the kernels (FrozenLinear)
        fc = self._modules.pop("fc")   # a FrozenLinear from here on (still .weight for kv_only): ~4x faster at 1 row
        self.fc = FrozenLinear(fc.weight, fc.bias, int8=int8)
        self.kernel_attention = kernels.registered()
        attn = self.midlayer.self_attn
        if fc.bias is None and PackedKVPrefill.supported(fc.weight, attn.k_proj.weight):
            self.kv_prefill = PackedKVPrefill(fc.weight, self.midlayer.hidden_norm.weight,
                                              self.midlayer.input_layernorm.weight, attn.k_proj.weight[None],
                                              attn.v_proj.weight[None], fc.weight.new_empty(1, 0),
                                              self.config.rms_norm_eps, int8)

    def forward(
        self,
        embeds: torch.Tensor,       # [T, H] target embeddings of the paired tokens x_{t+1}
        hidden: torch.Tensor,       # [T, H] g_t: fc(features) or the drafter's own previous output
        positions: torch.Tensor,    # [T]
        k_cache: torch.Tensor,      # [1, num_slots, kv_heads, head_dim]
        v_cache: torch.Tensor,
        write_slots: torch.Tensor,  # [T]
        read_slots: torch.Tensor,   # [S]
        attn_mask: torch.Tensor,    # [T, S] bool
    ) -> torch.Tensor:
        """-> [T, H] output hidden state (before the final norm), fed back as g at the next draft depth."""
        return self.forward_segments(embeds, hidden, positions, k_cache, v_cache, write_slots,
                                     [Segment(read_slots, attn_mask)])

    def forward_segments(self, embeds, hidden, positions, k_cache, v_cache, write_slots,
                         segments: list[Segment]) -> torch.Tensor:
        """Several sequences' draft steps in one call: the rows of segments[i] see only its keys."""
        keys = attention_keys(segments, self.config.num_heads // self.config.num_kv_heads, self.kernel_attention)
        ctx = AttentionContext.at(self.rotary, positions, hidden.dtype, write_slots, keys, k_cache, v_cache)
        return self.run(embeds, hidden, ctx)

    def run(self, embeds, hidden, ctx: AttentionContext) -> torch.Tensor:
        """The one forward every draft step runs: forward_segments, the compiled step (builder/compile_eagle3.py)
        and the exported graph (builder/onnx_export.py) build `ctx` and call it."""
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        h = hidden + layer.self_attn(x, ctx, 0)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def draft_logprobs(self, out_hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head if self.head is None else self.head
        return torch.log_softmax(head(self.norm(out_hidden)).float(), dim=-1)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def kv_only(self, feats: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor):
        attn = self.midlayer.self_attn
        cos, sin = self.rotary(positions, feats.dtype)
        empty = feats.new_empty(1, 0)
        return kv_only_prefill(feats, self.fc.weight, self.midlayer.hidden_norm.weight, embeds,
                               self.midlayer.input_layernorm.weight, attn.k_proj.weight[None],
                               attn.v_proj.weight[None], empty, cos[:, 0], sin[:, 0], self.config.rms_norm_eps)

    def write_kv_only(self, feats: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        if self.kv_prefill is None:
            return Eagle3.write_kv_only(self, feats, embeds, positions, k_cache, v_cache, slots)
        cos, sin = self.rotary.rows(positions, feats.dtype)
        self.kv_prefill.write(feats, embeds, cos, sin, k_cache, v_cache, slots)
