// Host-side helpers of the Python module lora_kernels._C (plain CPython functions, no torch dispatch).
#pragma once
#include <Python.h>

namespace lora_kernels {
// The method table of lora_kernels._C: fill_batch_record (batch_record.cpp), pread_into, pread_layers(_start, _wait)
// and read_heads
// (file_reads.cpp), stream_wait_geq (stream_wait.cpp).
extern PyMethodDef host_methods[];
}  // namespace lora_kernels
