// whiflash::linear_fp32: y = x W^T (+ bias) for fp32 x [M, K] and an fp32 weight W [N, K], on AVX2 and AVX-512
// CPUs (simd.h): the fp32 engine's GEMM. MKL sums a row of an fp32 GEMM in an order that depends on the row count,
// differently per CPU (the Intel Xeon: 17+ rows differ from 2-16; an AMD EPYC Zen 4: 4+ rows differ from 1-3), so a
// verify row would not equal its decode row; this one fixes the order.
//
// Row invariance by construction: every output y[m, n] is one fp32 accumulator lane that adds x[m, k] * W[n, k]
// with fp32 FMAs for k = 0, 1, ... in order, then the bias. Nothing depends on M, on the row's place in the call or
// on the thread count (tests/test_kernels.py).
//
// The weight is packed once (whiflash_trt/kernels/ops.py pack_weight): [N/64, K, 64] fp32, a block of 64
// outputs streaming as one contiguous run. Up to 6 rows read each weight once per call, more from cache.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>

#include "gemm_blocks.h"
#include "simd.h"

namespace {

using whiflash::kLanes;
using whiflash::Vec;

constexpr int64_t kBlock = 64;          // outputs per packed block
constexpr int kVecs = kBlock / kLanes;  // vectors of outputs per block: 4 zmm or 8 ymm
constexpr int kPrefetchBytes = 8192;    // software prefetch (to L2) distance along a block
constexpr int kTileRows = 6;            // rows of x per pass over a block

// Vectors of one block's outputs a pass of `rows` rows accumulates (as linear_bf16.cpp's pass_vecs)
constexpr int pass_vecs(int rows) {
  int vecs = kVecs;
  while (vecs > 1 && rows * vecs > whiflash::kAccumulators) vecs /= 2;
  return vecs;
}

// Outputs first .. first + Vecs kLanes - 1 of one block, for Rows rows
template <int Rows, int Vecs>
void block_pass(const float* x, int64_t ldx, const float* w, int64_t depth, int64_t first, const float* bias,
                float* y, int64_t ldy, int64_t cols) {
  Vec acc[Rows][Vecs];
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Vecs; ++j) acc[r][j] = Vec::zero();
  for (int64_t k = 0; k < depth; ++k) {
    const float* wk = w + k * kBlock + first;
    for (int line = 0; line < Vecs * kLanes; line += 16)
      _mm_prefetch(reinterpret_cast<const char*>(wk + line) + kPrefetchBytes, _MM_HINT_T1);
    for (int j = 0; j < Vecs; ++j) {
      const Vec wv = Vec::load(wk + kLanes * j);
      for (int r = 0; r < Rows; ++r) acc[r][j] = fma(Vec::all(x[r * ldx + k]), wv, acc[r][j]);
    }
  }
  for (int j = 0; j < Vecs; ++j) {
    const int64_t left = cols - first - kLanes * j;
    if (left <= 0) break;
    const Vec b = bias ? Vec::load(bias + first + kLanes * j, left) : Vec::zero();
    for (int r = 0; r < Rows; ++r) (acc[r][j] + b).store(y + r * ldy + first + kLanes * j, left);
  }
}

template <int Rows>
void block_rows(const float* x, int64_t ldx, const float* w, int64_t depth, const float* bias, float* y,
                int64_t ldy, int64_t cols) {
  constexpr int vecs = pass_vecs(Rows);
  for (int64_t first = 0; first < kBlock && first < cols; first += vecs * kLanes)
    block_pass<Rows, vecs>(x, ldx, w, depth, first, bias, y, ldy, cols);
}

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t);
constexpr BlockFn kBlockFns[kTileRows] = {block_rows<1>, block_rows<2>, block_rows<3>,
                                          block_rows<4>, block_rows<5>, block_rows<6>};

at::Tensor linear_fp32(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear_fp32: x must be [M, K] fp32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.size(2) == kBlock,
              "linear_fp32: packed must be [N/64, K, 64] fp32 (kernels.pack_weight)");
  const int64_t rows = x.size(0), depth = packed.size(1), blocks = packed.size(0);
  TORCH_CHECK(x.size(1) == depth, "linear_fp32: x has ", x.size(1), " features, the weight ", depth);
  TORCH_CHECK(out_features > (blocks - 1) * kBlock && out_features <= blocks * kBlock,
              "linear_fp32: out_features does not match the packed weight");
  const at::Tensor xc = x.contiguous(), pc = packed.contiguous();
  at::Tensor kept;
  const float* bp = whiflash::checked_bias(bias, out_features, kept, "linear_fp32");
  at::Tensor y = at::empty({rows, out_features}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = pc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  whiflash::for_each_tile(out_features, kBlock, rows, kTileRows, 0, [&](int64_t blk, int64_t, int64_t col,
                                                                         int64_t cols, int64_t r, int64_t n) {
    kBlockFns[n - 1](xp + r * depth, depth, wp + blk * depth * kBlock, depth, bp ? bp + col : nullptr,
                     yp + r * out_features + col, out_features, cols);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(whiflash, m) {
  m.def("linear_fp32(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(whiflash, CPU, m) {
  m.impl("linear_fp32", &linear_fp32);
}
