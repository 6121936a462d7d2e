// What the attention's two paths (paged_attention.cpp's AVX-512 one, attention_amx.cpp's AMX one) share: a layer of
// the pools as raw pointers, where a row's keys are cut into two runs, and the merge of the runs' partial results.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

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

// Both runs of every row: part[(run * rows + t) * heads + h], merged into out [rows, heads, dim]
template <typename T, int Vecs>
void merge_runs(const Partial<Vecs>* part, const int64_t* len, int64_t rows, int64_t heads, int64_t dim, T* out) {
  for (int64_t t = 0; t < rows; ++t) {
    const bool two = split_at(len[t]) < len[t];
    for (int64_t h = 0; h < heads; ++h)
      merge<T, Vecs>(part[t * heads + h], two ? &part[(rows + t) * heads + h] : nullptr, dim,
                     out + (t * heads + h) * dim);
  }
}

// The AMX path (attention_amx.cpp): bf16 heads of a multiple of 64 dims, where amx_selected()
constexpr bool amx_fits(int64_t dim) { return dim % 64 == 0 && dim <= 256; }
void attend_amx(const at::BFloat16* q, int64_t rows, int64_t heads, const Layer& pool, const int64_t* row_slots,
                int64_t width, const int64_t* row_len, float scale, at::BFloat16* out);

}  // namespace whiflash
