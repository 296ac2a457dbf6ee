// BatchInfoBuilder's host work in C++: Python lists of (token count, slot) per request -> the packed int32
// record that one non-blocking copy moves to the GPU (layout in lora_kernels/batch_info.py). Written
// against the CPython API directly: a torch op costs more in dispatch than this whole function.
#include "host/batch_record.h"

#include "host/file_reads.h"
#include "host/stream_wait.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace lora_kernels {
namespace {

struct Buffer {  // a writable C-contiguous int32 buffer (the staging record's numpy view)
  Py_buffer view{};
  bool ok = false;
  explicit Buffer(PyObject* obj) {
    if (PyObject_GetBuffer(obj, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) return;
    if (view.itemsize != 4) {
      PyErr_SetString(PyExc_TypeError, "fill_batch_record: buffers must hold int32");
      return;
    }
    ok = true;
  }
  ~Buffer() {
    if (view.obj != nullptr) PyBuffer_Release(&view);
  }
  int32_t* data() const { return static_cast<int32_t*>(view.buf); }
  Py_ssize_t size() const { return view.len / 4; }
};

// Reads a list or tuple of Python ints into out; false (with a Python error set) on a non-int or overflow.
bool read_ints(PyObject* seq, const char* name, std::vector<int64_t>& out) {
  PyObject** items = PySequence_Fast_ITEMS(seq);
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  out.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
    if (overflow != 0 || v < INT32_MIN || v > INT32_MAX) {
      PyErr_Format(PyExc_ValueError, "%s holds values outside int32", name);
      return false;
    }
    if (v == -1 && PyErr_Occurred()) return false;
    out[i] = v;
  }
  return true;
}

struct Request {
  std::vector<int64_t> counts, slots;
};

bool check(const Request& r, int64_t num_slots, int64_t max_tokens, int64_t* total, bool* ones) {
  *total = 0;
  *ones = !r.counts.empty();
  for (size_t i = 0; i < r.slots.size(); ++i) {
    if (r.slots[i] < -1 || r.slots[i] >= num_slots) {
      PyErr_Format(PyExc_ValueError, "slot %lld out of range: slots must be -1 or in [0, %lld)",
                   static_cast<long long>(r.slots[i]), static_cast<long long>(num_slots));
      return false;
    }
  }
  for (int64_t c : r.counts) {
    if (c < 0) {
      PyErr_Format(PyExc_ValueError, "seg_token_counts must be >= 0, got %lld", static_cast<long long>(c));
      return false;
    }
    if (c > max_tokens) {
      PyErr_Format(PyExc_ValueError, "%lld tokens exceed max_tokens=%lld", static_cast<long long>(c),
                   static_cast<long long>(max_tokens));
      return false;
    }
    *total += c;
    *ones = *ones && c == 1;
  }
  if (*total > max_tokens) {
    PyErr_Format(PyExc_ValueError, "%lld tokens exceed max_tokens=%lld", static_cast<long long>(*total),
                 static_cast<long long>(max_tokens));
    return false;
  }
  return true;
}

// Segments of the batch: one per request, or (sort) one per distinct slot in ascending slot order with
// the requests' rows gathered through perm (physical row of each segmented row).
// Requests ordered by slot, stably: a counting sort over the slot range when that range is small against the
// batch (the usual case: a pool of tens of slots), else std::stable_sort. Either gives the same order.
void order_by_slot(const Request& r, int64_t num_slots, std::vector<int32_t>& order) {
  const size_t n = r.slots.size();
  order.resize(n);
  if (num_slots > 4 * static_cast<int64_t>(n) + 64) {
    for (size_t i = 0; i < n; ++i) order[i] = static_cast<int32_t>(i);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return r.slots[a] < r.slots[b]; });
    return;
  }
  std::vector<int32_t> first(static_cast<size_t>(num_slots) + 2, 0);  // bucket slot + 1 (slot -1 -> 0)
  for (int64_t s : r.slots) ++first[s + 2];
  for (size_t b = 1; b < first.size(); ++b) first[b] += first[b - 1];
  for (size_t i = 0; i < n; ++i) order[first[r.slots[i] + 1]++] = static_cast<int32_t>(i);
}

void segments(const Request& r, bool sort, int64_t num_slots, std::vector<int32_t>& seg_slot,
              std::vector<int32_t>& seg_len, int32_t* perm) {
  const size_t n = r.slots.size();
  if (!sort) {
    seg_slot.assign(r.slots.begin(), r.slots.end());
    seg_len.assign(r.counts.begin(), r.counts.end());
    return;
  }
  std::vector<int64_t> start(n);  // physical first row of each request
  int64_t acc = 0;
  for (size_t i = 0; i < n; ++i) {
    start[i] = acc;
    acc += r.counts[i];
  }
  std::vector<int32_t> order;
  order_by_slot(r, num_slots, order);
  seg_slot.reserve(n);
  seg_len.reserve(n);
  int64_t row = 0;
  for (size_t k = 0; k < n; ++k) {
    const int32_t j = order[k];
    if (k == 0 || r.slots[j] != r.slots[order[k - 1]]) {
      seg_slot.push_back(static_cast<int32_t>(r.slots[j]));
      seg_len.push_back(0);
    }
    seg_len.back() += static_cast<int32_t>(r.counts[j]);
    for (int64_t t = 0; t < r.counts[j]; ++t) perm[row++] = static_cast<int32_t>(start[j] + t);
  }
}

// [tiles | slot m | row0 m | end m | weight_indices cap | seg_lens cap | seg_indptr cap+1]
void write_general(int32_t* rec, const std::vector<int32_t>& seg_slot, const std::vector<int32_t>& seg_len,
                   int64_t m, int64_t cap, int64_t tile_m) {
  const int64_t k = static_cast<int64_t>(seg_slot.size());
  int32_t* wi = rec + 1 + 3 * m;
  int32_t* lens = wi + cap;
  int32_t* indptr = lens + cap;
  int64_t tiles = 0, row = 0;
  indptr[0] = 0;
  for (int64_t s = 0; s < cap; ++s) {
    const int32_t len = s < k ? seg_len[s] : 0;
    wi[s] = s < k ? seg_slot[s] : -1;
    lens[s] = len;
    for (int64_t r0 = row; r0 < row + len; r0 += tile_m, ++tiles) {
      rec[1 + tiles] = wi[s];
      rec[1 + m + tiles] = static_cast<int32_t>(r0);
      rec[1 + 2 * m + tiles] = static_cast<int32_t>(row + len);
    }
    row += len;
    indptr[s + 1] = static_cast<int32_t>(row);
  }
  rec[0] = static_cast<int32_t>(tiles);
}

int64_t tile_count(const std::vector<int32_t>& seg_len, int64_t tile_m) {
  int64_t tiles = 0;
  for (int32_t len : seg_len) tiles += (len + tile_m - 1) / tile_m;
  return tiles;
}

struct Filled {  // what fill() wrote: kind 0 = graph-mode pure decode (count + slots only), 1 = general record
  int kind = 0;
  int64_t n = 0, k = 0, total = 0, tiles = 0, m = 0, cap = 0;
  int32_t max_len = 0;
};

// Parses and checks the lists, then writes the record (and, sorting, perm). False with a Python error set.
bool fill(PyObject* counts_obj, PyObject* slots_obj, Buffer& rec, Buffer& perm, long long num_slots,
          long long max_tokens, bool sort, long long graph_cap, long long graph_mt, long long dec_rows,
          long long tile_m, Filled& out) {
  PyObject* counts_seq = PySequence_Fast(counts_obj, "seg_token_counts must be a list or tuple");
  if (counts_seq == nullptr) return false;
  PyObject* slots_seq = PySequence_Fast(slots_obj, "slots must be a list or tuple");
  if (slots_seq == nullptr) {
    Py_DECREF(counts_seq);
    return false;
  }
  Request r;
  bool read = read_ints(counts_seq, "seg_token_counts", r.counts) && read_ints(slots_seq, "slots", r.slots);
  Py_DECREF(counts_seq);
  Py_DECREF(slots_seq);
  bool ones;
  if (!read || !check(r, num_slots, max_tokens, &out.total, &ones)) return false;
  out.n = static_cast<int64_t>(r.slots.size());
  if (!sort && ones && out.n <= dec_rows) {  // graph-mode pure decode: [n | slots padded with -1 to graph_cap]
    if (rec.size() < graph_cap + 1) return PyErr_Format(PyExc_ValueError, "fill_batch_record: record too short"), false;
    rec.data()[0] = static_cast<int32_t>(out.n);
    for (int64_t i = 0; i < graph_cap; ++i) rec.data()[1 + i] = i < out.n ? static_cast<int32_t>(r.slots[i]) : -1;
    out.kind = 0;
    return true;
  }
  if (sort && perm.size() < out.total) return PyErr_Format(PyExc_ValueError, "fill_batch_record: perm too short"), false;
  std::vector<int32_t> seg_slot, seg_len;
  segments(r, sort, num_slots, seg_slot, seg_len, perm.data());
  out.kind = 1;
  out.k = static_cast<int64_t>(seg_slot.size());
  out.tiles = tile_count(seg_len, tile_m);
  out.m = graph_mt > 0 ? graph_mt : std::max<int64_t>(out.tiles, 1);
  out.cap = graph_cap > 0 ? graph_cap : std::max<int64_t>(out.k, 1);
  if (out.tiles > out.m || rec.size() < 1 + 3 * out.m + 3 * out.cap + 1)
    return PyErr_Format(PyExc_ValueError, "fill_batch_record: record too short"), false;
  write_general(rec.data(), seg_slot, seg_len, out.m, out.cap, tile_m);
  for (int32_t len : seg_len) out.max_len = std::max(out.max_len, len);
  return true;
}

// Graph mode: restores the identity in perm[total, perm_dirty), then copies the record's used prefix (count +
// slots for a decode record, the general record, or the whole record with its permutation tail when sorting)
// to its static device buffer on `stream` and records `event` there: one call instead of three torch ones.
// copy = (perm_dirty, device, stream, event, dec_dst, dec_bytes, gen_dst, gen_bytes, sorted_dst, sorted_bytes).
bool copy_record(PyObject* copy, Buffer& rec, Buffer& perm, bool sort, const Filled& f) {
  long long dirty, device, stream, event, dst[3], bytes[3];
  if (!PyArg_ParseTuple(copy, "LLLLLLLLLL", &dirty, &device, &stream, &event, &dst[0], &bytes[0], &dst[1], &bytes[1],
                        &dst[2], &bytes[2]))
    return false;
  if (sort)
    for (int64_t i = f.total; i < dirty && i < perm.size(); ++i) perm.data()[i] = static_cast<int32_t>(i);
  const int which = f.kind == 0 ? 0 : (sort ? 2 : 1);
  if (bytes[which] > rec.size() * 4) return PyErr_Format(PyExc_ValueError, "fill_batch_record: copy too long"), false;
  int current = -1;
  cudaError_t err = cudaGetDevice(&current);
  if (err == cudaSuccess && current != device) err = cudaSetDevice(static_cast<int>(device));
  auto s = reinterpret_cast<cudaStream_t>(static_cast<intptr_t>(stream));
  if (err == cudaSuccess)
    err = cudaMemcpyAsync(reinterpret_cast<void*>(static_cast<intptr_t>(dst[which])), rec.data(),
                          static_cast<size_t>(bytes[which]), cudaMemcpyHostToDevice, s);
  if (err == cudaSuccess) err = cudaEventRecord(reinterpret_cast<cudaEvent_t>(static_cast<intptr_t>(event)), s);
  if (current >= 0 && current != device) cudaSetDevice(current);
  if (err != cudaSuccess)
    return PyErr_Format(PyExc_RuntimeError, "fill_batch_record: record copy failed: %s", cudaGetErrorString(err)),
           false;
  return true;
}

PyObject* fill_batch_record(PyObject*, PyObject* args) {
  PyObject *counts_obj, *slots_obj, *rec_obj, *perm_obj, *copy = Py_None;
  long long num_slots, max_tokens, graph_cap, graph_mt, dec_rows, tile_m;
  int sort;
  if (!PyArg_ParseTuple(args, "OOOOLLpLLLL|O", &counts_obj, &slots_obj, &rec_obj, &perm_obj, &num_slots, &max_tokens,
                        &sort, &graph_cap, &graph_mt, &dec_rows, &tile_m, &copy))
    return nullptr;
  Buffer rec(rec_obj), perm(perm_obj);
  if (!rec.ok || !perm.ok) return nullptr;
  Filled f;
  if (!fill(counts_obj, slots_obj, rec, perm, num_slots, max_tokens, sort, graph_cap, graph_mt, dec_rows, tile_m, f))
    return nullptr;
  if (copy != Py_None && !copy_record(copy, rec, perm, sort, f)) return nullptr;
  if (f.kind == 0) return Py_BuildValue("(iL)", 0, static_cast<long long>(f.n));
  return Py_BuildValue("(iLiLLLL)", 1, static_cast<long long>(f.k), f.max_len, static_cast<long long>(f.total),
                       static_cast<long long>(f.tiles), static_cast<long long>(f.m), static_cast<long long>(f.cap));
}

}  // namespace

PyMethodDef host_methods[] = {
    {"fill_batch_record", fill_batch_record, METH_VARARGS,
     "fill_batch_record(counts, slots, rec, perm, num_slots, max_tokens, sort, graph_cap, graph_mt, dec_rows, "
     "tile_m[, copy]) -> (0, n) for a graph-mode decode record, else (1, segments, max_len, total, tiles, m, cap); "
     "copy = (perm_dirty, device, stream, event, dec_dst, dec_bytes, gen_dst, gen_bytes, sorted_dst, sorted_bytes) "
     "also restores the permutation tail and copies the record to the device, then records the event"},
    {"pread_into", pread_into, METH_VARARGS,
     "pread_into(fd, [(file_offset, writable_buffer), ...], threads=1) -> None, or (job, file_byte, errno) of the first read "
     "that failed (errno 0: end of file); every read with the GIL released"},
    {"pread_layers", pread_layers, METH_VARARGS,
     "pread_layers(path, buffer, reads, nlayers, threads, flag) -> (None or (job, file_byte, errno), layer times): "
     "reads = (layer, file offset, buffer offset, bytes) with non-decreasing layers, read layer by layer by all "
     "threads, the file opened and closed with the GIL released once; the count of complete layers is stored into "
     "flag (int32 buffer or None) as each completes"},
    {"pread_layers_start", pread_layers_start, METH_VARARGS,
     "pread_layers_start(path, buffer, reads, nlayers, threads, flag) -> handle: pread_layers' read started on a kept "
     "reader thread; returns at once"},
    {"pread_layers_wait", pread_layers_wait, METH_VARARGS,
     "pread_layers_wait(handle) -> pread_layers' result, once the read started by pread_layers_start has ended (the GIL "
     "released while it waits)"},
    {"stream_wait_geq", stream_wait_geq, METH_VARARGS,
     "stream_wait_geq(stream, host_addr, value) -> None: the CUDA stream waits until the pinned int32 at host_addr "
     "is >= value (cuStreamWaitValue32)"},
    {"file_ids", file_ids, METH_VARARGS,
     "file_ids(path1, path2) -> ((device, inode, size, mtime_ns, ctime_ns), ...) of both files, or None if a stat "
     "fails; the GIL held"},
    {"read_heads", read_heads, METH_VARARGS,
     "read_heads(config_path, weights_path) -> (config bytes, weights size, safetensors header bytes) or None on any "
     "error; the GIL released once"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace lora_kernels
