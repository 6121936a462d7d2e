// whiflash::linear_bf16: y = x W^T (+ bias) for bf16 x [M, K] and a bf16 weight W [N, K], on AVX2 and AVX-512 CPUs;
// whiflash::linear_norm_bf16: the same GEMM with a decoder layer's residual add and RMSNorm before it and SwiGLU
// after it (rows.h), over a bf16 weight or an int8 one quantised per output row (a drafter's layers);
// whiflash::linear_i8: the few-row GEMM over such an int8 weight (a drafter's LM head; i8_rows below).
//
// Why a kernel of our own: decode and verify stream every weight once per step, and oneDNN's bf16 GEMM streams them
// well below the machine's read bandwidth, the more so the more rows. This one reads each weight once per call for up
// to 6 rows, and from cache for more. The timings behind this file's choices: docs/measurements.md, "Kernels".
//
// Three inner loops (whiflash::set_gemm_variant; kernels/ops.py picks the fastest one the process's ISA has, once
// per process):
// - FMA (0), every build, written over simd.h's Vec: each bf16 pair widened to fp32 (exact), x[m, 2k] * W[n, 2k] and
//   then x[m, 2k+1] * W[n, 2k+1] added with fp32 FMAs. The faster one where VDPBF16PS is slow (the Intel Xeon with
//   AMX: 1.3 G/s per core against 5.3 G/s of FMAs), the only one on AVX2.
// - DOT (1), AVX-512 BF16 builds: one VDPBF16PS per pair, x and W staying bf16: the pair's two products (exact in
//   fp32) added to the lane as the hardware does it (Intel documents odd then even, round to nearest, denormals
//   flushed). Twice the multiply-adds per instruction and no widening: on an AMD EPYC Zen 4 faster than FMA at 6 and
//   16 rows, as fast at 1-4 rows (memory-bound).
// - AMX (2), AVX-512 BF16 builds on CPUs with AMX-BF16: tiles of up to 16 rows, TDPBF16PS on the same packed weight
//   (amx_block below): faster than FMA at 6 and 16 rows, as fast at one row (memory-bound; the two-block walk below
//   has no AMX counterpart: eight tiles hold one block's four sums).
//
// Row invariance by construction, in every loop: every output y[m, n] is one fp32 accumulator lane that adds the
// pairs k = 0, 1, ... in order (AMX: in steps of 16 pairs, as its hardware adds them), then the bias, then rounds
// once to bf16. Nothing depends on M, on the row's place in the call or on the thread count, so a verify row equals
// the decode row bit for bit (tests/test_kernels.py). The loops may differ in the last bit, so a process must not
// switch between them while it decodes.
//
// The weight is packed once (whiflash_trt/kernels/ops.py pack_weight): [N/64, K/2, 64] int32, each int32 the
// bf16 pair W[n, 2k], W[n, 2k+1]: a block of 64 outputs streams as one contiguous run.
//
// A call of one row (decode, an EAGLE-3 draft step) walks two adjacent blocks side by side: two streams in flight per
// thread keep more of the memory bandwidth busy than one (three or four blocks are no faster). Only the order in
// which the two blocks' instructions issue changes, no lane's sum. The DOT loop walks two blocks up to 3 rows (a
// small verify; 24 accumulators), where one block's walk at 2-6 rows costs what 6 rows do. Not AVX-512's FMA loop (its
// 2 widened weights per pair leave too few registers), nor 4-6 rows as two passes over half of each block's outputs
// (the second from cache: slower than one walk).
//
// On AVX2 (16 ymm) a block's 64 outputs are 8 vectors, and a pass takes them all at any row count (the accumulators
// past the registers wait in L1): calls of up to 3 rows walk two blocks side by side, more rows one block, 6 rows a
// walk (run_blocks).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "amx.h"
#include "aoti_shim.h"
#include "gemm_blocks.h"
#include "ggml_gemm.h"
#include "rows.h"

namespace {

using whiflash::kLanes;
using whiflash::Vec;

constexpr int64_t kBlock = 64;      // outputs per packed block
constexpr int kVecs = kBlock / kLanes;   // vectors of outputs per block: 4 zmm or 8 ymm
constexpr int kTileRows = 6;        // rows of x per walk over a block
constexpr int64_t kScaleRows = 4;   // an int8 block's 64 fp32 scales = 4 rows of 64 int8 (i8_rows)

// Vectors of one block's outputs a pass of `rows` rows accumulates (a divisor of kVecs): as many as the registers
// hold beside a pass's weights and broadcasts. AVX-512: the whole block for up to 6 rows (24 accumulators); AVX2 (the
// int8 loop; its bf16 loops take the whole block, run_blocks): the whole block for 1 row, half of it for 2-3, a
// quarter for 4-6, each pass streaming its own lines of the block.
constexpr int pass_vecs(int rows) {
  int vecs = kVecs;
  while (vecs > 1 && rows * vecs > whiflash::kAccumulators) vecs /= 2;
  return vecs;
}

// A packed weight as the loops read it: bf16 pairs (kernels.pack_weight: [N/64, K/2, 64] int32), int8 rows and
// their scales (kernels.pack_int8: [N/64, K + 4, 64] int8, see i8_rows) or a GGUF file's blocks (kernels.pack_ggml:
// [N/8, K/32, bytes] uint8, ggml_gemm.h)
struct Weight {
  const int32_t* pairs = nullptr;
  const int8_t* q = nullptr;
  const uint8_t* ggml = nullptr;
  int ggml_type = -1;
  int64_t k = 0;   // in_features

  bool int8() const { return q != nullptr; }
  const void* block(int64_t blk) const {
    return q ? static_cast<const void*>(q + blk * (k + kScaleRows) * kBlock)
             : static_cast<const void*>(pairs + blk * (k / 2) * kBlock);
  }
};

enum Variant : int64_t { kFma = 0, kDot = 1, kAmx = 2 };
std::atomic<int64_t> g_variant{kFma};

// acc(r, j) + bias, rounded to bf16, into y[rows, cols]: acc(r, j) is row r's kLanes sums of outputs kLanes j ..
// kLanes j + kLanes - 1, j < vecs
template <typename Acc>
inline void store_rows(int rows, int vecs, const Acc& acc, const float* bias, uint16_t* y, int64_t ldy,
                       int64_t cols) {
  for (int j = 0; j < vecs; ++j) {
    const int64_t left = cols - kLanes * j;
    if (left <= 0) break;
    const Vec b = bias ? Vec::load(bias + kLanes * j, left) : Vec::zero();
    for (int r = 0; r < rows; ++r) (acc(r, j) + b).store(y + r * ldy + kLanes * j, left);
  }
}

// Software prefetch (to L2) of a pass's lines ahead, +5-10% over the hardware prefetcher alone (measured, AVX-512,
// 2 threads): 8 KB with one stream (4 KB was slower at 6 rows, 12-24 KB no faster at 3 and 6), 2 KB each with two
// (1 and 3 KB no faster at one row); on AVX2 two streams take 512 bytes (0-1 KB alike, docs/measurements.md)
template <int Blocks, int Vecs>
inline void prefetch_pass(const int32_t* wk) {
  constexpr int bytes = Blocks == 1 ? 8192 : kLanes == 8 ? 512 : 2048;
  for (int line = 0; line < Vecs * kLanes * 4; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(wk) + line + bytes, _MM_HINT_T1);
}

// The frame of the bf16 loops: one pass over `Blocks` adjacent blocks (1 or 2; `cols` columns from the first
// block's output `first`, which is vector `first` / kLanes of it), for outputs first .. first + Vecs kLanes - 1 of
// each block: accumulators from zero, the pairs k = 0, 1, ... in order, each block's pair k prefetched ahead and
// added, then store_rows per block; add(acc, k, wk) adds pair k, its Vecs x kLanes int32 at wk, to every row's
// lanes.
template <int Rows, int Vecs, int Blocks, typename Add>
inline void run_pass(const int32_t* w, int64_t pairs, int64_t first, const float* bias, uint16_t* y, int64_t ldy,
                     int64_t cols, const Add& add) {
  Vec acc[Blocks][Rows][Vecs];
  for (int b = 0; b < Blocks; ++b)
    for (int r = 0; r < Rows; ++r)
      for (int j = 0; j < Vecs; ++j) acc[b][r][j] = Vec::zero();
  for (int64_t k = 0; k < pairs; ++k) {
    for (int b = 0; b < Blocks; ++b) {
      const int32_t* wk = w + (b * pairs + k) * kBlock + first;
      prefetch_pass<Blocks, Vecs>(wk);
      add(acc[b], k, wk);
    }
  }
  for (int b = 0; b < Blocks; ++b)
    store_rows(Rows, Vecs, [&](int r, int j) { return acc[b][r][j]; }, bias ? bias + b * kBlock + first : nullptr,
               y + b * kBlock + first, ldy, cols - b * kBlock - first);
}

// Every pass over a block (or two) for `Rows` rows: Vecs = pass_vecs(Rows) vectors of outputs at a time on AVX-512.
// On AVX2 one pass takes the whole block (or both) whatever the rows, the accumulators the 16 ymm do not hold kept in
// L1 by the compiler: a pass then streams whole lines in order, where passes over a half or a quarter of each
// block's outputs read every k's lines strided and took 1.25-1.33x as long at 1-8 rows (docs/measurements.md)
template <int Rows, int Blocks, typename Add>
inline void run_blocks(const int32_t* w, int64_t pairs, const float* bias, uint16_t* y, int64_t ldy, int64_t cols,
                       const Add& add) {
  constexpr int vecs = kLanes == 8 ? kVecs : Blocks == 1 ? pass_vecs(Rows) : pass_vecs(2 * Rows);
  for (int64_t first = 0; first < kBlock && first < cols; first += vecs * kLanes)
    run_pass<Rows, vecs, Blocks>(w, pairs, first, bias, y, ldy, cols, add);
}

// FMA loop: y[rows, 64 outputs of one block] from x in fp32 (exact: a bf16 is the top half of its fp32): each pair
// widened to fp32 (exact), x[m, 2k] * W[n, 2k] and then x[m, 2k+1] * W[n, 2k+1] added with fp32 FMAs.
template <int Rows, int Blocks>
void fma_rows(const void* xv, int64_t ldx, const int32_t* w, int64_t pairs, const float* bias, uint16_t* y,
              int64_t ldy, int64_t cols) {
  const float* x = static_cast<const float*>(xv);
  run_blocks<Rows, Blocks>(w, pairs, bias, y, ldy, cols, [&](auto& acc, int64_t k, const int32_t* wk) {
    constexpr int vecs = sizeof(acc[0]) / sizeof(Vec);
    for (int j = 0; j < vecs; ++j) {
      const whiflash::NativeInt pair = whiflash::load_int(wk + kLanes * j);
      const Vec even = whiflash::low_bf16(pair), odd = whiflash::high_bf16(pair);   // W[n, 2k], W[n, 2k + 1]
      for (int r = 0; r < Rows; ++r) {
        const float* xr = x + r * ldx + 2 * k;
        acc[r][j] = fma(Vec::all(xr[1]), odd, fma(Vec::all(xr[0]), even, acc[r][j]));
      }
    }
  });
}

#if defined(__AVX512BF16__)
typedef int32_t __attribute__((may_alias, aligned(2))) Pair;  // two bf16 of x, read as one int32

// DOT loop (AVX-512 BF16 builds): the same block from x as bf16 pairs (one int32 each, broadcast from memory into
// its VDPBF16PS)
template <int Rows, int Blocks>
void dot_rows(const void* xv, int64_t ldx, const int32_t* w, int64_t pairs, const float* bias, uint16_t* y,
              int64_t ldy, int64_t cols) {
  const Pair* x = static_cast<const Pair*>(xv);  // ldx counts bf16 elements: a row is ldx / 2 pairs
  run_blocks<Rows, Blocks>(w, pairs, bias, y, ldy, cols, [&](auto& acc, int64_t k, const int32_t* wk) {
    constexpr int vecs = sizeof(acc[0]) / sizeof(Vec);
    for (int j = 0; j < vecs; ++j) {
      __m512bh pair = (__m512bh)_mm512_loadu_si512(wk + kLanes * j);
      for (int r = 0; r < Rows; ++r)
        acc[r][j].v = _mm512_dpbf16_ps(acc[r][j].v, (__m512bh)_mm512_set1_epi32(x[r * (ldx / 2) + k]), pair);
    }
  });
}
#endif

using BlockFn = void (*)(const void*, int64_t, const int32_t*, int64_t, const float*, uint16_t*, int64_t, int64_t);
constexpr int kMaxPairRows = 3;
struct Loops {
  BlockFn rows[kTileRows];      // one block, 1-6 rows
  BlockFn pair[kMaxPairRows];   // two blocks side by side, 1 .. pair_rows rows
  int64_t pair_rows;            // calls of up to this many rows walk two blocks at a time
};
// AVX2 walks two blocks up to 3 rows (0.77x the time of one at 3 rows), AVX-512 at one row
constexpr Loops kFmaLoops = {{fma_rows<1, 1>, fma_rows<2, 1>, fma_rows<3, 1>, fma_rows<4, 1>, fma_rows<5, 1>,
                              fma_rows<6, 1>}, {fma_rows<1, 2>, fma_rows<2, 2>, fma_rows<3, 2>}, kLanes == 8 ? 3 : 1};
#if defined(__AVX512BF16__)
constexpr Loops kDotLoops = {{dot_rows<1, 1>, dot_rows<2, 1>, dot_rows<3, 1>, dot_rows<4, 1>, dot_rows<5, 1>,
                              dot_rows<6, 1>}, {dot_rows<1, 2>, dot_rows<2, 2>, dot_rows<3, 2>}, 3};
#endif

// What linear_norm_bf16 folds into the GEMM (rows.h); nothing for linear_bf16
struct Fused {
  const uint16_t* delta = nullptr;   // a residual added to x first
  const uint16_t* norm = nullptr;    // an RMSNorm weight: the GEMM's input is RMSNorm(x + delta) * norm
  float eps = 0;
  uint16_t* h = nullptr;             // where x + delta goes
  bool silu = false;                 // each packed block holds 32 gate then 32 up outputs: y is SwiGLU(gate, up)
};

#if defined(__AMX_TILE__)

// AMX loop: a block's 64 outputs as four 16 x 16 fp32 tiles (C: tiles 0-3), for up to 16 rows of x at once. Each
// step of 16 pairs loads the rows' 32 bf16 of x (A: tile 4 or 5) and the block's 16 pairs x 16 outputs four times
// (B: tiles 6 and 7 in turn, a row of a B tile being one pair k's 16 int32 of the packed block: stride 256 bytes), then
// TDPBF16PS adds A x B to each C. The tiles are stored, then store_rows adds the bias and rounds each lane once. A
// row's lanes depend on its own x alone (TDPBF16PS computes every row of its tiles independently), so rows stay
// invariant to the call; K must be a multiple of 32 (amx_supported), else the call runs the DOT loop.
constexpr int kAmxRows = 16;   // rows of x per tile
constexpr int kAmxPairs = 16;  // pairs of K per step (a tile row of 64 bytes)
// Rows from which amx_linear's threads share the normalisation (each waits for the others' rows: its threads must
// run at once, as an OpenMP team's do; at one row a wait would cost more than the row)
constexpr int64_t kSharedNormRows = AT_PARALLEL_OPENMP ? 4 : INT64_MAX;

// This thread's tiles for `rows` rows of x (1-16)
void configure_tiles(int rows) {
  whiflash::TileConfig cfg;
  for (int t = 0; t < 4; ++t) cfg.rows[t] = rows, cfg.colsb[t] = 64;   // C: rows x 16 fp32
  for (int t = 4; t < 6; ++t) cfg.rows[t] = rows, cfg.colsb[t] = 64;      // A: rows x 32 bf16
  for (int t = 6; t < 8; ++t) cfg.rows[t] = kAmxPairs, cfg.colsb[t] = 64;  // B: 16 pairs x 16 outputs
  _tile_loadconfig(&cfg);
}

// One step of 16 pairs into tiles C 0 .. Tiles-1, x in A tile `a` (the _tile intrinsics take literal tile numbers),
// the weight's B tiles through 6 and 7 in turn: each load waits only for the product two before it (tiles are not
// renamed), and the next step's x goes into the other A tile while this step's products still read theirs. With
// one A tile and B tiles 5-7 the next step's loads waited for the last product: a 16-row verify step 1-2% slower
// (the linears alone, 30 SmolLM2 layers from memory, 2 threads), the same bits.
#define WHIFLASH_AMX_STEP(a)                                              \
  do {                                                                    \
    _tile_loadd(a, xk, xstride);                                          \
    _tile_loadd(6, wk, wstride);                                          \
    if constexpr (Tiles > 1) _tile_loadd(7, wk + 16, wstride);            \
    _tile_dpbf16ps(0, a, 6);                                              \
    if constexpr (Tiles > 2) _tile_loadd(6, wk + 32, wstride);            \
    if constexpr (Tiles > 1) _tile_dpbf16ps(1, a, 7);                     \
    if constexpr (Tiles > 3) _tile_loadd(7, wk + 48, wstride);            \
    if constexpr (Tiles > 2) _tile_dpbf16ps(2, a, 6);                     \
    if constexpr (Tiles > 3) _tile_dpbf16ps(3, a, 7);                     \
  } while (0)

template <int Tiles, int A>
inline void amx_step(const uint16_t* xk, int64_t xstride, const int32_t* wk) {
  constexpr int64_t wstride = kBlock * sizeof(int32_t);
  if constexpr (A == 4) WHIFLASH_AMX_STEP(4);
  else WHIFLASH_AMX_STEP(5);
}
#undef WHIFLASH_AMX_STEP

// int8 (pack_int8): a step's 16 pairs, from the block's rows 2k .. 2k + 31, as the packed bf16 pairs of tiles first ..
// first + Tiles - 1 in `to` ([16 pairs][64 outputs] int32). Q widened to fp32 is exact and, |Q| <= 127, has its low
// 16 bits zero: its top half is its bf16 (exact too), and the pair (Q[n, 2k] low, Q[n, 2k + 1] high) one shift and
// one OR.
template <int Tiles>
inline void widen_int8_step(const int8_t* q, int first, int32_t* to) {
  auto wide = [](const int8_t* from) {
    return _mm512_castps_si512(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from)))));
  };
  for (int p = 0; p < kAmxPairs; ++p) {
    const int8_t* even = q + 2 * p * kBlock;
    for (int t = first; t < first + Tiles; ++t)
      _mm512_store_si512(to + p * kBlock + 16 * t,
                         _mm512_or_si512(_mm512_srli_epi32(wide(even + 16 * t), 16), wide(even + kBlock + 16 * t)));
  }
}

// Tiles C 0 .. Tiles-1: the block's outputs 16 (first + t) .. + 15, t < Tiles, for `rows` rows of x. A bf16
// weight's step of 16 pairs is 4 KB, 64-byte line 4 p + j holding pair p of outputs 16 j .. 16 j + 15: a thread that
// owns some of a block's outputs reads (and prefetches) their lines only. An int8 weight's step (Int8) is 2 KB, 32
// rows of the block's 64 outputs, widened into bf16 pairs (widen_int8_step) before its tiles load them; each lane
// is scaled once its sum is done: the products and sums of a bf16 weight holding the integers Q (exact in bf16), in
// the same order, so rows stay invariant to the call.
template <int Tiles, bool Int8>
void amx_block(const uint16_t* x, int64_t ldx, int rows, const void* w, int64_t pairs, int first,
               const float* bias, uint16_t* y, int64_t ldy, int64_t cols) {
  constexpr int64_t wstride = kBlock * sizeof(int32_t);
  const int64_t xstride = ldx * sizeof(uint16_t);
  const int32_t* wj = static_cast<const int32_t*>(w) + 16 * first;
  const int8_t* q = static_cast<const int8_t*>(w);
  _tile_zero(0);
  if constexpr (Tiles > 1) _tile_zero(1);
  if constexpr (Tiles > 2) _tile_zero(2);
  if constexpr (Tiles > 3) _tile_zero(3);
  auto fetch = [&](int64_t k) {   // two steps ahead, to L1
    if constexpr (Int8) {
      const char* ahead = reinterpret_cast<const char*>(q + 2 * (k + 2 * kAmxPairs) * kBlock);
      for (int p = 0; p < 2 * kAmxPairs; ++p) _mm_prefetch(ahead + 64 * p, _MM_HINT_T0);
    } else {
      const char* ahead = reinterpret_cast<const char*>(wj + k * kBlock) + 8192;
      for (int p = 0; p < kAmxPairs; ++p)
        for (int t = 0; t < Tiles; ++t) _mm_prefetch(ahead + wstride * p + 64 * t, _MM_HINT_T0);
    }
  };
  alignas(64) int32_t staged[Int8 ? kAmxPairs * kBlock : 1];
  auto weights = [&](int64_t k) -> const int32_t* {   // the step's B tile rows, stride wstride
    if constexpr (!Int8) return wj + k * kBlock;
    whiflash::tile_memory_fence();   // after the last step's tile loads, which read `staged`
    widen_int8_step<Tiles>(q + 2 * k * kBlock, first, staged);
    whiflash::tile_memory_fence();
    return staged + 16 * first;
  };
  int64_t k = 0;
  for (; k + 2 * kAmxPairs <= pairs; k += 2 * kAmxPairs) {
    fetch(k);
    amx_step<Tiles, 4>(x + 2 * k, xstride, weights(k));
    fetch(k + kAmxPairs);
    amx_step<Tiles, 5>(x + 2 * (k + kAmxPairs), xstride, weights(k + kAmxPairs));
  }
  if (k < pairs) {
    fetch(k);
    amx_step<Tiles, 4>(x + 2 * k, xstride, weights(k));
  }
  alignas(64) float out[Tiles][kAmxRows * 16];
  _tile_stored(0, out[0], 64);
  if constexpr (Tiles > 1) _tile_stored(1, out[1], 64);
  if constexpr (Tiles > 2) _tile_stored(2, out[2], 64);
  if constexpr (Tiles > 3) _tile_stored(3, out[3], 64);
  whiflash::tile_memory_fence();
  const float* scale = reinterpret_cast<const float*>(q + 2 * pairs * kBlock) + 16 * first;   // Int8 only
  store_rows(rows, Tiles, [&](int r, int j) {
    const __m512 sum = _mm512_load_ps(out[j] + r * 16);
    if constexpr (Int8) return Vec{_mm512_mul_ps(sum, _mm512_loadu_ps(scale + 16 * j))};
    else return Vec{sum};
  }, bias ? bias + 16 * first : nullptr, y + 16 * first, ldy, std::min<int64_t>(cols - 16 * first, 16 * Tiles));
}

using AmxBlockFn = void (*)(const uint16_t*, int64_t, int, const void*, int64_t, int, const float*, uint16_t*,
                            int64_t, int64_t);
constexpr AmxBlockFn kAmxBlocks[2][4] = {{amx_block<1, false>, amx_block<2, false>, amx_block<3, false>,
                                          amx_block<4, false>},
                                         {amx_block<1, true>, amx_block<2, true>, amx_block<3, true>,
                                          amx_block<4, true>}};


// Waits until `count` reaches `target`: spinning, then (more threads than cores: the ones it waits for may need this
// core) yielding the core between looks: spinning alone, 4 torch threads on 2 cores spend most of a 16-row GEMM
// waiting; at one thread per core the yield costs nothing.
void wait_for(const std::atomic<int64_t>& count, int64_t target) {
  constexpr int kSpins = 4096;   // pauses: tens to hundreds of microseconds, by CPU
  for (int spins = 0; count.load(std::memory_order_acquire) < target; ++spins) {
    if (spins < kSpins) _mm_pause();
    else std::this_thread::yield();
  }
}

// y = x W^T over every block with AMX. The threads split the outputs in runs of whole 16-output tiles, not whole
// blocks: 9 blocks (576 outputs) give each of 2 threads 4.5 blocks, not 5 and 4 (SwiGLU: whole blocks, its gate
// and up outputs together). Each thread walks its part of each block for every tile of rows (it configures its
// tiles per tile height and releases them at the end); which thread computes an output changes none of its bits.
// With a norm, each thread normalises the rows in proportion to its outputs and writes their h, a cheaper 16-row
// verify step than every thread normalising all rows (the next call's threads then each read about half of h from
// the other core's cache, not one of them all of it); from kSharedNormRows rows into one buffer, each thread waiting
// until the others have written theirs, below that every thread all the rows into a buffer of its own (no wait for a
// decode row). The buffers start cache lines (aligned64): rows split across lines load into tiles more slowly.
void amx_linear(const uint16_t* x, int64_t ldx, int64_t rows, const Weight& w, const float* bias, uint16_t* y,
                int64_t out_features, const Fused& f) {
  constexpr int64_t kTilesPerBlock = kBlock / 16;
  const int64_t pairs = w.k / 2;
  const int64_t columns = f.silu ? 2 * out_features : out_features, unit = f.silu ? kTilesPerBlock : 1;
  const int64_t units = (columns + 16 * unit - 1) / (16 * unit);
  const bool shared = f.norm && rows >= kSharedNormRows;
  thread_local std::vector<uint16_t> shared_buffer;   // the caller's (a lambda would name each thread's own)
  uint16_t* const shared_normed = shared ? whiflash::aligned64(shared_buffer, rows * 2 * pairs) : nullptr;
  std::atomic<int64_t> normalised{0};   // units whose threads have written their rows of shared_normed
  at::parallel_for(0, units, 1, [&](int64_t begin_unit, int64_t end_unit) {
    const int64_t begin = begin_unit * unit, end = std::min(end_unit * unit, (columns + 15) / 16);
    const int64_t r0 = rows * begin_unit / units, r1 = rows * end_unit / units;
    const uint16_t* in = x;
    int64_t ld = ldx;
    if (shared) {
      whiflash::normalize_rows(x, f.delta, f.norm, f.eps, r0, r1, 2 * pairs, f.h, r0, r1, shared_normed);
      normalised.fetch_add(end_unit - begin_unit, std::memory_order_acq_rel);
      wait_for(normalised, units);
      in = shared_normed, ld = 2 * pairs;
    } else if (f.norm) {
      thread_local std::vector<uint16_t> buffer;
      uint16_t* const normed = whiflash::aligned64(buffer, rows * 2 * pairs);
      whiflash::normalize_rows(x, f.delta, f.norm, f.eps, 0, rows, 2 * pairs, f.h, r0, r1, normed);
      in = normed, ld = 2 * pairs;
    }
    alignas(64) uint16_t gate_up[kAmxRows][kBlock];
    int configured = 0;
    for (int64_t blk = begin / kTilesPerBlock; blk * kTilesPerBlock < end; ++blk) {
      const int64_t col = blk * kBlock, cols = std::min(kBlock, columns - col);
      const int first = static_cast<int>(std::max<int64_t>(begin - blk * kTilesPerBlock, 0));
      const int last = static_cast<int>(std::min<int64_t>(end - blk * kTilesPerBlock, kTilesPerBlock));
      for (int64_t r = 0; r < rows; r += kAmxRows) {
        const int n = static_cast<int>(std::min<int64_t>(kAmxRows, rows - r));
        if (n != configured) configure_tiles(n), configured = n;
        const void* wb = w.block(blk);
        const float* bb = bias ? bias + col : nullptr;
        if (!f.silu) {
          kAmxBlocks[w.int8()][last - first - 1](in + r * ld, ld, n, wb, pairs, first, bb, y + r * out_features + col,
                                                 out_features, cols);
          continue;
        }
        kAmxBlocks[w.int8()][3](in + r * ld, ld, n, wb, pairs, 0, bb, gate_up[0], kBlock, kBlock);
        for (int i = 0; i < n; ++i)
          whiflash::silu_mul32(gate_up[i], gate_up[i] + 32, y + (r + i) * out_features + col / 2);
      }
    }
    if (configured) _tile_release();
  });
}

#endif  // __AMX_TILE__

// int8 weights (linear_i8): y = x (s * Q)^T for a weight quantised per output row (kernels.pack_int8: W[n, k] ~
// s[n] Q[n, k], Q in [-127, 127], s[n] = max_k |W[n, k]| / 127), packed [N/64, K + 4, 64] int8: row k of a block
// holds Q[., k] of its 64 outputs, its last four rows their 64 fp32 scales. Half the bytes of the bf16 weight: for
// a drafter's LM head, which every draft step streams whole (SmolLM2's 8192-token draft vocabulary: 9.4 MB bf16).
// Each output is one fp32 lane that adds x[m, k] * Q[n, k] for k = 0, 1, ... in order, then is scaled by s[n] and
// rounded once to bf16: row-invariant as the loops above. Faster than the bf16 weight at a head's 1-4 rows, the
// more so the fewer (from 3 rows on the widening and the FMAs, not the memory, set the pace). linear_i8 runs this
// loop on every CPU, at every row count: at one row and in DFlash's 4-row rounds it beats AMX tiles (amx_block's
// Int8).
// linear_norm_bf16 over such a weight (a drafter's layers, at 8 rows a block) takes the process's loop, where AMX
// tiles are the faster.
constexpr int64_t kI8Ahead = 4096;     // software prefetch distance in bytes: 64 steps of k

template <int Rows, int Vecs>
void i8_pass(const float* x, int64_t ldx, const int8_t* w, int64_t k, int64_t first, uint16_t* y, int64_t ldy,
             int64_t cols) {
  Vec acc[Rows][Vecs];
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Vecs; ++j) acc[r][j] = Vec::zero();
  for (int64_t i = 0; i < k; ++i) {
    const int8_t* wi = w + i * kBlock + first;
    _mm_prefetch(reinterpret_cast<const char*>(wi) + kI8Ahead, _MM_HINT_T0);
    for (int j = 0; j < Vecs; ++j) {
      const Vec wv = whiflash::load_int8(wi + kLanes * j);
      for (int r = 0; r < Rows; ++r) acc[r][j] = fma(Vec::all(x[r * ldx + i]), wv, acc[r][j]);
    }
  }
  const float* scale = reinterpret_cast<const float*>(w + k * kBlock) + first;
  for (int j = 0; j < Vecs; ++j) {
    const Vec sj = Vec::load(scale + kLanes * j);
    for (int r = 0; r < Rows; ++r) acc[r][j] = acc[r][j] * sj;
  }
  store_rows(Rows, Vecs, [&](int r, int j) { return acc[r][j]; }, nullptr, y + first, ldy, cols - first);
}

template <int Rows>
void i8_rows(const float* x, int64_t ldx, const int8_t* w, int64_t k, uint16_t* y, int64_t ldy, int64_t cols) {
  constexpr int vecs = pass_vecs(Rows);
  for (int64_t first = 0; first < kBlock && first < cols; first += vecs * kLanes)
    i8_pass<Rows, vecs>(x, ldx, w, k, first, y, ldy, cols);
}

using I8Fn = void (*)(const float*, int64_t, const int8_t*, int64_t, uint16_t*, int64_t, int64_t);
constexpr I8Fn kI8Rows[kTileRows] = {i8_rows<1>, i8_rows<2>, i8_rows<3>, i8_rows<4>, i8_rows<5>, i8_rows<6>};

#if defined(__AMX_TILE__)
// AMX needs the kernel's leave to use the tile data (Linux: once per process)
bool amx_permitted() {
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  static const bool permitted = syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  return permitted;
}

bool amx_supported(int64_t pairs) { return pairs % kAmxPairs == 0; }
#else
bool amx_permitted() { return false; }   // a build without AMX code
#endif

// bf16 -> fp32 (a bf16 is the top half of its fp32), kLanes at a time
void widen(const uint16_t* from, float* to, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) Vec::load(from + i).store(to + i);
  for (; i < n; ++i) {
    const uint32_t wide = static_cast<uint32_t>(from[i]) << 16;
    std::memcpy(to + i, &wide, sizeof(float));
  }
}

// A packed weight's blocks ([N/64, ., 64]) hold `columns` outputs
void check_columns(const at::Tensor& packed, int64_t columns, const char* op) {
  TORCH_CHECK(columns > (packed.size(0) - 1) * kBlock && columns <= packed.size(0) * kBlock, op,
              ": out_features does not match the packed weight");
}

// The weight of a call, checked against x's K and the outputs: bf16 pairs (kernels.pack_weight), a GGUF file's
// blocks (kernels.pack_ggml) or, where the op takes them, int8 rows (kernels.pack_int8); `packed` contiguous, and
// kept alive while the weight is read
Weight packed_weight(const at::Tensor& packed, int64_t in_features, int64_t columns, bool int8_ok, const char* op) {
  Weight w;
  if (packed.scalar_type() == at::kByte) {
    w.ggml_type = packed.dim() == 3 ? whiflash::ggml_packed_type(packed.size(2)) : -1;
    TORCH_CHECK(w.ggml_type >= 0, op, ": a GGML weight must be [N/8, K/32, 144 | 160 | 272] uint8 (Q4_0 | Q4_1 | "
                "Q8_0, kernels.pack_ggml)");
    w.k = packed.size(1) * whiflash::kGgmlBlock;
    TORCH_CHECK(in_features == w.k, op, ": x has ", in_features, " features, the weight ", w.k);
    const int64_t groups = packed.size(0), group = whiflash::kGgmlGroup;
    TORCH_CHECK(columns > (groups - 1) * group && columns <= groups * group, op,
                ": out_features does not match the GGML weight");
    w.ggml = packed.data_ptr<uint8_t>();
    return w;
  }
  const bool int8 = int8_ok && packed.scalar_type() == at::kChar;
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlock && (int8 || packed.scalar_type() == at::kInt), op,
              ": packed must be [N/64, K/2, 64] int32 (kernels.pack_weight)",
              int8_ok ? " or [N/64, K + 4, 64] int8 (kernels.pack_int8)" : "",
              " or [N/8, K/32, bytes] uint8 (kernels.pack_ggml)");
  const int64_t k = int8 ? packed.size(1) - kScaleRows : 2 * packed.size(1);
  TORCH_CHECK(in_features == k, op, ": x has ", in_features, " features, the weight ", k);
  check_columns(packed, columns, op);
  w.k = k;
  if (int8) w.q = packed.data_ptr<int8_t>();
  else w.pairs = packed.data_ptr<int32_t>();
  return w;
}

// The int8 loop: y [rows, columns] = x (s * Q)^T, x [rows, ldx] bf16 widened to fp32 (exact)
void i8_gemm(const uint16_t* x, int64_t ldx, int64_t rows, const Weight& w, uint16_t* y, int64_t columns) {
  std::vector<float> xf(rows * ldx);
  widen(x, xf.data(), static_cast<int64_t>(xf.size()));
  whiflash::for_each_tile(columns, kBlock, rows, kTileRows, 0, [&](int64_t blk, int64_t, int64_t col, int64_t cols,
                                                                   int64_t r, int64_t n) {
    kI8Rows[n - 1](xf.data() + r * ldx, ldx, static_cast<const int8_t*>(w.block(blk)), w.k, y + r * columns + col,
                   columns, cols);
  });
}

// The FMA and DOT loops (or the int8 one): y [rows, columns] = x W^T (+ bias), x [rows, ldx] bf16
void loop_gemm(const uint16_t* x, int64_t ldx, int64_t rows, const Weight& w, const float* bias, uint16_t* y,
               int64_t columns, bool dot) {
  if (w.ggml) return whiflash::ggml_gemm(x, ldx, rows, w.ggml, w.ggml_type, w.k, bias, y, columns);
  if (w.int8()) return i8_gemm(x, ldx, rows, w, y, columns);
  // FMA: x widened to fp32 here (exact), not by aten: a dispatch and an allocation per call cost ~2.5 us, 121 calls
  // a step. DOT reads the bf16 pairs as they are.
  std::vector<float> xf(dot ? 0 : rows * ldx);
  if (!dot) widen(x, xf.data(), static_cast<int64_t>(xf.size()));
  const char* xp = dot ? reinterpret_cast<const char*>(x) : reinterpret_cast<const char*>(xf.data());
  const int64_t x_row_bytes = ldx * (dot ? 2 : 4), pairs = w.k / 2;
#if defined(__AVX512BF16__)
  const Loops& loops = dot ? kDotLoops : kFmaLoops;
#else
  const Loops& loops = kFmaLoops;   // set_gemm_variant offers no other loop in this build
#endif
  whiflash::for_each_tile(columns, kBlock, rows, kTileRows, loops.pair_rows, [&](int64_t blk, int64_t count,
                                                                                 int64_t col, int64_t cols, int64_t r,
                                                                                 int64_t n) {
    const BlockFn fn = count == 2 ? loops.pair[n - 1] : loops.rows[n - 1];
    fn(xp + r * x_row_bytes, ldx, w.pairs + blk * pairs * kBlock, pairs, bias ? bias + col : nullptr,
       y + r * columns + col, columns, cols);
  });
}

// y [rows, out_features] = x W^T (+ bias) on the process's loop, with what f folds in; x [rows, ldx] bf16. The AMX
// loop folds it into its threads' passes; the others normalise the rows once, run the GEMM, then SwiGLU over its
// [gate | up] blocks. An int8 weight runs the AMX loop too (amx_block's Int8), else the int8 one (i8_rows); a GGML
// weight runs ggml_gemm.h on every loop.
void gemm(const uint16_t* x, int64_t ldx, int64_t rows, const Weight& w, const float* bias, uint16_t* y,
          int64_t out_features, const Fused& f) {
  const int64_t columns = f.silu ? 2 * out_features : out_features;
  const int64_t variant = g_variant.load(std::memory_order_relaxed);
#if defined(__AMX_TILE__)
  if (variant == kAmx && !w.ggml && amx_supported(w.k / 2)) return amx_linear(x, ldx, rows, w, bias, y, out_features, f);
#endif
  std::vector<uint16_t> normed(f.norm ? rows * ldx : 0);
  if (f.norm) whiflash::normalize_rows(x, f.delta, f.norm, f.eps, 0, rows, ldx, f.h, 0, rows, normed.data());
  const uint16_t* in = f.norm ? normed.data() : x;
  if (!f.silu) return loop_gemm(in, ldx, rows, w, bias, y, columns, variant != kFma);
  std::vector<uint16_t> gate_up(rows * columns);
  loop_gemm(in, ldx, rows, w, bias, gate_up.data(), columns, variant != kFma);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t c = 0; c < columns; c += kBlock)
        whiflash::silu_mul32(gate_up.data() + r * columns + c, gate_up.data() + r * columns + c + 32,
                             y + r * out_features + c / 2);
  });
}

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
uint16_t* bits_out(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear_bf16: x must be [M, K] bf16");
  const at::Tensor xb = x.contiguous(), pc = packed.contiguous();
  const Weight w = packed_weight(pc, x.size(1), out_features, false, "linear_bf16");
  at::Tensor kept;
  const float* bp = whiflash::checked_bias(bias, out_features, kept, "linear_bf16");
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  gemm(bits(xb), xb.size(1), x.size(0), w, bp, bits_out(y), out_features, Fused{});
  return y;
}

// y [M, out_features] bf16 = x [M, K] bf16 times an int8 weight packed by kernels.pack_int8 (see i8_rows)
at::Tensor linear_i8(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear_i8: x must be [M, K] bf16");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.size(2) == kBlock &&
              packed.size(1) == k + kScaleRows, "linear_i8: packed must be [N/64, K + 4, 64] int8 "
              "(kernels.pack_int8) for x's K = ", k);
  const at::Tensor xb = x.contiguous(), pc = packed.contiguous();
  at::Tensor y = at::empty({rows, out_features}, x.options());
  i8_gemm(bits(xb), k, rows, packed_weight(pc, k, out_features, true, "linear_i8"), bits_out(y), out_features);
  return y;
}

// (y, h): h = x + delta (x itself, copied, without delta), y = RMSNorm(h) * norm_weight W^T (+ bias), or x W^T
// without a norm weight (then without delta, and h is empty: [0, K]); with `silu`, W's blocks hold 32 gate then 32
// up outputs each (kernels.pack_gate_up) and y = SwiGLU(gate, up) [M, out_features]. One call per norm and GEMM of a
// layer: rows.h.
std::tuple<at::Tensor, at::Tensor> linear_norm_bf16(const at::Tensor& x, const c10::optional<at::Tensor>& delta,
                                                    const c10::optional<at::Tensor>& norm_weight, double eps,
                                                    const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                                                    int64_t out_features, bool silu) {
  const char* op = "linear_norm_bf16";
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, op, ": x must be [M, K] bf16");
  const int64_t rows = x.size(0), k = x.size(1), columns = silu ? 2 * out_features : out_features;
  TORCH_CHECK(!delta.has_value() || (delta->scalar_type() == at::kBFloat16 && delta->sizes() == x.sizes()), op,
              ": delta must be bf16 shaped as x");
  TORCH_CHECK(norm_weight.has_value() || !delta.has_value(), op, ": a delta needs a norm_weight");
  TORCH_CHECK(!norm_weight.has_value() || (norm_weight->scalar_type() == at::kBFloat16 && norm_weight->numel() == k),
              op, ": norm_weight must be bf16 with K elements");
  TORCH_CHECK(!silu || out_features % 32 == 0, op, ": SwiGLU needs out_features a multiple of 32");
  TORCH_CHECK(!silu || !bias.has_value(), op, ": SwiGLU takes no bias (pack_gate_up reorders the outputs)");
  const at::Tensor xb = x.contiguous(), pc = packed.contiguous();
  const Weight w = packed_weight(pc, k, columns, true, op);
  TORCH_CHECK(!w.int8() || !bias.has_value(), op, ": an int8 weight (kernels.pack_int8) takes no bias");
  const at::Tensor nw = norm_weight.has_value() ? norm_weight->contiguous() : at::Tensor();
  const at::Tensor db = delta.has_value() ? delta->contiguous() : at::Tensor();
  at::Tensor kept;
  const float* bp = whiflash::checked_bias(bias, columns, kept, op);
  at::Tensor y = at::empty({rows, out_features}, x.options());
  at::Tensor h = delta.has_value() ? at::empty_like(xb) : nw.defined() ? xb.clone() : at::empty({0, k}, x.options());
  const Fused f{db.defined() ? bits(db) : nullptr, nw.defined() ? bits(nw) : nullptr, static_cast<float>(eps),
                db.defined() ? bits_out(h) : nullptr, silu};
  gemm(bits(xb), k, rows, w, bp, bits_out(y), out_features, f);
  return {y, h};
}

// The inner loop of every later call in this process (0 FMA, 1 DOT, 2 AMX); returns the previous one.
int64_t set_gemm_variant(int64_t variant) {
  TORCH_CHECK(variant == kFma || variant == kDot || variant == kAmx, "set_gemm_variant: 0 (FMA), 1 (DOT) or 2 (AMX), "
              "got ", variant);
#if !defined(__AVX512BF16__)
  TORCH_CHECK(variant == kFma, "set_gemm_variant: this build of the kernels has the FMA loop only");
#endif
  TORCH_CHECK(variant != kAmx || amx_permitted(), "set_gemm_variant: the OS does not let this process use AMX",
              " (or this build has no AMX code)");
  return g_variant.exchange(variant);
}

int64_t gemm_variant() { return g_variant.load(); }

}  // namespace

// C shims (aoti_shim.h)
extern "C" AOTITorchError aoti_torch_cpu_linear_bf16(AtenTensorHandle x, AtenTensorHandle packed,
                                                     AtenTensorHandle* bias, int64_t out_features,
                                                     AtenTensorHandle* y) {
  using namespace whiflash::shim;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(
      give(linear_bf16(tensor(x), tensor(packed), optional(bias), out_features), y);)
}

extern "C" AOTITorchError aoti_torch_cpu_linear_i8(AtenTensorHandle x, AtenTensorHandle packed, int64_t out_features,
                                                   AtenTensorHandle* y) {
  using namespace whiflash::shim;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(give(linear_i8(tensor(x), tensor(packed), out_features), y);)
}

extern "C" AOTITorchError aoti_torch_cpu_linear_norm_bf16(AtenTensorHandle x, AtenTensorHandle* delta,
                                                          AtenTensorHandle* norm_weight, double eps,
                                                          AtenTensorHandle packed, AtenTensorHandle* bias,
                                                          int64_t out_features, int32_t silu, AtenTensorHandle* y,
                                                          AtenTensorHandle* h) {
  using namespace whiflash::shim;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(
      auto out = linear_norm_bf16(tensor(x), optional(delta), optional(norm_weight), eps, tensor(packed),
                                  optional(bias), out_features, silu != 0);
      give(std::move(std::get<0>(out)), y); give(std::move(std::get<1>(out)), h);)
}

// The build, readable in the file without loading it (kernels/build.py library_build): a library is loaded only on
// a CPU that runs its build's instructions
extern "C" __attribute__((used)) const char whiflash_build_marker[] = "whiflash-kernels-build=" WHIFLASH_BUILD;

bool whiflash::amx_selected() { return g_variant.load(std::memory_order_relaxed) == kAmx; }

TORCH_LIBRARY(whiflash, m) {
  m.def("linear_bf16(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("linear_i8(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("linear_norm_bf16(Tensor x, Tensor? delta, Tensor? norm_weight, float eps, Tensor packed, Tensor? bias, "
        "int out_features, bool silu) -> (Tensor, Tensor)");
  m.def("set_gemm_variant(int variant) -> int", &set_gemm_variant);
  m.def("gemm_variant() -> int", &gemm_variant);
  m.def("amx_usable() -> bool", &amx_permitted);
}

TORCH_LIBRARY_IMPL(whiflash, CPU, m) {
  m.impl("linear_bf16", &linear_bf16);
  m.impl("linear_i8", &linear_i8);
  m.impl("linear_norm_bf16", &linear_norm_bf16);
}

