// LAMB's two stages on CUDA.
//
// Stage 1 (multi_tensor_lamb_stage1_) is one sweep per chunk that updates the
// moments and sums p^2 and u^2 (u the update direction) over the block; each
// block writes its two sums to partials[tensor * max_chunks + chunk], zeroed
// first. A second small launch gives each tensor one block that adds its row in
// a fixed order and takes the square root: the norms are the same from run to
// run. Stage 2 (multi_tensor_lamb_stage2_) recomputes u from the stored moments
// and steps the param by the tensor's trust ratio.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "check.h"
#include "optim_lists.cuh"

namespace amp_patch::cuda {
namespace {

using optim::RnFloat;

struct LambMomentsOp {
  OptimCommon common;
  optim::LambHyper h;
  const float* global_grad_norm;
  float* param_partials;
  float* update_partials;
  float max_grad_norm;
  int max_chunks;

  // Lists: 0 grad, 1 param (absent when neither weight decay nor the ratio needs it),
  // 2 exp_avg, 3 exp_avg_sq.
  __device__ void operator()(const Chunk<4>& c) const {
    if (common.skipped()) {
      return;
    }
    optim::LambHyper hh = h;
    hh.inv_scale = common.scale();
    hh.clip = clip_divisor(*global_grad_norm, hh.inv_scale, max_grad_norm);
    float p_sq = 0.0f, u_sq = 0.0f;
    sweep_chunk<4, 0b1111u, 0b1100u>(c, common.dt, [&](float* r) {
      RnFloat m = r[2], v = r[3];
      const RnFloat u = optim::lamb_moments<RnFloat>(r[0], r[1], m, v, hh);
      r[2] = m.v;
      r[3] = v.v;
      p_sq = fmaf(r[1], r[1], p_sq);
      u_sq = fmaf(u.v, u.v, u_sq);
    });
    lamb_block_totals<kBlockThreads>(p_sq, u_sq);
    if (threadIdx.x == 0) {
      const int slot = tensor_of(c) * max_chunks + static_cast<int>(c.begin / kChunkElems);
      param_partials[slot] = p_sq;
      update_partials[slot] = u_sq;
    }
  }
};

constexpr int kFinalizeThreads = 256;

// One block per tensor: each of the two norms is the root of its row's sum.
__global__ void __launch_bounds__(kFinalizeThreads) lamb_norms_finalize(
    const float* param_partials, const float* update_partials, int max_chunks, float* param_norms,
    float* update_norms) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * max_chunks;
  float p = 0.0f, u = 0.0f;
  for (int i = threadIdx.x; i < max_chunks; i += kFinalizeThreads) {
    p += param_partials[row + i];
    u += update_partials[row + i];
  }
  lamb_block_totals<kFinalizeThreads>(p, u);
  if (threadIdx.x == 0) {
    param_norms[blockIdx.x] = sqrtf(p);
    update_norms[blockIdx.x] = sqrtf(u);
  }
}

// Stage 2's lists: 0 param, 1 exp_avg, 2 exp_avg_sq, 3 model copy.
struct LambApplyRule {
  __device__ static void apply(float* r, const optim::LambHyper& h, float ratio) {
    RnFloat p = r[0];
    optim::lamb_apply<RnFloat>(p, r[1], r[2], ratio, h);
    r[0] = r[3] = p.v;
  }
};

// The CUDA side of LAMB's ops of optim_args.h.
struct CudaLamb {
  static std::tuple<at::Tensor, at::Tensor> lamb_moments(
      const char* op, const optim::Lists<4>& lists, const optim::Flags& flags,
      const optim::LambHyper& h, const at::Tensor& global_grad_norm, float max_grad_norm) {
    const at::Device device = global_grad_norm.device();
    const c10::cuda::CUDAGuard guard(device);
    const float* global_norm = global_norm_ptr(op, global_grad_norm, device);
    OptimPlan<4> plan(op, lists, device);
    const at::TensorList grads = lists[0].tensors;
    const int64_t n = static_cast<int64_t>(grads.size());
    int64_t max_chunks = 1;
    for (const at::Tensor& g : grads) {
      max_chunks = std::max<int64_t>(max_chunks, (g.numel() + kChunkElems - 1) / kChunkElems);
    }
    const auto fp32 = at::TensorOptions().device(device).dtype(at::kFloat);
    at::Tensor partials = at::zeros({2, n, max_chunks}, fp32);
    // Two tensors, not two rows of one: the op's outputs must not alias.
    at::Tensor param_norms = at::empty({n}, fp32);
    at::Tensor update_norms = at::empty({n}, fp32);
    if (n == 0) {
      return {param_norms, update_norms};
    }
    AMP_CHECK(n * max_chunks <= INT32_MAX, "amp_patch::", op, ": too many chunks");
    float* partials_ptr = partials.data_ptr<float>();
    launch_groups(plan, LambMomentsOp{optim_common(op, flags.noop, flags.inv_scale, device), h,
                                      global_norm, partials_ptr,
                                      partials_ptr + n * max_chunks, max_grad_norm,
                                      static_cast<int>(max_chunks)});
    lamb_norms_finalize<<<static_cast<unsigned>(n), kFinalizeThreads, 0,
                          c10::cuda::getCurrentCUDAStream()>>>(
        partials_ptr, partials_ptr + n * max_chunks, static_cast<int>(max_chunks),
        param_norms.data_ptr<float>(), update_norms.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return {param_norms, update_norms};
  }

  static void lamb_apply(const char* op, const optim::Lists<4>& lists, const optim::Flags& flags,
                         const optim::LambHyper& h, const at::Tensor& param_norms,
                         const at::Tensor& update_norms, float lr, bool use_ratio) {
    run_sweep<LambApplyRule, 0b0111u, 0b1001u>(op, lists, flags, h, [&](const at::Device& device) {
      const size_t n = lists[0].tensors.size();
      return TrustRatio{per_tensor(op, "param_norms", param_norms, n, device),
                        per_tensor(op, "update_norms", update_norms, n, device), lr, use_ratio};
    });
  }
};

}  // namespace
}  // namespace amp_patch::cuda

TORCH_LIBRARY_IMPL(amp_patch, CUDA, m) {
  using amp_patch::cuda::CudaLamb;
  namespace optim = amp_patch::optim;
  m.impl("multi_tensor_lamb_stage1_", &optim::lamb_stage1_op<CudaLamb>);
  m.impl("multi_tensor_lamb_stage2_", &optim::lamb_stage2_op<CudaLamb>);
}
