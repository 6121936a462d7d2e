// Reductions over a vocabulary of logits that every round runs, where torch's reductions cost ~0.1 ms each at a 49k
// vocabulary (timings: docs/measurements.md, "Kernels"):
// - whiflash::argmax_rows: each row's greedy choice for verification;
// - whiflash::entropy_margin: the route signal of a bonus position, the entropy (nats) of softmax(logits) and the
//   top-1 minus top-2 probability, in two passes (the top two values; then the sums of e = exp(z - top) and
//   e * (z - top)): H = log S - sum e (z - top) / S with S = sum e (one call where torch takes eight ops);
//   each thread over its part of the vocabulary, the parts merged;
// - whiflash::topk_rows: each row's k largest values (optionally as log-softmax values) and their indices, for the
//   drafters' trees: EAGLE-3's children and DDTree's ranks per depth (in place of aten's topk, and of DDTree's
//   log_softmax + topk).
// argmax_rows and entropy_margin split the vocabulary between the threads as the LM head's GEMM splits its outputs,
// so that each thread reads logits its own core wrote (see argmax_rows).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <mutex>
#include <utility>
#include <tuple>
#include <vector>

#include "simd.h"

namespace {

using whiflash::Index;
using whiflash::kLanes;
using whiflash::Mask;
using whiflash::Vec;

// What a part z[begin, end) of a row contributes to its route signal: its two largest values, and with e = exp(z -
// top) over the part, S = sum e and W = sum e (z - top) (a -inf adds nothing to either; both zero where the part
// holds no value above -inf).
struct SignalPart {
  float top = -INFINITY, runner = -INFINITY;
  double s = 0, w = 0;
};

template <typename T>
SignalPart signal_part(const T* z, int64_t begin, int64_t end) {
  const Vec lowest = Vec::all(-INFINITY);
  Vec first = lowest, second = lowest;   // per lane: its largest and second largest value
  for (int64_t i = begin; i < end; i += kLanes) {
    const Vec v = select(Mask::first(end - i), Vec::load(z + i, end - i), lowest);
    second = max(second, min(first, v));
    first = max(first, v);
  }
  // the two largest of the 2 kLanes lane candidates are the two largest values (each candidate is its own element)
  float cand[2 * kLanes];
  first.store(cand);
  second.store(cand + kLanes);
  SignalPart part;
  for (float c : cand) {
    if (c > part.top) {
      part.runner = part.top;
      part.top = c;
    } else if (c > part.runner) {
      part.runner = c;
    }
  }
  if (part.top == -INFINITY) return part;
  const Vec shift = Vec::all(part.top);
  Vec sum = Vec::zero(), weighted = Vec::zero();
  for (int64_t i = begin; i < end; i += kLanes) {
    const Vec v = Vec::load(z + i, end - i);
    const Mask counted = Mask::first(end - i) & greater(v, lowest);   // -inf (e = 0) adds 0
    const Vec d = select(counted, v - shift, Vec::zero());
    const Vec e = select(counted, whiflash::exp(d), Vec::zero());
    sum = sum + e;
    weighted = fma(e, d, weighted);
  }
  part.s = reduce_add(sum), part.w = reduce_add(weighted);
  return part;
}

// The route signal of a row from its parts: with T the row's top and r_p = exp(top_p - T), S = sum_p r_p S_p and
// sum e (z - T) = sum_p r_p (W_p + (top_p - T) S_p); H = log S - that / S, margin (1 - exp(runner - T)) / S.
std::vector<double> signal_of(const std::vector<SignalPart>& parts, int64_t n) {
  float top = -INFINITY, runner = -INFINITY;
  for (const SignalPart& p : parts) {
    for (float c : {p.top, p.runner}) {
      if (c > top) {
        runner = top;
        top = c;
      } else if (c > runner) {
        runner = c;
      }
    }
  }
  double s = 0, w = 0;
  for (const SignalPart& p : parts) {
    if (p.top == -INFINITY) continue;
    const double shift = static_cast<double>(p.top) - top, r = std::exp(shift);
    s += r * p.s;
    w += r * (p.w + shift * p.s);
  }
  const double margin = n < 2 ? 1.0 : (1.0 - std::exp(static_cast<double>(runner) - top)) / s;
  return {std::log(s) - w / s, margin};
}

// Of two (value, index) candidates the larger value, the smaller index among equal ones (index -1: no candidate).
inline std::pair<float, int64_t> better(std::pair<float, int64_t> a, std::pair<float, int64_t> b) {
  if (b.second < 0) return a;
  if (a.second < 0 || b.first > a.first || (b.first == a.first && b.second < a.second)) return b;
  return a;
}

// The largest value of z[begin, end) and its first index (torch.argmax's rule for ties; a NaN is skipped, not
// chosen); index -1 where the range holds no value above -inf.
template <typename T>
std::pair<float, int64_t> argmax_in(const T* z, int64_t begin, int64_t end) {
  Vec best = Vec::all(-INFINITY);
  Index where = Index::iota(0);
  Index index = Index::iota(static_cast<int32_t>(begin));
  for (int64_t i = begin; i < end; i += kLanes) {
    const Vec v = Vec::load(z + i, end - i);
    const Mask more = Mask::first(end - i) & greater(v, best);
    best = select(more, v, best);
    where = where.where(more, index);
    index = index.next();
  }
  float value[kLanes];
  int32_t at[kLanes];
  best.store(value);
  where.store(at);
  std::pair<float, int64_t> chosen{-INFINITY, -1};
  for (int lane = 0; lane < kLanes; ++lane)
    chosen = better(chosen, {value[lane], value[lane] > -INFINITY ? at[lane] : -1});
  return chosen;
}

// The k largest values of a row, largest first (ties: the smaller index first; NaN never chosen), into value/at;
// returns how many it found (fewer than k only where the row holds fewer non-NaN values). One pass: kLanes values
// at a time are compared with the k-th best so far, and the few that beat it are inserted in order.
template <typename T>
int64_t topk_of(const T* z, int64_t n, int64_t k, float* value, int64_t* at) {
  int64_t count = 0;
  for (int64_t i = 0; i < n; i += kLanes) {
    const Vec v = Vec::load(z + i, n - i);
    unsigned enter = (Mask::first(n - i) & (count < k ? ordered(v) : greater(v, Vec::all(value[k - 1])))).bits();
    while (enter) {
      const int lane = __builtin_ctz(enter);
      enter &= enter - 1;
      const float x = static_cast<float>(z[i + lane]);
      if (count == k && !(x > value[k - 1])) continue;   // the k-th best rose since the compare
      int64_t p = count < k ? count++ : k - 1;           // the slot it takes, then moved up past smaller values
      while (p > 0 && value[p - 1] < x) {
        value[p] = value[p - 1];
        at[p] = at[p - 1];
        --p;
      }
      value[p] = x;
      at[p] = i + lane;
    }
  }
  return count;
}

// log sum_j exp(z_j) of a row (the max, then the sum of exp(z - max) in kLanes lanes, reduced once)
template <typename T>
float log_sum_exp(const T* z, int64_t n) {
  Vec top = Vec::all(-INFINITY);
  for (int64_t i = 0; i < n; i += kLanes) {
    const Mask m = Mask::first(n - i);
    top = select(m, max(top, Vec::load(z + i, n - i)), top);
  }
  const float most = reduce_max(top);
  if (!std::isfinite(most)) return most;
  const Vec shift = Vec::all(most);
  Vec sum = Vec::zero();
  for (int64_t i = 0; i < n; i += kLanes)
    sum = sum + select(Mask::first(n - i), whiflash::exp(Vec::load(z + i, n - i) - shift), Vec::zero());
  return most + std::log(reduce_add(sum));
}

std::tuple<at::Tensor, at::Tensor> topk_rows(const at::Tensor& logits, int64_t k, bool log_softmax) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 1 && (logits.scalar_type() == at::kFloat ||
                                                             logits.scalar_type() == at::kBFloat16),
              "topk_rows: logits must be [rows, vocab] fp32 or bf16");
  TORCH_CHECK(k >= 1 && k <= logits.size(1), "topk_rows: k must be between 1 and the vocabulary size");
  const at::Tensor z = logits.contiguous();
  const int64_t rows = z.size(0), n = z.size(1);
  const bool fp32 = z.scalar_type() == at::kFloat;
  at::Tensor values = at::empty({rows, k}, z.options().dtype(at::kFloat));
  at::Tensor indices = at::empty({rows, k}, z.options().dtype(at::kLong));
  for (int64_t r = 0; r < rows; ++r) {
    float* v = values.data_ptr<float>() + r * k;
    int64_t* at = indices.data_ptr<int64_t>() + r * k;
    const float* zf = fp32 ? z.data_ptr<float>() + r * n : nullptr;
    const at::BFloat16* zb = fp32 ? nullptr : z.data_ptr<at::BFloat16>() + r * n;
    const int64_t found = fp32 ? topk_of(zf, n, k, v, at) : topk_of(zb, n, k, v, at);
    TORCH_CHECK(found == k, "topk_rows: a row holds fewer than k values that are not NaN");
    if (log_softmax) {
      const float lse = fp32 ? log_sum_exp(zf, n) : log_sum_exp(zb, n);
      for (int64_t j = 0; j < k; ++j) v[j] -= lse;
    }
  }
  return {values, indices};
}

// The threads split the vocabulary as the LM head's GEMM splits its outputs (at::parallel_for over 16-column tiles,
// grain 1), so each reads the logits its own core wrote. Still, most of a round's call is the logits' cold lines,
// whichever core reads them (a second call at once is several times faster; docs/measurements.md, "Kernels").
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 1 && logits.size(1) < (int64_t(1) << 31) &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "argmax_rows: logits must be [rows, vocab] fp32 or bf16");
  const at::Tensor z = logits.contiguous();
  const int64_t rows = z.size(0), n = z.size(1), tiles = (n + 15) / 16;
  const bool fp32 = z.scalar_type() == at::kFloat;
  std::vector<std::pair<float, int64_t>> chosen(rows, {-INFINITY, -1});
  std::mutex merge;
  at::parallel_for(0, tiles, 1, [&](int64_t begin_tile, int64_t end_tile) {
    const int64_t begin = begin_tile * 16, end = std::min(end_tile * 16, n);
    std::vector<std::pair<float, int64_t>> part(rows);
    for (int64_t r = 0; r < rows; ++r)
      part[r] = fp32 ? argmax_in(z.data_ptr<float>() + r * n, begin, end)
                     : argmax_in(z.data_ptr<at::BFloat16>() + r * n, begin, end);
    const std::lock_guard<std::mutex> hold(merge);
    for (int64_t r = 0; r < rows; ++r) chosen[r] = better(chosen[r], part[r]);
  });
  at::Tensor out = at::empty({rows}, z.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) o[r] = chosen[r].second < 0 ? 0 : chosen[r].second;   // no value above -inf: 0
  return out;
}

// Each thread over its part of the vocabulary, as in argmax_rows; the route signal from the parts.
std::vector<double> entropy_margin(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 1 && logits.numel() >= 1 &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "entropy_margin: logits must be [vocab] fp32 or bf16");
  const at::Tensor z = logits.contiguous();
  const int64_t n = z.numel();
  const bool fp32 = z.scalar_type() == at::kFloat;
  std::vector<SignalPart> parts;
  std::mutex merge;
  at::parallel_for(0, (n + 15) / 16, 1, [&](int64_t begin_tile, int64_t end_tile) {
    const int64_t begin = begin_tile * 16, end = std::min(end_tile * 16, n);
    const SignalPart part = fp32 ? signal_part(z.data_ptr<float>(), begin, end)
                                 : signal_part(z.data_ptr<at::BFloat16>(), begin, end);
    const std::lock_guard<std::mutex> hold(merge);
    parts.push_back(part);
  });
  return signal_of(parts, n);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(whiflash, m) {
  m.def("entropy_margin(Tensor logits) -> float[]");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("topk_rows(Tensor logits, int k, bool log_softmax) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(whiflash, CPU, m) {
  m.impl("entropy_margin", &entropy_margin);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("topk_rows", &topk_rows);
}
