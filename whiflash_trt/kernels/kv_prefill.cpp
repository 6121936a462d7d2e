// whiflash::kv_prefill: the KV-only prefill of plugins/kv_prefill.py (its contract, step for step) over the engine's
// packed weights, writing each backlog position's keys and values straight into the drafter's pools. Every round
// that drafts runs it on the tokens the last round accepted; as torch ops (the contract's reference) it costs ~0.45 ms
// for 5 tokens of SmolLM2's DFlash (AMD EPYC, 2 threads), mostly the dispatch of its ~30 small elementwise ops.
//
//   h = rms(feats @ fc^T) * hidden_norm;  x = [rms(embeds) * input_norm ; h]  (EAGLE-3)  or  h  (DFlash)
//   [k | v] = x @ kv^T  (kv: every layer's k_proj, then every layer's v_proj, one packed weight)
//   k = rope(rms_per_head(k) * k_norm[layer])  (k_norm absent: no norm);  pools[layer][slot[t]] = k, v
//
// The GEMMs are whiflash::linear_bf16 / linear_fp32 (linear_norm_bf16 over int8 weights, a drafter's where they
// pay); the elementwise steps round to the dtype where the reference's torch ops do (RMSNorm: normalise in fp32,
// round, times the weight, round; RoPE: k*cos and rot(k)*sin each rounded, then their sum), so they differ from the
// reference only by the order of the GEMMs' and norms' sums (and an int8 weight's quantisation).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

template <typename T>
inline float rounded(float x) {
  return static_cast<float>(static_cast<T>(x));
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  using Fn = at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, int64_t);
  using Opt = c10::optional<at::Tensor>;
  using NormFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const Opt&, const Opt&, double,
                                                    const at::Tensor&, const Opt&, int64_t, bool);
  static auto bf16 = c10::Dispatcher::singleton().findSchemaOrThrow("whiflash::linear_bf16", "").typed<Fn>();
  static auto fp32 = c10::Dispatcher::singleton().findSchemaOrThrow("whiflash::linear_fp32", "").typed<Fn>();
  // int8 (kernels.pack_int8): the process's loop, as a drafter's layers run it (linear_norm_bf16 without a norm)
  static auto int8 = c10::Dispatcher::singleton().findSchemaOrThrow("whiflash::linear_norm_bf16", "").typed<NormFn>();
  if (packed.scalar_type() == at::kChar)
    return std::get<0>(int8.call(x, c10::nullopt, c10::nullopt, 0.0, packed, c10::nullopt, out_features, false));
  return (packed.scalar_type() == at::kInt ? bf16 : fp32).call(x, packed, c10::nullopt, out_features);
}

// y[i] = weight[i] * round(x[i] / rms(x)) for n elements, rounded to T (RMSNorm as models.layers.RMSNorm computes it)
template <typename T>
void rms_norm(const T* x, const T* weight, int64_t n, float eps, T* y) {
  float squares = 0.f;
  for (int64_t i = 0; i < n; ++i) squares += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i)
    y[i] = static_cast<T>(static_cast<float>(weight[i]) * rounded<T>(static_cast<float>(x[i]) * inv));
}

template <typename T>
void write_kv(const at::Tensor& y, const at::Tensor& k_norm, const at::Tensor& cos, const at::Tensor& sin, float eps,
              at::Tensor& k_cache, at::Tensor& v_cache, const int64_t* slots) {
  const int64_t tokens = y.size(0), layers = k_cache.size(0), kv_heads = k_cache.size(2), dim = k_cache.size(3);
  const int64_t half = dim / 2, kv_width = layers * kv_heads * dim;
  const T* yp = y.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const bool norm = k_norm.size(1) > 0;
  T* kp = k_cache.data_ptr<T>();
  T* vp = v_cache.data_ptr<T>();
  const int64_t layer_stride = k_cache.stride(0), slot_stride = k_cache.stride(1);
  std::vector<T> head(dim);
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cp + t * dim;
    const T* s = sp + t * dim;
    for (int64_t l = 0; l < layers; ++l) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t col = (l * kv_heads + h) * dim, at = l * layer_stride + slots[t] * slot_stride + h * dim;
        const T* k = yp + t * 2 * kv_width + col;
        if (norm) {
          rms_norm(k, k_norm.data_ptr<T>() + l * dim, dim, eps, head.data());
        } else {
          std::memcpy(head.data(), k, dim * sizeof(T));
        }
        for (int64_t i = 0; i < dim; ++i) {
          const float x = head[i], turned = i < half ? -static_cast<float>(head[i + half])
                                                     : static_cast<float>(head[i - half]);
          kp[at + i] = static_cast<T>(rounded<T>(x * static_cast<float>(c[i])) +
                                      rounded<T>(turned * static_cast<float>(s[i])));
        }
        std::memcpy(vp + at, yp + t * 2 * kv_width + kv_width + col, dim * sizeof(T));
      }
    }
  }
}

template <typename T>
at::Tensor projected_input(const at::Tensor& feats, const at::Tensor& fc_packed, int64_t hidden,
                           const at::Tensor& hidden_norm, const at::Tensor& embeds, const at::Tensor& input_norm,
                           float eps) {
  const int64_t tokens = feats.size(0);
  const at::Tensor h = packed_linear(feats, fc_packed, hidden);
  const bool paired = embeds.size(1) > 0;
  at::Tensor x = at::empty({tokens, paired ? 2 * hidden : hidden}, feats.options());
  const int64_t width = x.size(1);
  T* xp = x.data_ptr<T>();
  for (int64_t t = 0; t < tokens; ++t) {
    if (paired) rms_norm(embeds.data_ptr<T>() + t * hidden, input_norm.data_ptr<T>(), hidden, eps, xp + t * width);
    rms_norm(h.data_ptr<T>() + t * hidden, hidden_norm.data_ptr<T>(), hidden, eps, xp + t * width + width - hidden);
  }
  return x;
}

void kv_prefill(const at::Tensor& feats, const at::Tensor& fc_packed, int64_t hidden, const at::Tensor& hidden_norm,
                const at::Tensor& embeds, const at::Tensor& input_norm, const at::Tensor& kv_packed,
                const at::Tensor& k_norm, const at::Tensor& cos, const at::Tensor& sin, double eps,
                at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& write_slots) {
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "kv_prefill: bf16 or fp32 pools");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && v_cache.scalar_type() == dtype,
              "kv_prefill: pools [layers, slots, kv_heads, D], contiguous, of one shape and dtype");
  const int64_t tokens = feats.size(0), layers = k_cache.size(0), dim = k_cache.size(3);
  TORCH_CHECK(feats.dim() == 2 && feats.scalar_type() == dtype, "kv_prefill: feats [T, F] in the pools' dtype");
  TORCH_CHECK(hidden_norm.numel() == hidden && hidden_norm.scalar_type() == dtype,
              "kv_prefill: hidden_norm_weight [H] in the pools' dtype");
  TORCH_CHECK(embeds.dim() == 2 && embeds.size(0) == tokens && (embeds.size(1) == 0 || embeds.size(1) == hidden) &&
                  embeds.scalar_type() == dtype && input_norm.numel() == embeds.size(1) &&
                  input_norm.scalar_type() == dtype,
              "kv_prefill: embeds [T, H] with input_norm_weight [H], or [T, 0] with [0], in the pools' dtype");
  TORCH_CHECK(k_norm.dim() == 2 && k_norm.size(0) == layers && (k_norm.size(1) == 0 || k_norm.size(1) == dim) &&
                  k_norm.scalar_type() == dtype,
              "kv_prefill: k_norm_weight [layers, D] or [layers, 0] in the pools' dtype");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == tokens && cos.size(1) == dim &&
                  dim % 2 == 0 && cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              "kv_prefill: cos and sin [T, D] (D even) in the pools' dtype");
  TORCH_CHECK(write_slots.numel() == tokens && write_slots.scalar_type() == at::kLong,
              "kv_prefill: one int64 write slot per token");
  const at::Tensor where = write_slots.contiguous();
  const int64_t* slots = where.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < k_cache.size(1), "kv_prefill: a write slot is outside the pool");
  if (tokens == 0) return;
  const float e = static_cast<float>(eps);
  const int64_t kv_out = 2 * layers * k_cache.size(2) * dim;
  const at::Tensor f = feats.contiguous(), em = embeds.contiguous(), hn = hidden_norm.contiguous(),
                   in = input_norm.contiguous(), kn = k_norm.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  if (dtype == at::kFloat) {
    const at::Tensor y = packed_linear(projected_input<float>(f, fc_packed, hidden, hn, em, in, e), kv_packed, kv_out);
    write_kv<float>(y, kn, c, s, e, k_cache, v_cache, slots);
  } else {
    const at::Tensor y = packed_linear(projected_input<at::BFloat16>(f, fc_packed, hidden, hn, em, in, e), kv_packed,
                                       kv_out);
    write_kv<at::BFloat16>(y, kn, c, s, e, k_cache, v_cache, slots);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(whiflash, m) {
  m.def("kv_prefill(Tensor feats, Tensor fc_packed, int hidden, Tensor hidden_norm_weight, Tensor embeds, "
        "Tensor input_norm_weight, Tensor kv_packed, Tensor k_norm_weight, Tensor cos, Tensor sin, float eps, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor write_slots) -> ()");
}

TORCH_LIBRARY_IMPL(whiflash, CPU, m) {
  m.impl("kv_prefill", &kv_prefill);
}
