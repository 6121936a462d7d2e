"""Export the engines the runtime needs to ONNX graphs (the artifact TensorRT's parser and onnxruntime consume).

An exported graph cannot mutate its inputs, so the steps that write a paged pool in torch (target step, EAGLE-3 draft
step) are thin wrappers over the models' own forward with models.attention.GraphKeys, which reads the pool at
read_slots as torch would see it *after* the step's own writes and keeps the new K/V for the caller to scatter.
KV-only prefill exports as the single `trt.plugins::WhiflashKVOnlyPrefill` node (whiflash_trt.plugins.onnx_plugin).

Graphs, inputs -> outputs (T new tokens, S keys read, NS pool slots, R logits rows; all dynamic; B static):
    target_step        input_ids[T] positions[T] k_cache,v_cache[L,NS,KV,D] write_slots[T] read_slots[S]
                       attn_mask[T,S] logits_indices[R]
                       -> logits[R,V] hidden[R,H] (captured[T,C*H] when drafters need features) k_new,v_new[L,T,KV,D]
    target_embed       input_ids[T] -> embeds[T,H]
    target_lm_head     hidden[T,H] -> logits[T,V]
    eagle3_fc          feats[T,3H] -> hidden[T,H]
    eagle3_step        embeds[T,H] hidden[T,H] positions[T] k_cache,v_cache[1,NS,KV,D] write_slots[T] read_slots[S]
                       attn_mask[T,S] -> out_hidden[T,H] k_new,v_new[1,T,KV,D]
    eagle3_head        out_hidden[T,H] -> logprobs[T,Vd] (fp32)
    eagle3_kv_prefill  feats[T,3H] embeds[T,H] positions[T] -> k,v[1,T,KV,D]
    dflash_block       block_embeds[B,H] positions[B] k_cache,v_cache[Ld,NS,KV,D] read_slots[S] -> hidden[B,H]
    dflash_kv_prefill  feats[T,n*H] positions[T] -> k,v[Ld,T,KV,D]
"""
from __future__ import annotations

import contextlib
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from whiflash_trt.models.attention import AttentionContext, GraphKeys
from whiflash_trt.models.dflash import DFlashDrafter
from whiflash_trt.models.eagle3 import Eagle3Drafter
from whiflash_trt.models.target import TargetModel

_DIM_NAMES = ("T", "S", "NS", "R")


class TargetStep(nn.Module):
    """TargetModel.run over GraphKeys: the same layers, the pools read through the overlay instead of
    written; returns every layer's new K/V."""

    def __init__(self, target: TargetModel, capture_layers: tuple[int, ...]) -> None:
        super().__init__()
        self.target, self.capture_layers = target, capture_layers

    def forward(self, input_ids, positions, k_cache, v_cache, write_slots, read_slots, attn_mask, logits_indices):
        m, keys = self.target, GraphKeys.overlay(k_cache, v_cache, write_slots, read_slots, attn_mask)
        ctx = AttentionContext.at(m.rotary, positions, m.dtype, write_slots, keys, k_cache, v_cache)
        out = m.run(input_ids, ctx, self.capture_layers, logits_indices)
        feats = (out.captured,) if self.capture_layers else ()
        return (out.logits, out.hidden, *feats, torch.stack(keys.k_new), torch.stack(keys.v_new))


class Eagle3Step(nn.Module):
    """Eagle3Drafter.run over GraphKeys (see TargetStep); returns the new K/V [1, T, KV, D]."""

    def __init__(self, drafter: Eagle3Drafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, embeds, hidden, positions, k_cache, v_cache, write_slots, read_slots, attn_mask):
        keys = GraphKeys.overlay(k_cache, v_cache, write_slots, read_slots, attn_mask)
        ctx = AttentionContext.at(self.drafter.rotary, positions, hidden.dtype, write_slots, keys, k_cache, v_cache)
        out = self.drafter.run(embeds, hidden, ctx)
        return out, keys.k_new[0][None], keys.v_new[0][None]


class DFlashBlock(nn.Module):
    """DFlashDrafter.forward (it never writes the pool) on the context gathered once for all layers."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, block_embeds, positions, k_cache, v_cache, read_slots):
        k, v = k_cache.index_select(1, read_slots), v_cache.index_select(1, read_slots)
        return self.drafter(block_embeds, positions, k, v, torch.arange(read_slots.shape[0]))


class _Call(nn.Module):
    """One method of a module as a graph (embedding, heads, fc, KV-only prefill); its inputs are one *args tuple."""

    def __init__(self, module: nn.Module, method: str) -> None:
        super().__init__()
        self.module, self.method = module, method

    def forward(self, *args):
        fn = getattr(self.module, self.method)
        return fn(*args)


@dataclass
class GraphSpec:
    name: str
    module: nn.Module
    args: tuple                 # sample inputs (sizes chosen distinct so no dimension is specialised)
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    dynamic: tuple[dict, ...]   # per input: {axis: dim name}


def _dims(dynamic: tuple[dict, ...]) -> tuple[dict, ...]:
    dims = {n: torch.export.Dim(n) for n in _DIM_NAMES}
    return tuple({axis: dims[name] for axis, name in d.items()} or None for d in dynamic)


def _pool_sample(num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_layers, 32, num_kv_heads, head_dim)
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)


def _step_sample(t: int = 3, past: int = 4):
    """write_slots, read_slots (past + the written ones), positions and a causal mask for a chain step."""
    write = torch.arange(20, 20 + t)
    read = torch.cat([torch.arange(2, 2 + past), write])
    mask = torch.ones(t, past + t, dtype=torch.bool)
    mask[:, past:] = torch.ones(t, t, dtype=torch.bool).tril()
    return write, read, torch.arange(past, past + t), mask


def target_specs(target: TargetModel, capture_layers: tuple[int, ...], with_heads: bool) -> list[GraphSpec]:
    cfg, dtype = target.config, target.embed_tokens.weight.dtype
    write, read, positions, mask = _step_sample()
    ids = torch.tensor([1, 2, 3])
    k, v = _pool_sample(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)
    outputs = ("logits", "hidden") + (("captured",) if capture_layers else ()) + ("k_new", "v_new")
    specs = [GraphSpec("target_step", TargetStep(target, capture_layers),
                       (ids, positions, k, v, write, read, mask, torch.tensor([0, 2])),
                       ("input_ids", "positions", "k_cache", "v_cache", "write_slots", "read_slots", "attn_mask",
                        "logits_indices"), outputs,
                       ({0: "T"}, {0: "T"}, {1: "NS"}, {1: "NS"}, {0: "T"}, {0: "S"}, {0: "T", 1: "S"}, {0: "R"}))]
    if with_heads:  # the drafters embed with the target's table; DFlash drafts through its lm_head
        hidden = torch.randn(3, cfg.hidden_size).to(dtype)
        specs += [GraphSpec("target_embed", _Call(target.embed_tokens, "forward"), (ids,), ("input_ids",),
                            ("embeds",), ({0: "T"},)),
                  GraphSpec("target_lm_head", _Call(target.lm_head, "forward"), (hidden,), ("hidden",),
                            ("logits",), ({0: "T"},))]
    return specs


def eagle3_specs(drafter: Eagle3Drafter) -> list[GraphSpec]:
    c = drafter.config
    dtype = drafter.fc.weight.dtype
    write, read, positions, mask = _step_sample()
    feats = torch.randn(3, 3 * c.target_hidden_size).to(dtype)
    embeds, hidden = torch.randn(3, c.hidden_size).to(dtype), torch.randn(3, c.hidden_size).to(dtype)
    k, v = _pool_sample(1, c.num_kv_heads, c.head_dim, dtype)
    t = ({0: "T"},)
    return [
        GraphSpec("eagle3_fc", _Call(drafter.fc, "forward"), (feats,), ("feats",), ("hidden",), t),
        GraphSpec("eagle3_step", Eagle3Step(drafter), (embeds, hidden, positions, k, v, write, read, mask),
                  ("embeds", "hidden", "positions", "k_cache", "v_cache", "write_slots", "read_slots", "attn_mask"),
                  ("out_hidden", "k_new", "v_new"),
                  ({0: "T"}, {0: "T"}, {0: "T"}, {1: "NS"}, {1: "NS"}, {0: "T"}, {0: "S"}, {0: "T", 1: "S"})),
        GraphSpec("eagle3_head", _Call(drafter, "draft_logprobs"), (hidden,), ("out_hidden",), ("logprobs",), t),
        GraphSpec("eagle3_kv_prefill", _Call(drafter, "kv_only"), (feats, embeds, positions),
                  ("feats", "embeds", "positions"), ("k", "v"), t * 3),
    ]


def dflash_specs(drafter: DFlashDrafter) -> list[GraphSpec]:
    c = drafter.config
    dtype = drafter.fc.weight.dtype
    b = c.draft_block_len
    k, v = _pool_sample(c.num_layers, c.num_kv_heads, c.head_dim, dtype)
    feats = torch.randn(3, drafter.fc.in_features).to(dtype)
    return [
        GraphSpec("dflash_block", DFlashBlock(drafter),
                  (torch.randn(b, c.hidden_size).to(dtype), torch.arange(7, 7 + b), k, v, torch.arange(2, 9)),
                  ("block_embeds", "positions", "k_cache", "v_cache", "read_slots"), ("hidden",),
                  ({}, {}, {1: "NS"}, {1: "NS"}, {0: "S"})),
        GraphSpec("dflash_kv_prefill", _Call(drafter, "kv_only"), (feats, torch.arange(3)), ("feats", "positions"),
                  ("k", "v"), ({0: "T"}, {0: "T"})),
    ]


@contextlib.contextmanager
def _quiet_exporter():
    """Silence the exporter's progress lines, optional-op notices and tracing warnings."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def export_graph(spec: GraphSpec, folder: Path) -> dict:
    """Export one graph into folder/<name>.onnx (+ .onnx.data past 1.5 GB), check it, and describe it."""
    import onnx

    from whiflash_trt.plugins import onnx_plugin

    start = time.perf_counter()
    dims = _dims(spec.dynamic)
    with _quiet_exporter(), torch.inference_mode(False), torch.no_grad():
        program = torch.onnx.export(
            spec.module.eval(), spec.args, input_names=list(spec.inputs), output_names=list(spec.outputs),
            dynamic_shapes=(dims,) if isinstance(spec.module, _Call) else dims, dynamo=True,
            opset_version=onnx_plugin.OPSET, optimize=True, verbose=False,
            custom_translation_table=onnx_plugin.custom_translation_table())
    proto = program.model_proto
    if onnx_plugin.plugin_nodes(proto):
        onnx_plugin.attach_functions(proto)
    path = folder / f"{spec.name}.onnx"
    big = sum(len(t.raw_data) for t in proto.graph.initializer) > 1.5 * 2**30
    onnx.save_model(proto, str(path), save_as_external_data=big, all_tensors_to_one_file=True,
                    location=f"{spec.name}.onnx.data")
    onnx.checker.check_model(str(path), full_check=True)
    return {"path": path.name, "inputs": signature(proto.graph.input), "outputs": signature(proto.graph.output),
            "plugin_nodes": len(onnx_plugin.plugin_nodes(proto)),
            "export_seconds": round(time.perf_counter() - start, 2)}


def signature(values) -> list[dict]:
    import onnx

    return [{"name": v.name, "dtype": onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name
             if v.type.tensor_type.elem_type != onnx.TensorProto.BFLOAT16 else "bfloat16",
             "shape": [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]} for v in values]


def export_engine_graphs(target: TargetModel, eagle3: Eagle3Drafter | None, dflash: DFlashDrafter | None,
                         folder: Path, progress=None) -> dict:
    """Export every graph the runtime needs for these models into `folder`; returns the manifest's "onnx" section."""
    from whiflash_trt.plugins.kv_prefill import PLUGIN_DOMAIN, PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION
    from whiflash_trt.plugins.onnx_plugin import OPSET

    capture = tuple(sorted({i for m in (eagle3, dflash) if m is not None for i in m.config.capture_layers}))
    specs = target_specs(target, capture, with_heads=eagle3 is not None or dflash is not None)
    specs += eagle3_specs(eagle3) if eagle3 is not None else []
    specs += dflash_specs(dflash) if dflash is not None else []
    start = time.perf_counter()
    graphs = {}
    for spec in specs:
        if progress is not None:
            progress(spec.name)
        graphs[spec.name] = export_graph(spec, folder)
    return {"opset": OPSET, "capture_layers": list(capture), "graphs": graphs,
            "plugin": {"op_type": PLUGIN_NAME, "domain": PLUGIN_DOMAIN, "plugin_version": PLUGIN_VERSION,
                       "plugin_namespace": PLUGIN_NAMESPACE},
            "export_seconds": round(time.perf_counter() - start, 2)}
