"""KV-only Prefill: a drafter's context K/V for a backlog of positions, as ONE custom op.

This is the single place the op's contract is written down (the ONNX schema/function, any TensorRT plugin or GPU
kernel, and the engine's CPU kernel kernels/kv_prefill.cpp, which a fused drafter runs over packed weights, implement
exactly this):

    whiflash::kv_only_prefill(feats, fc_weight, hidden_norm_weight, embeds, input_norm_weight,
                              k_weight, v_weight, k_norm_weight, cos, sin, eps) -> (k, v)

    feats              [T, F]          captured target features of the backlog positions (drafter's layers, concat)
    fc_weight          [H, F]          drafter fc (no bias)
    hidden_norm_weight [H]             RMSNorm applied to fc(feats)
    embeds             [T, H] | [T, 0] EAGLE-3: target embeddings of the paired next tokens; DFlash: empty
    input_norm_weight  [H] | [0]       EAGLE-3 input_layernorm; DFlash: empty
    k_weight, v_weight [L, KV*D, Din]  per drafter layer; Din = 2H (EAGLE-3: [input_norm(embeds); h]) or H (DFlash: h)
    k_norm_weight      [L, D] | [L, 0] per-head RMSNorm on keys (DFlash/Qwen3); empty for EAGLE-3
    cos, sin           [T, D]          rotary tables at the backlog positions (rotate-half convention)
    eps                float           RMSNorm epsilon (all norms)
    -> k, v            [L, T, KV, D]   keys after k_norm and RoPE, values; the caller scatters them into its pool

No queries, attention, o_proj, MLP, final norm or LM head: a position's K/V depend only on its own inputs (its
captured target features and, for EAGLE-3, the token paired with it), which is why the pass is exact.

In ONNX graphs and TensorRT the op is ONE node with the same ten inputs (in this order) and two outputs:

    domain PLUGIN_DOMAIN ("trt.plugins"), op_type PLUGIN_NAME ("WhiflashKVOnlyPrefill"), opset version 1
    attributes  eps (float), plugin_version (string, PLUGIN_VERSION), plugin_namespace (string, PLUGIN_NAMESPACE)
    types       one float type T (float32, float16 or bfloat16) for every input and both outputs; empty tensors
                stand for the absent EAGLE-3 / DFlash pieces exactly as above

plugins.onnx_plugin holds its OpSchema and the reference ONNX function body (what onnxruntime runs);
plugins.tensorrt_plugin registers the TensorRT plugin `PLUGIN_NAMESPACE::PLUGIN_NAME` that TensorRT's ONNX parser
maps the node to.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

OP_NAME = "whiflash::kv_only_prefill"
PLUGIN_NAME = "WhiflashKVOnlyPrefill"   # TensorRT plugin / ONNX op_type
PLUGIN_DOMAIN = "trt.plugins"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = "whiflash"          # TensorRT plugin id: "whiflash::WhiflashKVOnlyPrefill"


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def kv_only_prefill_reference(feats, fc_weight, hidden_norm_weight, embeds, input_norm_weight, k_weight, v_weight,
                              k_norm_weight, cos, sin, eps: float):
    h = _rms(feats @ fc_weight.t(), hidden_norm_weight, eps)                        # [T, H]
    x = torch.cat([_rms(embeds, input_norm_weight, eps), h], -1) if embeds.shape[-1] else h  # [T, Din]
    t, d = feats.shape[0], cos.shape[-1]
    num_layers, kv_dim = k_weight.shape[0], k_weight.shape[1]

    def project(w: torch.Tensor) -> torch.Tensor:   # every layer in one GEMM (~3x faster than einsum's bmm here)
        y = F.linear(x, w.reshape(num_layers * kv_dim, -1))                        # [T, L * KV * D]
        return y.view(t, num_layers, kv_dim // d, d).transpose(0, 1)
    k, v = project(k_weight), project(v_weight)
    if k_norm_weight.shape[-1]:
        k = _rms(k, k_norm_weight[:, None, None, :], eps)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    half = d // 2
    k = k * c + torch.cat([-k[..., half:], k[..., :half]], -1) * s
    return k.contiguous(), v.contiguous()


@torch.library.custom_op(OP_NAME, mutates_args=())
def kv_only_prefill(feats: torch.Tensor, fc_weight: torch.Tensor, hidden_norm_weight: torch.Tensor,
                    embeds: torch.Tensor, input_norm_weight: torch.Tensor, k_weight: torch.Tensor,
                    v_weight: torch.Tensor, k_norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return kv_only_prefill_reference(feats, fc_weight, hidden_norm_weight, embeds, input_norm_weight, k_weight,
                                     v_weight, k_norm_weight, cos, sin, eps)


@kv_only_prefill.register_fake
def _(feats, fc_weight, hidden_norm_weight, embeds, input_norm_weight, k_weight, v_weight, k_norm_weight, cos, sin,
      eps):
    t, d = feats.shape[0], cos.shape[-1]
    shape = (k_weight.shape[0], t, k_weight.shape[1] // d, d)
    return feats.new_empty(shape), feats.new_empty(shape)
