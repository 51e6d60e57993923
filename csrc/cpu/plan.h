// The host side of the CPU kernels: argument checks, the element types, and
// Plan, which turns tensor lists into flat runs of memory (Job), cuts their
// concatenation into equal tasks and runs them in parallel. Shared by every
// CPU op file (multi_tensor_ops.cpp; optimizer kernels may use it too).
//
// Tensors whose elements are not one dense run take a slow path: a contiguous
// copy, and for outputs a copy back afterwards (Plan::finish).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <deque>
#include <optional>
#include <utility>
#include <vector>

#include "check.h"
#include "cpu/kernel_table.h"

// With torch's OpenMP backend, at::parallel_for (Plan::run) is compiled into
// each file that includes this header; built without -fopenmp it quietly runs
// serially (setup.py passes the flag on Linux).
#if AT_PARALLEL_OPENMP && defined(__linux__) && !defined(_OPENMP)
#error "amp_patch's CPU kernels must be compiled with -fopenmp, or they run on one thread"
#endif

namespace amp_patch::cpu {

// Elements per parallel task: large enough to amortise the per-task overhead,
// small enough that a few hundred small tensors still spread over all threads.
constexpr int64_t kTaskElems = 32768;

inline int64_t dt_size(Dt dt) {
  switch (dt) {
    case kF64:
      return 8;
    case kF32:
      return 4;
    default:
      return 2;
  }
}

inline Dt dt_of(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return kF32;
    case at::kHalf:
      return kF16;
    case at::kBFloat16:
      return kBF16;
    case at::kDouble:
      return kF64;
    default:
      AMP_CHECK(false, "amp_patch::", op, ": unsupported dtype ", t.scalar_type(),
                  " (the multi-tensor kernels take float32, float16, bfloat16 and float64)");
  }
}

inline void check_cpu(const at::Tensor& t, const char* op, const char* what) {
  AMP_CHECK(t.device().is_cpu(), "amp_patch::", op, ": ", what, " is on ", t.device(),
              "; the CPU kernel needs every tensor on the CPU");
}

inline float* flag_ptr(const at::Tensor& found_inf, const char* op) {
  check_cpu(found_inf, op, "found_inf");
  AMP_CHECK(found_inf.scalar_type() == at::kFloat && found_inf.numel() == 1, "amp_patch::", op,
              ": found_inf must be a one-element float32 tensor, got ", found_inf.scalar_type(),
              " with ", found_inf.numel(), " elements");
  return found_inf.mutable_data_ptr<float>();
}

inline float read_scalar(const at::Tensor& t, const char* op, const char* what) {
  check_cpu(t, op, what);
  AMP_CHECK(t.scalar_type() == at::kFloat && t.numel() == 1, "amp_patch::", op, ": ", what,
              " must be a one-element float32 tensor, got ", t.scalar_type(), " with ", t.numel(),
              " elements");
  return *t.const_data_ptr<float>();
}

// One tensor (or src/dst pair) of a call, as flat memory.
struct Job {
  const void* in = nullptr;
  void* out = nullptr;
  Dt in_dt = kF32;
  Dt out_dt = kF32;
  int64_t numel = 0;
};

// A piece of one job: elements [begin, end) of jobs[job].
struct Span {
  int64_t job;
  int64_t begin;
  int64_t end;
};

inline const void* offset(const void* p, Dt dt, int64_t i) {
  return static_cast<const char*>(p) + i * dt_size(dt);
}

inline void* offset(void* p, Dt dt, int64_t i) {
  return static_cast<char*>(p) + i * dt_size(dt);
}

// Pieces of many flat runs of memory (run j has numel(j) elements) grouped into
// tasks of kTaskElems elements taken across runs, so that 200 small tensors and
// one huge tensor parallelise alike. Plan's work split; the optimizer kernels
// (optim_ops.cpp) split their rows of several lists with it too.
class Tasks {
 public:
  template <typename NumelOf>
  void cut(size_t runs, const NumelOf& numel) {
    task_begin_.push_back(0);
    int64_t room = kTaskElems;
    for (size_t j = 0; j < runs; ++j) {
      const int64_t n = numel(j);
      for (int64_t off = 0; off < n;) {
        const int64_t len = std::min(room, n - off);
        spans_.push_back({static_cast<int64_t>(j), off, off + len});
        off += len;
        room -= len;
        if (room == 0) {
          task_begin_.push_back(static_cast<int64_t>(spans_.size()));
          room = kTaskElems;
        }
      }
    }
    if (task_begin_.back() != static_cast<int64_t>(spans_.size())) {
      task_begin_.push_back(static_cast<int64_t>(spans_.size()));
    }
  }

  const std::vector<Span>& spans() const { return spans_; }

  // Runs f(span_index, span) -> bool over every span, in parallel across tasks.
  // Returns true when any call returned true (saw a non-finite input).
  //
  // Each thread owns a contiguous block of the tasks and takes them from its
  // front, so it streams through memory as one long run. Threads must not take
  // tasks from one shared counter in turn: a thread that skips ahead at every
  // task restarts its hardware prefetch streams each time and wastes what they
  // fetched past the end of its task, where the other thread is working (so
  // those lines also move between the cores). Measured on 2 threads (AMD EPYC,
  // avx512_bf16): 20 M fp32 params, an Adam step took 8-18% longer that way,
  // multi_tensor_unscale_ on bf16 grads 60% longer. A thread that is done
  // helps the others from the back of their blocks: on a shared machine one
  // thread is often descheduled for a while, and with a static split the
  // others would wait for its share at the barrier.
  template <typename F>
  bool run(const F& f) const {
    const int64_t ntasks = static_cast<int64_t>(task_begin_.size()) - 1;
    const int64_t nworkers = std::min<int64_t>(ntasks, at::get_num_threads());
    std::atomic<bool> flagged{false};
    auto run_task = [&](int64_t t, bool& local) {
      for (int64_t s = task_begin_[t]; s < task_begin_[t + 1]; ++s) {
        local |= f(s, spans_[s]);
      }
    };
    if (nworkers <= 1) {
      bool local = false;
      for (int64_t t = 0; t < ntasks; ++t) {
        run_task(t, local);
      }
      return local;
    }
    AMP_CHECK(ntasks <= INT32_MAX, "amp_patch: ", ntasks, " tasks in one call; at most ",
                INT32_MAX, " are supported");
    std::vector<Block> blocks(static_cast<size_t>(nworkers));
    for (int64_t w = 0; w < nworkers; ++w) {
      blocks[w].set(ntasks * w / nworkers, ntasks * (w + 1) / nworkers);
    }
    auto worker = [&](int64_t begin, int64_t end) {
      bool local = false;
      for (int64_t w = begin; w < end; ++w) {
        for (int64_t t = blocks[w].take_front(); t >= 0; t = blocks[w].take_front()) {
          run_task(t, local);
        }
      }
      for (int64_t k = 1; k < nworkers; ++k) {
        Block& other = blocks[(begin + k) % nworkers];
        for (int64_t t = other.take_back(); t >= 0; t = other.take_back()) {
          run_task(t, local);
        }
      }
      if (local) {
        flagged.store(true, std::memory_order_relaxed);
      }
    };
    at::parallel_for(0, nworkers, 1, worker);
    return flagged.load(std::memory_order_relaxed);
  }

 private:
  // The tasks [front, back) not yet taken from one thread's block, packed into
  // one word so that both ends move atomically; on its own cache line.
  class alignas(64) Block {
   public:
    void set(int64_t front, int64_t back) { range_.store(pack(front, back)); }
    int64_t take_front() { return take(true); }
    int64_t take_back() { return take(false); }

   private:
    static uint64_t pack(int64_t front, int64_t back) {
      return (static_cast<uint64_t>(back) << 32) | static_cast<uint32_t>(front);
    }
    // The task taken, or -1 when the block is empty.
    int64_t take(bool from_front) {
      uint64_t r = range_.load(std::memory_order_relaxed);
      for (;;) {
        const int64_t front = static_cast<int64_t>(r & 0xffffffffu);
        const int64_t back = static_cast<int64_t>(r >> 32);
        if (front >= back) {
          return -1;
        }
        const uint64_t next = from_front ? pack(front + 1, back) : pack(front, back - 1);
        if (range_.compare_exchange_weak(r, next, std::memory_order_relaxed)) {
          return from_front ? front : back - 1;
        }
      }
    }
    std::atomic<uint64_t> range_{0};
  };

  std::vector<Span> spans_;
  std::vector<int64_t> task_begin_;
};

// The work of one call: its jobs, the temporaries they point into, and the
// spans grouped into tasks (Tasks).
class Plan {
 public:
  // dst may be absent (read-only ops) or the same list as src (in-place ops).
  Plan(const char* op, at::TensorList src, std::optional<at::TensorList> dst, bool in_place) {
    if (dst) {
      AMP_CHECK(src.size() == dst->size(), "amp_patch::", op, ": list lengths differ (",
                  src.size(), " vs ", dst->size(), ")");
    }
    jobs_.resize(src.size());
    for (size_t i = 0; i < src.size(); ++i) {
      add_job(op, i, src[i], dst && !in_place ? &(*dst)[i] : nullptr, dst.has_value());
    }
    tasks_.cut(jobs_.size(), [&](size_t j) { return jobs_[j].numel; });
  }

  const std::vector<Job>& jobs() const { return jobs_; }
  const std::vector<Span>& spans() const { return tasks_.spans(); }

  // Runs f(span_index, span) -> bool over every span (see Tasks::run).
  template <typename F>
  bool run(const F& f) const {
    return tasks_.run(f);
  }

  // Copies slow-path outputs back into the caller's tensors.
  void finish() {
    for (auto& [target, tmp] : write_back_) {
      target.copy_(tmp);
    }
  }

 private:
  void add_job(const char* op, size_t i, const at::Tensor& s, const at::Tensor* d, bool writes) {
    check_cpu(s, op, "an input tensor");
    Job& job = jobs_[i];
    job.in_dt = dt_of(s, op);
    job.out_dt = job.in_dt;
    job.numel = s.numel();
    if (d != nullptr) {
      check_cpu(*d, op, "an output tensor");
      AMP_CHECK(s.sizes() == d->sizes(), "amp_patch::", op, ": tensor ", i, " has shape ",
                  s.sizes(), " in the first list but ", d->sizes(), " in the second");
      job.out_dt = dt_of(*d, op);
    }
    if (job.numel == 0) {
      return;
    }
    if (d == nullptr) {
      // Read-only, or in place: element order is irrelevant, so any dense layout
      // (channels-last, transposed) is walked as it lies in memory.
      const at::Tensor& flat = dense_or_copy(s, writes);
      job.in = flat.const_data_ptr();
      job.out = writes ? flat.data_ptr() : nullptr;
      return;
    }
    if (s.is_non_overlapping_and_dense() && d->is_non_overlapping_and_dense() &&
        s.strides() == d->strides()) {
      job.in = s.const_data_ptr();
      job.out = d->data_ptr();
      return;
    }
    // Slow path: the two sides must walk memory in the same element order.
    if (d->is_non_overlapping_and_dense()) {
      job.in = keep(s.new_empty_strided(d->sizes(), d->strides()).copy_(s)).const_data_ptr();
      job.out = d->data_ptr();
      return;
    }
    const at::Tensor& out = keep(d->contiguous());
    write_back_.emplace_back(*d, out);
    job.in = keep(s.contiguous()).const_data_ptr();
    job.out = out.data_ptr();
  }

  const at::Tensor& dense_or_copy(const at::Tensor& t, bool writes) {
    if (t.is_non_overlapping_and_dense()) {
      return t;
    }
    const at::Tensor& tmp = keep(t.contiguous());
    if (writes) {
      write_back_.emplace_back(t, tmp);
    }
    return tmp;
  }

  const at::Tensor& keep(at::Tensor t) {
    kept_.push_back(std::move(t));
    return kept_.back();
  }

  std::vector<Job> jobs_;
  Tasks tasks_;
  // A deque, so references to earlier temporaries stay valid as it grows.
  std::deque<at::Tensor> kept_;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back_;
};

}  // namespace amp_patch::cpu
