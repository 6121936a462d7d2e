// y = x W^T for a weight kept in a GGUF file's own blocks: Q4_0, Q4_1 or Q8_0, each block 32 consecutive inputs of
// one output row (ggml's definitions: Q4_0 w = d (q - 8), Q4_1 w = d q + m, Q8_0 w = d q; d and m fp16), the blocks
// of 8 outputs interleaved (kernels.pack_ggml). A decode step then streams the file's bytes (SmolLM2's Q4_1 layers
// and Q8_0 head: 97 MB a token) instead of their bf16 rounding (270 MB).
//
// As llama.cpp computes it: each row of x is quantised per 32 inputs to int8 (qx = round(x / dx), dx = max |x| / 127,
// round to nearest even), each block's products summed exactly in int32 (maddubs / madd), and then in fp32:
//   y[m, n] = sum over blocks b of  dw dx isum  (+ Q4_0: dw (-8 dx sum qx), Q4_1: mw (dx sum qx))
// both terms added to one fp32 lane per output, block by block in order, then the bias, and the sum rounded once to
// bf16.
//
// Row invariance by construction: a row's quantisation and every output's sums depend on that row alone, in an
// order fixed by the weight's shape, never by the row count, the row's place in the call or the thread count. The
// integer sums are exact, and the fp32 part runs on 256-bit vectors in every build (AVX2 and AVX-512 alike), so
// every build gives the same bits. Where the build has AVX-512 VNNI (the avx512bf16 build) one vpdpbusd takes a
// step's products straight into int32, where AVX2 needs maddubs and madd (Q4: an int16 add a step, one madd a
// block): the same integers, since no int16 sum of the AVX2 path saturates (Q8_0 pairs: at most 2 128 127).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace whiflash {

enum GgmlType : int { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };
constexpr int64_t kGgmlBlock = 32;   // inputs per block, every type

// Rows of x quantised per block: q [rows, k] int8, and per row and block dx and the offset term's factor (Q4_0:
// -8 dx sum qx; Q4_1 and Q8_0: dx sum qx, unused by Q8_0)
struct QuantRows {
  std::vector<int8_t> q;
  std::vector<float> d, offset;
  int64_t k = 0, blocks = 0;

  QuantRows(const uint16_t* x, int64_t ldx, int64_t rows, int64_t k_, int type) : k(k_), blocks(k_ / kGgmlBlock) {
    q.resize(rows * k), d.resize(rows * blocks), offset.resize(rows * blocks);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const uint16_t* xb = x + r * ldx + b * kGgmlBlock;
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
          const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb + 8 * i));
          v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));   // bf16 -> fp32, exact
          amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
        const float dx = _mm_cvtss_f32(m4) / 127.0f;
        const __m256 inv = _mm256_set1_ps(dx > 0 ? 1.0f / dx : 0.0f);
        int8_t* qb = q.data() + r * k + b * kGgmlBlock;
        int32_t sum = 0;
        for (int i = 0; i < 4; ++i) {
          const __m256i qi = _mm256_cvtps_epi32(
              _mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
          alignas(32) int32_t lanes[8];
          _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), qi);
          for (int j = 0; j < 8; ++j) qb[8 * i + j] = static_cast<int8_t>(lanes[j]), sum += lanes[j];
        }
        d[r * blocks + b] = dx;
        offset[r * blocks + b] = (type == kQ4_0 ? -8.0f : 1.0f) * (dx * static_cast<float>(sum));
      }
    }
  }
};

// The weight as ggml_gemm reads it (kernels.pack_ggml): the GGUF blocks of 8 outputs at a time interleaved, a
// group's block b (its 8 outputs' inputs 32 b .. 32 b + 31) being their 8 fp16 d (Q4_1: then their 8 fp16 m) and the
// quants in 8 steps of 4 inputs, a step one 32-byte vector of 8 outputs x 4 inputs; Q4 packs steps s and s + 4 of a
// block into the low and high nibbles of one vector. A step is then one maddubs per row against the row's 4 inputs
// broadcast, and the 8 lanes of every accumulator are 8 outputs: no horizontal sums, every block's scale one vector.
constexpr int64_t kGgmlGroup = 8;   // outputs interleaved
constexpr int64_t ggml_group_bytes(int type) { return type == kQ4_0 ? 144 : type == kQ4_1 ? 160 : 272; }

inline int ggml_packed_type(int64_t group_bytes) {
  return group_bytes == 144 ? kQ4_0 : group_bytes == 160 ? kQ4_1 : group_bytes == 272 ? kQ8_0 : -1;
}

// acc + the sums of each int32 lane's 4 products u8 s8: vpdpbusd, or on AVX2 maddubs and madd (the same integers
// where no pair of products leaves int16, as in every call here)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVnni = true;
inline __m256i dpbusd(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_epi32(acc, u8, s8); }
#else
constexpr bool kVnni = false;
inline __m256i dpbusd(__m256i acc, __m256i u8, __m256i s8) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1)));
}
#endif

inline __m256 halves(const uint8_t* p) {   // 8 fp16 -> fp32 (exact)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i four_inputs(const int8_t* qx) {   // a row's 4 quantised inputs, broadcast to every output
  int32_t four;
  std::memcpy(&four, qx, sizeof(four));
  return _mm256_set1_epi32(four);
}

// Outputs of one group (8) for rows [r0, r0 + Rows): y[r, n] = sum over blocks of dw dx isum (+ offset term), in
// 8 fp32 lanes (one per output), block by block in order
template <int Rows, int Type>
void ggml_group(const QuantRows& xq, int64_t r0, const uint8_t* group, const float* bias, uint16_t* y, int64_t ldy,
                int64_t outputs) {
  constexpr int64_t bytes = ggml_group_bytes(Type), quants = Type == kQ4_1 ? 32 : 16;
  const int64_t blocks = xq.blocks;
  __m256 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = group + b * bytes;
    for (int64_t line = 0; line < bytes; line += 64)   // 2 KB ahead, to L1
      _mm_prefetch(reinterpret_cast<const char*>(blk) + 2048 + line, _MM_HINT_T0);
    __m256i sums[Rows];
    for (int r = 0; r < Rows; ++r) sums[r] = _mm256_setzero_si256();
    const int8_t* qx[Rows];
    for (int r = 0; r < Rows; ++r) qx[r] = xq.q.data() + (r0 + r) * xq.k + b * kGgmlBlock;
    const __m256i ones = _mm256_set1_epi16(1);
    if constexpr (Type == kQ8_0) {   // |qw| times qx signed by qw, as ggml does; a pair sum fills int16
      for (int s = 0; s < 8; ++s) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + quants + 32 * s));
        const __m256i w_abs = _mm256_sign_epi8(w, w);
        for (int r = 0; r < Rows; ++r)
          sums[r] = dpbusd(sums[r], w_abs, _mm256_sign_epi8(four_inputs(qx[r] + 4 * s), w));
      }
    } else {   // AVX2: the 8 steps' pair sums in int16 (each at most 2 15 127, 30480 in all), one madd a block;
               // VNNI: the low and the high nibbles' steps in two int32 sums
      const __m256i low = _mm256_set1_epi8(0x0F);
      __m256i part[Rows];
      for (int r = 0; r < Rows; ++r) part[r] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + quants + 32 * c));
        const __m256i first = _mm256_and_si256(packed, low);
        const __m256i second = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        for (int r = 0; r < Rows; ++r) {
          const __m256i x_first = four_inputs(qx[r] + 4 * c), x_second = four_inputs(qx[r] + 4 * (c + 4));
          if constexpr (kVnni) {
            sums[r] = dpbusd(sums[r], first, x_first), part[r] = dpbusd(part[r], second, x_second);
          } else {
            part[r] = _mm256_add_epi16(part[r], _mm256_maddubs_epi16(first, x_first));
            part[r] = _mm256_add_epi16(part[r], _mm256_maddubs_epi16(second, x_second));
          }
        }
      }
      for (int r = 0; r < Rows; ++r)
        sums[r] = kVnni ? _mm256_add_epi32(sums[r], part[r]) : _mm256_madd_epi16(part[r], ones);
    }
    const __m256 dw = halves(blk);
    for (int r = 0; r < Rows; ++r) {
      const int64_t at = (r0 + r) * blocks + b;
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(xq.d[at])), _mm256_cvtepi32_ps(sums[r]), acc[r]);
      if constexpr (Type == kQ4_0) acc[r] = _mm256_fmadd_ps(dw, _mm256_set1_ps(xq.offset[at]), acc[r]);
      if constexpr (Type == kQ4_1) acc[r] = _mm256_fmadd_ps(halves(blk + 16), _mm256_set1_ps(xq.offset[at]), acc[r]);
    }
  }
  const __m256 b8 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();   // bias padded to the group (see caller)
  for (int r = 0; r < Rows; ++r) {
    alignas(32) float out[kGgmlGroup];
    _mm256_store_ps(out, _mm256_add_ps(acc[r], b8));
    for (int64_t n = 0; n < outputs; ++n) y[(r0 + r) * ldy + n] = c10::BFloat16(out[n]).x;
  }
}

constexpr int kGgmlTileRows = 4;   // rows per pass over a group's blocks (more rows: the next pass, from L1)

template <int Type>
void ggml_groups(const QuantRows& xq, int64_t rows, const uint8_t* w, int64_t g0, int64_t g1, const float* bias,
                 uint16_t* y, int64_t columns) {
  using Fn = void (*)(const QuantRows&, int64_t, const uint8_t*, const float*, uint16_t*, int64_t, int64_t);
  constexpr Fn fns[kGgmlTileRows] = {ggml_group<1, Type>, ggml_group<2, Type>, ggml_group<3, Type>,
                                     ggml_group<4, Type>};
  constexpr int64_t bytes = ggml_group_bytes(Type);
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n = g * kGgmlGroup, outputs = std::min(kGgmlGroup, columns - n);
    float padded[kGgmlGroup] = {};
    if (bias) std::memcpy(padded, bias + n, outputs * sizeof(float));
    for (int64_t r = 0; r < rows; r += kGgmlTileRows)
      fns[std::min<int64_t>(kGgmlTileRows, rows - r) - 1](xq, r, w + g * xq.blocks * bytes, bias ? padded : nullptr,
                                                          y + n, columns, outputs);
  }
}

// y [rows, columns] bf16 = x [rows, ldx] bf16 times a packed GGML weight (+ bias)
inline void ggml_gemm(const uint16_t* x, int64_t ldx, int64_t rows, const uint8_t* w, int type, int64_t k,
                      const float* bias, uint16_t* y, int64_t columns) {
  const QuantRows xq(x, ldx, rows, k, type);
  const int64_t groups = (columns + kGgmlGroup - 1) / kGgmlGroup;
  constexpr int64_t kGrain = 4;   // groups: 32 outputs (SmolLM2's 576 split evenly over 2 threads)
  at::parallel_for(0, (groups + kGrain - 1) / kGrain, 1, [&](int64_t begin, int64_t end) {
    const int64_t g0 = begin * kGrain, g1 = std::min(end * kGrain, groups);
    if (type == kQ4_0) ggml_groups<kQ4_0>(xq, rows, w, g0, g1, bias, y, columns);
    else if (type == kQ4_1) ggml_groups<kQ4_1>(xq, rows, w, g0, g1, bias, y, columns);
    else ggml_groups<kQ8_0>(xq, rows, w, g0, g1, bias, y, columns);
  });
}

}  // namespace whiflash
