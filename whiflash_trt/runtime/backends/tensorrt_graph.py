"""One serialized TensorRT engine run on CUDA tensors (the tensorrt backend's graph; see graph_models).

Inputs are bound by address (no copies: the KV pools stay where they are), outputs are allocated per call at the
shapes TensorRT infers from the inputs. Written against the TensorRT 10 Python API; not run here (no TensorRT).
"""
from __future__ import annotations

from pathlib import Path

import torch

from whiflash_trt.errors import WhiflashError


class TensorRTGraph:
    def __init__(self, path: Path, inputs: list[str], outputs: list[str]) -> None:
        from whiflash_trt.plugins.tensorrt_plugin import import_tensorrt
        from whiflash_trt.plugins.tensorrt_plugin import register_plugin

        trt = import_tensorrt()
        register_plugin()   # the KV-only prefill plugin's implementation must be registered to deserialize
        self.engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(Path(path).read_bytes())
        if self.engine is None:
            raise WhiflashError(f"cannot deserialize TensorRT engine {path} (built by another TensorRT version?)")
        self.context = self.engine.create_execution_context()
        self.inputs, self.outputs, self.name = inputs, outputs, Path(path).stem
        self._dtypes = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
                        trt.int64: torch.int64, trt.int32: torch.int32, trt.bool: torch.bool}

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(tensors) != len(self.inputs):
            raise ValueError(f"engine {self.name} takes {len(self.inputs)} inputs, got {len(tensors)}")
        keep = []
        for name, t in zip(self.inputs, tensors):
            if t.device.type != "cuda":
                raise WhiflashError(f"the tensorrt backend runs on CUDA; input {name} of {self.name} is on {t.device}")
            t = t.contiguous()
            keep.append(t)
            self.context.set_input_shape(name, tuple(t.shape))
            self.context.set_tensor_address(name, t.data_ptr())
        outs = []
        for name in self.outputs:
            dtype = self._dtypes[self.engine.get_tensor_dtype(name)]
            out = torch.empty(tuple(self.context.get_tensor_shape(name)), dtype=dtype, device=tensors[0].device)
            self.context.set_tensor_address(name, out.data_ptr())
            outs.append(out)
        if not self.context.execute_async_v3(torch.cuda.current_stream().cuda_stream):
            raise WhiflashError(f"TensorRT engine {self.name} failed to execute")
        return tuple(outs)
