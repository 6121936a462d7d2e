// What the engine's GEMM kernels (linear_bf16.cpp, linear_fp32.cpp) share around their inner loops: the bias check
// and the walk over (64-output block, tile of rows) pairs, blocks spread over the threads. A thread computes whole
// outputs, so the split changes no bits.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace whiflash {

// The bias of a call, checked (fp32 with out_features elements) and kept alive in `keep`; nullptr for none
inline const float* checked_bias(const c10::optional<at::Tensor>& bias, int64_t out_features, at::Tensor& keep,
                                 const char* op) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->numel() == out_features && bias->scalar_type() == at::kFloat, op,
              ": bias must be fp32 with out_features elements");
  keep = bias->contiguous();
  return keep.data_ptr<float>();
}

// fn(block, blocks, first column, columns, first row, rows) for every block of `block` outputs and tile of up to
// `tile` rows. Each thread walks a contiguous run of blocks; in a call of at most `pair_rows` rows it walks them two
// at a time (blocks = 2, the columns of both), a last odd one alone (blocks = 1).
template <typename Fn>
void for_each_tile(int64_t out_features, int64_t block, int64_t rows, int64_t tile, int64_t pair_rows, const Fn& fn) {
  const int64_t blocks = (out_features + block - 1) / block;
  const int64_t step = rows <= pair_rows ? 2 : 1;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; blk += step) {
      const int64_t count = std::min(step, end - blk);
      const int64_t col = blk * block, cols = std::min(count * block, out_features - col);
      for (int64_t r = 0; r < rows; r += tile) fn(blk, count, col, cols, r, std::min(tile, rows - r));
    }
  });
}

}  // namespace whiflash
