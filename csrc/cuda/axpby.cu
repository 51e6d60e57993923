// multi_tensor_axpby_: y = a * x + b * y in place, with found_inf set when an
// element of x is inf or NaN.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "multi_tensor_apply.cuh"
#include "overlap.h"
#include "tensor_lists.cuh"

namespace amp_patch::cuda {
namespace {

template <typename X, typename Y>
struct AxpbyOp {
  using M = opmath_t<X, Y>;
  M a;
  M b;
  float* found_inf;

  __device__ void operator()(const Chunk<2>& c) const {
    bool nonfinite = false;
    // Two products and a sum, each rounded to opmath and never fused into an
    // FMA, so that the result matches the reference `a * x.to(m) + b * y.to(m)`.
    for_each_element<Access::kReadWrite>(c.in<X>(), c.out<Y>(), c.n, [&](X x, Y y) {
      const M xv = to_opmath<M>(x);
      nonfinite |= is_nonfinite(xv);
      return from_opmath<Y>(add_rn(mul_rn(a, xv), mul_rn(b, to_opmath<M>(y))));
    });
    if (nonfinite) {
      *found_inf = 1.0f;  // racing writers all store the same value
    }
  }
};

void multi_tensor_axpby_cuda(
    at::TensorList x, at::TensorList y, const at::Tensor& found_inf, double a, double b) {
  constexpr const char* op = "multi_tensor_axpby_";
  check_pairs(op, x, y);
  check_found_inf(op, found_inf);
  check_list(op, "x", x, found_inf.device(), "found_inf");
  check_list(op, "y", y, found_inf.device(), "found_inf");
  check_no_overlap(op, "y", y, "x", x);
  const c10::cuda::CUDAGuard guard(found_inf.device());

  Plan<2> plan;
  for (size_t i = 0; i < x.size(); ++i) {
    plan.add(x[i], y[i], /*read_dst=*/true);
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  float* flag = found_inf.data_ptr<float>();
  plan.run([&](auto in, auto out, const std::vector<Task<2>>& tasks) {
    using X = typename decltype(in)::type;
    using Y = typename decltype(out)::type;
    // The Python scalars are rounded to opmath once, on the host, as ATen's
    // kernels take them (fp32 for fp32 math).
    using M = opmath_t<X, Y>;
    multi_tensor_apply<2>(tasks, AxpbyOp<X, Y>{static_cast<M>(a), static_cast<M>(b), flag}, stream);
  });
}

}  // namespace
}  // namespace amp_patch::cuda

TORCH_LIBRARY_IMPL(amp_patch, CUDA, m) {
  m.impl("multi_tensor_axpby_", &amp_patch::cuda::multi_tensor_axpby_cuda);
}
