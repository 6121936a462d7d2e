// What the attention's two paths (paged_attention.cpp's AVX-512 one, attention_amx.cpp's AMX one) share: a layer of
// the pools as raw pointers, where a row's keys are cut into two runs, and the merge of the runs' partial results.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace whiflash {

// One layer of the pools: raw pointers, not at::Tensor views (a select costs ~1.5 us of dispatch, 60 a step).
struct Layer {
  char* k;
  char* v;
  int64_t slots, kv_heads, dim, slot_stride;   // slot_stride in elements
};

// Where a row's keys are cut into its two runs (the second may be empty): past their middle, at a multiple of 32 (a
// chunk of the AMX path's values; two score chunks of the other), once there are kSplitFrom keys; a function of
// their number alone, so rows stay invariant.
constexpr int64_t kSplitFrom = 64;
inline int64_t split_at(int64_t keys) { return keys < kSplitFrom ? keys : ((keys + 1) / 2 + 31) / 32 * 32; }

// RoPE (rotate-half, the HF checkpoints' convention) of one head vector x [dim] at its row's cos, sin [dim], into
// out: out[:h] = x[:h] cos[:h] + (-x[h:]) sin[:h], out[h:] = x[h:] cos[h:] + x[:h] sin[h:], every product and sum
// rounded to T as models/layers.py apply_rope's torch ops round them (fp32: the explicitly rounded intrinsics, which
// the compiler cannot fuse into a multiply-add; bf16: a product of two bf16 is exact in fp32, then rounded).
template <typename T>
inline void rope_head(const T* x, const T* cos, const T* sin, int64_t dim, T* out) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  auto product = [](__m512 a, __m512 b) {
    const __m512 p = _mm512_mul_round_ps(a, b, kNearest);
    return std::is_same_v<T, float> ? p : round_bf16(p);
  };
  const int64_t half = dim / 2;
  for (int64_t j = 0; j < half; j += 16) {
    const __mmask16 m = lanes(half - j);
    const __m512 a = load16(x + j, m), b = load16(x + half + j, m);
    const __m512 minus_b = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(b), sign));
    store16(out + j, _mm512_add_round_ps(product(a, load16(cos + j, m)), product(minus_b, load16(sin + j, m)),
                                         kNearest), m);
    store16(out + half + j, _mm512_add_round_ps(product(b, load16(cos + half + j, m)),
                                                product(a, load16(sin + half + j, m)), kNearest), m);
  }
}

// A run's weights p_j = exp(s_j - top) for keys [0, n), 16 at a time, and their sum (16 lanes, reduced once). With
// `bf16`, p rounded to bf16 goes there and the sum adds the rounded p (bf16 may lie over s: 2 bytes a key, written
// behind the 4 still to read); without, p replaces s.
inline float exp_weights(float* s, int64_t n, float top, uint16_t* bf16) {
  __m512 sums = _mm512_setzero_ps(), shift = _mm512_set1_ps(top);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = lanes(n - j);
    __m512 p = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), shift)));
    if (bf16 != nullptr) {
      const __m256bh b = _mm512_cvtneps_pbh(p);
      p = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)b), 16));   // p as rounded
      _mm256_mask_storeu_epi16(bf16 + j, m, (__m256i)b);
    } else {
      _mm512_mask_storeu_ps(s + j, m, p);
    }
    sums = _mm512_add_ps(sums, p);
  }
  return _mm512_reduce_add_ps(sums);
}

// What one run of keys leaves for a head: its max score, sum of exp(s - max) and sum_j p_j v_j (Vecs * 16 lanes)
template <int Vecs>
struct Partial {
  float top, total;
  alignas(64) float acc[Vecs * 16];
};

// out = (a.acc e^(a.top - m) + b.acc e^(b.top - m)) / (a.total e^(a.top - m) + b.total e^(b.top - m)), m the larger
// max; a alone where b is null
template <typename T, int Vecs>
void merge(const Partial<Vecs>& a, const Partial<Vecs>* b, int64_t dim, T* out) {
  float wa = 1.f, wb = 0.f, total = a.total;
  if (b != nullptr) {
    const float m = std::max(a.top, b->top);
    wa = std::exp(a.top - m);
    wb = std::exp(b->top - m);
    total = a.total * wa + b->total * wb;
  }
  const __m512 inv = _mm512_set1_ps(1.f / total);
  for (int i = 0; i < Vecs; ++i) {
    __m512 x = _mm512_mul_ps(_mm512_load_ps(a.acc + 16 * i), _mm512_set1_ps(wa));
    if (b != nullptr) x = _mm512_fmadd_ps(_mm512_load_ps(b->acc + 16 * i), _mm512_set1_ps(wb), x);
    store16(out + 16 * i, _mm512_mul_ps(x, inv), lanes(dim - 16 * i));
  }
}

// Both runs of every row: part[(run * rows + t) * heads + h], merged into out [rows, heads, dim]; the rows of a
// call of 8 or more spread over the threads
template <typename T, int Vecs>
void merge_runs(const Partial<Vecs>* part, const int64_t* len, int64_t rows, int64_t heads, int64_t dim, T* out) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const bool two = split_at(len[t]) < len[t];
      for (int64_t h = 0; h < heads; ++h)
        merge<T, Vecs>(part[t * heads + h], two ? &part[(rows + t) * heads + h] : nullptr, dim,
                       out + (t * heads + h) * dim);
    }
  });
}

// The calling thread's buffer of a call's partial results, n of them at least: kept across calls, not zeroed (each
// partial a row reads is written first)
template <int Vecs>
Partial<Vecs>* partials(int64_t n) {
  thread_local std::vector<Partial<Vecs>> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// Each row's cos and sin [rows, dim] in the queries' dtype: the call's q and k are rotated in it (rope_head)
struct Rope {
  const void* cos;
  const void* sin;
};

// The AMX path (attention_amx.cpp): bf16 heads of a multiple of 64 dims, where amx_selected(). q [rows, heads, dim]
// with rows q_row elements apart; rope: q rotated per task as it is read (null: q as it is).
constexpr bool amx_fits(int64_t dim) { return dim % 64 == 0 && dim <= 256; }
void attend_amx(const at::BFloat16* q, int64_t q_row, int64_t rows, int64_t heads, const Layer& pool,
                const int64_t* row_slots, int64_t width, const int64_t* row_len, float scale, const Rope* rope,
                at::BFloat16* out);

}  // namespace whiflash
