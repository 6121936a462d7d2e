"""The TensorRT side of KV-only prefill: a quickly deployable Python plugin (tensorrt.plugin, TensorRT >= 10.7)
registered as PLUGIN_NAMESPACE::PLUGIN_NAME, which TensorRT's ONNX parser maps the graphs' plugin node to (the node's
op_type is the plugin name and its plugin_namespace attribute the namespace). Contract: plugins/kv_prefill.py.

The implementation is the torch reference on TensorRT's stream (a Python callback, so engines holding the plugin need
this module registered in the process that runs them), written to the documented tensorrt.plugin API.
"""
from __future__ import annotations

from whiflash_trt.errors import WhiflashError
from whiflash_trt.plugins.kv_prefill import PLUGIN_NAME, PLUGIN_NAMESPACE, kv_only_prefill_reference

INSTALL_HINT = ("TensorRT is not installed. It comes from NVIDIA's package index: "
                "pip install tensorrt --extra-index-url https://pypi.nvidia.com (Linux with an NVIDIA GPU and CUDA "
                "driver; the index is not reachable from this project's build machines)")


def import_tensorrt():
    """tensorrt, imported lazily; a clear error saying what to install where it is absent."""
    try:
        import tensorrt
    except ImportError as e:
        raise WhiflashError(f"--backend tensorrt: {INSTALL_HINT} (import failed: {e})") from None
    return tensorrt

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"
_registered = False


def register_plugin() -> None:
    """Register the plugin with TensorRT's registry (idempotent). Import tensorrt first (builder.tensorrt_build)."""
    global _registered
    if _registered:
        return
    import tensorrt.plugin as trtp
    import torch

    @trtp.register(PLUGIN_ID)
    def _desc(feats: trtp.TensorDesc, fc_weight: trtp.TensorDesc, hidden_norm_weight: trtp.TensorDesc,
              embeds: trtp.TensorDesc, input_norm_weight: trtp.TensorDesc, k_weight: trtp.TensorDesc,
              v_weight: trtp.TensorDesc, k_norm_weight: trtp.TensorDesc, cos: trtp.TensorDesc, sin: trtp.TensorDesc,
              eps: float):
        # k, v: [L, T, KV, D] with L, KV*D from k_weight, T from feats, D from cos
        head_dim = cos.shape_expr[1]
        shape = (k_weight.shape_expr[0], feats.shape_expr[0], k_weight.shape_expr[1] // head_dim, head_dim)
        return trtp.from_shape_expr(shape, dtype=feats.dtype), trtp.from_shape_expr(shape, dtype=feats.dtype)

    @trtp.impl(PLUGIN_ID)
    def _impl(feats, fc_weight, hidden_norm_weight, embeds, input_norm_weight, k_weight, v_weight, k_norm_weight,
              cos, sin, eps: float, outputs, stream):
        args = [torch.as_tensor(t, device="cuda") for t in (feats, fc_weight, hidden_norm_weight, embeds,
                                                            input_norm_weight, k_weight, v_weight, k_norm_weight,
                                                            cos, sin)]
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            k, v = kv_only_prefill_reference(*args, eps)
            torch.as_tensor(outputs[0], device="cuda").copy_(k)
            torch.as_tensor(outputs[1], device="cuda").copy_(v)

    _registered = True
