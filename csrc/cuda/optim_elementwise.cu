// The single-sweep optimizer ops on CUDA: multi_tensor_adam_, _sgd_, _adagrad_
// and _novograd_. Each chunk is one sweep (SweepOp, optim_lists.cuh) that reads
// the grad, the param and the state, applies the update rule of
// csrc/optim_math.h, and writes the param, the state and the optional half
// model copy. A set noop flag makes every block return before it touches memory.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
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

}  // namespace
}  // namespace amp_patch::cuda

TORCH_LIBRARY_IMPL(amp_patch, CUDA, m) {
  using amp_patch::cuda::CudaSweeps;
  namespace optim = amp_patch::optim;
  m.impl("multi_tensor_adam_", &optim::adam_op<CudaSweeps>);
  m.impl("multi_tensor_sgd_", &optim::sgd_op<CudaSweeps>);
  m.impl("multi_tensor_adagrad_", &optim::adagrad_op<CudaSweeps>);
  m.impl("multi_tensor_novograd_", &optim::novograd_op<CudaSweeps>);
}
