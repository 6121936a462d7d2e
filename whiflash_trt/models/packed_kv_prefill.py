"""A fused drafter's KV-only prefill on the engine's kernels: plugins/kv_prefill.py's op computed by
kernels/kv_prefill.cpp over weights packed once (fc, and every layer's k_proj then v_proj as one GEMM), its keys and
values written straight into the drafter's pools. Catch-up runs it every round a drafter drafts; the contract's torch
reference stays what ONNX, TensorRT and a model without the kernels run."""
from __future__ import annotations

import torch

from whiflash_trt import kernels


class PackedKVPrefill:
    def __init__(self, fc_weight: torch.Tensor, hidden_norm_weight: torch.Tensor, input_norm_weight: torch.Tensor,
                 k_weight: torch.Tensor, v_weight: torch.Tensor, k_norm_weight: torch.Tensor, eps: float,
                 int8: bool = False) -> None:
        """The contract's weights (k_weight, v_weight [L, KV * D, Din]; empty input_norm / k_norm where the drafter
        has none); `int8`: fc and the K/V projections quantised per output row (bf16 weights, kernels.pack_int8)."""
        kv = torch.cat([k_weight.flatten(0, 1), v_weight.flatten(0, 1)]).detach()
        pack = kernels.pack_int8 if int8 and kv.dtype == torch.bfloat16 else kernels.pack_weight
        self.fc, self.kv = pack(fc_weight), pack(kv)
        self.hidden = fc_weight.shape[0]
        self.hidden_norm, self.input_norm = hidden_norm_weight.detach(), input_norm_weight.detach()
        self.k_norm, self.eps = k_norm_weight.detach(), eps

    @staticmethod
    def supported(*weights: torch.Tensor) -> bool:
        """The kernels are loaded and take these weights (bf16 or fp32 on the CPU)."""
        return kernels.registered() and all(kernels.supports(w) for w in weights)

    def write(self, feats: torch.Tensor, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """K/V of the backlog feats [T, F] (embeds [T, H] or [T, 0]; cos, sin [T, D]) at slots [T] of the pools."""
        kernels.kv_prefill(feats, self.fc, self.hidden, self.hidden_norm, embeds, self.input_norm, self.kv,
                           self.k_norm, cos, sin, self.eps, k_cache, v_cache, slots)
