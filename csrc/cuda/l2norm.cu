// multi_tensor_l2norm and multi_tensor_unscale_l2norm: the L2 norm of a tensor
// list (and of each tensor), of the values as they are or times inv_scale,
// accumulated in fp32, in two stages with a fixed order of summation, so the
// result is the same from run to run.
//
// Stage 1 is a multi_tensor_apply kernel: each block writes the sum of
// squares of its chunk to partials[first chunk of its tensor + chunk]. The
// slots are numbered in list order, whatever the dtype grouping, so each
// tensor's partials are one contiguous range. Stage 2 is one small launch
// (plus one per 8000 tensors past the first 8000, with per_tensor): block 0
// sums all partials into the total; the other blocks give each tensor one warp
// that sums its range. The ranges travel as kernel parameters, so nothing is
// copied from the host and the op can be captured in a CUDA graph.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

#include "check.h"
#include "multi_tensor_apply.cuh"
#include "tensor_lists.cuh"

namespace amp_patch::cuda {
namespace {

constexpr int kWarps = kBlockThreads / 32;

// The block's sum, valid in thread 0. Called at most once per block.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[kWarps];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  v = warp_sum(v);
  if (lane == 0) {
    warp_sums[warp] = v;
  }
  __syncthreads();
  v = 0.0f;
  if (warp == 0) {
    v = warp_sum(lane < kWarps ? warp_sums[lane] : 0.0f);
  }
  return v;
}

// fp64 inputs are squared and summed per thread in fp64; the block's sum and
// everything after it is fp32, as for the other dtypes. With kScaled each
// element is first multiplied by *inv_scale, the product rounded to opmath
// (multi_tensor_unscale_l2norm).
template <typename T, bool kScaled>
struct SumSquaresOp {
  float* partials;
  const float* inv_scale;

  __device__ void operator()(const Chunk<1>& c) const {
    using M = opmath_t<T, T>;
    const M s = kScaled ? static_cast<M>(*inv_scale) : M(1);
    M acc = 0;
    for_each_element<Access::kRead>(c.in<T>(), static_cast<T*>(nullptr), c.n, [&](T x) {
      M v = to_opmath<M>(x);
      if constexpr (kScaled) {
        v = mul_rn(v, s);
      }
      if constexpr (std::is_same_v<M, double>) {
        acc = fma(v, v, acc);
      } else {
        acc = fmaf(v, v, acc);
      }
    });
    const float sum = block_sum(static_cast<float>(acc));
    if (threadIdx.x == 0) {
      partials[c.index] = sum;
    }
  }
};

// The per-tensor partial ranges of one stage-2 launch, passed by value as a
// kernel parameter. A CUDA graph captures kernel parameters with the launch,
// so a captured l2norm replays correctly; a host buffer copied to the device
// would be freed after capture and read again at every replay.
struct TensorRanges {
  static constexpr int kMaxTensors =
      (kParamBytes - kOpParamBytes) / static_cast<int>(sizeof(int32_t)) - 3;
  int32_t first;  // list index of the first tensor of this launch
  int32_t count;  // tensors in this launch
  // Tensor first + t has partials [offsets[t], offsets[t + 1]).
  int32_t offsets[kMaxTensors + 1];
};
static_assert(sizeof(TensorRanges) + kOpParamBytes <= kParamBytes, "stage-2 arguments exceed the limit");

// Block 0 of the first launch (with_total) sums all partials into the total;
// every other warp takes one tensor of `ranges`.
__global__ void __launch_bounds__(kBlockThreads) l2norm_finalize(
    const float* partials,
    int num_partials,
    float* total,
    float* norms,
    bool with_total,
    const __grid_constant__ TensorRanges ranges) {
  if (with_total && blockIdx.x == 0) {
    // Four independent sums keep four loads in flight per thread.
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int i = threadIdx.x;
    for (; i + 3 * kBlockThreads < num_partials; i += 4 * kBlockThreads) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        acc[u] += partials[i + u * kBlockThreads];
      }
    }
    for (; i < num_partials; i += kBlockThreads) {
      acc[0] += partials[i];
    }
    const float sum = block_sum((acc[0] + acc[1]) + (acc[2] + acc[3]));
    if (threadIdx.x == 0) {
      *total = sqrtf(sum);
    }
    return;
  }
  const int t = (blockIdx.x - (with_total ? 1 : 0)) * kWarps + threadIdx.x / 32;
  if (t >= ranges.count) {
    return;  // whole warps leave together, so warp_sum below sees all 32 lanes
  }
  float sum = 0.0f;
  for (int i = ranges.offsets[t] + threadIdx.x % 32; i < ranges.offsets[t + 1]; i += 32) {
    sum += partials[i];
  }
  sum = warp_sum(sum);
  if (threadIdx.x % 32 == 0) {
    norms[ranges.first + t] = sqrtf(sum);
  }
}

// Both norms; inv_scale is null for the plain l2norm. Every tensor is on `device`.
std::tuple<at::Tensor, at::Tensor> norms_cuda(
    const char* op,
    at::TensorList x,
    bool per_tensor,
    const at::Device& device,
    const float* inv_scale) {
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  const int num_tensors = static_cast<int>(x.size());
  std::vector<int32_t> offsets(num_tensors + 1);
  Plan<1> plan;
  int64_t num_partials = 0;
  for (int i = 0; i < num_tensors; ++i) {
    offsets[i] = static_cast<int32_t>(num_partials);
    plan.add(x[i], /*in_place=*/false, offsets[i]);
    num_partials += (x[i].numel() + kChunkElems - 1) / kChunkElems;
    AMP_CHECK(
        num_partials <= INT_MAX, "amp_patch::", op, ": more than 2^31 chunks of ",
        kChunkElems, " elements");
  }
  offsets[num_tensors] = static_cast<int32_t>(num_partials);

  const auto fp32 = at::TensorOptions().device(device).dtype(at::kFloat);
  at::Tensor partials = at::empty({num_partials}, fp32);
  float* partials_ptr = partials.data_ptr<float>();
  plan.run([&](auto in, auto, const std::vector<Task<1>>& tasks) {
    using T = typename decltype(in)::type;
    if (inv_scale != nullptr) {
      multi_tensor_apply<1>(tasks, SumSquaresOp<T, true>{partials_ptr, inv_scale}, stream);
    } else {
      multi_tensor_apply<1>(tasks, SumSquaresOp<T, false>{partials_ptr, nullptr}, stream);
    }
  });

  at::Tensor total = at::empty({}, fp32);
  at::Tensor norms = at::empty({per_tensor ? num_tensors : 0}, fp32);
  // Stage 2: one launch for the total and the first tensors' norms, then one
  // per kMaxTensors further tensors (8000 with the 32 KB parameter limit).
  constexpr int kPerLaunch = TensorRanges::kMaxTensors;
  auto ranges = std::make_unique<TensorRanges>();  // 32 KB: not on the stack
  const int launched = per_tensor ? num_tensors : 0;
  for (int first = 0; first == 0 || first < launched; first += kPerLaunch) {
    const bool with_total = first == 0;
    ranges->first = first;
    ranges->count = std::min(kPerLaunch, launched - first);
    std::copy_n(offsets.begin() + first, ranges->count + 1, ranges->offsets);
    const int blocks = (with_total ? 1 : 0) + (ranges->count + kWarps - 1) / kWarps;
    l2norm_finalize<<<blocks, kBlockThreads, 0, stream>>>(
        partials_ptr, static_cast<int>(num_partials), total.data_ptr<float>(),
        norms.data_ptr<float>(), with_total, *ranges);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {total, norms};
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_cuda(at::TensorList x, bool per_tensor) {
  constexpr const char* op = "multi_tensor_l2norm";
  if (x.empty()) {
    // Unreachable through the dispatcher (no tensor picks CUDA); matches the reference.
    return {at::zeros({}, at::kFloat), at::zeros({0}, at::kFloat)};
  }
  const at::Device device = x[0].device();
  check_list(op, "x", x, device, "x[0]");
  return norms_cuda(op, x, per_tensor, device, nullptr);
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_unscale_l2norm_cuda(
    at::TensorList x, const at::Tensor& inv_scale, bool per_tensor) {
  constexpr const char* op = "multi_tensor_unscale_l2norm";
  AMP_CHECK(
      inv_scale.is_cuda(), "amp_patch::", op, ": inv_scale must be a CUDA tensor, got ",
      inv_scale.device());
  check_inv_scale(op, inv_scale, inv_scale.device(), "inv_scale");
  check_list(op, "x", x, inv_scale.device(), "inv_scale");
  return norms_cuda(op, x, per_tensor, inv_scale.device(), inv_scale.const_data_ptr<float>());
}

}  // namespace
}  // namespace amp_patch::cuda

TORCH_LIBRARY_IMPL(amp_patch, CUDA, m) {
  m.impl("multi_tensor_l2norm", &amp_patch::cuda::multi_tensor_l2norm_cuda);
  m.impl("multi_tensor_unscale_l2norm", &amp_patch::cuda::multi_tensor_unscale_l2norm_cuda);
}
