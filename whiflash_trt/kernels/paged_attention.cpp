// whiflash::paged_attention: writes the new tokens' K/V into layer `layer` of the paged pools, then attends every
// query row to its visible keys, given per row as pool slots in logical order. The op mutates the whole pools (not a
// view of one layer) so that torch.export sees plain in-place writes to graph inputs. Given the rows' cos and sin,
// it rotates q and k first (rope_head, attention.h, rounded as models/layers.py apply_rope): k as it writes it into
// the pool, q as each task reads it on the AMX path and into a copy on the other.
//
// Two paths: bf16 heads of a multiple of 64 dims in a process whose GEMM loop is AMX take attention_amx.cpp's (tiles
// for every query vector that shares the keys); every other call the vector one below (simd.h: kLanes = 8 fp32
// lanes on AVX2, 16 on AVX-512). A process takes one path for every call, so both halves of a verify-versus-decode
// comparison round alike.
//
// Row invariance by construction: a row's keys are cut into two runs at a point that depends on their number alone
// (split_at); one (row, run, KV head) is computed by one thread, in a fixed order that depends only on its query and
// its keys: scores q.k kLanes keys at a time (each key's kLanes partial lanes over head_dim, by FMAs in two chains,
// the even and the odd vectors, then added; bf16 in an AVX-512 BF16 build by VDPBF16PS; reduced by one fixed tree),
// the max, exp(s - max) kLanes keys at a time and their sum (kLanes lanes, then a fixed reduction), then sum_j p_j v_j
// in key order (kLanes lanes over head_dim; in an AVX-512 BF16 build, bf16 heads of a multiple of 32 dims: p rounded
// to bf16, as flash attention does, and keys two at a time by VDPBF16PS). The two runs' sums are then merged under
// their common max. A verify row, a tree node or a row of a batched call equals the same position fed alone, bit for
// bit (tests/test_kernels.py).
//
// Why two runs: a decode row has as many tasks as KV heads (SmolLM2: 3), so two threads would take 2 and 1; one run
// per thread of all KV heads balances them and reads each slot's K and V whole. Timings: docs/measurements.md,
// "Kernels".
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "aoti_shim.h"
#include "attention.h"
#include "simd.h"

namespace {

using whiflash::Layer;
using whiflash::merge_runs;
using whiflash::Partial;
using whiflash::Rope;
using whiflash::split_at;
using whiflash::exp_weights;
using whiflash::kLanes;
using whiflash::Mask;
using whiflash::Vec;

constexpr int kMaxGroup = 16;   // query heads per KV head
constexpr int kMaxDim = 256;

// bf16 heads of an even number of 16-lane vectors weigh their values in pairs of keys (weigh_pairs, AVX-512 BF16
// builds)
#if defined(__AVX512BF16__)
template <typename T, int Vecs>
constexpr bool kPairs = std::is_same_v<T, at::BFloat16> && Vecs % 2 == 0;
#else
template <typename T, int Vecs>
constexpr bool kPairs = false;
#endif

// sum_j p[h][j] v_j for G heads (accumulators in registers), keys in order, p already exp'd; -> acc_out[G][Vecs *
// kLanes]
template <typename T, int Vecs, int G>
void weigh_values(const float* p, int64_t ld, const T* v_pool, int64_t slot_stride, const int64_t* slots,
                  int64_t keys, int64_t dim, float* acc_out) {
  Vec acc[G][Vecs];
  for (int h = 0; h < G; ++h)
    for (int i = 0; i < Vecs; ++i) acc[h][i] = Vec::zero();
  const bool full = dim == Vecs * kLanes;
  for (int64_t j = 0; j < keys; ++j) {
    const T* v = v_pool + slots[j] * slot_stride;
    Vec vv[Vecs];
    for (int i = 0; i < Vecs; ++i)
      vv[i] = full ? Vec::load(v + kLanes * i) : Vec::load(v + kLanes * i, dim - kLanes * i);
    for (int h = 0; h < G; ++h) {
      const Vec w = Vec::all(p[h * ld + j]);
      for (int i = 0; i < Vecs; ++i) acc[h][i] = fma(w, vv[i], acc[h][i]);
    }
  }
  for (int h = 0; h < G; ++h)
    for (int i = 0; i < Vecs; ++i) acc[h][i].store(acc_out + (h * Vecs + i) * kLanes);
}

#if defined(__AVX512BF16__)

// weigh_values for bf16 values of head_dim Vecs * 16 (Vecs even) and weights p as bf16, packed by pairs (p_j in
// the low half of dword j / 2 of a head's row, p_{j+1} in its high half; an odd last key pairs with zero): keys two
// at a time, one VDPBF16PS per 16 dims adds p_j v_j[d] + p_{j+1} v_{j+1}[d] to lane d (the pair's products exact in
// fp32), half the multiply-adds of the fp32 loop and no widening. The pair (v_j, v_{j+1}) is interleaved by
// unpacklo/hi_epi16, which put dims 8L+0..3 (lo) and 8L+4..7 (hi) of each 128-bit quarter L in its dwords 4L..4L+3;
// the accumulators go back to dim order at the end.
template <int Vecs, int G>
void weigh_pairs(const float* p, int64_t ld, const at::BFloat16* v_pool, int64_t slot_stride, const int64_t* slots,
                 int64_t keys, float* acc_out) {
  static_assert(Vecs % 2 == 0, "pairs of 32 bf16 per register");
  __m512 acc[G][Vecs];
  for (int h = 0; h < G; ++h)
    for (int i = 0; i < Vecs; ++i) acc[h][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < keys; j += 2) {
    const bool two = j + 1 < keys;
    const at::BFloat16* a = v_pool + slots[j] * slot_stride;
    const at::BFloat16* b = two ? v_pool + slots[j + 1] * slot_stride : nullptr;
    __m512i pair[Vecs];
    for (int r = 0; r < Vecs / 2; ++r) {
      const __m512i va = _mm512_loadu_si512(a + 32 * r);
      const __m512i vb = two ? _mm512_loadu_si512(b + 32 * r) : _mm512_setzero_si512();
      pair[2 * r] = _mm512_unpacklo_epi16(va, vb);
      pair[2 * r + 1] = _mm512_unpackhi_epi16(va, vb);
    }
    for (int h = 0; h < G; ++h) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(reinterpret_cast<const int32_t*>(p + h * ld)[j / 2]);
      for (int i = 0; i < Vecs; ++i) acc[h][i] = _mm512_dpbf16_ps(acc[h][i], (__m512bh)pair[i], w);
    }
  }
  for (int h = 0; h < G; ++h) {
    float* out = acc_out + h * Vecs * 16;
    for (int r = 0; r < Vecs / 2; ++r) {
      alignas(64) float lo[16], hi[16];
      _mm512_store_ps(lo, acc[h][2 * r]);
      _mm512_store_ps(hi, acc[h][2 * r + 1]);
      for (int q = 0; q < 4; ++q)
        for (int i = 0; i < 4; ++i) {
          out[32 * r + 8 * q + i] = lo[4 * q + i];
          out[32 * r + 8 * q + 4 + i] = hi[4 * q + i];
        }
    }
  }
}

#endif

// G heads' values: in pairs of keys where `paired` (kPairs and head_dim Vecs * 16), else one key at a time
template <typename T, int Vecs, int G>
void weigh(bool paired, const float* p, int64_t ld, const T* v_pool, int64_t slot_stride, const int64_t* slots,
           int64_t keys, int64_t dim, float* acc_out) {
#if defined(__AVX512BF16__)
  if constexpr (kPairs<T, Vecs>) {
    if (paired) return weigh_pairs<Vecs, G>(p, ld, v_pool, slot_stride, slots, keys, acc_out);
  }
#endif
  weigh_values<T, Vecs, G>(p, ld, v_pool, slot_stride, slots, keys, dim, acc_out);
}

// A head's query, ready for q.k against keys of type T, as Vecs vectors of fp32 (bf16 widened, exact): FMAs over
// head_dim. In an AVX-512 BF16 build bf16 keeps its pairs (one VDPBF16PS per 32 elements: each product exact in
// fp32, a pair's two added into its lane as the hardware does). dot() gives kLanes fp32 lanes whose sum is q.k; how
// a key's elements fall into lanes depends on head_dim alone.
template <typename T, int Vecs>
struct Query {
  Vec q[Vecs];
  int64_t dim;
  bool full;   // head_dim is Vecs whole vectors: loads without a tail
  Query(const T* p, int64_t dim) : dim(dim), full(dim == Vecs * kLanes) {
    for (int i = 0; i < Vecs; ++i) q[i] = Vec::load(p + kLanes * i, dim - kLanes * i);
  }
  // the even vectors' products into one accumulator and the odd ones' into another, then their sum: two chains of
  // FMAs in flight, not one
  Vec dot(const T* k) const {
    Vec even = Vec::zero(), odd = Vec::zero();
    if (full) {
      for (int i = 0; i < Vecs; i += 2) {
        even = fma(q[i], Vec::load(k + kLanes * i), even);
        if (i + 1 < Vecs) odd = fma(q[i + 1], Vec::load(k + kLanes * (i + 1)), odd);
      }
    } else {
      for (int i = 0; i < Vecs; i += 2) {
        even = fma(q[i], Vec::load(k + kLanes * i, dim - kLanes * i), even);
        if (i + 1 < Vecs) odd = fma(q[i + 1], Vec::load(k + kLanes * (i + 1), dim - kLanes * (i + 1)), odd);
      }
    }
    return even + odd;
  }
};

#if defined(__AVX512BF16__)
template <int Vecs>
struct Query<at::BFloat16, Vecs> {
  static constexpr int kRegs = (Vecs + 1) / 2;   // 32 bf16 per register
  __m512bh q[kRegs];
  __mmask32 m[kRegs];
  Query(const at::BFloat16* p, int64_t dim) {
    for (int i = 0; i < kRegs; ++i) {
      const int64_t left = dim - 32 * i;
      m[i] = left >= 32 ? ~(__mmask32)0 : left <= 0 ? (__mmask32)0 : (__mmask32)((1u << left) - 1);
      q[i] = (__m512bh)_mm512_maskz_loadu_epi16(m[i], p + 32 * i);
    }
  }
  Vec dot(const at::BFloat16* k) const {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < kRegs; ++i)
      acc = _mm512_dpbf16_ps(acc, q[i], (__m512bh)_mm512_maskz_loadu_epi16(m[i], k + 32 * i));
    return {acc};
  }
};
#endif

// Decode and verify find a layer's K/V out of cache (the weights streamed through since): while the first head
// scores a chunk, fetch the next chunk's keys and this chunk's values (read after the softmax) into L1.
template <typename T>
inline void prefetch_chunk(const T* k_pool, const T* v_pool, int64_t slot_stride, const int64_t* slots, int64_t j0,
                           int64_t keys, int64_t bytes) {
  const int64_t next = std::min<int64_t>(keys, j0 + 2 * kLanes);
  for (int64_t j = j0 + kLanes; j < next; ++j)
    for (int64_t b = 0; b < bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(k_pool + slots[j] * slot_stride) + b, _MM_HINT_T0);
  for (int64_t j = j0; j < std::min<int64_t>(keys, j0 + kLanes); ++j)
    for (int64_t b = 0; b < bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(v_pool + slots[j] * slot_stride) + b, _MM_HINT_T0);
}

// One row's heads that share a KV head (a GQA group), over one run of its keys. Scores kLanes keys at a time per
// head
// (the keys stay in L1 across the group's heads), then softmax and values; each value is loaded and widened once for
// all heads. A head's bits depend on its query and its keys alone (not on the group, the row's place in the call,
// or the thread). Vecs = ceil(head_dim / kLanes).
template <typename T, int Vecs>
void attend_group(const T* q, int64_t group, const T* k_pool, const T* v_pool, int64_t slot_stride,
                  const int64_t* slots, int64_t keys, int64_t dim, float scale, float* scores, int64_t ld,
                  Partial<Vecs>* out) {
  alignas(64) float acc[kMaxGroup][Vecs * kLanes];
  float top[kMaxGroup], total[kMaxGroup];
  const bool paired = kPairs<T, Vecs> && dim == Vecs * 16;   // bf16 values, p rounded to bf16 (weigh_pairs)
  for (int64_t h = 0; h < group; ++h) {
    const Query<T, Vecs> qh(q + h * dim, dim);
    Vec best = Vec::all(-INFINITY);
    for (int64_t j0 = 0; j0 < keys; j0 += kLanes) {
      const int64_t n = std::min<int64_t>(kLanes, keys - j0);
      if (h == 0) prefetch_chunk(k_pool, v_pool, slot_stride, slots, j0, keys, dim * sizeof(T));
      Vec d[kLanes];
      for (int64_t j = 0; j < kLanes; ++j) d[j] = j < n ? qh.dot(k_pool + slots[j0 + j] * slot_stride) : Vec::zero();
      const Vec s = whiflash::sum_lanes(d) * Vec::all(scale);
      s.store(scores + h * ld + j0, n);
      best = select(Mask::first(n), max(best, s), best);
    }
    top[h] = reduce_max(best);
  }
  // the weights; paired, p goes back as bf16 over the first half of the head's row
  for (int64_t h = 0; h < group; ++h) {
    float* sh = scores + h * ld;
    auto* ph = reinterpret_cast<uint16_t*>(sh);
    total[h] = exp_weights(sh, keys, top[h], paired ? ph : nullptr);
    if (paired && keys % 2) ph[keys] = 0;
  }
  // heads 4 at a time, their accumulators in registers (each head's order is the same in any chunk)
  for (int64_t h0 = 0; h0 < group; h0 += 4) {
    const float* p = scores + h0 * ld;
    float* a = acc[h0];
    switch (std::min<int64_t>(4, group - h0)) {
      case 1: weigh<T, Vecs, 1>(paired, p, ld, v_pool, slot_stride, slots, keys, dim, a); break;
      case 2: weigh<T, Vecs, 2>(paired, p, ld, v_pool, slot_stride, slots, keys, dim, a); break;
      case 3: weigh<T, Vecs, 3>(paired, p, ld, v_pool, slot_stride, slots, keys, dim, a); break;
      default: weigh<T, Vecs, 4>(paired, p, ld, v_pool, slot_stride, slots, keys, dim, a); break;
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    out[h].top = top[h];
    out[h].total = total[h];
    std::memcpy(out[h].acc, acc[h], sizeof(out[h].acc));
  }
}

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
  // task i: run i / rows of row i % rows, every KV head (the first runs of all rows, then the second runs: with two
  // threads, each reads one half of the keys the rows share)
  Partial<Vecs>* part = whiflash::partials<Vecs>(2 * rows * heads);
  at::parallel_for(0, 2 * rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * width);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t run = i / rows, t = i % rows, cut = split_at(lp[t]);
      const int64_t from = run == 0 ? 0 : cut, to = run == 0 ? cut : lp[t];
      for (int64_t kv = 0; to > from && kv < kv_heads; ++kv)
        attend_group<T, Vecs>(qp + (t * heads + kv * group) * dim, group, kp + kv * dim, vp + kv * dim,
                              pool.slot_stride, sp + t * width + from, to - from, dim, static_cast<float>(scale),
                              scores.data(), width, part + i * heads + kv * group);
    }
  });
  merge_runs<T, Vecs>(part, lp, rows, heads, dim, op);
}

template <typename T>
void attend_dim(const at::Tensor& q, const Layer& pool, const at::Tensor& row_slots, const at::Tensor& row_len,
                double scale, at::Tensor& out) {
  constexpr int per16 = 16 / kLanes;   // vectors per 16 dims
  switch ((q.size(2) + 15) / 16) {
    case 1: return attend<T, 1 * per16>(q, pool, row_slots, row_len, scale, out);
    case 2: return attend<T, 2 * per16>(q, pool, row_slots, row_len, scale, out);
    case 3: return attend<T, 3 * per16>(q, pool, row_slots, row_len, scale, out);
    case 4: return attend<T, 4 * per16>(q, pool, row_slots, row_len, scale, out);
    case 5: case 6: return attend<T, 6 * per16>(q, pool, row_slots, row_len, scale, out);
    case 7: case 8: return attend<T, 8 * per16>(q, pool, row_slots, row_len, scale, out);
    default: return attend<T, 16 * per16>(q, pool, row_slots, row_len, scale, out);
  }
}

// Rows [T, heads, D] whose heads x D are contiguous, read in place (q, k and v of a verify are such views of the
// fused QKV projection; a copy of V cost ~10 us per layer)
bool heads_in_place(const at::Tensor& rows) {
  return rows.stride(2) == 1 && (rows.size(1) == 1 || rows.stride(1) == rows.size(2));
}

// Row t of rows [T, heads, D] (from: its heads x D, contiguous) through rope_head at the row's cos and sin, into dst
template <typename T>
void rope_row(const T* from, int64_t heads, int64_t dim, const Rope& rope, int64_t t, T* dst) {
  const T* c = static_cast<const T*>(rope.cos) + t * dim;
  const T* s = static_cast<const T*>(rope.sin) + t * dim;
  for (int64_t h = 0; h < heads; ++h) whiflash::rope_head(from + h * dim, c, s, dim, dst + h * dim);
}

// layer[write_slots[t]] = rows[t] for every row t: one memcpy of kv_heads * D per row (index_copy_'s dispatch and
// checks cost ~3 us per call, 30 layers x 2 pools a step); with `rope` (the keys), each head through rope_head at
// its row's cos and sin instead.
template <typename T>
void write_rows(char* layer, const Layer& pool, const at::Tensor& rows, const int64_t* slot, const Rope* rope) {
  const at::Tensor src = heads_in_place(rows) ? rows : rows.contiguous();
  const int64_t n = src.size(0), heads = src.size(1), dim = src.size(2), from_stride = src.stride(0);
  const T* from = src.data_ptr<T>();
  T* to = reinterpret_cast<T*>(layer);
  for (int64_t t = 0; t < n; ++t) {
    T* dst = to + slot[t] * pool.slot_stride;
    if (rope == nullptr) std::memcpy(dst, from + t * from_stride, heads * dim * sizeof(T));
    else rope_row(from + t * from_stride, heads, dim, *rope, t, dst);
  }
}

// q [T, heads, D] as the vector path reads it: contiguous, rotated with `rope`
template <typename T>
at::Tensor queries(const at::Tensor& q, const Rope* rope) {
  if (rope == nullptr) return q.contiguous();
  const at::Tensor src = heads_in_place(q) ? q : q.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  const int64_t heads = q.size(1), dim = q.size(2);
  const T* from = src.data_ptr<T>();
  T* to = out.data_ptr<T>();
  for (int64_t t = 0; t < q.size(0); ++t)
    rope_row(from + t * src.stride(0), heads, dim, *rope, t, to + t * heads * dim);
  return out;
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                           at::Tensor v_cache, int64_t layer, const at::Tensor& write_slots,
                           const at::Tensor& row_slots, const at::Tensor& row_len, double scale,
                           const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin) {
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
  TORCH_CHECK(cos.has_value() == sin.has_value(), "paged_attention: cos and sin come together");
  at::Tensor cos_rows, sin_rows;
  Rope rope_rows;
  const Rope* rope = nullptr;
  if (cos.has_value()) {
    TORCH_CHECK(cos->sizes() == sin->sizes() && cos->dim() >= 2 && cos->size(0) == q.size(0) &&
                    cos->size(-1) == pool.dim && cos->numel() == q.size(0) * pool.dim &&
                    cos->scalar_type() == q.scalar_type() && sin->scalar_type() == q.scalar_type() &&
                    pool.dim % 2 == 0,
                "paged_attention: cos and sin [T, D] or [T, 1, D] (D even) in q's dtype");
    cos_rows = cos->contiguous(), sin_rows = sin->contiguous();
    rope_rows = Rope{cos_rows.data_ptr(), sin_rows.data_ptr()};
    rope = &rope_rows;
  }
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  if (bf16) {
    write_rows<at::BFloat16>(pool.k, pool, k, write, rope);
    write_rows<at::BFloat16>(pool.v, pool, v, write, nullptr);
  } else {
    write_rows<float>(pool.k, pool, k, write, rope);
    write_rows<float>(pool.v, pool, v, write, nullptr);
  }
  at::Tensor slots = row_slots.contiguous(), len = row_len.contiguous();
  // every key a row reads lies in the pool: one unsigned compare per slot (a negative slot compares as a huge one),
  // which the compiler vectorises; aten reductions would cost microseconds per layer
  const int64_t width = slots.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = len.data_ptr<int64_t>();
  const uint64_t limit = static_cast<uint64_t>(pool.slots);
  for (int64_t t = 0; t < len.numel(); ++t) {
    TORCH_CHECK(lp[t] >= 1 && lp[t] <= width, "paged_attention: every row sees between 1 and W keys");
    bool outside = false;
    for (int64_t j = 0; j < lp[t]; ++j) outside |= static_cast<uint64_t>(sp[t * width + j]) >= limit;
    TORCH_CHECK(!outside, "paged_attention: a read slot is outside the pool");
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
#if defined(__AMX_TILE__)
  if (bf16 && whiflash::amx_selected() && whiflash::amx_fits(pool.dim)) {   // reads q in place, rotates it per task
    const at::Tensor qv = heads_in_place(q) ? q : q.contiguous();
    whiflash::attend_amx(qv.data_ptr<at::BFloat16>(), qv.stride(0), qv.size(0), qv.size(1), pool, sp, width, lp,
                         static_cast<float>(scale), rope, out.data_ptr<at::BFloat16>());
    return out.view({q.size(0), q.size(1) * q.size(2)});
  }
#endif
  if (bf16) {
    attend_dim<at::BFloat16>(queries<at::BFloat16>(q, rope), pool, slots, len, scale, out);
  } else {
    attend_dim<float>(queries<float>(q, rope), pool, slots, len, scale, out);
  }
  return out.view({q.size(0), q.size(1) * q.size(2)});
}

}  // namespace

// C shim (aoti_shim.h)
extern "C" AOTITorchError aoti_torch_cpu_paged_attention(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v,
                                                         AtenTensorHandle k_cache, AtenTensorHandle v_cache,
                                                         int64_t layer, AtenTensorHandle write_slots,
                                                         AtenTensorHandle row_slots, AtenTensorHandle row_len,
                                                         double scale, AtenTensorHandle* cos, AtenTensorHandle* sin,
                                                         AtenTensorHandle* out) {
  using namespace whiflash::shim;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(give(paged_attention(tensor(q), tensor(k), tensor(v), tensor(k_cache),
      tensor(v_cache), layer, tensor(write_slots), tensor(row_slots), tensor(row_len), scale, optional(cos),
      optional(sin)), out);)
}

TORCH_LIBRARY_FRAGMENT(whiflash, m) {
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, int layer, "
        "Tensor write_slots, Tensor row_slots, Tensor row_len, float scale, Tensor? cos, Tensor? sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(whiflash, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
