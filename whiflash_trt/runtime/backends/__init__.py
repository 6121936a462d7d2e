"""Execution backends: "torch" (the modules themselves), "compiled" (the target step as an AOTInductor package over
the engine's kernels, compiled.py), "onnx" (onnxruntime sessions over the exported graphs), "tensorrt" (serialized
TensorRT engines built from those graphs). Each implements the torch modules' contracts (models.contracts), so the
round loop and the proposers are the same for all."""
from __future__ import annotations

from pathlib import Path

from whiflash_trt.config import GRAPH_BACKENDS, parse_dtype
from whiflash_trt.errors import CheckpointError, SpecError, literal
from whiflash_trt.manifest import Manifest


def engine_backend(manifest: Manifest) -> str:
    return manifest.build_options.get("backend", "torch")


def _graph_section(manifest: Manifest, backend: str, engine_dir: Path) -> dict:
    section = manifest.onnx if backend == "onnx" else manifest.tensorrt
    if not section.get("graphs"):
        raise SpecError(("backend",), f"engine {literal(engine_dir)} has no {backend} graphs; rebuild it with "
                                      f"whiflash-build {{backend}} {backend}")
    return section


def load_graph_models(engine_dir: Path, manifest: Manifest, backend: str, device: str):
    """(target, eagle3 or None, dflash or None) running the engine's `backend` graphs."""
    from whiflash_trt.models.drafter_checkpoints import load_dflash, load_eagle3
    from whiflash_trt.runtime.backends.graph_models import GraphDFlash, GraphEagle3, GraphTarget

    if backend not in GRAPH_BACKENDS:
        raise ValueError(f"unknown graph backend {backend!r}; expected one of {', '.join(GRAPH_BACKENDS)}")
    section = _graph_section(manifest, backend, engine_dir)
    if backend == "onnx" and str(device) != "cpu":
        raise SpecError(("device",), f"the onnx backend runs onnxruntime's CPU provider; use {{device}} cpu, "
                                     f"not {literal(device)}")
    missing = [info["path"] for info in section["graphs"].values() if not (engine_dir / info["path"]).is_file()]
    if missing:
        raise CheckpointError(f"engine {engine_dir} is incomplete: {', '.join(missing)} missing")
    graphs = {name: _open_graph(backend, engine_dir / info["path"], info) for name, info in section["graphs"].items()}
    dtype = parse_dtype(manifest.dtype)
    target = GraphTarget(manifest.model, graphs, tuple(section["capture_layers"]), dtype)
    # The drafters' configs and their small non-graph tensors (d2t map, DFlash mask row) come from the checkpoints
    # the engine carries anyway; their weights are not used here.
    parts = manifest.components
    eagle3 = dflash = None
    if "eagle3" in parts:
        torch_eagle3 = load_eagle3(engine_dir / parts["eagle3"]["path"], manifest.model)
        eagle3 = GraphEagle3(torch_eagle3.config, graphs, torch_eagle3.d2t.to(device))
    if "dflash" in parts:
        torch_dflash = load_dflash(engine_dir / parts["dflash"]["path"], manifest.model)
        mask = torch_dflash.mask_embedding
        dflash = GraphDFlash(torch_dflash.config, graphs, None if mask is None else mask.detach().to(device, dtype))
    return target, eagle3, dflash


def _open_graph(backend: str, path: Path, info: dict):
    if backend == "onnx":
        from whiflash_trt.runtime.backends.onnx_graph import OnnxGraph
        return OnnxGraph(path)
    from whiflash_trt.runtime.backends.tensorrt_graph import TensorRTGraph
    return TensorRTGraph(path, [i["name"] for i in info["inputs"]], [o["name"] for o in info["outputs"]])
