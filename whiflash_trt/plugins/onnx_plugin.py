"""The ONNX side of KV-only prefill: OpSchema, reference function body, torch.onnx translation.

The contract (inputs, outputs, attributes, layout) is whiflash_trt.plugins.kv_prefill's docstring; this file only
expresses it in ONNX. In a graph the op is ONE node `trt.plugins::WhiflashKVOnlyPrefill` carrying the attributes
eps, plugin_version and plugin_namespace. The model also holds a local function of that domain and name whose body
is the reference computation: onnxruntime inlines and runs it, TensorRT's ONNX parser maps the node to the plugin
registered under the same name, version and namespace.
"""
from __future__ import annotations

import onnx
import onnxscript
from onnx.defs import OpSchema
from onnxscript import FLOAT
from onnxscript import opset20 as op

from whiflash_trt.plugins.kv_prefill import PLUGIN_DOMAIN, PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION

DOMAIN_VERSION = 1          # opset version of the trt.plugins domain in our graphs
OPSET = 20                  # default-domain opset of our graphs and of the function body
HELPER_DOMAIN = "whiflash"  # private domain of helper functions called by the body

_INPUTS = ("feats", "fc_weight", "hidden_norm_weight", "embeds", "input_norm_weight", "k_weight", "v_weight",
           "k_norm_weight", "cos", "sin")
_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]

plugin_opset = onnxscript.values.Opset(PLUGIN_DOMAIN, DOMAIN_VERSION)


def _schema() -> OpSchema:
    attr = OpSchema.Attribute
    return OpSchema(
        PLUGIN_NAME, PLUGIN_DOMAIN, DOMAIN_VERSION,
        doc="KV-only prefill of a drafter's context positions; contract: whiflash_trt/plugins/kv_prefill.py",
        inputs=[OpSchema.FormalParameter(name, "T") for name in _INPUTS],
        outputs=[OpSchema.FormalParameter("k", "T"), OpSchema.FormalParameter("v", "T")],
        type_constraints=[("T", _FLOATS, "activations and weights share one float type")],
        attributes=[attr("eps", OpSchema.AttrType.FLOAT, "RMSNorm epsilon of all norms"),
                    attr("plugin_version", OpSchema.AttrType.STRING, "TensorRT plugin version", required=False),
                    attr("plugin_namespace", OpSchema.AttrType.STRING, "TensorRT plugin namespace", required=False)])


def register_schema() -> None:
    """Register the OpSchema with onnx (idempotent): the exporter and onnx.checker validate the node against it."""
    if not onnx.defs.has(PLUGIN_NAME, PLUGIN_DOMAIN):
        onnx.defs.register_schema(_schema())


register_schema()


# ----- reference body (an ONNX function; onnxruntime runs it) -------------------------------------------------------
helper_opset = onnxscript.values.Opset(HELPER_DOMAIN, 1)


@onnxscript.script(helper_opset, default_opset=op)
def _rms(x, weight, eps: float):
    x32 = op.Cast(x, to=FLOAT.dtype)
    ms = op.ReduceMean(x32 * x32, op.Constant(value_ints=[-1]), keepdims=1)
    normed = x32 / op.Sqrt(ms + op.CastLike(op.Constant(value_float=eps), ms))
    return weight * op.CastLike(normed, x)


@onnxscript.script(plugin_opset, default_opset=op)
def WhiflashKVOnlyPrefill(feats, fc_weight, hidden_norm_weight, embeds, input_norm_weight, k_weight, v_weight,
                          k_norm_weight, cos, sin, eps: float, plugin_version: str = PLUGIN_VERSION,
                          plugin_namespace: str = PLUGIN_NAMESPACE):
    h = _rms(op.MatMul(feats, op.Transpose(fc_weight, perm=[1, 0])), hidden_norm_weight, eps)     # [T, H]
    # EAGLE-3: [input_norm(embeds); h]; DFlash passes embeds [T, 0], whose normed form is [T, 0] too.
    x = op.Concat(_rms(embeds, input_norm_weight, eps), h, axis=-1)                                # [T, Din]
    # [L, T, KV*D] -> [L, T, KV, D], D taken from cos
    kv_shape = op.Concat(op.Constant(value_ints=[0, 0, -1]), op.Shape(cos, start=1), axis=0)
    k = op.Reshape(op.MatMul(x, op.Transpose(k_weight, perm=[0, 2, 1])), kv_shape)
    v = op.Reshape(op.MatMul(x, op.Transpose(v_weight, perm=[0, 2, 1])), kv_shape)
    # Per-head key norm (DFlash / Qwen3) where k_norm_weight is [L, D]; EAGLE-3 passes [L, 0] and keeps k as is.
    # Branch-free (an If would make onnxruntime infer shapes of the dead branch): pad the weight with ones to
    # [L, D] either way, normalise, then select.
    head_dim = op.Shape(cos, start=1)
    ones = op.Expand(op.CastLike(op.Constant(value_float=1.0), k), op.Concat(op.Shape(k_norm_weight, end=1),
                                                                             head_dim, axis=0))
    weight = op.Slice(op.Concat(k_norm_weight, ones, axis=-1), op.Constant(value_ints=[0]), head_dim,
                      op.Constant(value_ints=[-1]))
    normed = _rms(k, op.Unsqueeze(weight, op.Constant(value_ints=[1, 2])), eps)
    k_normed = op.Where(op.Size(k_norm_weight) > op.Constant(value_int=0), normed, k)
    axes = op.Constant(value_ints=[0, 2])
    c, s = op.Unsqueeze(cos, axes), op.Unsqueeze(sin, axes)                # [1, T, 1, D]
    first, second = op.Split(k_normed, num_outputs=2, axis=-1)
    rotated = op.Concat(op.Neg(second), first, axis=-1)
    k_out = k_normed * c + rotated * s
    return k_out, v


def function_protos() -> list[onnx.FunctionProto]:
    """The plugin's function and the helpers it calls, to put into a model's `functions`."""
    return [_rms.to_function_proto(), WhiflashKVOnlyPrefill.to_function_proto()]


# ----- torch.onnx translation: the custom op becomes the single plugin node -----------------------------------------
def translate_kv_only_prefill(feats, fc_weight, hidden_norm_weight, embeds, input_norm_weight, k_weight, v_weight,
                              k_norm_weight, cos, sin, eps: float):
    return plugin_opset.WhiflashKVOnlyPrefill(
        feats, fc_weight, hidden_norm_weight, embeds, input_norm_weight, k_weight, v_weight, k_norm_weight, cos,
        sin, eps=eps, plugin_version=PLUGIN_VERSION, plugin_namespace=PLUGIN_NAMESPACE, _num_outputs=2)


def custom_translation_table() -> dict:
    import torch

    import whiflash_trt.plugins.kv_prefill  # noqa: F401  (registers torch.ops.whiflash.kv_only_prefill)
    return {torch.ops.whiflash.kv_only_prefill.default: translate_kv_only_prefill}


def attach_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give a model holding plugin nodes the reference function body and the domains it needs (in place)."""
    present = {(f.domain, f.name) for f in model.functions}
    for fn in function_protos():
        if (fn.domain, fn.name) not in present:
            model.functions.append(fn)
    domains = {o.domain for o in model.opset_import}
    for fn in function_protos():
        if fn.domain not in domains:
            model.opset_import.append(onnx.helper.make_opsetid(fn.domain, DOMAIN_VERSION))
            domains.add(fn.domain)
    return model


def plugin_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == PLUGIN_DOMAIN and n.op_type == PLUGIN_NAME]
