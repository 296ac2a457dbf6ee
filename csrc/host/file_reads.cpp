// The host stage's file reads, each call with the GIL released once for all of its system calls.
//
// A host-stage worker reads an adapter's PEFT folder: the config and the safetensors header (to check the cached
// plan), then each tensor straight into its place in the packed (pinned) buffer. From Python every open, read and
// close releases the GIL and must take it back; while the scheduler thread runs Python (it launches the step's
// kernels), each take can wait for the interpreter's switch interval (5 ms). Here a worker takes it back once.
//   read_heads: the config's bytes, the weights file's size and its JSON header's bytes (the plan cache's key);
//   pread_into: a list of (file offset, buffer) reads, on up to `threads` threads;
//   pread_layers: the same list, each job tagged with its model layer, read layer by layer by all threads at once,
//     reporting when each layer is complete (a layer-wise load copies layer l once its bytes are in place).
#include "host/file_reads.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include <time.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace lora_kernels {
namespace {

struct Failure {  // the first job of a run that failed: file byte, errno (0: end of file)
  Py_ssize_t job = -1;
  long long at = 0;
  int err = 0;
};

// Reads len bytes at file offset off into dst; returns how many it read before end of file or an error (errno
// then set; 0 at end of file).
size_t pread_full(int fd, char* dst, size_t len, long long off) {
  size_t done = 0;
  errno = 0;
  while (done < len) {
    const ssize_t r = pread(fd, dst + done, len - done, static_cast<off_t>(off + static_cast<long long>(done)));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      if (r == 0) errno = 0;
      break;
    }
    done += static_cast<size_t>(r);
  }
  return done;
}

// Reads jobs [lo, hi) in order, stopping at the first failure.
Failure read_run(int fd, const std::vector<Py_buffer>& views, const std::vector<long long>& offsets, Py_ssize_t lo,
                 Py_ssize_t hi) {
  Failure f;
  for (Py_ssize_t i = lo; i < hi; ++i) {
    const size_t len = static_cast<size_t>(views[i].len);
    const size_t done = pread_full(fd, static_cast<char*>(views[i].buf), len, offsets[i]);
    if (done < len) {
      f.job = i;
      f.at = offsets[i] + static_cast<long long>(done);
      f.err = errno;
      return f;
    }
  }
  return f;
}

// The regular file at `path`, opened read-only (-1 on any error, a directory included); st filled.
int open_regular(const char* path, struct stat& st) {
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd >= 0 && (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))) {
    close(fd);
    return -1;
  }
  return fd;
}

// The whole file at `path` into out (false on any error: a missing file, a directory, a failed read).
bool read_file(const char* path, std::string& out) {
  struct stat st {};
  const int fd = open_regular(path, st);
  if (fd < 0) return false;
  out.resize(static_cast<size_t>(st.st_size));
  const bool ok = pread_full(fd, out.data(), out.size(), 0) == out.size();
  close(fd);
  return ok;
}

// The safetensors file's size and its JSON header (false on any error, or a header longer than the file).
bool read_header(const char* path, long long& size, std::string& header) {
  struct stat st {};
  const int fd = open_regular(path, st);
  if (fd < 0) return false;
  unsigned char len8[8];
  size = static_cast<long long>(st.st_size);
  bool ok = pread_full(fd, reinterpret_cast<char*>(len8), 8, 0) == 8;
  if (ok) {
    unsigned long long n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | len8[i];  // little-endian u64
    ok = size >= 8 && n <= static_cast<unsigned long long>(size - 8);
    if (ok) {
      header.resize(static_cast<size_t>(n));
      ok = pread_full(fd, header.data(), header.size(), 8) == header.size();
    }
  }
  close(fd);
  return ok;
}

// Seconds on CLOCK_MONOTONIC, the clock of Python's time.monotonic (and time.perf_counter) on Linux.
double monotonic_s() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Parses [(file offset, writable buffer), ...] into views/offsets; false with a Python error set. `got` is the
// number of views acquired (to release).
bool parse_jobs(PyObject* seq, std::vector<Py_buffer>& views, std::vector<long long>& offsets, Py_ssize_t& got) {
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  views.resize(n);
  offsets.resize(n);
  for (got = 0; got < n; ++got) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq, got);
    PyObject* buf = nullptr;
    if (!PyArg_ParseTuple(item, "LO", &offsets[got], &buf)) return false;
    if (offsets[got] < 0) {
      PyErr_Format(PyExc_ValueError, "jobs[%zd] has a negative file offset %lld", got, offsets[got]);
      return false;
    }
    if (PyObject_GetBuffer(buf, &views[got], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) return false;
  }
  return true;
}

constexpr size_t kLayerChunk = 256 << 10;  // a layer's jobs are cut into pieces of this size that the threads share:
// a rank-8 layer of the serving model is 1.3 MB, so 1 MB pieces kept all but two threads idle

// Reader threads kept for the life of the process: starting threads for every read cost ~15-20 µs each, paid
// before a host stage's first layer lands. run(work, helpers) runs `work` on the caller and on up to `helpers`
// idle pool threads at once, and returns when every copy has returned; concurrent calls share the threads, the
// earliest call's helpers first (an earlier host stage finishes first). submit(task) runs `task` on a pool thread
// and returns at once: an asynchronous read (pread_layers_start) starts without its caller waiting for anything.
class ReadPool {
 public:
  void run(const std::function<void()>& work, size_t helpers) {
    Job job{&work, helpers, 0};
    {
      std::lock_guard<std::mutex> lock(mu_);
      grow(helpers);
      jobs_.push_back(&job);
    }
    wake(helpers);
    work();
    std::unique_lock<std::mutex> lock(mu_);
    job.wanted = 0;  // no helper joins from now on
    jobs_.erase(std::find(jobs_.begin(), jobs_.end(), &job));
    done_.wait(lock, [&] { return job.active == 0; });
  }

  void submit(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
      grow(tasks_.size());
    }
    wake(1);
  }

 private:
  struct Job {
    const std::function<void()>* work;
    size_t wanted, active;
  };
  static constexpr size_t kMaxThreads = 64;
  // Wakes one idle thread per unit of new work, not all of them: a herd of woken threads fights for mu_ while the
  // caller (a serving engine's scheduler thread, in submit) waits for it.
  void wake(size_t units) {
    for (size_t i = 0; i < units; ++i) cv_.notify_one();
  }
  // Starts threads until `want` of them are idle (at most kMaxThreads in all); mu_ held.
  void grow(size_t want) {
    while (idle_ < want && threads_ < kMaxThreads) {
      std::thread([this] { serve(); }).detach();
      ++threads_;
      ++idle_;
    }
  }
  bool has_work() const {
    return !tasks_.empty() || std::any_of(jobs_.begin(), jobs_.end(), [](Job* j) { return j->wanted > 0; });
  }
  void serve() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return has_work(); });
      --idle_;
      if (!tasks_.empty()) {  // a read to start: its first layer is what a cold request waits for
        std::function<void()> task = std::move(tasks_.front());
        tasks_.pop_front();
        lock.unlock();
        task();
        lock.lock();
      } else {
        Job* job = *std::find_if(jobs_.begin(), jobs_.end(), [](Job* j) { return j->wanted > 0; });
        --job->wanted;
        ++job->active;
        lock.unlock();
        (*job->work)();
        lock.lock();
        if (--job->active == 0) done_.notify_all();
      }
      ++idle_;
    }
  }
  std::mutex mu_;
  std::condition_variable cv_, done_;
  std::vector<Job*> jobs_;
  std::deque<std::function<void()>> tasks_;
  size_t threads_ = 0, idle_ = 0;
};

ReadPool& read_pool() {
  // Never destroyed: its threads outlive static destructors. A forked child has none of the parent's threads (and
  // maybe a mutex held at the fork), so it starts a pool of its own.
  static std::atomic<ReadPool*> pool{nullptr};
  static std::atomic<pid_t> owner{0};
  static std::mutex make;
  std::lock_guard<std::mutex> lock(make);
  if (pool.load() == nullptr || owner.load() != getpid()) {
    pool.store(new ReadPool());
    owner.store(getpid());
  }
  return *pool.load();
}

}  // namespace

PyObject* file_ids(PyObject* /*self*/, PyObject* args) {
  // Two stat calls with the GIL held (~5 µs): a serving engine's scheduler thread that released it here would wait
  // for it again behind any other thread that wants it.
  const char* paths[2];
  if (!PyArg_ParseTuple(args, "ss", &paths[0], &paths[1])) return nullptr;
  PyObject* out = PyTuple_New(2);
  if (out == nullptr) return nullptr;
  for (int i = 0; i < 2; ++i) {
    struct stat st {};
    if (stat(paths[i], &st) != 0) {
      Py_DECREF(out);
      Py_RETURN_NONE;
    }
    const long long mtime = static_cast<long long>(st.st_mtim.tv_sec) * 1000000000LL + st.st_mtim.tv_nsec;
    const long long ctime = static_cast<long long>(st.st_ctim.tv_sec) * 1000000000LL + st.st_ctim.tv_nsec;
    PyObject* id = Py_BuildValue("(KKLLL)", static_cast<unsigned long long>(st.st_dev),
                                 static_cast<unsigned long long>(st.st_ino), static_cast<long long>(st.st_size), mtime,
                                 ctime);
    if (id == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, i, id);
  }
  return out;
}

PyObject* read_heads(PyObject* /*self*/, PyObject* args) {
  const char* config_path;
  const char* weights_path;
  if (!PyArg_ParseTuple(args, "ss", &config_path, &weights_path)) return nullptr;
  std::string config, header;
  long long size = 0;
  bool ok;
  Py_BEGIN_ALLOW_THREADS
  ok = read_file(config_path, config) && read_header(weights_path, size, header);
  Py_END_ALLOW_THREADS
  if (!ok) Py_RETURN_NONE;  // the caller's Python path then names what is wrong
  PyObject* c = PyBytes_FromStringAndSize(config.data(), static_cast<Py_ssize_t>(config.size()));
  PyObject* h = c == nullptr ? nullptr : PyBytes_FromStringAndSize(header.data(), static_cast<Py_ssize_t>(header.size()));
  if (h == nullptr) {
    Py_XDECREF(c);
    return nullptr;
  }
  return Py_BuildValue("(NLN)", c, size, h);  // N: the tuple takes the references
}

PyObject* pread_into(PyObject* /*self*/, PyObject* args) {
  int fd, threads = 1;
  PyObject* jobs_obj;
  if (!PyArg_ParseTuple(args, "iO|i", &fd, &jobs_obj, &threads)) return nullptr;
  PyObject* seq = PySequence_Fast(jobs_obj, "pread_into: jobs must be a list of (file offset, writable buffer)");
  if (seq == nullptr) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  std::vector<Py_buffer> views;
  std::vector<long long> offsets;
  Py_ssize_t got = 0;
  const bool ok = parse_jobs(seq, views, offsets, got);
  // Contiguous runs of jobs of about equal bytes, taken in turn by this thread and the kept reader threads; the GIL
  // is released for all of them. The first failure in job order is reported.
  Failure failed;
  if (ok && n > 0) {
    long long total = 0;
    for (Py_ssize_t i = 0; i < n; ++i) total += views[i].len;
    const int t = static_cast<int>(std::max<long long>(1, std::min<long long>({threads, n, 64})));
    std::vector<Py_ssize_t> bounds{0};
    long long acc = 0;
    for (Py_ssize_t i = 0; i < n; ++i) {
      acc += views[i].len;
      if (static_cast<int>(bounds.size()) < t && acc * t >= total * static_cast<long long>(bounds.size()))
        bounds.push_back(i + 1);
    }
    if (bounds.back() != n) bounds.push_back(n);
    const size_t runs = bounds.size() - 1;
    std::vector<Failure> fails(runs);
    std::atomic<size_t> next{0};
    const std::function<void()> work = [&] {
      for (size_t k; (k = next.fetch_add(1)) < runs;) fails[k] = read_run(fd, views, offsets, bounds[k], bounds[k + 1]);
    };
    Py_BEGIN_ALLOW_THREADS
    read_pool().run(work, runs - 1);
    Py_END_ALLOW_THREADS
    for (const Failure& f : fails) {
      if (f.job >= 0) {
        failed = f;
        break;
      }
    }
  }
  for (Py_ssize_t i = 0; i < got; ++i) PyBuffer_Release(&views[i]);
  Py_DECREF(seq);
  if (!ok) return nullptr;
  if (failed.job < 0) Py_RETURN_NONE;
  return Py_BuildValue("(nLi)", failed.job, failed.at, failed.err);
}

namespace {

struct Read {  // one direct read of a layer-wise job list: file bytes [file, file + len) into buffer + dst
  int layer;
  long long file, dst, len;
};

// Reads `reads` (layers non-decreasing) into `base` layer by layer, every thread on the next piece of the lowest
// unread layer; stamps each layer as the prefix of complete layers passes it and stores the prefix into *flag
// (release: the layer's bytes are in place before the GPU can see the count). Returns the first failure in job order.
Failure read_by_layer(int fd, char* base, const std::vector<Read>& reads, int nlayers, int threads, int* flag,
                      std::vector<double>& times) {
  struct Piece {
    Py_ssize_t job;
    long long begin, len;
  };
  std::vector<Piece> pieces;
  std::vector<std::atomic<long long>> left(nlayers);
  for (auto& c : left) c.store(0);
  for (size_t i = 0; i < reads.size(); ++i) {
    for (long long b = 0; b < reads[i].len; b += kLayerChunk) {
      pieces.push_back({static_cast<Py_ssize_t>(i), b, std::min<long long>(kLayerChunk, reads[i].len - b)});
      left[reads[i].layer].fetch_add(1, std::memory_order_relaxed);
    }
  }
  std::atomic<size_t> next{0};
  std::atomic<bool> stop{false};
  std::mutex mu;
  Failure failed;
  int prefix = 0;
  auto advance = [&] {
    std::lock_guard<std::mutex> lock(mu);
    while (prefix < nlayers && left[prefix].load(std::memory_order_acquire) == 0) {
      times.push_back(monotonic_s());
      ++prefix;
      if (flag != nullptr) __atomic_store_n(flag, prefix, __ATOMIC_RELEASE);
    }
  };
  auto work = [&] {
    while (!stop.load(std::memory_order_relaxed)) {
      const size_t k = next.fetch_add(1);
      if (k >= pieces.size()) return;
      const Piece& p = pieces[k];
      const Read& r = reads[p.job];
      const long long off = r.file + p.begin;
      const size_t done = pread_full(fd, base + r.dst + p.begin, static_cast<size_t>(p.len), off);
      if (done < static_cast<size_t>(p.len)) {
        std::lock_guard<std::mutex> lock(mu);
        if (failed.job < 0 || p.job < failed.job) failed = Failure{p.job, off + static_cast<long long>(done), errno};
        stop.store(true);
        return;
      }
      if (left[r.layer].fetch_sub(1, std::memory_order_acq_rel) == 1) advance();
    }
  };
  const size_t t = std::max<size_t>(1, std::min<size_t>({static_cast<size_t>(std::max(threads, 1)), pieces.size(), 64}));
  advance();  // leading layers with no bytes
  read_pool().run(work, t - 1);
  return failed;
}

// (layer, file offset, buffer offset, bytes) tuples, layers non-decreasing in [0, nlayers), each inside a buffer
// of `size` bytes; false with a Python error set.
bool parse_reads(PyObject* obj, int nlayers, long long size, std::vector<Read>& reads) {
  PyObject* seq = PySequence_Fast(obj, "pread_layers: reads must be a sequence of (layer, file, dst, bytes)");
  if (seq == nullptr) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  reads.resize(n);
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < n; ++i) {
    Read& r = reads[i];
    ok = PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "iLLL", &r.layer, &r.file, &r.dst, &r.len) != 0;
    if (ok && (r.layer < 0 || r.layer >= nlayers || (i > 0 && r.layer < reads[i - 1].layer) || r.file < 0 ||
               r.dst < 0 || r.len < 0 || r.dst + r.len > size)) {
      PyErr_Format(PyExc_ValueError, "pread_layers: reads[%zd] = (%d, %lld, %lld, %lld) is out of order or outside "
                   "the %lld-byte buffer (layers in [0, %d))", i, r.layer, r.file, r.dst, r.len, size, nlayers);
      ok = false;
    }
  }
  Py_DECREF(seq);
  return ok;
}

}  // namespace

namespace {

// One layer-wise read: its arguments (buffers held until release) and its outcome. pread_layers runs it on the
// caller; pread_layers_start on a kept thread, and pread_layers_wait collects it.
struct LayerRead {
  std::string path;
  std::vector<Read> reads;
  int nlayers = 0, threads = 1;
  Py_buffer buf{}, flag{};
  bool have_buf = false, have_flag = false;
  Failure failed;
  int open_errno = 0;
  std::vector<double> times;
  std::mutex mu;  // the asynchronous read's end
  std::condition_variable cv;
  bool done = false, waited = false;

  void execute() {  // the GIL is not needed
    if (nlayers <= 0) return;
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      open_errno = errno;
      return;
    }
    failed = read_by_layer(fd, static_cast<char*>(buf.buf), reads, nlayers, threads,
                           have_flag ? static_cast<int*>(flag.buf) : nullptr, times);
    close(fd);
  }
  void release() {  // the GIL held
    if (have_flag) PyBuffer_Release(&flag);
    if (have_buf) PyBuffer_Release(&buf);
    have_flag = have_buf = false;
  }
  void wait_done() {  // the GIL released by the caller
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
  }
  // (None or (job, file byte, errno), layer times); job -1: the open failed.
  PyObject* result() const {
    if (open_errno != 0) return Py_BuildValue("((nLi)())", static_cast<Py_ssize_t>(-1), 0LL, open_errno);
    PyObject* stamps = PyTuple_New(static_cast<Py_ssize_t>(times.size()));
    if (stamps == nullptr) return nullptr;
    for (size_t i = 0; i < times.size(); ++i)
      PyTuple_SET_ITEM(stamps, static_cast<Py_ssize_t>(i), PyFloat_FromDouble(times[i]));
    if (failed.job < 0) return Py_BuildValue("(ON)", Py_None, stamps);
    return Py_BuildValue("((nLi)N)", failed.job, failed.at, failed.err, stamps);
  }
};

// pread_layers' arguments into r; false with a Python error set (r.release() frees what was taken).
bool parse_layer_read(PyObject* args, LayerRead& r) {
  const char* path;
  PyObject *buf_obj, *reads_obj, *flag_obj;
  if (!PyArg_ParseTuple(args, "sOOiiO", &path, &buf_obj, &reads_obj, &r.nlayers, &r.threads, &flag_obj)) return false;
  r.path = path;
  if (PyObject_GetBuffer(buf_obj, &r.buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) return false;
  r.have_buf = true;
  if (!parse_reads(reads_obj, r.nlayers, static_cast<long long>(r.buf.len), r.reads)) return false;
  if (flag_obj == Py_None) return true;
  if (PyObject_GetBuffer(flag_obj, &r.flag, PyBUF_WRITABLE) != 0) return false;
  r.have_flag = true;
  if (r.flag.len < 4 || reinterpret_cast<uintptr_t>(r.flag.buf) % 4 != 0) {
    PyErr_SetString(PyExc_ValueError, "pread_layers: flag must be a writable, 4-byte aligned buffer of >= 4 bytes");
    return false;
  }
  return true;
}

constexpr const char* kLayerReadName = "lora_kernels.LayerRead";

void drop_layer_read(PyObject* capsule) {  // a handle dropped unwaited waits for its read: the buffer must outlive it
  auto* r = static_cast<LayerRead*>(PyCapsule_GetPointer(capsule, kLayerReadName));
  if (r == nullptr) return;
  if (!r->waited) {
    Py_BEGIN_ALLOW_THREADS
    r->wait_done();
    Py_END_ALLOW_THREADS
  }
  r->release();
  delete r;
}

}  // namespace

PyObject* pread_layers(PyObject* /*self*/, PyObject* args) {
  LayerRead r;
  const bool ok = parse_layer_read(args, r);
  if (ok) {
    Py_BEGIN_ALLOW_THREADS  // open, every read and close: the GIL released once
    r.execute();
    Py_END_ALLOW_THREADS
  }
  r.release();
  return ok ? r.result() : nullptr;
}

PyObject* pread_layers_start(PyObject* /*self*/, PyObject* args) {
  auto* r = new LayerRead();
  if (!parse_layer_read(args, *r)) {
    r->release();
    delete r;
    return nullptr;
  }
  PyObject* handle = PyCapsule_New(r, kLayerReadName, drop_layer_read);
  if (handle == nullptr) {
    r->release();
    delete r;
    return nullptr;
  }
  read_pool().submit([r] {
    r->execute();
    {
      std::lock_guard<std::mutex> lock(r->mu);
      r->done = true;
    }
    r->cv.notify_all();
  });
  return handle;
}

PyObject* pread_layers_wait(PyObject* /*self*/, PyObject* args) {
  PyObject* capsule;
  if (!PyArg_ParseTuple(args, "O", &capsule)) return nullptr;
  auto* r = static_cast<LayerRead*>(PyCapsule_GetPointer(capsule, kLayerReadName));
  if (r == nullptr) return nullptr;
  if (r->waited) {
    PyErr_SetString(PyExc_RuntimeError, "pread_layers_wait: this read was already waited for");
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS
  r->wait_done();
  Py_END_ALLOW_THREADS
  r->waited = true;
  r->release();
  return r->result();
}

}  // namespace lora_kernels
