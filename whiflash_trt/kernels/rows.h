// The elementwise work that linear_norm_bf16 (linear_bf16.cpp) folds into its GEMM, so a layer's norms, residual
// adds and SwiGLU run inside the GEMMs' parallel regions instead of as serial kernels between them. On an Intel Xeon
// with AMX (perf, 1 thread, SmolLM2 on a 300-token context) the compiled step's elementwise kernels took ~0.13 ms of
// a decode step and ~1.5 ms of a 16-row verify, the other thread waiting through them when there are two. With
// them folded in, and the AMX GEMM's outputs split by 16-column tiles in the same change (2 threads, 6 processes of
// each alternated, medians): decode 12.37 -> 12.04 ms, a 16-row verify 16.41 -> 16.01 ms, a 6-row one 13.70 ->
// 13.68 ms.
//
// Each rounds as the torch modules it replaces (models/layers.py) do in bf16: the residual sum h = x + delta once to
// bf16; RMSNorm as n = bf16(bf16(h * rsqrt(mean(h^2) + eps)) * w), its sum of squares in 16 fp32 lanes then reduced
// (torch's own order differs: the last bit of a norm can differ from eager mode without the kernels); SwiGLU as
// bf16(bf16(silu(g)) * u), silu(g) = g / (1 + exp(-g)) with torch's own exp (Sleef, as ATen's silu and inductor).
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "simd.h"

extern "C" __m512 Sleef_expf16_u10(__m512);   // in libtorch_cpu: the exp of at::vec::Vectorized<float>

namespace whiflash {

// Rows [first, last) of x [., k] (+ delta): RMSNorm(h) * w into n_out, and the h of rows [h_first, h_last) into
// h_out (when given); all [., k] bf16. The second pass adds delta again rather than read h back (a thread that does
// not write a row's h has it nowhere else).
inline void normalize_rows(const uint16_t* x, const uint16_t* delta, const uint16_t* w, float eps, int64_t first,
                           int64_t last, int64_t k, uint16_t* h_out, int64_t h_first, int64_t h_last,
                           uint16_t* n_out) {
  for (int64_t r = first; r < last; ++r) {
    const uint16_t* xr = x + r * k;
    const uint16_t* dr = delta ? delta + r * k : nullptr;
    const bool write_h = dr && h_out && r >= h_first && r < h_last;
    auto h = [&](int64_t j, __mmask16 m) {
      return dr ? round_bf16(_mm512_add_ps(load16(xr + j, m), load16(dr + j, m))) : load16(xr + j, m);
    };
    __m512 squares = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 16) {
      const __mmask16 m = lanes(k - j);
      const __m512 hj = h(j, m);
      if (write_h) store16(h_out + r * k + j, hj, m);
      squares = _mm512_fmadd_ps(hj, hj, squares);
    }
    const __m512 s = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(k) + eps));
    for (int64_t j = 0; j < k; j += 16) {
      const __mmask16 m = lanes(k - j);
      store16(n_out + r * k + j, _mm512_mul_ps(round_bf16(_mm512_mul_ps(h(j, m), s)), load16(w + j, m)), m);
    }
  }
}

// SwiGLU of one row's 32 outputs: y[i] = bf16(bf16(silu(g[i])) * u[i]), g and u bf16
inline void silu_mul32(const uint16_t* g, const uint16_t* u, uint16_t* y) {
  for (int j = 0; j < 32; j += 16) {
    const __m512 gate = load16(g + j, 0xFFFF), up = load16(u + j, 0xFFFF);
    const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                          Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), gate))));
    store16(y + j, _mm512_mul_ps(round_bf16(silu), up), 0xFFFF);
  }
}

}  // namespace whiflash
