// paged_attention's AMX path (whiflash::attend_amx): bf16 heads of a multiple of 64 dims, in a process whose GEMM
// loop is AMX. Scores and value sums go through TDPBF16PS for all the query vectors of a call that see the same
// keys, so the rows of a verify cost little more than one row.
//
// A task is one (run, KV head, column tile) of the call: two runs of keys per row as split_at cuts them, the query
// vectors of the KV head as columns (column c = row * group + head in the group), 16 to a tile. Keys go in chunks of
// 32 at absolute positions, the same for a row alone and in any call.
// - Scores: C [16 keys x 16 columns] = A [16 keys x 32 dims] (the keys as the pool holds them) . B [16 dim pairs x
//   16 columns] (the queries, transposed per task), summed over the head in steps of 32 dims; then transposed into
//   each column's scores.
// - Softmax per column over its run: the max, p = exp(s - max) rounded to bf16, their sum in 16 lanes.
// - Values: C [16 columns x 16 dims] += A [16 columns x 32 keys] (p) . B [16 key pairs x 16 dims] (two keys' values
//   interleaved), four C tiles per 64 dims.
// Rows that see the same keys in a chunk (a verify's context, a chain's rows) share its pass: the row that sees most
// of the chunk leads, and rows whose keys there are a prefix of its keys join it. Other rows (a tree's branches, a
// batch's sequences) get passes of their own, in which the other columns' p are zero.
//
// Row invariance: TDPBF16PS computes each C element from its own A row and B column, in a fixed order; a column's
// keys sit at the same places of the same chunks in any call, and keys it does not see weigh zero (adding an exact 0
// changes no sum), so a row's bits are those it gets alone (tests/test_kernels.py). They are not the AVX-512 path's:
// TDPBF16PS adds its pairs otherwise than a chain of VDPBF16PS (on a Xeon with AMX, 65% of the elements of random
// 16 x 16 x 32 products differed in the last bits), so one process takes one path for every call.
//
// Against the AVX-512 path, AMX tiles are faster from a few rows up (a tree, a chain, a prefill) and a little slower
// on a decode row; tasks of four column tiles sharing the keys and value pairs are slower than the tasks here. A
// chunk's two score halves go in tiles of their own (their loads and products overlap), the queries are transposed in
// vectors and p is zeroed only outside each column's run. Timings: docs/measurements.md, "Kernels".
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "attention.h"
#include "simd.h"

namespace whiflash {
namespace {

constexpr int kChunk = 32;   // keys per chunk: one A row of p (16 pairs)
constexpr int kCols = 16;    // query vectors per column tile
constexpr int kMaxVecs = 16; // head_dim / 16 at most (256 dims)

// Tiles: scores C 0 and 5 (a chunk's two halves), keys 1, 4 and 6, 7, queries 2 and 3; then p 1, values 0, 2 and
// 3, their sums 4-7. Each 16 x 64 bytes
void configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// 16 rows of 16 fp32 -> their transpose
inline void transpose16(const float* in, __m512 (&out)[16]) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(in + 16 * i);
  for (int i = 0; i < 8; ++i) {   // quarter Q: rows 2i, 2i+1 at columns 4Q, 4Q+1 (lo) and 4Q+2, 4Q+3 (hi)
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {   // r[4i + e], quarter Q: column 4Q + e of rows 4i .. 4i+3
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int e = 0; e < 4; ++e) {   // column 4Q + e: quarter Q of r[e], r[4 + e], r[8 + e], r[12 + e]
    const __m512 a = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x88), b = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xDD);
    const __m512 c = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x88);
    const __m512 d = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xDD);
    out[e] = _mm512_shuffle_f32x4(a, c, 0x88);
    out[4 + e] = _mm512_shuffle_f32x4(b, d, 0x88);
    out[8 + e] = _mm512_shuffle_f32x4(a, c, 0xDD);
    out[12 + e] = _mm512_shuffle_f32x4(b, d, 0xDD);
  }
}

// Rows of one chunk that share a pass: the leader's keys up to `end`, the columns (a bit each) of its members
struct Pass {
  int64_t leader, end, to;   // to: where the leader's run ends
  uint32_t columns;
};

struct Call {
  const at::BFloat16* q;
  int64_t q_row;                 // elements from one row of q to the next
  const Rope* rope;              // null: q as it is
  int64_t rows, heads, group, dim;
  const Layer* pool;
  const int64_t* slots;
  int64_t width;
  const int64_t* len;
  float scale;
};

// A thread's buffers, kept across its tasks and calls (sized once, no allocation per layer)
struct Buffers {
  std::vector<float> scores;     // [column][key]
  std::vector<uint16_t> p;       // [column][key], bf16
  std::vector<Pass> passes;      // every chunk's passes, chunk after chunk
  std::vector<size_t> chunks;    // where each chunk's passes start in passes, then their end
};

class Task {
 public:
  Task(const Call& call, int run, int64_t kv, int64_t tile, Buffers& buffers)
      : c_(call), run_(run), kv_(kv), first_col_(tile * kCols),
        cols_(std::min<int64_t>(kCols, call.rows * call.group - tile * kCols)), ld_((call.width + kChunk) / kChunk *
        kChunk), buffers_(buffers), passes_(buffers.passes), chunks_(buffers.chunks) {
    passes_.clear();
    chunks_.clear();
  }

  // this task's partial results into part[(run * rows + row) * heads + head]
  template <int Vecs>
  void run(Partial<Vecs>* part) {
    lo_ = INT64_MAX, hi_ = 0;
    for (int n = 0; n < cols_; ++n) {
      range(row(n), from_[n], to_[n]);
      if (from_[n] < to_[n]) lo_ = std::min(lo_, from_[n]), hi_ = std::max(hi_, to_[n]);
    }
    if (lo_ >= hi_) return;
    scores_ = aligned64(buffers_.scores, kCols * ld_);
    p_ = aligned64(buffers_.p, kCols * ld_);
    // a column's p is zero over the chunks' keys outside its run (softmax writes the rest); the columns past cols_
    // only give C rows that are never read
    const int64_t end = lo_ + (hi_ - lo_ + kChunk - 1) / kChunk * kChunk;
    for (int n = 0; n < cols_; ++n) {
      uint16_t* pn = p_ + n * ld_;
      if (from_[n] >= to_[n]) {
        std::memset(pn + lo_, 0, (end - lo_) * sizeof(uint16_t));
        continue;
      }
      std::memset(pn + lo_, 0, (from_[n] - lo_) * sizeof(uint16_t));
      std::memset(pn + to_[n], 0, (end - to_[n]) * sizeof(uint16_t));
    }
    transpose_queries();
    if (c_.dim == 64) {   // the queries' two B tiles stay for every chunk
      tile_memory_fence();
      _tile_loadd(2, qt_[0], 64);
      _tile_loadd(3, qt_[1], 64);
    }
    for (int64_t k0 = lo_; k0 < hi_; k0 += kChunk) {
      chunks_.push_back(passes_.size());
      plan(k0);
      for (size_t i = chunks_.back(); i < passes_.size(); ++i) score(k0, passes_[i]);
    }
    chunks_.push_back(passes_.size());
    float top[kCols], total[kCols];
    for (int n = 0; n < cols_; ++n)
      if (from_[n] < to_[n]) softmax(n, top[n], total[n]);
    alignas(64) float acc[kCols][kMaxVecs * 16];
    for (int64_t d0 = 0; d0 < c_.dim; d0 += 64) weigh(d0, acc);
    for (int n = 0; n < cols_; ++n) {
      if (from_[n] >= to_[n]) continue;
      Partial<Vecs>& out = part[(run_ * c_.rows + row(n)) * c_.heads + head(n)];
      out.top = top[n], out.total = total[n];
      std::memcpy(out.acc, acc[n], sizeof(out.acc));
    }
  }

 private:
  int64_t row(int n) const { return (first_col_ + n) / c_.group; }
  int64_t head(int n) const { return kv_ * c_.group + (first_col_ + n) % c_.group; }
  const int64_t* slots_of(int64_t r) const { return c_.slots + r * c_.width; }
  void range(int64_t r, int64_t& from, int64_t& to) const {
    const int64_t cut = split_at(c_.len[r]);
    from = run_ == 0 ? 0 : cut, to = run_ == 0 ? cut : c_.len[r];
  }
  const uint16_t* key(int64_t slot) const {
    return reinterpret_cast<const uint16_t*>(c_.pool->k) + slot * c_.pool->slot_stride + kv_ * c_.dim;
  }
  const uint16_t* value(int64_t slot) const {
    return reinterpret_cast<const uint16_t*>(c_.pool->v) + slot * c_.pool->slot_stride + kv_ * c_.dim;
  }

  // B tiles of the queries: qt_[dc][pair p][column n] = the n-th query's dims 32 dc + 2p, 2p + 1 (zero past cols_):
  // per 32 dims, the columns' 16 pairs as 16 rows of 16 int32, transposed. With RoPE each column's query is rotated
  // first (into stage_, free until the scores).
  void transpose_queries() {
    const at::BFloat16* query[kCols];
    for (int n = 0; n < cols_; ++n) {
      query[n] = c_.q + row(n) * c_.q_row + head(n) * c_.dim;
      if (c_.rope == nullptr) continue;
      auto* rotated = reinterpret_cast<at::BFloat16*>(stage_[0]) + n * c_.dim;
      rope_head(query[n], static_cast<const at::BFloat16*>(c_.rope->cos) + row(n) * c_.dim,
                static_cast<const at::BFloat16*>(c_.rope->sin) + row(n) * c_.dim, c_.dim, rotated);
      query[n] = rotated;
    }
    alignas(64) float rows[16 * 16];
    for (int64_t dc = 0; dc < c_.dim / 32; ++dc) {
      for (int n = 0; n < 16; ++n) {   // a pair of bf16 moved as one 32-bit lane
        const __m512 pairs = n < cols_ ? _mm512_loadu_ps(reinterpret_cast<const float*>(query[n]) + 16 * dc)
                                       : _mm512_setzero_ps();
        _mm512_store_ps(rows + 16 * n, pairs);
      }
      __m512 t[16];
      transpose16(rows, t);
      for (int pair = 0; pair < 16; ++pair) _mm512_store_ps(reinterpret_cast<float*>(qt_[dc][pair]), t[pair]);
    }
  }

  // The passes of chunk k0: the row seeing most of it leads; rows whose keys there are a prefix of its join it
  void plan(int64_t k0) {
    int64_t end[kCols];
    uint32_t left = 0;
    for (int n = 0; n < cols_; ++n) {
      end[n] = std::min(to_[n], k0 + kChunk);
      if (from_[n] <= k0 && k0 < to_[n]) left |= 1u << n;
    }
    while (left) {
      int lead = __builtin_ctz(left);
      for (uint32_t m = left; m; m &= m - 1)
        if (end[__builtin_ctz(m)] > end[lead]) lead = __builtin_ctz(m);
      const int64_t* mine = slots_of(row(lead));
      uint32_t members = 0;
      int64_t seen = -1;   // a row's columns are adjacent: compare its keys once
      bool same = false;
      for (uint32_t m = left; m; m &= m - 1) {
        const int n = __builtin_ctz(m);
        if (row(n) != seen) {
          seen = row(n);
          same = end[n] <= end[lead] &&
                 std::memcmp(slots_of(seen) + k0, mine + k0, (end[n] - k0) * sizeof(int64_t)) == 0;
        }
        if (same) members |= 1u << n;
      }
      passes_.push_back({row(lead), end[lead], to_[lead], members});
      left &= ~members;
    }
  }

  // The K/V of a layer come from memory (the weights streamed through since): fetch the leader's next keys and
  // (for weigh) this chunk's values while the tiles work
  void prefetch(const Pass& pass, int64_t k0) const {
    const int64_t* s = slots_of(pass.leader);
    const int64_t bytes = c_.dim * sizeof(uint16_t);
    for (int64_t j = k0 + kChunk; j < std::min(pass.to, k0 + 2 * kChunk); ++j)
      for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(key(s[j])) + b, _MM_HINT_T0);
    for (int64_t j = k0; j < std::min(pass.end, k0 + kChunk); ++j)
      for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(value(s[j])) + b, _MM_HINT_T1);
  }

  // Half h of chunk k0 of a pass (keys j0 .. j0 + 15) as an A tile: the pool's rows where the slots are 16 in a row,
  // else gathered into stage_[h] (zero rows past the pass's end)
  const uint16_t* keys_tile(const Pass& pass, int64_t j0, int h, int64_t& lda) {
    const int64_t* s = slots_of(pass.leader);
    const int64_t n = std::min<int64_t>(16, pass.end - j0);
    bool direct = n == 16;
    for (int i = 1; direct && i < 16; ++i) direct = s[j0 + i] == s[j0] + i;
    if (direct) {
      lda = c_.pool->slot_stride * sizeof(uint16_t);
      return key(s[j0]);
    }
    for (int i = 0; i < 16; ++i) {
      if (i < n) std::memcpy(stage_[h] + i * c_.dim, key(s[j0 + i]), c_.dim * sizeof(uint16_t));
      else std::memset(stage_[h] + i * c_.dim, 0, c_.dim * sizeof(uint16_t));
    }
    lda = c_.dim * sizeof(uint16_t);
    return stage_[h];
  }

  // Scores of a pass's members over chunk k0, its halves of 16 keys in C tiles 0 and 5 (at 64 dims the second
  // half's keys in tiles 6 and 7, so its loads and products overlap the first's)
  void score(int64_t k0, const Pass& pass) {
    prefetch(pass, k0);
    const int halves = pass.end > k0 + 16 ? 2 : 1;
    const uint16_t* a[2];
    int64_t lda[2];
    for (int h = 0; h < halves; ++h) a[h] = keys_tile(pass, k0 + 16 * h, h, lda[h]);
    alignas(64) float c[2][16 * 16];
    tile_memory_fence();
    if (c_.dim == 64) {   // the queries in tiles 2 and 3 (run)
      _tile_zero(0);
      _tile_loadd(1, a[0], lda[0]);
      _tile_loadd(4, a[0] + 32, lda[0]);
      if (halves == 2) {
        _tile_zero(5);
        _tile_loadd(6, a[1], lda[1]);
        _tile_loadd(7, a[1] + 32, lda[1]);
      }
      _tile_dpbf16ps(0, 1, 2);
      if (halves == 2) _tile_dpbf16ps(5, 6, 2);
      _tile_dpbf16ps(0, 4, 3);
      if (halves == 2) _tile_dpbf16ps(5, 7, 3);
      _tile_stored(0, c[0], 64);
      if (halves == 2) _tile_stored(5, c[1], 64);
    } else {
      for (int h = 0; h < halves; ++h) {
        _tile_zero(0);
        for (int64_t dc = 0; dc < c_.dim / 32; dc += 2) {   // keys in tiles 1 and 4, queries in 2 and 3
          _tile_loadd(1, a[h] + 32 * dc, lda[h]);
          _tile_loadd(4, a[h] + 32 * dc + 32, lda[h]);
          _tile_loadd(2, qt_[dc], 64);
          _tile_loadd(3, qt_[dc + 1], 64);
          _tile_dpbf16ps(0, 1, 2);
          _tile_dpbf16ps(0, 4, 3);
        }
        _tile_stored(0, c[h], 64);
      }
    }
    tile_memory_fence();
    for (int h = 0; h < halves; ++h) scatter(c[h], k0 + 16 * h, pass.columns);
  }

  // C [16 keys x 16 columns] of keys j0 .. j0 + 15, scaled, into the scores of each column in `columns`
  void scatter(const float* c, int64_t j0, uint32_t columns) {
    const __m512 scale = _mm512_set1_ps(c_.scale);
    if (__builtin_popcount(columns) <= 4) {   // a few columns: gather them
      const __m512i down = _mm512_mullo_epi32(_mm512_set1_epi32(16), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                                                        10, 11, 12, 13, 14, 15));
      for (uint32_t m = columns; m; m &= m - 1) {
        const int col = __builtin_ctz(m);
        const __m512 x = _mm512_i32gather_ps(_mm512_add_epi32(down, _mm512_set1_epi32(col)), c, 4);
        _mm512_storeu_ps(scores_ + col * ld_ + j0, _mm512_mul_ps(x, scale));
      }
    } else {
      __m512 t[16];
      transpose16(c, t);
      for (uint32_t m = columns; m; m &= m - 1) {
        const int col = __builtin_ctz(m);
        _mm512_storeu_ps(scores_ + col * ld_ + j0, _mm512_mul_ps(t[col], scale));
      }
    }
  }

  // Column n's max and weights (exp_weights: p as bf16, the sum of the rounded p) from its run's start
  void softmax(int n, float& top, float& total) {
    float* s = scores_ + n * ld_;
    __m512 best = _mm512_set1_ps(-INFINITY);
    for (int64_t j = from_[n]; j < to_[n]; j += 16) {
      const __mmask16 m = lanes(to_[n] - j);
      best = _mm512_mask_max_ps(best, m, best, _mm512_maskz_loadu_ps(m, s + j));
    }
    top = _mm512_reduce_max_ps(best);
    total = exp_weights(s + from_[n], to_[n] - from_[n], top, p_ + n * ld_ + from_[n]);
  }

  // dims d0 .. d0 + 63 of every column's sum_j p_j v_j into acc[column][dim]
  void weigh(int64_t d0, float (&acc)[kCols][kMaxVecs * 16]) {
    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
    for (size_t c = 0; c + 1 < chunks_.size(); ++c) {
      const size_t first = chunks_[c], last = chunks_[c + 1];
      for (size_t i = first; i < last; ++i) weigh_pass(lo_ + c * kChunk, passes_[i], d0, last - first == 1);
    }
    alignas(64) float c[4][16 * 16];
    _tile_stored(4, c[0], 64); _tile_stored(5, c[1], 64); _tile_stored(6, c[2], 64); _tile_stored(7, c[3], 64);
    tile_memory_fence();
    // tile b, lane 4L + i of a row: dim d0 + 32 (b / 2) + 8L + 4 (b % 2) + i (the unpacks' order)
    for (int n = 0; n < cols_; ++n)
      for (int b = 0; b < 4; ++b)
        for (int l = 0; l < 4; ++l)
          std::memcpy(&acc[n][d0 + 32 * (b / 2) + 8 * l + 4 * (b % 2)], &c[b][n * 16 + 4 * l], 4 * sizeof(float));
  }
  void weigh_pass(int64_t k0, const Pass& pass, int64_t d0, bool alone) {
    const int64_t* s = slots_of(pass.leader);
    alignas(64) uint32_t pairs[4][16][16];
    const __m512i zero = _mm512_setzero_si512();
    for (int t = 0; t < 16; ++t) {
      const int64_t j = k0 + 2 * t;
      const uint16_t* a = j < pass.end ? value(s[j]) + d0 : nullptr;
      const uint16_t* b = j + 1 < pass.end ? value(s[j + 1]) + d0 : nullptr;
      const __m512i a0 = a ? _mm512_loadu_si512(a) : zero, a1 = a ? _mm512_loadu_si512(a + 32) : zero;
      const __m512i b0 = b ? _mm512_loadu_si512(b) : zero, b1 = b ? _mm512_loadu_si512(b + 32) : zero;
      _mm512_store_si512(pairs[0][t], _mm512_unpacklo_epi16(a0, b0));
      _mm512_store_si512(pairs[1][t], _mm512_unpackhi_epi16(a0, b0));
      _mm512_store_si512(pairs[2][t], _mm512_unpacklo_epi16(a1, b1));
      _mm512_store_si512(pairs[3][t], _mm512_unpackhi_epi16(a1, b1));
    }
    const uint16_t* p = p_ + k0;
    int64_t ldp = ld_ * sizeof(uint16_t);
    alignas(64) uint16_t staged[16][kChunk];
    if (!alone) {   // the members' p, zero for the other columns
      for (int n = 0; n < kCols; ++n) {
        if (pass.columns >> n & 1) std::memcpy(staged[n], p_ + n * ld_ + k0, sizeof(staged[n]));
        else std::memset(staged[n], 0, sizeof(staged[n]));
      }
      p = staged[0], ldp = sizeof(staged[0]);
    }
    tile_memory_fence();   // p in tile 1, the values in 2, 3 and 0 (free once the scores are done), then 2 again
    _tile_loadd(1, p, ldp);
    _tile_loadd(2, pairs[0], 64);
    _tile_loadd(3, pairs[1], 64);
    _tile_loadd(0, pairs[2], 64);
    _tile_dpbf16ps(4, 1, 2);
    _tile_dpbf16ps(5, 1, 3);
    _tile_dpbf16ps(6, 1, 0);
    _tile_loadd(2, pairs[3], 64);
    _tile_dpbf16ps(7, 1, 2);
  }

  const Call& c_;
  const int run_;
  const int64_t kv_, first_col_;
  const int cols_;
  const int64_t ld_;
  Buffers& buffers_;
  float* scores_ = nullptr;   // buffers_'s, from a 64-byte boundary (p_'s rows are a tile's)
  uint16_t* p_ = nullptr;
  int64_t from_[kCols], to_[kCols], lo_ = 0, hi_ = 0;
  std::vector<Pass>& passes_;
  std::vector<size_t>& chunks_;
  alignas(64) uint32_t qt_[kMaxVecs / 2][16][16];
  alignas(64) uint16_t stage_[2][16 * 256];
};

template <int Vecs>
void attend_tiles(const Call& call, int64_t tiles, at::BFloat16* out) {
  Partial<Vecs>* part = partials<Vecs>(2 * call.rows * call.heads);
  const int64_t per_run = call.pool->kv_heads * tiles;
  // task i: run i / per_run, KV head, column tile (the first runs first: with two threads, each reads one half of
  // the keys the rows share)
  at::parallel_for(0, 2 * per_run, 1, [&](int64_t begin, int64_t end) {
    configure();
    thread_local Buffers buffers;
    for (int64_t i = begin; i < end; ++i) {
      Task task(call, static_cast<int>(i / per_run), i % per_run / tiles, i % tiles, buffers);
      task.run<Vecs>(part);
    }
    _tile_release();
  });
  merge_runs<at::BFloat16, Vecs>(part, call.len, call.rows, call.heads, call.dim, out);
}

}  // namespace

void attend_amx(const at::BFloat16* q, int64_t q_row, int64_t rows, int64_t heads, const Layer& pool,
                const int64_t* row_slots, int64_t width, const int64_t* row_len, float scale, const Rope* rope,
                at::BFloat16* out) {
  const int64_t group = heads / pool.kv_heads, tiles = (rows * group + kCols - 1) / kCols;
  const Call call{q, q_row, rope, rows, heads, group, pool.dim, &pool, row_slots, width, row_len, scale};
  switch (pool.dim) {
    case 64: return attend_tiles<4>(call, tiles, out);
    case 128: return attend_tiles<8>(call, tiles, out);
    case 192: return attend_tiles<12>(call, tiles, out);
    default: return attend_tiles<16>(call, tiles, out);
  }
}

}  // namespace whiflash
