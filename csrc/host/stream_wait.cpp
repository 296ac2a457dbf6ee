// stream_wait_geq: a stream waits, on the GPU, until a 32-bit value in pinned host memory reaches a bound.
//
// A layer-wise adapter load enqueues every layer's copy at once; the host stage's reader publishes how many layers
// are in place (pread_layers' flag), and layer l's copy waits here for the count to reach l + 1. The wait is
// cuStreamWaitValue32 (a stream memory operation, handled by the GPU's front end: no kernel, no SM), reached through
// cudaGetDriverEntryPointByVersion so that the extension needs no link against the driver library.
#include <Python.h>
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "host/stream_wait.h"

namespace lora_kernels {
namespace {

using WaitValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

// The driver's cuStreamWaitValue32 (nullptr with the reason in `why` when it cannot be had).
WaitValue32 wait_value32(const char** why) {
  static WaitValue32 fn = nullptr;
  static const char* reason = nullptr;
  static bool tried = false;
  if (!tried) {
    tried = true;
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status{};
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &p, 12000, cudaEnableDefault,
                                                             &status);
    if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || p == nullptr)
      reason = err != cudaSuccess ? cudaGetErrorString(err) : "the driver has no cuStreamWaitValue32";
    else
      fn = reinterpret_cast<WaitValue32>(p);
  }
  *why = reason;
  return fn;
}

}  // namespace

PyObject* stream_wait_geq(PyObject* /*self*/, PyObject* args) {
  unsigned long long stream, addr;
  unsigned int value;
  if (!PyArg_ParseTuple(args, "KKI", &stream, &addr, &value)) return nullptr;
  if (addr == 0 || addr % 4 != 0) {
    PyErr_Format(PyExc_ValueError, "stream_wait_geq: address 0x%llx is not a 4-byte aligned host pointer", addr);
    return nullptr;
  }
  const char* why = nullptr;
  const WaitValue32 fn = wait_value32(&why);
  if (fn == nullptr) {
    PyErr_Format(PyExc_RuntimeError, "stream_wait_geq: %s", why);
    return nullptr;
  }
  void* dptr = nullptr;  // the device's address of the pinned host word (the host address under UVA)
  cudaError_t err = cudaHostGetDevicePointer(&dptr, reinterpret_cast<void*>(addr), 0);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so that later calls do not see it
    PyErr_Format(PyExc_RuntimeError, "stream_wait_geq: 0x%llx is not mapped pinned host memory (%s)", addr,
                 cudaGetErrorString(err));
    return nullptr;
  }
  const CUresult res = fn(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(dptr), value,
                          CU_STREAM_WAIT_VALUE_GEQ);
  if (res != CUDA_SUCCESS) {
    PyErr_Format(PyExc_RuntimeError, "stream_wait_geq: cuStreamWaitValue32 failed (CUresult %d)",
                 static_cast<int>(res));
    return nullptr;
  }
  Py_RETURN_NONE;
}

}  // namespace lora_kernels
