// What the attention's two paths (paged_attention.cpp's vector one, attention_amx.cpp's AMX one) share: a layer of
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
// rounded to T as models/layers.py apply_rope's torch ops round them (fp32: products and sums apart, the build's
// -ffp-contract=off keeping the compiler from fusing them; bf16: a product of two bf16 is exact in fp32, then
// rounded).
template <typename T>
inline void rope_head(const T* x, const T* cos, const T* sin, int64_t dim, T* out) {
  auto product = [](Vec a, Vec b) { return std::is_same_v<T, float> ? a * b : round_bf16(a * b); };
  const int64_t half = dim / 2;
  for (int64_t j = 0; j < half; j += kLanes) {
    const int64_t n = half - j;
    const Vec a = Vec::load(x + j, n), b = Vec::load(x + half + j, n);
    (product(a, Vec::load(cos + j, n)) + product(negate(b), Vec::load(sin + j, n))).store(out + j, n);
    (product(b, Vec::load(cos + half + j, n)) + product(a, Vec::load(sin + half + j, n))).store(out + half + j, n);
  }
}

// A run's weights p_j = exp(s_j - top) for keys [0, n), kLanes at a time, and their sum (kLanes lanes, reduced
// once). With `bf16`, p rounded to bf16 goes there and the sum adds the rounded p (bf16 may lie over s: 2 bytes a
// key, written behind the 4 still to read); without, p replaces s.
inline float exp_weights(float* s, int64_t n, float top, uint16_t* bf16) {
  Vec sums = Vec::zero();
  const Vec shift = Vec::all(top);
  for (int64_t j = 0; j < n; j += kLanes) {
    const int64_t left = n - j;
    Vec p = select(Mask::first(left), exp(Vec::load(s + j, left) - shift), Vec::zero());
    if (bf16 != nullptr) {
      const NativeInt b = p.bf16_bits();
      p = Vec::widen(b);   // p as rounded
      narrow_store(bf16 + j, b, left);
    } else {
      p.store(s + j, left);
    }
    sums = sums + p;
  }
  return reduce_add(sums);
}

// What one run of keys leaves for a head: its max score, sum of exp(s - max) and sum_j p_j v_j (Vecs * kLanes
// lanes)
template <int Vecs>
struct Partial {
  float top, total;
  alignas(64) float acc[Vecs * kLanes];
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
  const Vec inv = Vec::all(1.f / total);
  for (int i = 0; i < Vecs; ++i) {
    Vec x = Vec::load(a.acc + kLanes * i) * Vec::all(wa);
    if (b != nullptr) x = fma(Vec::load(b->acc + kLanes * i), Vec::all(wb), x);
    (x * inv).store(out + kLanes * i, dim - kLanes * i);
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
#if defined(__AMX_TILE__)
void attend_amx(const at::BFloat16* q, int64_t q_row, int64_t rows, int64_t heads, const Layer& pool,
                const int64_t* row_slots, int64_t width, const int64_t* row_len, float scale, const Rope* rope,
                at::BFloat16* out);
#endif

}  // namespace whiflash
