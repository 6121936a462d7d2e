"""The compiler driver of the kernels: one library per build (an ISA's flags over the same sources), compiled once
per version into a cache folder, and checked before it is loaded.

A build lives in cache_dir/<version>/: the library (LIBRARY) and its sha256 (LIBRARY + ".sha256"), each written to a
temporary name in that folder and then renamed, so that a process killed mid-write leaves no half library under the
real name; a library whose bytes do not match its sha256 is rebuilt. Each process compiles in a build folder of its
own (torch's cpp_extension lock sits there), so a stale lock left by a killed build never blocks a later one.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import uuid
from pathlib import Path

import torch

from whiflash_trt.kernels import cpu

HERE = Path(__file__).parent
COMMON_SOURCES = ("linear_bf16.cpp", "linear_fp32.cpp", "paged_attention.cpp", "logits.cpp", "kv_prefill.cpp")
HEADERS = ("simd.h", "gemm_blocks.h", "ggml_gemm.h", "amx.h", "attention.h", "rows.h", "aoti_shim.h")
DEFAULT_CACHE = Path.home() / ".cache" / "whiflash-trt" / "kernels"
LIBRARY = "whiflash_kernels.so"
# -ffp-contract=off: a product and a sum written apart are rounded apart, as torch's ops round them (simd.h)
COMMON_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
BUILD_FLAGS = {   # the builds, lowest first; AMX only in the "amx" loop and the attention's AMX path
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": AVX512,
    "avx512bf16": AVX512 + ["-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16"],
}
BUILD_OF_ISA = {"avx2": "avx2", "avx512": "avx512", "avx512bf16": "avx512bf16", "amx": "avx512bf16"}
MARKER = b"whiflash-kernels-build="   # linear_bf16.cpp kBuildMarker: the build a library file was compiled as


class KernelBuildError(RuntimeError):
    pass


def sources(build: str) -> list[Path]:
    return [HERE / name for name in COMMON_SOURCES + (("attention_amx.cpp",) if build == "avx512bf16" else ())]


def flags(build: str) -> list[str]:
    return COMMON_FLAGS + BUILD_FLAGS[build]


def build_for(isa: str | None = None) -> str:
    """The build that runs `isa` (default: this process's, cpu.isa())."""
    isa = isa or cpu.isa()
    if isa is None:
        raise KernelBuildError("this CPU lacks AVX2 and FMA (the kernels' lowest instruction set)")
    return BUILD_OF_ISA[isa]


def version(isa: str | None = None) -> str:
    """Identifies a compiled library: its build's sources and flags and the torch it was built against."""
    build = build_for(isa)
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources(build) + [HERE / h for h in HEADERS])
                            + " ".join(flags(build)).encode() + torch.__version__.encode())
    return f"{build}-{digest.hexdigest()[:12]}"


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_atomically(path: Path, data: bytes) -> None:
    """data into path through a temporary name in its folder and a rename (readers see the old file or the new)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def library_build(library: Path) -> str | None:
    """The build a library file says it was compiled as (its marker), None where it has none."""
    data = library.read_bytes()
    at = data.find(MARKER)
    if at < 0:
        return None
    return data[at + len(MARKER):].split(b"\0", 1)[0].decode(errors="replace")


def intact(library: Path) -> bool:
    """The library's bytes match the sha256 recorded beside it (no record: not intact)."""
    record = library.with_name(library.name + ".sha256")
    try:
        return record.read_text().strip() == sha256_of(library)
    except OSError:
        return False


def unbuildable_reason() -> str | None:
    """Why this process cannot build and load its ISA's library here (None: it can)."""
    if cpu.isa() is None:
        return "this CPU lacks AVX2 and FMA (the kernels' lowest instruction set)"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (install g++, e.g. apt-get install g++)"
    return None


def can_build() -> bool:
    """This process can build its ISA's library here and load it (the CPU runs an ISA, a C++ compiler is found)."""
    return unbuildable_reason() is None


def compile_library(cache_dir: Path, isa: str | None = None) -> Path:
    """The kernel library of `isa` (default: this process's) for this source and torch, compiled into
    cache_dir/<version>/ unless an intact one is there (~1-2 min on 2 cores). The build loads it into this process
    (torch's cpp_extension), so compile another ISA's only in a process that runs that ISA. Raises KernelBuildError
    with the reason when it cannot be built here."""
    build = build_for(isa)
    out = Path(cache_dir) / version(isa)
    library = out / LIBRARY
    if library.is_file():
        if intact(library):
            return library
        print(f"whiflash: the cached kernel library {library} does not match its sha256; rebuilding it",
              file=sys.stderr)
    reason = unbuildable_reason()
    if reason is not None:
        raise KernelBuildError(reason)
    from torch.utils import cpp_extension

    work = out / f"build-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load("whiflash_kernels", [str(p) for p in sources(build)], extra_cflags=flags(build),
                           build_directory=str(work), is_python_module=False, verbose=False)
        data = (work / LIBRARY).read_bytes()
    except (RuntimeError, OSError, ImportError) as e:  # compiler errors, missing ninja
        raise KernelBuildError(f"compiling the kernels failed: {e}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)   # the loaded library stays mapped
    write_atomically(library, data)
    write_atomically(library.with_name(LIBRARY + ".sha256"), hashlib.sha256(data).hexdigest().encode())
    return library
