// multi_tensor_unscale_ and multi_tensor_unscale_copy_: out = float(in) * inv_scale,
// with found_inf set when an input element is inf or NaN; and the loss-scale
// step that reads that flag, update_scale_hysteresis.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "check.h"
#include "multi_tensor_apply.cuh"
#include "overlap.h"
#include "scale_update.h"
#include "tensor_lists.cuh"

namespace amp_patch::cuda {
namespace {

// Depth 1 unscales in place; Depth 2 reads ptr[0] and writes ptr[1].
template <int Depth, typename In, typename Out>
struct UnscaleOp {
  const float* inv_scale;
  float* found_inf;

  __device__ void operator()(const Chunk<Depth>& c) const {
    using M = opmath_t<In, Out>;
    const M s = static_cast<M>(*inv_scale);
    bool nonfinite = false;
    // One product rounded to opmath, as the reference's `t.to(opmath) * inv_scale`.
    for_each_element<Access::kWrite>(c.template in<In>(), c.template out<Out>(), c.n, [&](In x) {
      const M v = to_opmath<M>(x);
      nonfinite |= is_nonfinite(v);
      return from_opmath<Out>(mul_rn(v, s));
    });
    if (nonfinite) {
      *found_inf = 1.0f;  // racing writers all store the same value
    }
  }
};

template <int Depth>
void launch_unscale(Plan<Depth>& plan, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  float* flag = found_inf.data_ptr<float>();
  const float* s = inv_scale.const_data_ptr<float>();
  plan.run([&](auto in, auto out, const std::vector<Task<Depth>>& tasks) {
    using In = typename decltype(in)::type;
    using Out = typename decltype(out)::type;
    multi_tensor_apply<Depth>(tasks, UnscaleOp<Depth, In, Out>{s, flag}, stream);
  });
}

void multi_tensor_unscale_cuda(
    at::TensorList tensors, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  constexpr const char* op = "multi_tensor_unscale_";
  check_found_inf(op, found_inf);
  check_inv_scale(op, inv_scale, found_inf.device());
  check_list(op, "tensors", tensors, found_inf.device(), "found_inf");
  check_no_overlap(op, "tensors", tensors);
  const c10::cuda::CUDAGuard guard(found_inf.device());

  Plan<1> plan;
  for (const at::Tensor& t : tensors) {
    plan.add(t, /*in_place=*/true);
  }
  launch_unscale(plan, found_inf, inv_scale);
}

void multi_tensor_unscale_copy_cuda(
    at::TensorList src,
    at::TensorList dst,
    const at::Tensor& found_inf,
    const at::Tensor& inv_scale) {
  constexpr const char* op = "multi_tensor_unscale_copy_";
  check_pairs(op, src, dst);
  check_found_inf(op, found_inf);
  check_inv_scale(op, inv_scale, found_inf.device());
  check_list(op, "src", src, found_inf.device(), "found_inf");
  check_list(op, "dst", dst, found_inf.device(), "found_inf");
  check_no_overlap(op, "dst", dst, "src", src);
  const c10::cuda::CUDAGuard guard(found_inf.device());

  Plan<2> plan;
  for (size_t i = 0; i < src.size(); ++i) {
    plan.add(src[i], dst[i], /*read_dst=*/false);
  }
  launch_unscale(plan, found_inf, inv_scale);
}

// One thread runs the step shared with the CPU kernel (scale_update.h), on
// the device, so that the scale is never read back to the host.
__global__ void update_scale_hysteresis_kernel(ScaleState state, HysteresisConfig config) {
  update_scale_hysteresis_step(state, config);
}

void update_scale_hysteresis_cuda(
    const at::Tensor& current_scale,
    const at::Tensor& growth_tracker,
    const at::Tensor& hysteresis_tracker,
    const at::Tensor& found_inf,
    double growth_factor,
    double backoff_factor,
    int64_t growth_interval,
    int64_t hysteresis) {
  constexpr const char* op = "update_scale_hysteresis";
  AMP_CHECK(
      current_scale.is_cuda(), "amp_patch::", op, ": current_scale must be a CUDA tensor, got ",
      current_scale.device());
  const ScaleState state =
      scale_state(op, current_scale, growth_tracker, hysteresis_tracker, found_inf);
  const c10::cuda::CUDAGuard guard(current_scale.device());
  const HysteresisConfig config{growth_factor, backoff_factor, growth_interval, hysteresis};
  update_scale_hysteresis_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(state, config);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// amp's loss-scale update (scale_update.h), one thread, so that nothing is read
// back to the host.
__global__ void loss_scale_update_kernel(LossScalePointers p, LossScaleConfig config) {
  loss_scale_update_step(p, config);
}

void loss_scale_update_cuda(const at::Tensor& state, const at::Tensor& inv_scale,
                            const at::Tensor& scale, const at::Tensor& found_inf,
                            const at::Tensor& overflow, double scale_window, double floor,
                            bool floor_is_min, double max_scale, bool dynamic,
                            double max_consecutive) {
  constexpr const char* op = "loss_scale_update_";
  AMP_CHECK(state.is_cuda(), "amp_patch::", op, ": state must be a CUDA tensor, got ",
            state.device());
  const LossScalePointers p = loss_scale_pointers(op, state, inv_scale, scale, found_inf, overflow);
  const c10::cuda::CUDAGuard guard(state.device());
  const LossScaleConfig config{scale_window, floor, floor_is_min, max_scale, dynamic,
                               max_consecutive};
  loss_scale_update_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(p, config);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace amp_patch::cuda

TORCH_LIBRARY_IMPL(amp_patch, CUDA, m) {
  m.impl("multi_tensor_unscale_", &amp_patch::cuda::multi_tensor_unscale_cuda);
  m.impl("multi_tensor_unscale_copy_", &amp_patch::cuda::multi_tensor_unscale_copy_cuda);
  m.impl("update_scale_hysteresis", &amp_patch::cuda::update_scale_hysteresis_cuda);
  m.impl("loss_scale_update_", &amp_patch::cuda::loss_scale_update_cuda);
}
