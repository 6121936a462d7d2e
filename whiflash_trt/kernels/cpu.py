"""What this CPU runs, read from /proc/cpuinfo before anything is compiled or loaded: the instruction sets (ISAs)
the kernels are built for, lowest first, and the one this process uses (the best the CPU has, or $WHIFLASH_ISA
where set: a lower one, for tests and comparisons)."""
from __future__ import annotations

import functools
import os
from pathlib import Path

# Each ISA and the /proc/cpuinfo flags it needs (each needs those of the ones before it too)
ISA_FLAGS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512bf16": ("avx512_bf16", "avx512_vnni"),   # every CPU with BF16 so far has VNNI
    "amx": ("amx_tile", "amx_bf16"),
}
ISAS = tuple(ISA_FLAGS)
ISA_ENV = "WHIFLASH_ISA"


@functools.cache
def _cpuinfo_fields() -> dict[str, str]:
    """The first CPU's fields of /proc/cpuinfo, read once per process ({} where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpuinfo(field: str) -> str:
    """The first `field` line of /proc/cpuinfo ("model name", "flags", ...; '' where there is none)."""
    return _cpuinfo_fields().get(field, "")


def cpu_isas() -> tuple[str, ...]:
    """The ISAs this CPU runs, lowest first (none off x86 or without AVX2 and FMA)."""
    flags = set(cpuinfo("flags").split())
    have = []
    for isa in ISAS:
        if not all(f in flags for f in ISA_FLAGS[isa]):
            break
        have.append(isa)
    return tuple(have)


def isa() -> str | None:
    """The ISA this process's kernels are built and run for: $WHIFLASH_ISA where set, else the best this CPU has;
    None where it has none. A forced ISA above what the CPU has, or not one of ISAS, is a ValueError."""
    have = cpu_isas()
    forced = os.environ.get(ISA_ENV)
    if forced:
        if forced not in ISAS:
            raise ValueError(f"{ISA_ENV} must be one of {ISAS}, got {forced!r}")
        if forced not in have:
            raise ValueError(f"{ISA_ENV}={forced} but this CPU runs only {have or 'none of them'}")
        return forced
    return have[-1] if have else None


def cpu_supported() -> bool:
    """The CPU runs the kernels in some ISA (read from /proc/cpuinfo; other systems: no)."""
    return isa() is not None
