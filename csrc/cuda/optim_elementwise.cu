// The single-sweep optimizer ops on CUDA: multi_tensor_adam_, _sgd_, _adagrad_
// and _novograd_. Each chunk is one sweep (SweepOp, optim_lists.cuh) that reads
// the grad, the param and the state, applies the update rule of
// csrc/optim_math.h, and writes the param, the state and the optional half
// model copy. A set noop flag makes every block return before it touches memory.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>

#include "optim_lists.cuh"

namespace amp_patch::cuda {
namespace {

using optim::RnFloat;

// Adam's lists: 0 grad, 1 param, 2 exp_avg, 3 exp_avg_sq, 4 model copy.
struct AdamRule {
  __device__ static void apply(float* r, const optim::AdamHyper& h, float) {
    RnFloat p = r[1], m = r[2], v = r[3];
    optim::adam_update<RnFloat>(r[0], p, m, v, h);
    r[1] = r[4] = p.v;
    r[2] = m.v;
    r[3] = v.v;
  }
};

// The other rules' lists: 0 grad, 1 param, 2 state (absent for SGD without
// momentum), 3 model copy.
constexpr unsigned kRead = 0b0111u, kWritten = 0b1110u;

struct SgdRule {
  __device__ static void apply(float* r, const optim::SgdHyper& h, float) {
    RnFloat p = r[1], mom = r[2];
    optim::sgd_update<RnFloat>(r[0], p, h.momentum != 0.0f ? &mom : nullptr, h);
    r[1] = r[3] = p.v;
    r[2] = mom.v;
  }
};

struct AdagradRule {
  __device__ static void apply(float* r, const optim::AdagradHyper& h, float) {
    RnFloat p = r[1], sum = r[2];
    optim::adagrad_update<RnFloat>(r[0], p, sum, h);
    r[1] = r[3] = p.v;
    r[2] = sum.v;
  }
};

struct NovoGradRule {
  __device__ static void apply(float* r, const optim::NovoGradHyper& h, float denom) {
    RnFloat p = r[1], m = r[2];
    optim::novograd_update<RnFloat>(r[0], p, m, denom, h);
    r[1] = r[3] = p.v;
    r[2] = m.v;
  }
};

// NovoGrad's per-tensor denominator, rounded as the CPU kernels round it on the host.
struct NovoGradDenom {
  const float* grad_norms;
  float bias_correction2;
  float eps;

  __device__ float operator()(int t) const {
    return (RnFloat(grad_norms[t]) / RnFloat(bias_correction2) + RnFloat(eps)).v;
  }
};

// Adam with its bias corrections read on the device (made there from a step
// counter kept there, so the host never reads it): each thread takes them once
// per chunk, before the sweep (SweepOp calls prepare).
struct AdamDeviceBcHyper : optim::AdamHyper {
  const float* bc;
};

struct AdamDeviceBcRule {
  __device__ static void prepare(AdamDeviceBcHyper& h) {
    h.bias_correction1 = h.bc[0];
    h.bias_correction2 = h.bc[1];
  }
  __device__ static void apply(float* r, const AdamDeviceBcHyper& h, float value) {
    AdamRule::apply(r, h, value);
  }
};

// The CUDA side of the single-sweep ops of optim_args.h.
struct CudaSweeps {
  static void adam(const char* op, const optim::Lists<5>& lists, const optim::Flags& flags,
                   const optim::AdamHyper& h, const float* device_bc = nullptr) {
    if (device_bc != nullptr) {
      run_sweep<AdamDeviceBcRule, 0b01111u, 0b11110u>(op, lists, flags,
                                                      AdamDeviceBcHyper{h, device_bc});
      return;
    }
    run_sweep<AdamRule, 0b01111u, 0b11110u>(op, lists, flags, h);
  }

  static void sgd(const char* op, const optim::Lists<4>& lists, const optim::Flags& flags,
                  const optim::SgdHyper& h) {
    run_sweep<SgdRule, kRead, kWritten>(op, lists, flags, h);
  }

  static void adagrad(const char* op, const optim::Lists<4>& lists, const optim::Flags& flags,
                      const optim::AdagradHyper& h) {
    run_sweep<AdagradRule, kRead, kWritten>(op, lists, flags, h);
  }

  static void novograd(const char* op, const optim::Lists<4>& lists, const optim::Flags& flags,
                       const optim::NovoGradHyper& h, const at::Tensor& grad_norms,
                       float bias_correction2, float eps) {
    run_sweep<NovoGradRule, kRead, kWritten>(op, lists, flags, h, [&](const at::Device& device) {
      return NovoGradDenom{per_tensor(op, "grad_norms", grad_norms, lists[0].tensors.size(), device),
                           bias_correction2, eps};
    });
  }
};

// adam_device_step_: one thread advances the counter unless the flag is set and
// writes 1 - beta**count for both betas (float64, rounded once), as the
// reference's tensor ops do, in one launch instead of five.
template <typename T>
__global__ void adam_device_step_kernel(T* step, const float* found_inf, const double* betas,
                                        float* out, bool bias_correction) {
  if (*found_inf == 0.0f) {
    *step += T(1);
  }
  const double count = static_cast<double>(*step);
  for (int i = 0; i < 2; ++i) {
    out[i] = bias_correction ? static_cast<float>(1.0 - ::pow(betas[i], count)) : 1.0f;
  }
}

at::Tensor adam_device_step_cuda(const at::Tensor& step, const at::Tensor& found_inf,
                                 const at::Tensor& betas, bool bias_correction) {
  constexpr const char* op = "adam_device_step_";
  AMP_CHECK(step.is_cuda() && found_inf.device() == step.device() &&
                betas.device() == step.device(),
            "amp_patch::", op, ": step, found_inf and betas must be on one CUDA device, got ",
            step.device(), ", ", found_inf.device(), " and ", betas.device());
  optim::check_device_step_args(op, step, found_inf, betas);
  const c10::cuda::CUDAGuard guard(step.device());
  at::Tensor out = at::empty({2}, step.options().dtype(at::kFloat));
  AT_DISPATCH_ALL_TYPES(step.scalar_type(), op, [&] {
    adam_device_step_kernel<scalar_t><<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
        step.data_ptr<scalar_t>(), found_inf.const_data_ptr<float>(),
        betas.const_data_ptr<double>(), out.data_ptr<float>(), bias_correction);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace
}  // namespace amp_patch::cuda

TORCH_LIBRARY_IMPL(amp_patch, CUDA, m) {
  using amp_patch::cuda::CudaSweeps;
  m.impl("adam_device_step_", &amp_patch::cuda::adam_device_step_cuda);
  namespace optim = amp_patch::optim;
  m.impl("multi_tensor_adam_", &optim::adam_op<CudaSweeps>);
  m.impl("multi_tensor_sgd_", &optim::sgd_op<CudaSweeps>);
  m.impl("multi_tensor_adagrad_", &optim::adagrad_op<CudaSweeps>);
  m.impl("multi_tensor_novograd_", &optim::novograd_op<CudaSweeps>);
}
