// multi_tensor_copy_: dst = src with a cast, the masters-to-model copy after a step.
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

template <typename In, typename Out>
struct CopyOp {
  __device__ void operator()(const Chunk<2>& c) const {
    for_each_element<Access::kWrite>(
        c.in<In>(), c.out<Out>(), c.n, [](In x) { return cast_to<Out>(x); });
  }
};

void multi_tensor_copy_cuda(at::TensorList src, at::TensorList dst) {
  constexpr const char* op = "multi_tensor_copy_";
  check_pairs(op, src, dst);
  if (src.empty()) {
    return;
  }
  const at::Device device = src[0].device();
  check_list(op, "src", src, device, "src[0]");
  check_list(op, "dst", dst, device, "src[0]");
  check_no_overlap(op, "dst", dst, "src", src);
  const c10::cuda::CUDAGuard guard(device);

  Plan<2> plan;
  for (size_t i = 0; i < src.size(); ++i) {
    plan.add(src[i], dst[i], /*read_dst=*/false);
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  plan.run([&](auto in, auto out, const std::vector<Task<2>>& tasks) {
    using In = typename decltype(in)::type;
    using Out = typename decltype(out)::type;
    multi_tensor_apply<2>(tasks, CopyOp<In, Out>{}, stream);
  });
}

}  // namespace
}  // namespace amp_patch::cuda

TORCH_LIBRARY_IMPL(amp_patch, CUDA, m) {
  m.impl("multi_tensor_copy_", &amp_patch::cuda::multi_tensor_copy_cuda);
}
