"""The kernels' ops in this process: loading a compiled library (kernels/build.py) for this process's ISA
(kernels/cpu.py), the GEMM loop it runs (choose_gemm), the C shims and fake shapes a compiled step needs, and the
wrappers the models call (linear, linear_norm, paged_attention, ...).

The vocabulary reductions (entropy_margin, argmax_rows, topk_rows) work everywhere: each runs the engine's kernel on
a CPU tensor where the kernels are loaded, else its torch formulation. The other wrappers take weights packed for the
kernels (pack_weight, pack_int8, pack_gate_up) or run inside a model that chose the kernels when it was built."""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from whiflash_trt.kernels import build, cpu
from whiflash_trt.kernels.build import DEFAULT_CACHE, LIBRARY, KernelBuildError
from whiflash_trt.spec.router import entropy_and_margin

BLOCK = 64   # outputs per packed block (linear_bf16.cpp kBlock)

# linear_bf16.cpp's inner loops, in their index order there, each with the lowest ISA (cpu.ISAS) that runs it
GEMM_MIN_ISA = {"fma": "avx2", "dot": "avx512bf16", "amx": "amx"}
GEMM_VARIANTS = tuple(GEMM_MIN_ISA)
GEMM_ENV = "WHIFLASH_GEMM"       # forces one of them (tests, comparisons)


def loaded_isa() -> str | None:
    """The ISA of the kernels this process loaded (None before load)."""
    return _loaded_isa


def available_gemms() -> tuple[str, ...]:
    """The GEMM loops this process can run, by its ISA (cpu.isa()): "fma" on avx2 and avx512, "dot" too from
    avx512bf16, "amx" too on amx where the OS lets the process use it (Linux 5.16 and later grant it on request; the
    kernels must be loaded to ask)."""
    isa = _loaded_isa or cpu.isa()
    if isa is None:
        return ()
    rank = cpu.ISAS.index(isa)
    amx = isa == "amx" and registered() and torch.ops.whiflash.amx_usable()
    return tuple(v for v, needs in GEMM_MIN_ISA.items() if rank >= cpu.ISAS.index(needs) and (v != "amx" or amx))


def load(library: Path, cache_dir: Path | None = DEFAULT_CACHE) -> bool:
    """Registers the kernels from `library` unless they are registered already (a process holds one library) and
    gives the process its GEMM loop (choose_gemm, once); False where the library's build is not this process's ISA's
    (read from the file before it is loaded: a library of instructions the CPU lacks is never run)."""
    global _gemm_chosen, _loaded_isa
    isa = cpu.isa()
    if isa is None:
        return False
    built_as = build.library_build(Path(library))
    if built_as != build.BUILD_OF_ISA[isa]:
        report_unavailable(f"{library} is a build for {built_as or 'no known ISA'}, this process runs {isa}")
        return False
    if not registered():   # compile_library's build loads it too
        torch.ops.load_library(str(library))
    _loaded_isa = isa
    _global_symbols()
    _register_shapes()
    if not _gemm_chosen:
        set_gemm(choose_gemm(cache_dir))
        _gemm_chosen = True
    return True


_gemm_chosen = False
_loaded_isa: str | None = None


def _global_symbols() -> None:
    """The loaded library's symbols made global (it stays the one loaded: RTLD_NOLOAD), so that a compiled step
    finds the ops' C shims (c_shims) when its package is loaded."""
    for path in torch.ops.loaded_libraries:
        if Path(path).name == LIBRARY:
            ctypes.CDLL(path, mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD | os.RTLD_NOW)


def set_gemm(variant: str) -> str:
    """Every later linear_bf16 call of this process runs `variant` (GEMM_VARIANTS), and with "amx" every bf16
    paged_attention call of heads of a multiple of 64 dims its AMX path; returns the previous one. The loops and the
    paths may round differently in the last bit: switch only between generations, never inside one."""
    if variant not in available_gemms():
        raise ValueError(f"GEMM variant must be one of {available_gemms()} on this CPU, got {variant!r}")
    return GEMM_VARIANTS[torch.ops.whiflash.set_gemm_variant(GEMM_VARIANTS.index(variant))]


def gemm() -> str:
    """The GEMM loop this process runs."""
    return GEMM_VARIANTS[torch.ops.whiflash.gemm_variant()]


def choose_gemm(cache_dir: Path | None = DEFAULT_CACHE) -> str:
    """The faster GEMM loop on this CPU: $WHIFLASH_GEMM where set; the one there is where the ISA has one (avx2,
    avx512); else the one measured before on this CPU model and ISA (cache_dir/<version>/gemm-<isa>-<cpu>.json);
    else measure_gemm now (~0.2 s) and keep the choice there, so that every process on a machine rounds the same
    way."""
    forced = os.environ.get(GEMM_ENV)
    if forced:
        if forced not in available_gemms():
            raise ValueError(f"{GEMM_ENV} must be one of {available_gemms()} on this CPU, got {forced!r}")
        return forced
    if len(available_gemms()) == 1:
        return available_gemms()[0]
    model = " / ".join(cpu.cpuinfo(f) for f in ("vendor_id", "cpu family", "model", "model name"))
    isa = _loaded_isa or cpu.isa()
    path = None
    if cache_dir is not None:   # keyed by the ISA too: avx512bf16 and amx share a build, not their loops
        path = (Path(cache_dir) / build.version()
                / f"gemm-{isa}-{hashlib.sha256(model.encode()).hexdigest()[:12]}.json")
        try:
            chosen = json.loads(path.read_text())["variant"]
            if chosen in available_gemms():
                return chosen
        except (OSError, ValueError, KeyError, TypeError):
            pass
    seconds = measure_gemm()
    chosen = min(seconds, key=seconds.get)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            build.write_atomically(path, json.dumps({"variant": chosen, "seconds": seconds, "cpu": model,
                                                     "isa": isa}).encode())
        except OSError:
            pass   # an unwritable cache only costs the next process a measurement
    return chosen


def measure_gemm(rows: tuple[int, ...] = (1, 8), weights: int = 8, repeats: int = 5) -> dict[str, float]:
    """Seconds of each GEMM loop over `weights` SmolLM2 MLP-shaped weights (3072 x 576 bf16, 28 MB in all: they
    stream from memory as an engine's do), summed over a decode-like and a verify-like row count (best of
    `repeats`). Leaves the process's loop as it found it."""
    gen = torch.Generator().manual_seed(0)
    packed = [pack_weight(torch.randn(3072, 576, generator=gen).bfloat16()) for _ in range(weights)]
    xs = [torch.randn(m, 576, generator=gen).bfloat16() for m in rows]
    before = gemm()
    seconds = {}
    try:
        for variant in available_gemms():
            set_gemm(variant)
            total = 0.0
            for x in xs:
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    for p in packed:
                        linear(x, p, None, 3072)
                    best = min(best, time.perf_counter() - start)
                total += best
            seconds[variant] = total
    finally:
        set_gemm(before)
    return seconds


# The ops a compiled step calls as C functions (aoti_shim.h), as inductor declares them: their argument types follow
# the op schemas in the order inductor passes them, the returned tensors last.
C_SHIMS = {
    "linear_bf16": "AOTITorchError aoti_torch_cpu_linear_bf16(AtenTensorHandle x, AtenTensorHandle packed, "
                   "AtenTensorHandle* bias, int64_t out_features, AtenTensorHandle* y)",
    "linear_norm_bf16": "AOTITorchError aoti_torch_cpu_linear_norm_bf16(AtenTensorHandle x, AtenTensorHandle* delta, "
                        "AtenTensorHandle* norm_weight, double eps, AtenTensorHandle packed, AtenTensorHandle* bias, "
                        "int64_t out_features, int32_t silu, AtenTensorHandle* y, AtenTensorHandle* h)",
    "linear_i8": "AOTITorchError aoti_torch_cpu_linear_i8(AtenTensorHandle x, AtenTensorHandle packed, "
                 "int64_t out_features, AtenTensorHandle* y)",
    "paged_attention": "AOTITorchError aoti_torch_cpu_paged_attention(AtenTensorHandle q, AtenTensorHandle k, "
                       "AtenTensorHandle v, AtenTensorHandle k_cache, AtenTensorHandle v_cache, int64_t layer, "
                       "AtenTensorHandle write_slots, AtenTensorHandle row_slots, AtenTensorHandle row_len, "
                       "double scale, AtenTensorHandle* cos, AtenTensorHandle* sin, AtenTensorHandle* out)",
}


def c_shims() -> dict:
    """inductor's aot_inductor.custom_ops_to_c_shims for the loaded kernels (empty where they are not loaded)."""
    if not registered():
        return {}
    return {getattr(torch.ops.whiflash, name).default: [declaration] for name, declaration in C_SHIMS.items()}


_shapes_registered = False


def _register_shapes() -> None:
    """Output shapes without running the kernels (once per process): torch.export traces through them
    (builder/compile_target.py)."""
    global _shapes_registered
    if _shapes_registered:
        return
    for op in ("whiflash::linear_bf16", "whiflash::linear_fp32"):
        torch.library.register_fake(op)(lambda x, packed, bias, out_features: x.new_empty(x.shape[0], out_features))
    torch.library.register_fake("whiflash::linear_i8")(
        lambda x, packed, out_features: x.new_empty(x.shape[0], out_features))
    torch.library.register_fake("whiflash::linear_norm_bf16")(
        lambda x, delta, norm_weight, eps, packed, bias, out_features, silu:
        (x.new_empty(x.shape[0], out_features), x.new_empty(0 if norm_weight is None else x.shape[0], x.shape[1])))
    torch.library.register_fake("whiflash::paged_attention")(
        lambda q, k, v, k_cache, v_cache, layer, write_slots, row_slots, row_len, scale, cos, sin:
        q.new_empty(q.shape[0], q.shape[1] * q.shape[2]))
    _shapes_registered = True


def ensure_loaded(cache_dir: Path = DEFAULT_CACHE) -> bool:
    """Compile (once) and load the kernels for a model built outside an engine directory (training data, tests);
    says why on stderr and returns False where they cannot be used here."""
    try:
        return load(build.compile_library(cache_dir), cache_dir)
    except (KernelBuildError, OSError) as e:
        report_unavailable(str(e))
        return False


def registered() -> bool:
    return hasattr(torch.ops.whiflash, "paged_attention")


def supports(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] -> [ceil(N/64), K/2, 64] int32, each int32 the pair W[n, 2k], W[n, 2k+1]; fp32 [N, K] ->
    [ceil(N/64), K, 64] fp32 (zero rows pad N)."""
    n, k = weight.shape
    padded = F.pad(weight.detach(), (0, 0, 0, -n % BLOCK))
    if weight.dtype == torch.float32:
        return padded.view(-1, BLOCK, k).transpose(1, 2).contiguous()
    pairs = padded.view(-1, BLOCK, k // 2, 2).transpose(1, 2).contiguous()
    return pairs.view(torch.int32).view(-1, k // 2, BLOCK)


def pack_int8(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/64), K + 4, 64] int8 for linear (linear_bf16.cpp's linear_i8): each output row n quantised
    as W[n] ~ s[n] Q[n] with s[n] = max |W[n]| / 127 and Q = round(W[n] / s[n]) in [-127, 127]; a block's rows 0..K-1
    hold Q[., k] of its 64 outputs, its rows K..K+3 their 64 fp32 scales (zero rows pad N)."""
    w = weight.detach().float()
    n, k = w.shape
    scale = w.abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    q = F.pad(q, (0, 0, 0, -n % BLOCK)).view(-1, BLOCK, k).transpose(1, 2)
    scales = F.pad(scale, (0, -n % BLOCK)).view(-1, BLOCK).contiguous().view(torch.int8).view(-1, 4, BLOCK)
    return torch.cat([q, scales], 1).contiguous()


# A GGUF file's block types the kernels compute from, and the bytes of one block of 32 inputs (ggml_gemm.h)
GGML_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
GGML_PACKING = 1   # the layout of pack_ggml's output, which an engine stores: raised when ggml_gemm.h's changes


def ggml_kind(blocks: torch.Tensor) -> str:
    """The block type of a GGML weight (ggml_blocks: [N, K/32, block bytes]), read from its block bytes."""
    size = blocks.shape[-1]
    for kind, block_bytes in GGML_BLOCK_BYTES.items():
        if block_bytes == size:
            return kind
    raise ValueError(f"a GGML weight's blocks are {', '.join(map(str, GGML_BLOCK_BYTES.values()))} bytes "
                     f"({', '.join(GGML_BLOCK_BYTES)}), not {size}")


def ggml_blocks(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """A GGUF tensor's bytes [N, K/32 * block bytes] uint8 of type `kind` -> the weight linear and linear_norm take:
    [N, K/32, block bytes], each row the blocks of one output (ggml's own layout; nothing is repacked)."""
    if kind not in GGML_BLOCK_BYTES:
        raise ValueError(f"the kernels compute from {', '.join(GGML_BLOCK_BYTES)} blocks, not {kind}")
    size = GGML_BLOCK_BYTES[kind]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % size:
        raise ValueError(f"a {kind} tensor is [N, K/32 * {size}] uint8, got {raw.dtype} {list(raw.shape)}")
    return raw.contiguous().view(raw.shape[0], -1, size)


def ggml_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """A SwiGLU's gate and up GGML weights (ggml_blocks, one type) as linear_norm(silu=True) takes them: the rows of
    each 64 outputs 32 of gate, then the same 32 of up, as pack_gate_up orders a bf16 weight's."""
    if gate.shape != up.shape or gate.shape[0] % 32:
        raise ValueError("gate and up must be GGML weights of one shape, their rows a multiple of 32")
    return torch.stack([gate.view(-1, 32, *gate.shape[1:]), up.view(-1, 32, *up.shape[1:])], 1).reshape(
        -1, *gate.shape[1:]).contiguous()


def pack_ggml(blocks: torch.Tensor) -> torch.Tensor:
    """A GGML weight (ggml_blocks: [N, K/32, block bytes]) -> [ceil(N/8), K/32, group bytes] uint8 for linear and
    linear_norm (ggml_gemm.h): per 8 outputs and block, their 8 fp16 d (Q4_1: then their 8 m), then the quants in 8
    steps of 4 inputs, a step 8 outputs x 4 inputs (Q4: steps s and s + 4 in the low and high nibbles of one 32 bytes;
    zero rows pad N)."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 3:
        raise ValueError("pack_ggml takes ggml_blocks' [N, K/32, 18 | 20 | 34] uint8")
    kind, size = ggml_kind(blocks), blocks.shape[2]
    n, nblocks = blocks.shape[:2]
    padded = F.pad(blocks, (0, 0, 0, 0, 0, -n % 8)).view(-1, 8, nblocks, size).transpose(1, 2)   # [G, B, 8, size]
    scales = 4 if kind == "Q4_1" else 2
    head = padded[..., :scales].reshape(*padded.shape[:2], 8, scales // 2, 2).transpose(2, 3).reshape(
        *padded.shape[:2], 8 * scales)   # the 8 d, then the 8 m
    qs = padded[..., scales:]
    if kind != "Q8_0":   # byte i: input i low, input i + 16 high
        qs = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
    steps = qs.reshape(*qs.shape[:3], 8, 4).transpose(2, 3).reshape(*qs.shape[:2], 8, 32)   # [G, B, step, 8 x 4]
    if kind != "Q8_0":
        steps = steps[:, :, :4] | (steps[:, :, 4:] << 4)
    return torch.cat([head, steps.reshape(*steps.shape[:2], -1)], dim=-1).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
           many_rows: bool = False) -> torch.Tensor:
    """x [M, K] -> [M, out_features] in x's dtype (bf16 over a packed bf16, int8 or GGML weight, fp32 over an fp32
    one); bias fp32 or None (none with an int8 weight). An int8 weight runs linear_i8, the int8 loop that is fastest for
    the few rows of an LM head on every CPU, or, `many_rows` (a drafter's layers), the process's GEMM loop
    (linear_norm without a norm: AMX tiles where that is the loop). Either way a row does not depend on the call."""
    if packed.dtype == torch.int8:
        if bias is not None:
            raise ValueError("an int8 weight (pack_int8) takes no bias")
        if many_rows:
            return linear_norm(x, None, None, 0.0, packed, None, out_features)[0]
        return torch.ops.whiflash.linear_i8(x, packed, out_features)
    if packed.dtype == torch.float32:
        return torch.ops.whiflash.linear_fp32(x, packed, bias, out_features)
    return torch.ops.whiflash.linear_bf16(x, packed, bias, out_features)


def pack_gate_up(gate_up: torch.Tensor, int8: bool = False) -> torch.Tensor:
    """A SwiGLU's bf16 [gate; up] weight [2I, K] packed for linear_norm(silu=True): each block of 64 outputs holds
    32 gate outputs, then the same 32 of up (I a multiple of 32); in bf16 pairs (pack_weight) or, `int8`, quantised
    per output row (pack_int8)."""
    gate, up = gate_up.detach().view(2, -1, 32, gate_up.shape[1])
    blocks = torch.stack([gate, up], dim=1).reshape(gate_up.shape)
    return pack_int8(blocks) if int8 else pack_weight(blocks)


def int8_layers_pay() -> bool:
    """A drafter's layers run over int8 weights (pack_int8) here, half the bytes of bf16 per round: the process's GEMM
    loop is AMX. There DFlash's block (through the AMX loop, which widens int8 into its bf16 tiles, linear_bf16.cpp
    amx_block), EAGLE-3's draft steps (through the int8 loop for few rows, i8_rows) and EAGLE-3's KV-only prefill all
    run faster in int8; on the dot loop DFlash's drafting runs slower, so elsewhere the layers stay bf16. Timings:
    docs/measurements.md, "Kernels"."""
    return registered() and gemm() == "amx"


def linear_norm(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
                packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                silu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's norm and the GEMM after it in one call (bf16): h = x + delta (x without delta), y = linear(
    RMSNorm(h) * norm_weight) [M, out_features] -> (y, h); packed is pack_weight's or, without bias, pack_int8's
    (the process's GEMM loop either way: AMX tiles where it is the loop). With `silu`, packed is pack_gate_up's and y
    the SwiGLU of its gate and up outputs. Without norm_weight (and delta), y = linear(x) and h is empty ([0, K]).
    Rounds as the torch modules do (kernels/rows.h)."""
    return torch.ops.whiflash.linear_norm_bf16(x, delta, norm_weight, eps, packed, bias, out_features, silu)


def swiglu(x: torch.Tensor, gate_up_packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """silu(x gate^T) * (x up^T) [M, out_features] over pack_gate_up's weight, in one call (bf16)."""
    return linear_norm(x, None, None, 0.0, gate_up_packed, None, out_features, silu=True)[0]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    layer: int, write_slots: torch.Tensor, row_slots: torch.Tensor, row_len: torch.Tensor,
                    scale: float, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:
    """Writes k, v [T, kv_heads, D] at write_slots [T] of layer `layer` of the pools [layers, slots, kv_heads, D],
    then attends q [T, heads, D] row t to the slots row_slots[t, :row_len[t]] (int64, logical order) of that layer
    -> [T, heads * D]. With cos, sin ([T, D] or [T, 1, D], q's dtype) q and k are rotated first, as
    models.layers.apply_rope rotates them, bit for bit: in the op, a compiled step makes no pass of its own over
    them."""
    return torch.ops.whiflash.paged_attention(q, k, v, k_cache, v_cache, layer, write_slots, row_slots, row_len,
                                              scale, cos, sin)


def kv_prefill(feats: torch.Tensor, fc_packed: torch.Tensor, hidden: int, hidden_norm_weight: torch.Tensor,
               embeds: torch.Tensor, input_norm_weight: torch.Tensor, kv_packed: torch.Tensor,
               k_norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, k_cache: torch.Tensor,
               v_cache: torch.Tensor, write_slots: torch.Tensor) -> None:
    """plugins.kv_prefill's op with fc packed ([hidden, F]) and every layer's k_proj then v_proj packed as one
    weight; writes the keys and values at write_slots [T] of the pools [layers, slots, kv_heads, D]."""
    torch.ops.whiflash.kv_prefill(feats, fc_packed, hidden, hidden_norm_weight, embeds, input_norm_weight, kv_packed,
                                  k_norm_weight, cos, sin, eps, k_cache, v_cache, write_slots)


def _on_kernels(t: torch.Tensor) -> bool:
    """The engine's kernel runs an op on `t` (else its torch formulation): the kernels are loaded, t is on the CPU."""
    return registered() and t.device.type == "cpu"


def entropy_margin(logits: torch.Tensor) -> tuple[float, float]:
    """spec.router.entropy_and_margin of logits [vocab] (fp32 or bf16): in two passes in C++ on the kernels, else that
    function itself."""
    if not _on_kernels(logits):
        return entropy_and_margin(logits)
    entropy, margin = torch.ops.whiflash.entropy_margin(logits)
    return entropy, margin


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] (fp32 or bf16) -> int64 [rows]: torch.argmax(logits, -1) (the first index of a tie); off
    the kernels, torch's over logits.float() (the index it has in bf16: widening is exact)."""
    if not _on_kernels(logits):
        return logits.float().argmax(-1)
    return torch.ops.whiflash.argmax_rows(logits)


def topk_rows(logits: torch.Tensor, k: int, log_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] (fp32 or bf16) -> (fp32 values [rows, k], int64 indices [rows, k]): each row's k largest,
    largest first; with `log_softmax`, the values of torch.log_softmax(logits.float()). On the kernels ties go to the
    smaller index; off them torch.topk runs over the fp32 values."""
    if not _on_kernels(logits):
        top = torch.topk(torch.log_softmax(logits.float(), dim=-1) if log_softmax else logits.float(), k, dim=-1)
        return top.values, top.indices
    return torch.ops.whiflash.topk_rows(logits, k, log_softmax)


def report_unavailable(reason: str) -> None:
    print(f"whiflash: the engine's CPU kernels are not used ({reason}); linears and attention run on torch",
          file=sys.stderr)
