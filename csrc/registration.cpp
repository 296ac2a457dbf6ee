// Op schemas of the lora_kernels namespace and their CUDA implementations. The module has an
// PyInit__C with only host helpers (csrc/host/) so `import lora_kernels._C` loads the library and runs the
// registrations.
#include <Python.h>
#include <torch/library.h>

#include "host/batch_record.h"
#include "ops/ops.h"

TORCH_LIBRARY(lora_kernels, m) {
  // The batch is the builder's work list (lora_kernels/batch_info.py): work = int32[1 + 3*max_tiles],
  // tiles of <= 64 rows of one segment: (slot, first segmented row, segment end); segmented row i is
  // physical row perm(i) = permutation[i] (or i). For every row i of a tile, slot = its slot:
  // v[perm(i), s*R + j] = sum_k x[perm(i), k] * lora_a[slot, s*R + j, k] for j < rank(slot), else 0.
  m.def(
      "sgmv_shrink(Tensor x, Tensor lora_a, Tensor work, Tensor lora_ranks, Tensor? permutation, "
      "int num_slices, int max_tiles, Tensor(a!) v) -> ()");
  // out[perm(i), off[s] + n] += scaling(slot) * sum_{j<rank} v[perm(i), s*R + j] * lora_b[slot, off[s] + n, j]
  // (rows of slot -1 / rank-0 tiles untouched).
  m.def(
      "sgmv_expand(Tensor v, Tensor lora_b, Tensor work, Tensor lora_ranks, Tensor scalings, Tensor? permutation, "
      "int[] slice_offsets, int max_tiles, Tensor(a!) out) -> ()");
  // sgmv_shrink then sgmv_expand through an fp32 v (bit for bit), in one call; on sm_90 the expand is a
  // programmatic dependent launch that streams its weights while the shrink finishes.
  m.def(
      "sgmv_apply(Tensor x, Tensor lora_a, Tensor lora_b, Tensor work, Tensor lora_ranks, Tensor scalings, "
      "Tensor? permutation, int[] slice_offsets, int max_tiles, Tensor(a!) out) -> ()");
  // linear(x, weight, bias) with sgmv_apply added into it: x [..., in_dim] contiguous, returns [..., out_total].
  // One call for a LoRA-targeted Linear, for eager callers whose host time is the cost (decode steps).
  // one_launch: up to kFusedMaxRowsLinear rows, the LoRA in one cluster launch instead of two (the same bits; fewer
  // host µs, more GPU µs: for callers whose GPU waits on the host, such as an eager decode step).
  m.def(
      "sgmv_linear(Tensor x, Tensor weight, Tensor? bias, Tensor lora_a, Tensor lora_b, Tensor work, "
      "Tensor lora_ranks, Tensor scalings, Tensor? permutation, int[] slice_offsets, int max_tiles, "
      "bool one_launch=False) -> Tensor");
  // out = x weightᵀ (+ bias) + the LoRA delta (sgmv_apply's sums, the base not rounded before the add) in one launch,
  // for 1..16 rows of x (fp16/bf16, in_dim a multiple of 256, pool rank a multiple of 8 up to 64). sync: int32 words,
  // two a slot, zero before a slot's first launch; each launch leaves its slot at zero. Launches that may run at once
  // (other streams) need other slots.
  m.def(
      "lora_gemv(Tensor x, Tensor weight, Tensor? bias, Tensor lora_a, Tensor lora_b, Tensor work, Tensor lora_ranks, "
      "Tensor scalings, Tensor? permutation, int[] slice_offsets, int max_tiles, Tensor(a!) sync, int sync_slot, "
      "Tensor(b!) out) -> ()");
  // silu(gu[..., :I]) * gu[..., I:] for gu [..., 2I] contiguous, rounded as torch's silu then mul: a gated MLP's
  // activation in one launch and one host call (eager decode steps).
  m.def("silu_mul(Tensor gu) -> Tensor");
  // dsts[i].copy_(srcs[i]) for pinned host srcs, all on the current stream, in one call.
  m.def("batched_h2d_copy(Tensor[] srcs, Tensor(a!)[] dsts) -> ()");
}

TORCH_LIBRARY_IMPL(lora_kernels, CUDA, m) {
  m.impl("sgmv_shrink", &lora_kernels::sgmv_shrink);
  m.impl("sgmv_expand", &lora_kernels::sgmv_expand);
  m.impl("sgmv_apply", &lora_kernels::sgmv_apply);
  m.impl("sgmv_linear", &lora_kernels::sgmv_linear);
  m.impl("silu_mul", &lora_kernels::silu_mul);
  m.impl("lora_gemv", &lora_kernels::lora_gemv);
  m.impl("batched_h2d_copy", &lora_kernels::batched_h2d_copy);
}

// On CPU tensors the copy op only rejects its inputs (a CPU destination is a plain copy_ for the caller);
// this gives CI, which has no GPU, a real C++ error path to test: a TORCH_CHECK must raise, not crash.
TORCH_LIBRARY_IMPL(lora_kernels, CPU, m) { m.impl("batched_h2d_copy", &lora_kernels::batched_h2d_copy); }

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, lora_kernels::host_methods};
  return PyModule_Create(&module_def);
}
}
