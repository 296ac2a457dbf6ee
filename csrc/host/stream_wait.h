// stream_wait_geq(stream handle, pinned host address, value) -> None: the stream waits on the GPU until the int32
// at that address is >= value (stream_wait.cpp); raises RuntimeError where the driver cannot.
#pragma once
#include <Python.h>

namespace lora_kernels {
PyObject* stream_wait_geq(PyObject* self, PyObject* args);
}  // namespace lora_kernels
