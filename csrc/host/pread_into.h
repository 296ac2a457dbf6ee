// pread_into(fd, [(file offset, writable buffer), ...]) -> None, or (job index, file byte, errno) of the first
// read that failed (errno 0: end of file); see pread_into.cpp.
#pragma once
#include <Python.h>

namespace lora_kernels {
PyObject* pread_into(PyObject* self, PyObject* args);
}  // namespace lora_kernels
