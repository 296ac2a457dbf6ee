// The one list of supported dtypes: (torch scalar type, CUDA storage type). Dispatch below is the only
// place that turns a run-time dtype into a kernel instantiation, so adding a dtype is one line of
// LK_FOR_EACH_DTYPE (plus to_float/from_float in kernels/types.cuh and lora_kernels/limits.py DTYPES).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/all.h>

#define LK_FOR_EACH_DTYPE(F)           \
  F(at::kHalf, __half)                 \
  F(at::kBFloat16, __nv_bfloat16)      \
  F(at::kFloat, float)

namespace lora_kernels {

// f(T{}) with T the storage type of `t`; false if `t` is not in the list.
template <typename F>
bool dispatch_dtype(at::ScalarType t, F&& f) {
#define LK_CASE(ST, CT) \
  if (t == ST) {        \
    f(CT{});            \
    return true;        \
  }
  LK_FOR_EACH_DTYPE(LK_CASE)
#undef LK_CASE
  return false;
}

// f(T{}, V{}) for inputs of dtype `t` and a v of dtype `v`, which must be fp32 or `t` itself.
template <typename F>
bool dispatch_dtype_v(at::ScalarType t, at::ScalarType v, F&& f) {
  if (v != at::kFloat && v != t) return false;
  return dispatch_dtype(t, [&](auto tt) {
    using T = decltype(tt);
    if (v == at::kFloat)
      f(T{}, float{});
    else
      f(T{}, T{});
  });
}

}  // namespace lora_kernels
