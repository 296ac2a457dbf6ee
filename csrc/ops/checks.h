// Tensor checks shared by the op bindings: each names the argument and what was expected.
#pragma once
#include <torch/all.h>

#define CHECK_CUDA(x) TORCH_CHECK((x).is_cuda(), #x " must be a CUDA tensor, got device ", (x).device())
#define CHECK_CONTIGUOUS(x) TORCH_CHECK((x).is_contiguous(), #x " must be contiguous, got strides ", (x).strides())
#define CHECK_DIM(d, x) \
  TORCH_CHECK((x).dim() == (d), #x " must be a ", d, "-D tensor, got shape ", (x).sizes())
#define CHECK_DTYPE(x, dt) \
  TORCH_CHECK((x).scalar_type() == (dt), #x " must have dtype ", dt, ", got ", (x).scalar_type())
#define CHECK_SAME_DEVICE(x, y) \
  TORCH_CHECK((x).device() == (y).device(), #x " is on ", (x).device(), " but " #y " is on ", (y).device())
#define CHECK_INPUT(x) \
  CHECK_CUDA(x);       \
  CHECK_CONTIGUOUS(x)
