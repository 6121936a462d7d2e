"""Devices and threads: checked before anything is loaded, so a bad value is one clear line, not a traceback."""
from __future__ import annotations

import os
import platform

import torch

from whiflash_trt import kernels
from whiflash_trt.errors import SpecError, WhiflashError, literal


def check_device(name: str) -> torch.device:
    """`cpu`, `cuda` or `cuda:N`, where this torch build and machine can run it."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise WhiflashError(f"unknown device {name!r}; expected cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise WhiflashError(f"device {name!r} is not supported; expected cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        build = "has no CUDA support" if torch.version.cuda is None else "finds no CUDA GPU on this machine"
        raise SpecError(("device",), f"{{device}} {literal(name)}: this torch ({torch.__version__}) {build}; "
                                     f"use {{device}} cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise SpecError(("device",), f"{{device}} {literal(name)}: only {torch.cuda.device_count()} CUDA device(s) "
                                     f"are visible")
    return device


def default_threads() -> int:
    """Half the CPUs this process may use, at least one. torch's own default (every core) collapses as soon as
    another job takes a core: its threads spin waiting for each other (docs/benchmark.md, "Threads on a shared
    machine")."""
    return max(1, len(os.sched_getaffinity(0)) // 2)


def set_threads(n: int) -> None:
    if n < 1:
        raise SpecError(("threads",), f"{{threads}} must be >= 1, got {n}")
    torch.set_num_threads(n)


def cpu_model() -> str:
    """The CPU's model name with its family and model numbers (from /proc/cpuinfo where there is one): names such
    as "AMD EPYC" cover several generations."""
    name = kernels.cpuinfo("model name")
    if name:
        return f"{name} (family {kernels.cpuinfo('cpu family') or '?'}, model {kernels.cpuinfo('model') or '?'})"
    return platform.processor() or "unknown"
