// whiflash::paged_attention: writes the new tokens' K/V into layer `layer` of the paged pools, then attends every
// query row to its visible keys, given per row as pool slots in logical order. The op mutates the whole pools (not a
// view of one layer) so that torch.export sees plain in-place writes to graph inputs.
//
// Row invariance by construction: one (row, head) is computed by one thread, in a fixed order that depends only on
// its query and its keys: scores q.k (16 fp32 lanes over head_dim, then a fixed lane reduction) in key order, the max,
// exp(s - max) 16 keys at a time and their sum (16 lanes, then a fixed reduction), then sum_j p_j v_j in key order
// (16 lanes over head_dim). A verify row, a tree node or a row of a batched call equals the same position fed alone,
// bit for bit (tests/test_kernels.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

namespace {

using whiflash::exp16;
using whiflash::lanes;
using whiflash::load16;
using whiflash::store16;

constexpr int kMaxGroup = 16;   // query heads per KV head
constexpr int kMaxDim = 256;

// sum_j p[h][j] v_j for G heads (accumulators in registers), keys in order, p already exp'd; -> acc_out[G][Vecs*16]
template <typename T, int Vecs, int G>
void weigh_values(const float* p, int64_t ld, const T* v_pool, int64_t slot_stride, const int64_t* slots,
                  int64_t keys, int64_t dim, float* acc_out) {
  __m512 acc[G][Vecs];
  for (int h = 0; h < G; ++h)
    for (int i = 0; i < Vecs; ++i) acc[h][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < keys; ++j) {
    const T* v = v_pool + slots[j] * slot_stride;
    __m512 vv[Vecs];
    for (int i = 0; i < Vecs; ++i) vv[i] = load16(v + 16 * i, lanes(dim - 16 * i));
    for (int h = 0; h < G; ++h) {
      const __m512 w = _mm512_set1_ps(p[h * ld + j]);
      for (int i = 0; i < Vecs; ++i) acc[h][i] = _mm512_fmadd_ps(w, vv[i], acc[h][i]);
    }
  }
  for (int h = 0; h < G; ++h)
    for (int i = 0; i < Vecs; ++i) _mm512_store_ps(acc_out + (h * Vecs + i) * 16, acc[h][i]);
}

// One row's heads that share a KV head (a GQA group): each key and value is loaded and widened once for all of them.
// Per head the order is the one of a head alone (the bits do not depend on the group). Vecs = ceil(head_dim / 16).
template <typename T, int Vecs>
void attend_group(const T* q, int64_t group, const T* k_pool, const T* v_pool, int64_t slot_stride,
                  const int64_t* slots, int64_t keys, int64_t dim, float scale, float* scores, int64_t ld, T* out) {
  alignas(64) float qf[kMaxGroup][Vecs * 16];
  alignas(64) float acc[kMaxGroup][Vecs * 16];
  float top[kMaxGroup], total[kMaxGroup];
  for (int64_t h = 0; h < group; ++h) {
    top[h] = -INFINITY;
    for (int i = 0; i < Vecs; ++i) _mm512_store_ps(qf[h] + 16 * i, load16(q + h * dim + 16 * i, lanes(dim - 16 * i)));
  }
  for (int64_t j = 0; j < keys; ++j) {
    const T* k = k_pool + slots[j] * slot_stride;
    __m512 kv[Vecs];
    for (int i = 0; i < Vecs; ++i) kv[i] = load16(k + 16 * i, lanes(dim - 16 * i));
    for (int64_t h = 0; h < group; ++h) {
      __m512 dot = _mm512_setzero_ps();
      for (int i = 0; i < Vecs; ++i) dot = _mm512_fmadd_ps(_mm512_load_ps(qf[h] + 16 * i), kv[i], dot);
      const float s = _mm512_reduce_add_ps(dot) * scale;
      scores[h * ld + j] = s;
      top[h] = std::max(top[h], s);
    }
  }
  // p_j = exp(s_j - max), 16 keys at a time; their sum in 16 lanes, reduced once
  for (int64_t h = 0; h < group; ++h) {
    float* sh = scores + h * ld;
    __m512 sums = _mm512_setzero_ps(), shift = _mm512_set1_ps(top[h]);
    for (int64_t j = 0; j < keys; j += 16) {
      __mmask16 m = lanes(keys - j);
      __m512 p = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sh + j), shift)));
      _mm512_mask_storeu_ps(sh + j, m, p);
      sums = _mm512_add_ps(sums, p);
    }
    total[h] = _mm512_reduce_add_ps(sums);
  }
  // heads 4 at a time, their accumulators in registers (each head's order is the same in any chunk)
  for (int64_t h0 = 0; h0 < group; h0 += 4) {
    const float* p = scores + h0 * ld;
    float* a = acc[h0];
    switch (std::min<int64_t>(4, group - h0)) {
      case 1: weigh_values<T, Vecs, 1>(p, ld, v_pool, slot_stride, slots, keys, dim, a); break;
      case 2: weigh_values<T, Vecs, 2>(p, ld, v_pool, slot_stride, slots, keys, dim, a); break;
      case 3: weigh_values<T, Vecs, 3>(p, ld, v_pool, slot_stride, slots, keys, dim, a); break;
      default: weigh_values<T, Vecs, 4>(p, ld, v_pool, slot_stride, slots, keys, dim, a); break;
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    __m512 inv = _mm512_set1_ps(1.f / total[h]);
    for (int i = 0; i < Vecs; ++i)
      store16(out + h * dim + 16 * i, _mm512_mul_ps(_mm512_load_ps(acc[h] + 16 * i), inv), lanes(dim - 16 * i));
  }
}

// One layer of the pools: raw pointers, not at::Tensor views (a select costs ~1.5 us of dispatch, 60 a step).
struct Layer {
  char* k;
  char* v;
  int64_t slots, kv_heads, dim, slot_stride;   // slot_stride in elements
};

template <typename T, int Vecs>
void attend(const at::Tensor& q, const Layer& pool, const at::Tensor& row_slots, const at::Tensor& row_len,
            double scale, at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = pool.kv_heads, group = heads / kv_heads, width = row_slots.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = reinterpret_cast<const T*>(pool.k);
  const T* vp = reinterpret_cast<const T*>(pool.v);
  const int64_t* sp = row_slots.data_ptr<int64_t>();
  const int64_t* lp = row_len.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * width);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / kv_heads, kv = i % kv_heads, first = (t * heads + kv * group) * dim;
      attend_group<T, Vecs>(qp + first, group, kp + kv * dim, vp + kv * dim, pool.slot_stride, sp + t * width,
                            lp[t], dim, static_cast<float>(scale), scores.data(), width, op + first);
    }
  });
}

template <typename T>
void attend_dim(const at::Tensor& q, const Layer& pool, const at::Tensor& row_slots, const at::Tensor& row_len,
                double scale, at::Tensor& out) {
  switch ((q.size(2) + 15) / 16) {
    case 1: return attend<T, 1>(q, pool, row_slots, row_len, scale, out);
    case 2: return attend<T, 2>(q, pool, row_slots, row_len, scale, out);
    case 3: return attend<T, 3>(q, pool, row_slots, row_len, scale, out);
    case 4: return attend<T, 4>(q, pool, row_slots, row_len, scale, out);
    case 5: case 6: return attend<T, 6>(q, pool, row_slots, row_len, scale, out);
    case 7: case 8: return attend<T, 8>(q, pool, row_slots, row_len, scale, out);
    default: return attend<T, 16>(q, pool, row_slots, row_len, scale, out);
  }
}

// layer[write_slots[t]] = rows[t] for every row t: one memcpy of kv_heads * D per row (index_copy_'s dispatch and
// checks cost ~3 us per call, 30 layers x 2 pools a step)
void write_rows(char* layer, const Layer& pool, const at::Tensor& rows, const int64_t* slot) {
  const at::Tensor src = rows.contiguous();
  const int64_t n = src.size(0), row_bytes = src.size(1) * src.size(2) * src.element_size();
  const int64_t stride = pool.slot_stride * src.element_size();
  const auto* from = static_cast<const char*>(src.data_ptr());
  for (int64_t t = 0; t < n; ++t) std::memcpy(layer + slot[t] * stride, from + t * row_bytes, row_bytes);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                           at::Tensor v_cache, int64_t layer, const at::Tensor& write_slots,
                           const at::Tensor& row_slots, const at::Tensor& row_len, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k_cache.dim() == 4, "paged_attention: q [T, heads, D], k and v "
              "[T, kv_heads, D], pools [layers, slots, kv_heads, D]");
  TORCH_CHECK(layer >= 0 && layer < k_cache.size(0), "paged_attention: layer out of range");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "paged_attention: the pools must be contiguous and of one shape");
  const int64_t layer_bytes = k_cache.stride(0) * k_cache.element_size();
  const Layer pool{static_cast<char*>(k_cache.data_ptr()) + layer * layer_bytes,
                   static_cast<char*>(v_cache.data_ptr()) + layer * layer_bytes, k_cache.size(1), k_cache.size(2),
                   k_cache.size(3), k_cache.stride(1)};
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k.scalar_type() == k_cache.scalar_type() &&
                  v.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "paged_attention: q, k, v and the pools must share one dtype, fp32 or bf16");
  TORCH_CHECK(q.size(2) == pool.dim && q.size(1) % pool.kv_heads == 0, "paged_attention: head shapes differ");
  TORCH_CHECK(q.size(2) <= kMaxDim && q.size(1) / pool.kv_heads <= kMaxGroup,
              "paged_attention: head_dim above 256 or more than 16 query heads per KV head is not supported");
  TORCH_CHECK(row_slots.dim() == 2 && row_slots.size(0) == q.size(0) && row_len.numel() == q.size(0) &&
                  row_slots.scalar_type() == at::kLong && row_len.scalar_type() == at::kLong,
              "paged_attention: row_slots [T, W] and row_len [T] int64");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == write_slots.numel() && k.size(1) == pool.kv_heads &&
                  k.size(2) == pool.dim && write_slots.scalar_type() == at::kLong,
              "paged_attention: k and v [T, kv_heads, D] with one int64 write slot per row");
  const at::Tensor where = write_slots.contiguous();
  const int64_t* write = where.data_ptr<int64_t>();
  for (int64_t t = 0; t < where.numel(); ++t)
    TORCH_CHECK(write[t] >= 0 && write[t] < pool.slots, "paged_attention: a write slot is outside the pool");
  write_rows(pool.k, pool, k, write);
  write_rows(pool.v, pool, v, write);
  at::Tensor qc = q.contiguous(), slots = row_slots.contiguous(), len = row_len.contiguous();
  // every key a row reads lies in the pool (a plain loop over the visible slots: ~1 ns per key, where aten
  // reductions cost microseconds per layer)
  const int64_t width = slots.size(1), pool_slots = pool.slots;
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = len.data_ptr<int64_t>();
  for (int64_t t = 0; t < len.numel(); ++t) {
    TORCH_CHECK(lp[t] >= 1 && lp[t] <= width, "paged_attention: every row sees between 1 and W keys");
    bool inside = true;
    for (int64_t j = 0; j < lp[t]; ++j) inside &= sp[t * width + j] >= 0 && sp[t * width + j] < pool_slots;
    TORCH_CHECK(inside, "paged_attention: a read slot is outside the pool");
  }
  at::Tensor out = at::empty_like(qc);
  if (q.scalar_type() == at::kFloat) {
    attend_dim<float>(qc, pool, slots, len, scale, out);
  } else {
    attend_dim<at::BFloat16>(qc, pool, slots, len, scale, out);
  }
  return out.view({q.size(0), q.size(1) * q.size(2)});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(whiflash, m) {
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, int layer, "
        "Tensor write_slots, Tensor row_slots, Tensor row_len, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(whiflash, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
