"""The exported graphs: valid ONNX, listed in the manifest, KV-only prefill as one plugin node with its function."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")  # the exporter

from whiflash_trt.plugins import onnx_plugin  # noqa: E402
from whiflash_trt.plugins.kv_prefill import (PLUGIN_DOMAIN, PLUGIN_NAME, PLUGIN_NAMESPACE,  # noqa: E402
                                             PLUGIN_VERSION, kv_only_prefill_reference)

EXPECTED = {"target_step", "target_embed", "target_lm_head", "eagle3_fc", "eagle3_step", "eagle3_head",
            "eagle3_kv_prefill", "dflash_block", "dflash_kv_prefill"}


@pytest.fixture(scope="module")
def onnx_section(onnx_engine_dirs):
    _, onnx_dir = onnx_engine_dirs
    return onnx_dir, json.loads((onnx_dir / "manifest.json").read_text())["onnx"]


def test_engine_holds_every_graph_the_runtime_needs(onnx_section):
    engine, section = onnx_section
    assert set(section["graphs"]) == EXPECTED
    assert section["capture_layers"] == [1, 3, 4, 5]   # union of EAGLE-3 (1, 3, 4) and DFlash (1, 5)
    for graph in section["graphs"].values():
        assert (engine / graph["path"]).is_file()


def test_every_exported_graph_passes_the_onnx_checker(onnx_section):
    engine, section = onnx_section
    for graph in section["graphs"].values():
        onnx.checker.check_model(str(engine / graph["path"]), full_check=True)


def test_manifest_signatures_match_the_graphs_with_dynamic_dims(onnx_section):
    engine, section = onnx_section
    for name, graph in section["graphs"].items():
        model = onnx.load(str(engine / graph["path"]), load_external_data=False)
        assert [i["name"] for i in graph["inputs"]] == [i.name for i in model.graph.input], name
        assert [o["name"] for o in graph["outputs"]] == [o.name for o in model.graph.output], name
    step = {i["name"]: i for i in section["graphs"]["target_step"]["inputs"]}
    assert step["input_ids"]["shape"] == ["T"] and step["read_slots"]["shape"] == ["S"]
    assert step["attn_mask"] == {"name": "attn_mask", "dtype": "bool", "shape": ["T", "S"]}
    assert step["k_cache"]["shape"] == [8, "NS", 2, 16]
    outputs = [o["name"] for o in section["graphs"]["target_step"]["outputs"]]
    assert outputs == ["logits", "hidden", "captured", "k_new", "v_new"]


@pytest.mark.parametrize("name", ["eagle3_kv_prefill", "dflash_kv_prefill"])
def test_kv_prefill_is_one_plugin_node_with_attributes_and_function_body(onnx_section, name):
    engine, section = onnx_section
    model = onnx.load(str(engine / section["graphs"][name]["path"]))
    nodes = onnx_plugin.plugin_nodes(model)
    assert len(nodes) == 1
    node = nodes[0]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["plugin_version"] == PLUGIN_VERSION.encode()
    assert attrs["plugin_namespace"] == PLUGIN_NAMESPACE.encode()
    assert attrs["eps"] == pytest.approx(1e-6)
    assert len(node.input) == 10 and len(node.output) == 2
    functions = {(f.domain, f.name): f for f in model.functions}
    body = functions[(PLUGIN_DOMAIN, PLUGIN_NAME)]
    assert {"MatMul", "Reshape", "Where", "Concat"} <= {n.op_type for n in body.node}
    assert PLUGIN_DOMAIN in {o.domain for o in model.opset_import}
    assert onnx.defs.has(PLUGIN_NAME, PLUGIN_DOMAIN)   # the OpSchema is registered


def test_only_the_prefill_graphs_hold_the_plugin_node(onnx_section):
    _, section = onnx_section
    assert {n for n, g in section["graphs"].items() if g["plugin_nodes"]} == {"eagle3_kv_prefill",
                                                                                "dflash_kv_prefill"}


def _plugin_model(args: list[torch.Tensor], eps: float) -> onnx.ModelProto:
    """A graph that is just the plugin node, to run its function body against the torch reference."""
    h = onnx.helper
    inputs = [h.make_tensor_value_info(n, onnx.TensorProto.FLOAT, list(a.shape))
              for n, a in zip(onnx_plugin._INPUTS, args)]
    node = h.make_node(PLUGIN_NAME, list(onnx_plugin._INPUTS), ["k", "v"], domain=PLUGIN_DOMAIN, eps=eps,
                       plugin_version=PLUGIN_VERSION, plugin_namespace=PLUGIN_NAMESPACE)
    outputs = [h.make_tensor_value_info(n, onnx.TensorProto.FLOAT, ["L", "T", "KV", "D"]) for n in ("k", "v")]
    model = h.make_model(h.make_graph([node], "plugin", inputs, outputs),
                         opset_imports=[h.make_opsetid("", onnx_plugin.OPSET)])
    return onnx_plugin.attach_functions(model)


@pytest.mark.parametrize("variant", ["eagle3", "dflash"])
def test_plugin_function_body_equals_the_torch_reference(variant):
    g = torch.Generator().manual_seed(0)
    t, h, f, layers, kv, d = 5, 8, 24, (1 if variant == "eagle3" else 3), 2, 4
    din = 2 * h if variant == "eagle3" else h
    args = [torch.randn(t, f, generator=g), torch.randn(h, f, generator=g), torch.randn(h, generator=g),
            torch.randn(t, h, generator=g) if variant == "eagle3" else torch.empty(t, 0),
            torch.randn(h, generator=g) if variant == "eagle3" else torch.empty(0),
            torch.randn(layers, kv * d, din, generator=g), torch.randn(layers, kv * d, din, generator=g),
            torch.empty(layers, 0) if variant == "eagle3" else torch.randn(layers, d, generator=g),
            torch.randn(t, d, generator=g), torch.randn(t, d, generator=g)]
    model = _plugin_model(args, 1e-5)
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    k, v = session.run(None, {n: a.numpy() for n, a in zip(onnx_plugin._INPUTS, args)})
    k_ref, v_ref = kv_only_prefill_reference(*args, 1e-5)
    assert k.shape == (layers, t, kv, d)
    assert np.abs(k - k_ref.numpy()).max() <= 1e-5
    assert np.abs(v - v_ref.numpy()).max() <= 1e-5
