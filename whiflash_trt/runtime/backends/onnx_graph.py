"""One exported graph run by an onnxruntime session (CPU provider).

Inputs go in as numpy views of the torch tensors (no copy: onnxruntime reads CPU numpy buffers in place, which
matters for the KV pools), outputs come back as torch tensors sharing onnxruntime's buffers.
"""
from __future__ import annotations

from pathlib import Path

import torch

from whiflash_trt.errors import WhiflashError

INSTALL_HINT = "pip install onnxruntime (or pip install 'whiflash-trt[onnx]')"


def import_onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise WhiflashError(f"the onnx backend needs onnxruntime, which is not installed: {INSTALL_HINT}") from None
    return onnxruntime


class OnnxGraph:
    def __init__(self, path: Path) -> None:
        ort = import_onnxruntime()
        options = ort.SessionOptions()
        options.log_severity_level = 3
        # One knob for both backends: onnxruntime uses as many threads as torch is set to (torch.set_num_threads).
        options.intra_op_num_threads = torch.get_num_threads()
        # No busy-waiting between runs: the round loop runs torch ops between graph calls, and spinning
        # onnxruntime threads would compete with torch's for the same cores.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.name = Path(path).stem

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(tensors) != len(self.inputs):
            raise ValueError(f"graph {self.name} takes {len(self.inputs)} inputs ({', '.join(self.inputs)}), "
                             f"got {len(tensors)}")
        feeds = {}
        for name, t in zip(self.inputs, tensors):
            if t.device.type != "cpu":
                raise WhiflashError(f"the onnx backend runs on CPU; input {name} of {self.name} is on {t.device}")
            feeds[name] = t.detach().contiguous().numpy()
        return tuple(torch.from_numpy(o) for o in self.session.run(None, feeds))
