// CPU kernels of the amp_patch multi-tensor ops (schemas: amp_patch/ops.py).
//
// Each op turns its tensor lists into flat runs of memory (Job), cuts the
// concatenation of all of them into equal tasks (Plan), and runs the tasks with
// at::parallel_for, calling the vectorised loop for each piece (vec_loops.h).
// Tensors whose elements are not one dense run take a slow path: a contiguous
// copy, and for outputs a copy back afterwards.
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu/kernel_table.h"
#include "overlap.h"
#include "scale_update.h"

// With torch's OpenMP backend, at::parallel_for is compiled into this file; built
// without -fopenmp it quietly runs serially (setup.py passes the flag on Linux).
#if AT_PARALLEL_OPENMP && defined(__linux__) && !defined(_OPENMP)
#error "amp_patch's CPU kernels must be compiled with -fopenmp, or they run on one thread"
#endif

namespace amp_patch::cpu {

namespace {

struct Selected {
  std::string name;
  KernelTable table;
};

// torch's capability honours ATEN_CPU_CAPABILITY, so forcing torch onto a lower
// ISA forces these kernels too (the tests use it to cover every table); the
// feature checks guard the exact extensions each of our TUs was compiled for.
Selected select_kernels() {
  const std::string torch_cap = at::get_cpu_capability();
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi") &&
      __builtin_cpu_supports("bmi2");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq");
  if (torch_cap == "AVX512" && avx512) {
    return {"AVX512", AVX512::kernel_table()};
  }
  if ((torch_cap == "AVX512" || torch_cap == "AVX2") && avx2) {
    return {"AVX2", AVX2::kernel_table()};
  }
#endif
  return {"DEFAULT", DEFAULT::kernel_table()};
}

const Selected& selected() {
  static const Selected s = select_kernels();
  return s;
}

// Elements per parallel task: large enough to amortise the per-task overhead,
// small enough that a few hundred small tensors still spread over all threads.
constexpr int64_t kTaskElems = 32768;

int64_t dt_size(Dt dt) {
  switch (dt) {
    case kF64:
      return 8;
    case kF32:
      return 4;
    default:
      return 2;
  }
}

Dt dt_of(const at::Tensor& t, const char* op) {
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
      TORCH_CHECK(false, "amp_patch::", op, ": unsupported dtype ", t.scalar_type(),
                  " (the multi-tensor kernels take float32, float16, bfloat16 and float64)");
  }
}

void check_cpu(const at::Tensor& t, const char* op, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), "amp_patch::", op, ": ", what, " is on ", t.device(),
              "; the CPU kernel needs every tensor on the CPU");
}

float* flag_ptr(const at::Tensor& found_inf, const char* op) {
  check_cpu(found_inf, op, "found_inf");
  TORCH_CHECK(found_inf.scalar_type() == at::kFloat && found_inf.numel() == 1, "amp_patch::", op,
              ": found_inf must be a one-element float32 tensor, got ", found_inf.scalar_type(),
              " with ", found_inf.numel(), " elements");
  return found_inf.mutable_data_ptr<float>();
}

float read_scalar(const at::Tensor& t, const char* op, const char* what) {
  check_cpu(t, op, what);
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == 1, "amp_patch::", op, ": ", what,
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

const void* offset(const void* p, Dt dt, int64_t i) {
  return static_cast<const char*>(p) + i * dt_size(dt);
}

void* offset(void* p, Dt dt, int64_t i) {
  return static_cast<char*>(p) + i * dt_size(dt);
}

// The work of one call: its jobs, the temporaries they point into, and the
// spans grouped into tasks of kTaskElems elements taken across all jobs, so
// that 200 small tensors and one huge tensor parallelise alike.
class Plan {
 public:
  // dst may be absent (read-only ops) or the same list as src (in-place ops).
  Plan(const char* op, at::TensorList src, std::optional<at::TensorList> dst, bool in_place) {
    if (dst) {
      TORCH_CHECK(src.size() == dst->size(), "amp_patch::", op, ": list lengths differ (",
                  src.size(), " vs ", dst->size(), ")");
    }
    jobs_.resize(src.size());
    for (size_t i = 0; i < src.size(); ++i) {
      add_job(op, i, src[i], dst && !in_place ? &(*dst)[i] : nullptr, dst.has_value());
    }
    cut_tasks();
  }

  const std::vector<Job>& jobs() const { return jobs_; }
  const std::vector<Span>& spans() const { return spans_; }

  // Runs f(span_index, span) -> bool over every span, in parallel across tasks.
  // Returns true when any call returned true (saw a non-finite input).
  //
  // Threads take tasks from a shared counter rather than a fixed split: on a
  // shared machine one thread is often descheduled for a while, and with a
  // static split the others would wait for its half at the barrier.
  template <typename F>
  bool run(const F& f) const {
    const int64_t ntasks = static_cast<int64_t>(task_begin_.size()) - 1;
    std::atomic<int64_t> next{0};
    std::atomic<bool> flagged{false};
    auto worker = [&](int64_t, int64_t) {
      bool local = false;
      for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < ntasks;
           t = next.fetch_add(1, std::memory_order_relaxed)) {
        for (int64_t s = task_begin_[t]; s < task_begin_[t + 1]; ++s) {
          local |= f(s, spans_[s]);
        }
      }
      if (local) {
        flagged.store(true, std::memory_order_relaxed);
      }
    };
    const int64_t nworkers = std::min<int64_t>(ntasks, at::get_num_threads());
    if (nworkers <= 1) {
      worker(0, 1);
    } else {
      at::parallel_for(0, nworkers, 1, worker);
    }
    return flagged.load(std::memory_order_relaxed);
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
      TORCH_CHECK(s.sizes() == d->sizes(), "amp_patch::", op, ": tensor ", i, " has shape ",
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

  void cut_tasks() {
    task_begin_.push_back(0);
    int64_t room = kTaskElems;
    for (size_t j = 0; j < jobs_.size(); ++j) {
      const int64_t n = jobs_[j].numel;
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

  std::vector<Job> jobs_;
  std::vector<Span> spans_;
  std::vector<int64_t> task_begin_;
  // A deque, so references to earlier temporaries stay valid as it grows.
  std::deque<at::Tensor> kept_;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back_;
};

// Both unscale ops: out = in * inv_scale, flagging non-finite input; in place
// when dst is src.
void scale_lists(const char* op, at::TensorList src, at::TensorList dst, bool in_place,
                 const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  float* flag = flag_ptr(found_inf, op);
  const float s = read_scalar(inv_scale, op, "inv_scale");
  Plan plan(op, src, dst, in_place);
  if (in_place) {
    check_no_overlap(op, "tensors", src);
  } else {
    check_no_overlap(op, "dst", dst, "src", src);
  }
  const KernelTable& k = kernels();
  const auto& jobs = plan.jobs();
  const bool bad = plan.run([&](int64_t, const Span& sp) {
    const Job& j = jobs[sp.job];
    return k.scale[j.in_dt][j.out_dt](offset(j.in, j.in_dt, sp.begin),
                                      offset(j.out, j.out_dt, sp.begin), sp.end - sp.begin, s);
  });
  if (bad) {
    *flag = 1.0f;
  }
  plan.finish();
}

void unscale_cpu(at::TensorList tensors, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  scale_lists("multi_tensor_unscale_", tensors, tensors, /*in_place=*/true, found_inf, inv_scale);
}

void unscale_copy_cpu(at::TensorList src, at::TensorList dst, const at::Tensor& found_inf,
                      const at::Tensor& inv_scale) {
  scale_lists("multi_tensor_unscale_copy_", src, dst, /*in_place=*/false, found_inf, inv_scale);
}

void axpby_cpu(at::TensorList x, at::TensorList y, const at::Tensor& found_inf, double a, double b) {
  constexpr const char* op = "multi_tensor_axpby_";
  float* flag = flag_ptr(found_inf, op);
  Plan plan(op, x, y, /*in_place=*/false);
  check_no_overlap(op, "y", y, "x", x);
  const KernelTable& k = kernels();
  const auto& jobs = plan.jobs();
  const bool bad = plan.run([&](int64_t, const Span& sp) {
    const Job& j = jobs[sp.job];
    return k.axpby[j.in_dt][j.out_dt](offset(j.in, j.in_dt, sp.begin),
                                      offset(j.out, j.out_dt, sp.begin), sp.end - sp.begin, a, b);
  });
  if (bad) {
    *flag = 1.0f;
  }
  plan.finish();
}

void copy_cpu(at::TensorList src, at::TensorList dst) {
  constexpr const char* op = "multi_tensor_copy_";
  Plan plan(op, src, dst, /*in_place=*/false);
  check_no_overlap(op, "dst", dst, "src", src);
  const KernelTable& k = kernels();
  const auto& jobs = plan.jobs();
  plan.run([&](int64_t, const Span& sp) {
    const Job& j = jobs[sp.job];
    k.copy[j.in_dt][j.out_dt](offset(j.in, j.in_dt, sp.begin), offset(j.out, j.out_dt, sp.begin),
                              sp.end - sp.begin);
    return false;
  });
  plan.finish();
}

// Both norms: the sum of squares of (x * scale) per span, in parallel, then
// per tensor and in total in double.
std::tuple<at::Tensor, at::Tensor> norms_cpu(const char* op, at::TensorList x, bool per_tensor,
                                             const SumsqFn (&sumsq)[kNumDt], float scale) {
  Plan plan(op, x, std::nullopt, /*in_place=*/false);
  const auto& jobs = plan.jobs();
  const auto& spans = plan.spans();
  std::vector<double> partial(spans.size(), 0.0);
  plan.run([&](int64_t s, const Span& sp) {
    const Job& j = jobs[sp.job];
    partial[s] = sumsq[j.in_dt](offset(j.in, j.in_dt, sp.begin), sp.end - sp.begin, scale);
    return false;
  });
  // Summed in span order, which depends only on the shapes: the result does not
  // change with the thread count.
  std::vector<double> sumsq_of(x.size(), 0.0);
  for (size_t s = 0; s < spans.size(); ++s) {
    sumsq_of[spans[s].job] += partial[s];
  }
  double total = 0.0;
  for (double v : sumsq_of) {
    total += v;
  }
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
  at::Tensor total_t = at::empty({}, opts);
  *total_t.mutable_data_ptr<float>() = static_cast<float>(std::sqrt(total));
  at::Tensor norms = at::empty({per_tensor ? static_cast<int64_t>(x.size()) : 0}, opts);
  if (per_tensor) {
    float* out = norms.mutable_data_ptr<float>();
    for (size_t i = 0; i < sumsq_of.size(); ++i) {
      out[i] = static_cast<float>(std::sqrt(sumsq_of[i]));
    }
  }
  return {total_t, norms};
}

std::tuple<at::Tensor, at::Tensor> l2norm_cpu(at::TensorList x, bool per_tensor) {
  return norms_cpu("multi_tensor_l2norm", x, per_tensor, kernels().sumsq, 1.0f);
}

std::tuple<at::Tensor, at::Tensor> unscale_l2norm_cpu(at::TensorList x, const at::Tensor& inv_scale,
                                                      bool per_tensor) {
  constexpr const char* op = "multi_tensor_unscale_l2norm";
  const float s = read_scalar(inv_scale, op, "inv_scale");
  return norms_cpu(op, x, per_tensor, kernels().scaled_sumsq, s);
}

// One element each, so no loop to vectorise: the step itself is shared with
// the CUDA kernel (scale_update.h).
void update_scale_hysteresis_cpu(const at::Tensor& current_scale, const at::Tensor& growth_tracker,
                                 const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                                 double growth_factor, double backoff_factor,
                                 int64_t growth_interval, int64_t hysteresis) {
  constexpr const char* op = "update_scale_hysteresis";
  check_cpu(current_scale, op, "current_scale");
  update_scale_hysteresis_step(
      scale_state(op, current_scale, growth_tracker, hysteresis_tracker, found_inf),
      {growth_factor, backoff_factor, growth_interval, hysteresis});
}

}  // namespace

const KernelTable& kernels() {
  return selected().table;
}

const std::string& kernel_capability() {
  return selected().name;
}

}  // namespace amp_patch::cpu

TORCH_LIBRARY_IMPL(amp_patch, CPU, m) {
  m.impl("multi_tensor_unscale_", &amp_patch::cpu::unscale_cpu);
  m.impl("multi_tensor_unscale_copy_", &amp_patch::cpu::unscale_copy_cpu);
  m.impl("multi_tensor_axpby_", &amp_patch::cpu::axpby_cpu);
  m.impl("multi_tensor_l2norm", &amp_patch::cpu::l2norm_cpu);
  m.impl("multi_tensor_copy_", &amp_patch::cpu::copy_cpu);
  m.impl("multi_tensor_unscale_l2norm", &amp_patch::cpu::unscale_l2norm_cpu);
  m.impl("update_scale_hysteresis", &amp_patch::cpu::update_scale_hysteresis_cpu);
}
