"""Building blocks shared by the target and both drafters: RMSNorm, rotary embeddings, SwiGLU, paged attention."""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from whiflash_trt import kernels
from whiflash_trt.config import RopeConfig


def k_major(w: torch.Tensor) -> torch.Tensor:
    """The same [out, in] matrix stored input-major (the transposed view of a contiguous [in, out] tensor): the
    fp32 layout row_linear needs. bf16 weights stay [out, in] (as fast or faster there, e.g. the LM head)."""
    return w.t().contiguous().t() if w.dtype == torch.float32 else w


@functools.cache
def onednn_bf16() -> bool:
    """oneDNN's bf16 GEMM runs on this CPU (x86 with AVX-512 BW/VL/DQ or AVX-NE-CONVERT): torch asks oneDNN, nothing
    is tried and caught. Where it does not, bf16 linears without the engine's kernels widen their weights to fp32
    (exact) for row_linear's fp32 GEMM and round the rows back to bf16: every row still gets a 1-row call's bits."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def linear_path(dtype: torch.dtype) -> str:
    """What runs a CPU target's linears in `dtype` in this process, and why, in a few words (whiflash-run's note and
    its --json stats)."""
    if kernels.registered():
        return f"whiflash kernels ({kernels.loaded_isa()}, {kernels.gemm()} loop)"
    if dtype != torch.bfloat16:
        return "MKL fp32 (whiflash kernels not loaded)"
    if onednn_bf16():
        return "oneDNN bf16 (whiflash kernels not loaded)"
    return "bf16 widened to fp32 on MKL (whiflash kernels not loaded; oneDNN has no bf16 GEMM on this CPU)"


# Largest row count of one fp32 GEMM whose rows get the bits of a 2-row call, on every CPU we measured: MKL sums rows
# of 17-100-row calls in another order on the Intel Xeon (in_features 1536), and of 4-row and larger calls on an AMD
# EPYC (Zen 4, any shape).
FP32_ROWS = 3


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over x [T, in] (or [..., in]) whose row i does not depend on T, so a verify row equals a 1-token
    step's row.

    Measured on this project's CPUs (tests/test_row_invariance.py holds it): oneDNN's bf16 GEMM gives a row the same
    bits for any row count from 2 up, and at 1 row too unless in_features > 1024 (its GEMV path then sums in
    another order); MKL's fp32 GEMM with input-major weights (k_major) does for 2..FP32_ROWS rows, and at 1 row on
    the Xeon never.
    Calls outside those ranges run in row blocks, a lone row as two.
    """
    if x.dim() != 2:  # [..., in]: the rows are every leading index
        return row_linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
    if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and not onednn_bf16():
        widened_bias = None if bias is None else bias.float()
        return row_linear(x.float(), k_major(weight.float()), widened_bias).to(x.dtype)
    rows = x.shape[0]
    if weight.dtype == torch.float32 and rows > FP32_ROWS:
        return torch.cat([row_linear(x[i:i + FP32_ROWS], weight, bias) for i in range(0, rows, FP32_ROWS)])
    if rows == 1 and (weight.dtype == torch.float32 or weight.shape[1] > 1024):
        return F.linear(x.repeat(2, 1), weight, bias)[:1]
    return F.linear(x, weight, bias)


class FrozenLinear:
    """An inference-only linear layer (weight [out, in]) whose rows do not depend on the row count, so a verify row
    equals a 1-token step's row. A bf16 or fp32 CPU weight runs on the engine's own kernels where they are loaded
    (whiflash_trt.kernels: row-invariant by construction). Elsewhere a bf16 weight is
    prepacked for oneDNN where its bf16 GEMM runs (the bits of F.linear, with row_linear's rule for a lone row over
    in_features > 1024, whose GEMV path sums in another order), else widened to fp32 for row_linear and rounded
    back; an fp32 weight runs on MKL through row_linear. tests/test_row_invariance.py and tests/test_kernels.py hold
    the bits.

    int8 (the drafters' LM heads, and both drafters' layers where kernels.int8_layers_pay): on the kernels a bf16
    weight without bias is quantised per output row (kernels.pack_int8) and streams half the bytes; many_rows picks
    the int8 GEMM loop for calls of many rows (kernels.linear: DFlash's blocks), else the one for few rows. A
    drafter's output only steers what it proposes, never what is accepted, so this costs no exactness (measured tau:
    MODEL_CARD.md).

    `kernel_weight`: the weight it runs over on the kernels, packed already (a native target's GGML blocks,
    models.target.pack_native's); `weight` is then not packed, and may be a meta tensor but for the LM head's."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, use_kernel: bool = True,
                 int8: bool = False, many_rows: bool = False, kernel_weight: torch.Tensor | None = None) -> None:
        self.weight, self.bias, self.many_rows = weight, bias, many_rows
        self.packed = self.kernel_bias = self.widened = None
        if kernel_weight is None and use_kernel and kernels.registered() and kernels.supports(weight):
            # int8: a bf16 weight without bias quantised per output row (kernels.pack_int8): a drafter's head or layers
            quantise = int8 and bias is None and weight.dtype == torch.bfloat16
            kernel_weight = kernels.pack_int8(weight) if quantise else kernels.pack_weight(weight)
        self.kernel_weight = kernel_weight
        if kernel_weight is not None:
            self.kernel_bias = None if bias is None else bias.detach().float()   # the kernels take an fp32 bias
        elif weight.dtype == torch.bfloat16 and weight.device.type == "cpu":
            if onednn_bf16():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            else:
                self.widened = k_major(weight.detach().float())
                self.widened_bias = None if bias is None else bias.detach().float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.kernel_weight is not None:
            y = kernels.linear(rows, self.kernel_weight, self.kernel_bias, self.weight.shape[0], self.many_rows)
            return y.view(*x.shape[:-1], y.shape[-1])
        if self.widened is not None:
            return row_linear(x.float(), self.widened, self.widened_bias).to(x.dtype)
        if self.packed is None:
            return row_linear(x, self.weight, self.bias)
        lone = rows.shape[0] == 1 and rows.shape[1] > 1024   # row_linear's rule: a lone row runs as two
        y = torch.ops.mkldnn._linear_pointwise(rows.repeat(2, 1) if lone else rows, self.packed, self.bias, "none",
                                               [], "")
        return y[:1].view(*x.shape[:-1], y.shape[-1]) if lone else y.view(*x.shape[:-1], y.shape[-1])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference implementations, then cast back before the weight multiply.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def gate_up_packs(intermediate_size: int) -> bool:
    """An MLP's [gate; up] can run in the kernels' SwiGLU (kernels.swiglu): they are interleaved in runs of 32
    rows (kernels.pack_gate_up for bf16 weights, kernels.ggml_gate_up for GGML blocks)."""
    return intermediate_size % 32 == 0


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up: FrozenLinear | None = None   # set by fuse(), with self.down; or instead:
        self.gate_up_packed: torch.Tensor | None = None   # [gate; up] for the kernels' SwiGLU (kernels.swiglu)

    def fuse(self, use_kernels: bool = True, int8: bool = False, many_rows: bool = True,
             blocks: dict[str, torch.Tensor] | None = None) -> None:
        """One [gate; up] matrix; gate/up_proj become views into it (names and state_dict unchanged). On the
        kernels (bf16), SwiGLU itself runs in the GEMM: one call, no [T, 2I] intermediate. `int8`: there, both
        weights quantised per output row (a drafter's layers, see FrozenLinear); without `many_rows` (EAGLE-3's
        draft steps of few rows) the GEMMs run the int8 loop for few rows and SwiGLU after them. `blocks`: GGML
        weights packed already ("gate_up", "down_proj": a native target's, models.target.pack_native's) that run in
        place of those the dense ones would be packed into (FrozenLinear's kernel_weight)."""
        blocks = blocks or {}
        fused = k_major(torch.cat([self.gate_proj.weight, self.up_proj.weight]))
        self.down_proj.weight = nn.Parameter(k_major(self.down_proj.weight), requires_grad=False)
        n = self.gate_proj.weight.shape[0]
        self.gate_proj.weight = nn.Parameter(fused[:n], requires_grad=False)
        self.up_proj.weight = nn.Parameter(fused[n:], requires_grad=False)
        if "gate_up" in blocks:
            self.gate_up_packed = blocks["gate_up"]
        elif use_kernels and kernels.registered() and fused.dtype == torch.bfloat16 and gate_up_packs(n) \
                and kernels.supports(fused) and (many_rows or not int8):
            self.gate_up_packed = kernels.pack_gate_up(fused, int8)
        else:
            self.gate_up = FrozenLinear(fused, use_kernel=use_kernels, int8=int8, many_rows=many_rows)
        self.down = FrozenLinear(self.down_proj.weight, use_kernel=use_kernels, int8=int8, many_rows=many_rows,
                                 kernel_weight=blocks.get("down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_packed is not None:
            rows = kernels.swiglu(x.reshape(-1, x.shape[-1]), self.gate_up_packed, self.gate_proj.weight.shape[0])
            return self.down(rows.view(*x.shape[:-1], -1))
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with linear or Llama-3 scaling applied."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.scaling_type == "linear":
        return inv_freq / rope.factor
    if rope.scaling_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryTable(nn.Module):
    """Precomputed cos/sin [max_positions, head_dim] indexed by absolute positions."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, rope)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self._cast: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, 1, head_dim] each, broadcast over heads
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)

    def rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] in `dtype`, the same values as forward's: from tables cast once per dtype (a
        drafter's catch-up takes them every round, and each host op of a round costs ~20-40 us)."""
        key = (dtype, self.cos.device)
        if key not in self._cast:
            self._cast[key] = (self.cos.to(dtype), self.sin.to(dtype))
        cos, sin = self._cast[key]
        return cos[positions], sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] (rotate-half convention of the HF checkpoints).

    Traced for a compiled step (DFlash's block; the target's and EAGLE-3's attention kernel rotates q and k itself,
    kernels.paged_attention), the same products and sums per half, so inductor writes each half of the output
    straight from x; the rotated copy of x the eager form concatenates costs the step's fused kernel two more passes
    (same bits; timings: docs/measurements.md, "Models"). Eager, the form of fewer ops."""
    half = x.shape[-1] // 2
    if torch.compiler.is_compiling():
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos[..., :half] + (-x2) * sin[..., :half],
                          x2 * cos[..., half:] + x1 * sin[..., half:]], dim=-1)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, read_slots: torch.Tensor,
                    attn_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attend T queries to the keys at read_slots of one layer's pool.

    q: [T, heads, head_dim]; k_pool, v_pool: [num_slots, kv_heads, head_dim] (keys stored after RoPE);
    read_slots: [S] physical slots in logical order; attn_mask: [T, S] bool, True = may attend.
    Returns [T, heads * head_dim].
    """
    return attention(q, k_pool.index_select(0, read_slots), v_pool.index_select(0, read_slots), attn_mask, scale)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor,
              scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim]; k, v: [S, kv_heads, head_dim] (already gathered); attn_mask: [T, S] bool.
    Returns [T, heads * head_dim].

    SDPA, for the DFlash drafter and the fp32 ONNX graphs. A row's last bits depend on the shape of the call, so the
    target's torch forward uses models/attention.py instead (a draft needs no bit-exactness)."""
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # [kv_heads, S, head_dim]
    heads, kv_heads = q.shape[1], k.shape[0]
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=0)
        v = v.repeat_interleave(heads // kv_heads, dim=0)
    # 4-D [1, heads, T, head_dim]: the form ONNX export translates
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=attn_mask, scale=scale)
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)
