"""The engine's own CPU kernels, compiled with the machine's C++ compiler into one library per instruction set (an
engine directory carries one), and loaded once per process:
- linear_bf16.cpp: a bf16 GEMM for the few-row calls of decode and verify, with up to three inner loops (FMA on
  widened pairs on every build; VDPBF16PS and AMX tiles where the CPU has AVX-512 BF16 and AMX-BF16): `load` gives
  the process the fastest one on this CPU (choose_gemm); linear_norm_bf16 takes int8 weights quantised per output
  row too (pack_int8: DFlash's layers and both drafters' KV-only prefills, where int8_layers_pay), and linear_i8
  runs them in a loop for few rows (the drafters' LM heads, EAGLE-3's layers); both take a GGUF file's own Q4_0,
  Q4_1 and Q8_0 blocks too (ggml_gemm.h: a native engine's target);
- linear_fp32.cpp: the same for fp32 engines (MKL's fp32 GEMM sums a row by the row count);
- logits.cpp: reductions over a vocabulary that every round runs: each row's argmax (greedy verification), the
  entropy and top-2 margin of a bonus position (the route signal), and each row's top k (the drafters' trees);
- paged_attention.cpp: attention of each row to its visible keys in a paged KV pool (attention_amx.cpp: its path on
  AMX tiles, taken with the GEMM's AMX loop);
- kv_prefill.cpp: a drafter's KV-only prefill (plugins/kv_prefill.py) over packed weights, into its pools.
The sources are written once over simd.h's vector layer (8 fp32 lanes on AVX2, 16 on AVX-512); only the VDPBF16PS
and AMX loops are AVX-512-only. The GEMMs and the attention give every row the same bits whatever else the call
holds (what lossless verification needs), in every build; gemm_blocks.h, amx.h, rows.h and attention.h hold what
they share.

    cpu.py    which ISA this process runs (the best the CPU has; $WHIFLASH_ISA forces a lower one)
    build.py  the compiler driver: a library per build, cached by version, checked by its sha256 before use
    ops.py    loading, the GEMM loop, the C shims, and the ops' wrappers below

    path = build.compile_library(DEFAULT_CACHE)  # once per source version and ISA (whiflash-build copies it
                                                 # into the engine)
    load(path)                                   # registers torch.ops.whiflash.* in this process
    if registered(): packed = pack_weight(w); y = linear(x, packed, bias, w.shape[0])   # w bf16 or fp32
                     out = paged_attention(q, k, v, k_cache, v_cache, layer, write_slots, row_slots, row_len,
                                           scale)

TargetModel.fuse_projections hands bf16 and fp32 weights and the attention to them once they are loaded. Where the
CPU lacks AVX2 and FMA or no C++ compiler is found, nothing is loaded: the linears keep oneDNN and MKL
(models/layers.py FrozenLinear) and the attention models/attention.py's row-invariant torch version. The vocabulary
reductions (entropy_margin, argmax_rows, topk_rows) can be called anywhere: off the kernels, or on a tensor off the
CPU, each runs its torch formulation.
"""
from whiflash_trt.kernels.build import DEFAULT_CACHE, LIBRARY, KernelBuildError, can_build
from whiflash_trt.kernels.cpu import ISA_ENV, ISAS, cpu_supported, cpuinfo, isa
from whiflash_trt.kernels.ops import (BLOCK, C_SHIMS, GEMM_ENV, GEMM_VARIANTS, GGML_BLOCK_BYTES, GGML_PACKING,
                                      argmax_rows, available_gemms, c_shims, choose_gemm, ensure_loaded, entropy_margin,
                                      gemm, ggml_blocks, ggml_gate_up, ggml_kind, int8_layers_pay, kv_prefill, linear,
                                      linear_norm, load, loaded_isa, measure_gemm, pack_gate_up, pack_ggml, pack_int8,
                                      pack_weight, paged_attention, registered, report_unavailable, set_gemm, supports,
                                      swiglu, topk_rows)

__all__ = ["BLOCK", "C_SHIMS", "DEFAULT_CACHE", "GEMM_ENV", "GEMM_VARIANTS", "GGML_BLOCK_BYTES", "GGML_PACKING", "ISAS",
           "ISA_ENV", "LIBRARY", "KernelBuildError", "argmax_rows", "available_gemms", "c_shims", "can_build",
           "choose_gemm", "cpu_supported", "cpuinfo", "ensure_loaded", "entropy_margin", "gemm", "ggml_blocks",
           "ggml_gate_up", "ggml_kind", "int8_layers_pay", "isa", "kv_prefill", "linear", "linear_norm", "load",
           "loaded_isa", "measure_gemm", "pack_gate_up", "pack_ggml", "pack_int8", "pack_weight", "paged_attention",
           "registered", "report_unavailable", "set_gemm", "supports", "swiglu", "topk_rows"]
