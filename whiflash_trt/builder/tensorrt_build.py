"""Serialized TensorRT engines from the exported ONNX graphs (`whiflash-build --backend tensorrt`).

One engine per graph, parsed from ENGINE/onnx/*.onnx, built strongly typed (the precision is the graphs' own, i.e.
the engine --dtype: fp32, fp16 or bf16), with one optimization profile spanning the shapes the runtime uses:
T, R in [1, context], S in [1, context + scratch], NS (pool slots) in [block_size, MAX_POOL_SLOTS]. The KV-only
prefill node is mapped to the Python plugin of plugins.tensorrt_plugin.

tensorrt is imported lazily (it comes from NVIDIA's own package index, so a missing install fails at the start of
the build with a message naming it). The calls are those of the TensorRT 10 Python API.
"""
from __future__ import annotations

import time
from pathlib import Path

from whiflash_trt.errors import WhiflashError
from whiflash_trt.plugins.tensorrt_plugin import import_tensorrt

MAX_POOL_SLOTS = 1 << 22     # profile bound of the KV pool dimension NS (slots of all blocks)
TREE_SCRATCH = 256           # room past the context for EAGLE-3 tree scratch slots in S


def profile_dims(context: int, block_size: int) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) of every dynamic dimension name used by the exported graphs."""
    return {"T": (1, 16, context), "R": (1, 16, context), "S": (1, min(1024, context), context + TREE_SCRATCH),
            "NS": (block_size, 1 << 14, MAX_POOL_SLOTS)}


def _shapes(shape: list, dims: dict) -> tuple[tuple, tuple, tuple] | None:
    if all(isinstance(d, int) for d in shape):
        return None
    return tuple(tuple(dims[d][i] if isinstance(d, str) else d for d in shape) for i in range(3))


def build_graph_engine(trt, onnx_path: Path, inputs: list[dict], dims: dict, logger) -> bytes:
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise WhiflashError(f"TensorRT cannot parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for inp in inputs:
        shapes = _shapes(inp["shape"], dims)
        if shapes is not None:
            profile.set_shape(inp["name"], *shapes)
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise WhiflashError(f"TensorRT failed to build an engine from {onnx_path} (see its log above)")
    return bytes(plan)


def build_tensorrt_engines(engine_dir: Path, onnx_section: dict, context: int, block_size: int,
                           show_progress: bool = True) -> dict:
    """Build ENGINE/tensorrt/<graph>.plan for every graph; returns the manifest's "tensorrt" section."""
    from whiflash_trt.manifest import TENSORRT_DIR
    from whiflash_trt.plugins.tensorrt_plugin import register_plugin

    trt = import_tensorrt()
    register_plugin()
    logger = trt.Logger(trt.Logger.WARNING)
    dims = profile_dims(context, block_size)
    folder = engine_dir / TENSORRT_DIR
    folder.mkdir()
    start = time.perf_counter()
    graphs = {}
    for name, graph in onnx_section["graphs"].items():
        if show_progress:
            print(f"building TensorRT engine {name}", flush=True)
        (folder / f"{name}.plan").write_bytes(
            build_graph_engine(trt, engine_dir / graph["path"], graph["inputs"], dims, logger))
        graphs[name] = {"path": f"{TENSORRT_DIR}/{name}.plan", "inputs": graph["inputs"],
                        "outputs": graph["outputs"]}
    return {"graphs": graphs, "capture_layers": onnx_section["capture_layers"], "profile": dims,
            "tensorrt_version": trt.__version__, "build_seconds": round(time.perf_counter() - start, 2)}
