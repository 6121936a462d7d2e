// The elementwise work that linear_norm_bf16 (linear_bf16.cpp) folds into its GEMM, so a layer's norms, residual
// adds and SwiGLU run inside the GEMMs' parallel regions instead of as serial kernels between them, which the other
// thread would wait through (~1.5 ms of a 16-row verify on an Intel Xeon with AMX; docs/measurements.md, "Kernels").
//
// Each rounds as the torch modules it replaces (models/layers.py) do in bf16: the residual sum h = x + delta once to
// bf16; RMSNorm as n = bf16(bf16(h * rsqrt(mean(h^2) + eps)) * w), its sum of squares in kLanes fp32 lanes then
// reduced (torch's own order differs: the last bit of a norm can differ from eager mode without the kernels); SwiGLU as
// bf16(bf16(silu(g)) * u), silu(g) = g / (1 + exp(-g)) with torch's own exp (Sleef, as ATen's silu and inductor).
#pragma once

#include <cmath>
#include <cstdint>

#include "simd.h"

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
    auto h = [&](int64_t j) {
      return dr ? round_bf16(Vec::load(xr + j, k - j) + Vec::load(dr + j, k - j)) : Vec::load(xr + j, k - j);
    };
    Vec squares = Vec::zero();
    for (int64_t j = 0; j < k; j += kLanes) {
      const Vec hj = h(j);
      if (write_h) hj.store(h_out + r * k + j, k - j);
      squares = fma(hj, hj, squares);
    }
    const Vec s = Vec::all(1.0f / std::sqrt(reduce_add(squares) / static_cast<float>(k) + eps));
    for (int64_t j = 0; j < k; j += kLanes)
      (round_bf16(h(j) * s) * Vec::load(w + j, k - j)).store(n_out + r * k + j, k - j);
  }
}

// SwiGLU of one row's 32 outputs: y[i] = bf16(bf16(silu(g[i])) * u[i]), g and u bf16
inline void silu_mul32(const uint16_t* g, const uint16_t* u, uint16_t* y) {
  for (int j = 0; j < 32; j += kLanes) {
    const Vec gate = Vec::load(g + j), up = Vec::load(u + j);
    const Vec silu = gate / (Vec::all(1.0f) + torch_exp(negate(gate)));
    (round_bf16(silu) * up).store(y + j);
  }
}

}  // namespace whiflash
