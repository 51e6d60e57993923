// The single-sweep optimizer ops on CUDA: multi_tensor_adam_, _sgd_, _adagrad_
// and _novograd_. Each chunk is one sweep that reads the grad, the param and
// the state, applies the update rule of csrc/cpu/optim_math.h, and writes the
// param, the state and the optional half model copy. A set noop flag makes
// every block return before it touches memory.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "optim_lists.cuh"

namespace amp_patch::cuda {
namespace {

using optim::RnFloat;

// List bits. Adam: 0 grad, 1 param, 2 exp_avg, 3 exp_avg_sq, 4 model copy.
// The others: 0 grad, 1 param, 2 state (absent for SGD without momentum), 3 model copy.
constexpr unsigned kAdamRead = 0b01111u, kAdamWritten = 0b11110u;
constexpr unsigned kRead = 0b0111u, kWritten = 0b1110u;

struct AdamOp {
  OptimCommon common;
  optim::AdamHyper h;

  __device__ void operator()(const Chunk<5>& c) const {
    if (common.skipped()) {
      return;
    }
    optim::AdamHyper hh = h;
    hh.inv_scale = common.scale();
    sweep_chunk<5, kAdamRead, kAdamWritten>(c, common.dt, [&](float* r) {
      RnFloat p = r[1], m = r[2], v = r[3];
      optim::adam_update<RnFloat>(r[0], p, m, v, hh);
      r[1] = r[4] = p.v;
      r[2] = m.v;
      r[3] = v.v;
    });
  }
};

struct SgdOp {
  OptimCommon common;
  optim::SgdHyper h;

  __device__ void operator()(const Chunk<4>& c) const {
    if (common.skipped()) {
      return;
    }
    optim::SgdHyper hh = h;
    hh.inv_scale = common.scale();
    sweep_chunk<4, kRead, kWritten>(c, common.dt, [&](float* r) {
      RnFloat p = r[1], mom = r[2];
      optim::sgd_update<RnFloat>(r[0], p, hh.momentum != 0.0f ? &mom : nullptr, hh);
      r[1] = r[3] = p.v;
      r[2] = mom.v;
    });
  }
};

struct AdagradOp {
  OptimCommon common;
  optim::AdagradHyper h;

  __device__ void operator()(const Chunk<4>& c) const {
    if (common.skipped()) {
      return;
    }
    optim::AdagradHyper hh = h;
    hh.inv_scale = common.scale();
    sweep_chunk<4, kRead, kWritten>(c, common.dt, [&](float* r) {
      RnFloat p = r[1], sum = r[2];
      optim::adagrad_update<RnFloat>(r[0], p, sum, hh);
      r[1] = r[3] = p.v;
      r[2] = sum.v;
    });
  }
};

struct NovoGradOp {
  OptimCommon common;
  optim::NovoGradHyper h;
  const float* grad_norms;  // one per tensor
  float bias_correction2;
  float eps;

  __device__ void operator()(const Chunk<4>& c) const {
    if (common.skipped()) {
      return;
    }
    optim::NovoGradHyper hh = h;
    hh.inv_scale = common.scale();
    // The tensor's denominator, rounded as the CPU kernels round it on the host.
    const RnFloat denom = RnFloat(grad_norms[tensor_of(c)]) / RnFloat(bias_correction2) + RnFloat(eps);
    sweep_chunk<4, kRead, kWritten>(c, common.dt, [&](float* r) {
      RnFloat p = r[1], m = r[2];
      optim::novograd_update<RnFloat>(r[0], p, m, denom, hh);
      r[1] = r[3] = p.v;
      r[2] = m.v;
    });
  }
};

template <int Depth, typename Op>
void launch(OptimPlan<Depth>& plan, Op o) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  plan.run([&](const typename OptimPlan<Depth>::Dtypes& dtypes,
               const std::vector<Task<Depth>>& tasks) {
    std::copy(dtypes.begin(), dtypes.end(), o.common.dt);
    multi_tensor_apply<Depth>(tasks, o, stream);
  });
}

ListUse out_use(at::TensorList model_params) {
  return model_params.empty() ? ListUse::kAbsent : ListUse::kWrite;
}

void adam_cuda(at::TensorList grads, at::TensorList params, at::TensorList exp_avgs,
               at::TensorList exp_avg_sqs, at::TensorList model_params,
               const std::optional<at::Tensor>& noop, const std::optional<at::Tensor>& inv_scale,
               double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
               bool adam_w_mode, bool bias_correction_on) {
  constexpr const char* op = "multi_tensor_adam_";
  const std::optional<at::Device> device = call_device(grads, noop);
  if (!device) {
    return;
  }
  const c10::cuda::CUDAGuard guard(*device);
  OptimPlan<5> plan(op,
                    {{{"grads", grads, ListUse::kRead},
                      {"params", params, ListUse::kUpdate},
                      {"exp_avgs", exp_avgs, ListUse::kUpdate},
                      {"exp_avg_sqs", exp_avg_sqs, ListUse::kUpdate},
                      {"model_params", model_params, out_use(model_params)}}},
                    *device);
  const float b1 = f32(beta1), b2 = f32(beta2);
  launch(plan, AdamOp{optim_common(op, noop, inv_scale, *device),
                      {1.0f, f32(lr), b1, b2, 1.0f - b1, 1.0f - b2, f32(eps), f32(weight_decay),
                       optim::bias_correction(b1, step, bias_correction_on),
                       optim::bias_correction(b2, step, bias_correction_on), adam_w_mode}});
}

void sgd_cuda(at::TensorList grads, at::TensorList params, at::TensorList momentum_buffers,
              at::TensorList model_params, const std::optional<at::Tensor>& noop,
              const std::optional<at::Tensor>& inv_scale, double lr, double weight_decay,
              double momentum, double dampening, bool nesterov, bool first_run,
              bool wd_after_momentum) {
  constexpr const char* op = "multi_tensor_sgd_";
  const bool with_momentum = momentum != 0.0;
  TORCH_CHECK(!with_momentum || momentum_buffers.size() == grads.size(), "amp_patch::", op,
              ": momentum is ", momentum, " but momentum_buffers has ", momentum_buffers.size(),
              " tensors for ", grads.size(), " grads");
  const std::optional<at::Device> device = call_device(grads, noop);
  if (!device) {
    return;
  }
  const c10::cuda::CUDAGuard guard(*device);
  OptimPlan<4> plan(op,
                    {{{"grads", grads, ListUse::kRead},
                      {"params", params, ListUse::kUpdate},
                      {"momentum_buffers", momentum_buffers,
                       with_momentum ? ListUse::kUpdate : ListUse::kAbsent},
                      {"model_params", model_params, out_use(model_params)}}},
                    *device);
  launch(plan, SgdOp{optim_common(op, noop, inv_scale, *device),
                     {1.0f, f32(lr), f32(weight_decay), f32(momentum), 1.0f - f32(dampening),
                      nesterov, first_run, wd_after_momentum}});
}

void adagrad_cuda(at::TensorList grads, at::TensorList params, at::TensorList state_sums,
                  at::TensorList model_params, const std::optional<at::Tensor>& noop,
                  const std::optional<at::Tensor>& inv_scale, double lr, double eps,
                  double weight_decay, bool adagrad_w_mode) {
  constexpr const char* op = "multi_tensor_adagrad_";
  const std::optional<at::Device> device = call_device(grads, noop);
  if (!device) {
    return;
  }
  const c10::cuda::CUDAGuard guard(*device);
  OptimPlan<4> plan(op,
                    {{{"grads", grads, ListUse::kRead},
                      {"params", params, ListUse::kUpdate},
                      {"state_sums", state_sums, ListUse::kUpdate},
                      {"model_params", model_params, out_use(model_params)}}},
                    *device);
  launch(plan, AdagradOp{optim_common(op, noop, inv_scale, *device),
                         {1.0f, f32(lr), f32(eps), f32(weight_decay), adagrad_w_mode}});
}

void novograd_cuda(at::TensorList grads, at::TensorList params, at::TensorList exp_avgs,
                   const at::Tensor& grad_norms, at::TensorList model_params,
                   const std::optional<at::Tensor>& noop,
                   const std::optional<at::Tensor>& inv_scale, double lr, double beta1,
                   double beta2, double eps, double weight_decay, int64_t step,
                   bool bias_correction_on, bool grad_averaging, bool reg_inside_moment) {
  constexpr const char* op = "multi_tensor_novograd_";
  const std::optional<at::Device> device = call_device(grads, noop);
  if (!device) {
    return;
  }
  const c10::cuda::CUDAGuard guard(*device);
  OptimPlan<4> plan(op,
                    {{{"grads", grads, ListUse::kRead},
                      {"params", params, ListUse::kUpdate},
                      {"exp_avgs", exp_avgs, ListUse::kUpdate},
                      {"model_params", model_params, out_use(model_params)}}},
                    *device);
  const float b1 = f32(beta1);
  launch(plan, NovoGradOp{optim_common(op, noop, inv_scale, *device),
                          {1.0f, f32(lr), b1, grad_averaging ? 1.0f - b1 : 1.0f, f32(weight_decay),
                           optim::bias_correction(b1, step, bias_correction_on), reg_inside_moment},
                          per_tensor(op, "grad_norms", grad_norms, grads.size(), *device),
                          optim::norm_bias_correction(f32(beta2), step, bias_correction_on),
                          f32(eps)});
}

}  // namespace
}  // namespace amp_patch::cuda

TORCH_LIBRARY_IMPL(amp_patch, CUDA, m) {
  m.impl("multi_tensor_adam_", &amp_patch::cuda::adam_cuda);
  m.impl("multi_tensor_sgd_", &amp_patch::cuda::sgd_cuda);
  m.impl("multi_tensor_adagrad_", &amp_patch::cuda::adagrad_cuda);
  m.impl("multi_tensor_novograd_", &amp_patch::cuda::novograd_cuda);
}
