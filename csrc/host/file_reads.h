// The host stage's file reads with the GIL released once per call (file_reads.cpp):
//   pread_into(fd, [(file offset, writable buffer), ...], threads=1) -> None, or (job index, file byte, errno) of
//     the first read that failed (errno 0: end of file);
//   pread_layers(path, buffer, [(layer, file offset, buffer offset, bytes), ...], nlayers, threads, flag) -> (None or
//     the failure as above (job -1: the open failed), (time each layer was complete, CLOCK_MONOTONIC seconds, ...)):
//     the file opened, read by all threads layer by layer and closed with the GIL released once; after each complete
//     layer the count of complete layers is stored into `flag` (an int32 buffer, or None);
//   pread_layers_start(same arguments) -> handle: the same read started on a kept thread, returning at once;
//   pread_layers_wait(handle) -> pread_layers' result, the GIL released while it waits (once per handle; a handle
//     dropped unwaited waits for its read, which writes into the buffer, before it lets the buffer go);
//   file_ids(path1, path2) -> ((device, inode, size, mtime ns, ctime ns), (...)) or None if a stat fails; the GIL
//     held (two stat calls);
//   read_heads(config_path, weights_path) -> (config bytes, weights file size, safetensors header bytes), or None
//     on any error (the caller's Python path then raises the error that names it).
#pragma once
#include <Python.h>

namespace lora_kernels {
PyObject* pread_into(PyObject* self, PyObject* args);
PyObject* pread_layers(PyObject* self, PyObject* args);
PyObject* pread_layers_start(PyObject* self, PyObject* args);
PyObject* pread_layers_wait(PyObject* self, PyObject* args);
PyObject* read_heads(PyObject* self, PyObject* args);
PyObject* file_ids(PyObject* self, PyObject* args);
}  // namespace lora_kernels
