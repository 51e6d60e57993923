// CPU kernels of the amp_patch multi-tensor ops (schemas: amp_patch/ops/scaling_ops.py).
//
// Each op turns its tensor lists into a Plan (cpu/plan.h) and runs its tasks,
// calling the vectorised loop of the chosen ISA for each piece (vec_loops.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/kernel_table.h"
#include "cpu/plan.h"
#include "overlap.h"
#include "scale_update.h"

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

void loss_scale_update_cpu(const at::Tensor& state, const at::Tensor& inv_scale,
                           const at::Tensor& scale, const at::Tensor& found_inf,
                           const at::Tensor& overflow, double scale_window, double floor,
                           bool floor_is_min, double max_scale, bool dynamic,
                           double max_consecutive) {
  constexpr const char* op = "loss_scale_update_";
  check_cpu(state, op, "state");
  loss_scale_update_step(loss_scale_pointers(op, state, inv_scale, scale, found_inf, overflow),
                         {scale_window, floor, floor_is_min, max_scale, dynamic, max_consecutive});
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
  m.impl("loss_scale_update_", &amp_patch::cpu::loss_scale_update_cpu);
}
