"""The memory roofline of decoding: one target step streams every weight once plus the KV cache it attends to, so no
step can be faster than those bytes over the rate this machine streams memory at. Measured, not looked up: the rate
of a plain read and of the best matrix-vector kernel torch (or the engine, whiflash_trt.kernels) has here, each over
weights far larger than the caches.

A verify of T rows reads the same bytes but multiplies every weight T times: past a few rows its GEMMs are
compute-bound, and no T-row step can beat T x the weights' multiply-adds at the rate the GEMM kernel computes when
its weight sits in cache (measure_gemm_compute). verify_floor gives both limits per row count.

The machine's read rate swings from minute to minute on a shared host (a plain read of 27 to 55 GB/s within one
session on the AMD EPYC these figures come from), so a roofline measured once and a decode rate measured later do not
make a ratio. interleaved_decode times the engine's decode step and the plain read in turns, and each turn's step
against that turn's limit."""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from whiflash_trt import kernels
from whiflash_trt.config import ModelConfig

BUFFER_BYTES = 256 * 2**20   # streamed per timed pass: far past any last-level cache
COMPUTE_ROWS = 64            # rows of x when measuring the GEMM's compute rate: far past its memory-bound few rows


@dataclass(frozen=True)
class StreamRates:
    """GB/s (1e9 bytes per second) at the thread count they were measured with."""
    plain_read: float            # a sum over a flat fp32 buffer
    best_kernel: float           # the fastest matrix-vector product over weights of a decoder's shape
    best_kernel_name: str
    kernels: dict[str, float]
    threads: int


def _best_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _gemv_rate(dtype: torch.dtype, hidden: int, rows: int, repeats: int, engine_kernel: bool = False) -> float:
    """y = W x for a stack of [rows, hidden] weights that together hold BUFFER_BYTES: F.linear, or the engine's bf16
    kernel (whiflash_trt.kernels) over the same weights packed."""
    elem = torch.empty((), dtype=dtype).element_size()
    count = max(1, BUFFER_BYTES // (rows * hidden * elem))
    weights = [torch.randn(rows, hidden).to(dtype) for _ in range(count)]
    x = torch.randn(1, hidden).to(dtype)
    if engine_kernel:
        weights = [kernels.pack_weight(w) for w in weights]

    def run() -> None:
        for w in weights:
            kernels.linear(x, w, None, rows) if engine_kernel else F.linear(x, w)
    return count * rows * hidden * elem / _best_seconds(run, repeats) / 1e9


def plain_read_gbs(flat: torch.Tensor) -> float:
    """GB/s of one plain read (a sum) over `flat`: a turn of an interleaved measurement."""
    start = time.perf_counter()
    flat.sum()
    return flat.numel() * flat.element_size() / (time.perf_counter() - start) / 1e9


@torch.inference_mode()
def measure_stream_rates(hidden: int = 576, rows: int = 1536, repeats: int = 5) -> StreamRates:
    """The rates at torch's current thread count. `hidden` x `rows` is one weight matrix (default: SmolLM2's MLP)."""
    flat = torch.ones(BUFFER_BYTES // 4)
    plain = BUFFER_BYTES / _best_seconds(lambda: flat.sum(), repeats) / 1e9
    del flat
    rates = {f"linear {name}": _gemv_rate(dtype, hidden, rows, repeats)
             for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32))}
    if kernels.registered():
        rates["whiflash linear_bf16"] = _gemv_rate(torch.bfloat16, hidden, rows, repeats, engine_kernel=True)
    best = max(rates, key=rates.get)
    return StreamRates(round(plain, 2), round(rates[best], 2), best, {k: round(v, 2) for k, v in rates.items()},
                       torch.get_num_threads())


@dataclass(frozen=True)
class ComputeRate:
    """Multiply-adds per second (1e9) of a GEMM kernel at COMPUTE_ROWS rows over a cache-resident weight."""
    gmacs: float
    kernel: str
    threads: int


@torch.inference_mode()
def measure_gemm_compute(hidden: int = 576, repeats: int = 5, calls: int = 20) -> ComputeRate:
    """The bf16 GEMM's compute rate at torch's current thread count: the engine's kernel where it is loaded, else
    F.linear; one [hidden, hidden] weight (SmolLM2's: 0.66 MB) called `calls` times per timed pass, so it stays in
    cache and the multiply-adds, not the reads, set the time."""
    torch.manual_seed(0)
    weight = torch.randn(hidden, hidden).bfloat16()
    x = torch.randn(COMPUTE_ROWS, hidden).bfloat16()
    if kernels.registered():
        name, packed = "whiflash linear_bf16", kernels.pack_weight(weight)
        fn = lambda: [kernels.linear(x, packed, None, hidden) for _ in range(calls)]   # noqa: E731
    else:
        name, fn = "linear bf16", lambda: [F.linear(x, weight) for _ in range(calls)]   # noqa: E731
    macs = calls * COMPUTE_ROWS * hidden * hidden
    return ComputeRate(round(macs / _best_seconds(fn, repeats) / 1e9, 1), name, torch.get_num_threads())


def _projection_weights(config: ModelConfig) -> int:
    """Weights of one decoder layer's projections: q, k, v, o, gate, up, down."""
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    q = config.num_heads * config.head_dim
    return h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size


def gemm_macs_per_row(config: ModelConfig) -> int:
    """Multiply-adds one row of a target step makes in its GEMMs: every projection and the LM head."""
    return config.num_layers * _projection_weights(config) + config.vocab_size * config.hidden_size


def step_bytes(config: ModelConfig, dtype: torch.dtype, context: int, weights: int | None = None) -> dict[str, int]:
    """Bytes one decode step must read: every weight matrix once (an untied embedding table only its one row) and
    the K/V of `context` positions in every layer. `weights`: the weights' bytes as the target reads them where
    they are not dense in `dtype` (a native engine's GGUF blocks: TargetModel.streamed_weight_bytes)."""
    elem = torch.empty((), dtype=dtype).element_size()
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    per_layer = _projection_weights(config) + 2 * h   # and the layer's two norms
    embedding_row = 0 if config.tie_word_embeddings else h   # a tied table is the LM head, read whole anyway
    if weights is None:
        weights = (config.num_layers * per_layer + h + config.vocab_size * h + embedding_row) * elem
    kv_cache = 2 * config.num_layers * context * kv * elem
    return {"weights": weights, "kv_cache": kv_cache, "total": weights + kv_cache}


def _stream_ms(nbytes: int, rates: StreamRates) -> float:
    """Milliseconds to stream `nbytes` at the best measured rate."""
    return nbytes / (max(rates.plain_read, rates.best_kernel) * 1e9) * 1e3


def roofline(config: ModelConfig, dtype: torch.dtype, context: int, rates: StreamRates,
             weights: int | None = None) -> dict:
    """The fastest possible decode step at `context` tokens, from the best measured streaming rate (`weights`: as
    step_bytes takes them)."""
    nbytes = step_bytes(config, dtype, context, weights)
    ms = _stream_ms(nbytes["total"], rates)
    return {"context": context, "bytes": nbytes, "rates_gbs": asdict(rates), "limit_ms_per_step": round(ms, 2),
            "limit_tokens_per_s": round(1e3 / ms, 1)}


def verify_floor(config: ModelConfig, dtype: torch.dtype, context: int, rates: StreamRates, compute: ComputeRate,
                 rows: tuple[int, ...] = (1, 6, 16), weights: int | None = None) -> dict[int, dict[str, float]]:
    """Per row count T: the ms a T-row step cannot beat, from its bytes at the best streaming rate ("memory_ms") and
    from T rows of GEMM multiply-adds at the measured compute rate ("compute_ms"); "floor_ms" is the larger. Only the
    GEMMs: attention, norms and the rest come on top."""
    memory_ms = _stream_ms(step_bytes(config, dtype, context, weights)["total"], rates)
    out = {}
    for t in rows:
        compute_ms = t * gemm_macs_per_row(config) / (compute.gmacs * 1e9) * 1e3
        out[t] = {"memory_ms": round(memory_ms, 2), "compute_ms": round(compute_ms, 2),
                  "floor_ms": round(max(memory_ms, compute_ms), 2)}
    return out


def native_weight_bytes(engine) -> int | None:
    """The weights' bytes of an engine whose target runs its GGUF blocks (a native engine), else None (dense; a
    native engine loaded where its blocks do not run is dense too)."""
    if not engine.target.native:
        return None
    return engine.target.streamed_weight_bytes()


@torch.inference_mode()
def interleaved_decode(engine, context: int, turns: int = 15) -> dict:
    """The engine's one-token decode step at `context` tokens of context and a plain read of BUFFER_BYTES, timed in
    turns (after one untimed pair). Per turn, the roofline is the step's bytes (step_bytes) at that turn's read rate.
    -> medians of the step's ms, the read's GB/s and the roofline's ms, and the median and range over turns of step /
    roofline."""
    if turns < 1 or context < 1:
        raise ValueError(f"interleaved_decode needs turns >= 1 and context >= 1, got {turns}, {context}")
    nbytes = step_bytes(engine.target.config, engine.target.dtype, context, native_weight_bytes(engine))["total"]
    flat = torch.ones(BUFFER_BYTES // 4)
    prompt = [i % engine.target.config.vocab_size for i in range(1, context + 1)]
    steps, rates = [], []
    with engine.scratch_sequence(prompt, context + 1) as seq:
        engine.runner.step(seq, prompt, logits_rows=[context - 1])
        seq.commit(prompt, prompt[0])
        for turn in range(turns + 1):   # every step writes the same slot: the context stays `context` tokens
            rate = plain_read_gbs(flat) * 1e9
            start = time.perf_counter()
            engine.runner.step(seq, [seq.pending])
            step = time.perf_counter() - start
            if turn:
                steps.append(step)
                rates.append(rate)
    ratios = [s * rate / nbytes for s, rate in zip(steps, rates)]
    return {"context": context, "turns": turns, "bytes": nbytes,
            "step_ms": round(statistics.median(steps) * 1e3, 2),
            "plain_read_gbs": round(statistics.median(rates) / 1e9, 2),
            "roofline_ms": round(statistics.median(nbytes / r for r in rates) * 1e3, 2),
            "step_over_roofline": round(statistics.median(ratios), 3),
            "step_over_roofline_range": [round(min(ratios), 3), round(max(ratios), 3)]}
