// The engine's ops as plain C functions for AOTInductor (C shims). A compiled step calls an op that has one,
// aoti_torch_cpu_<op>, directly; any other custom op goes through AOTInductor's proxy executor, which builds an
// IValue stack, looks the op up by name and calls it boxed on every call (a SmolLM2 step makes ~150 such calls).
// kernels/ops.py C_SHIMS declares them to inductor (builder/compile_target.py) in the convention its generated
// code calls them with: a tensor as an AtenTensorHandle, an optional one as a pointer to one (nullptr for None),
// int as int64_t, float as double, bool as int32_t, and each returned tensor through an AtenTensorHandle* the shim
// fills. The library is loaded with global symbols (kernels.load) so that a package finds them.
//
// Through the shims a compiled step skips the proxy executor's per-call work: a slightly faster target step
// (docs/measurements.md, "Kernels").
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <utility>

namespace whiflash::shim {

inline const at::Tensor& tensor(AtenTensorHandle handle) {
  return *torch::aot_inductor::tensor_handle_to_tensor_pointer(handle);
}

inline c10::optional<at::Tensor> optional(AtenTensorHandle* handle) {
  return handle ? c10::optional<at::Tensor>(tensor(*handle)) : c10::nullopt;
}

inline void give(at::Tensor t, AtenTensorHandle* out) { *out = torch::aot_inductor::new_tensor_handle(std::move(t)); }

}  // namespace whiflash::shim
