// Shared by the CUDA optimizer ops (optim_*.cu): the round-to-nearest float
// type that instantiates the update rules of csrc/optim_math.h, element
// access by run-time dtype, the chunk sweep, and the host-side plan that turns
// an op's lists into multi_tensor_apply tasks grouped by dtype combination.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <cub/block/block_reduce.cuh>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "check.h"
#include "multi_tensor_apply.cuh"
#include "tensor_lists.cuh"

namespace amp_patch::optim {

// A float whose arithmetic is the _rn intrinsics: one rounding per operation
// and never an FMA, as in the reference ops and the CPU loops.
struct RnFloat {
  float v;
  __device__ __forceinline__ RnFloat(float x) : v(x) {}  // NOLINT: implicit, like float
};
__device__ __forceinline__ RnFloat operator+(RnFloat a, RnFloat b) { return __fadd_rn(a.v, b.v); }
__device__ __forceinline__ RnFloat operator-(RnFloat a, RnFloat b) { return __fsub_rn(a.v, b.v); }
__device__ __forceinline__ RnFloat operator*(RnFloat a, RnFloat b) { return __fmul_rn(a.v, b.v); }
__device__ __forceinline__ RnFloat operator/(RnFloat a, RnFloat b) { return __fdiv_rn(a.v, b.v); }
__device__ __forceinline__ RnFloat sqrt_rn(RnFloat a) { return __fsqrt_rn(a.v); }

}  // namespace amp_patch::optim

#include "optim_args.h"
#include "optim_math.h"

namespace amp_patch::cuda {

// The optimizer kernels hold up to five lists per tensor (grad, param, two
// moments, the half model copy).
constexpr int kOptimLists = 5;
// Elements each thread loads before it computes, per sweep round (Apex's ILP).
constexpr int kIlp = 4;

// dtype codes: tensor_lists.cuh's dtype_index (0 fp32, 1 fp16, 2 bf16).
__device__ __forceinline__ float load_as_float(const void* base, int dt, int64_t i) {
  switch (dt) {
    case 0:
      return static_cast<const float*>(base)[i];
    case 1:
      return to_float(static_cast<const c10::Half*>(base)[i]);
    default:
      return to_float(static_cast<const c10::BFloat16*>(base)[i]);
  }
}

__device__ __forceinline__ void store_from_float(void* base, int dt, int64_t i, float v) {
  switch (dt) {
    case 0:
      static_cast<float*>(base)[i] = v;
      break;
    case 1:
      static_cast<c10::Half*>(base)[i] = from_float<c10::Half>(v);
      break;
    default:
      static_cast<c10::BFloat16*>(base)[i] = from_float<c10::BFloat16>(v);
  }
}

// What every optimizer kernel carries besides its hyper-parameters.
struct OptimCommon {
  const float* noop_f32 = nullptr;  // at most one of the two noop pointers is set
  const int32_t* noop_i32 = nullptr;
  const float* inv_scale = nullptr;
  int8_t dt[kOptimLists] = {};

  __device__ __forceinline__ bool skipped() const {
    return (noop_f32 != nullptr && *noop_f32 != 0.0f) || (noop_i32 != nullptr && *noop_i32 != 0);
  }
  __device__ __forceinline__ float scale() const { return inv_scale != nullptr ? *inv_scale : 1.0f; }
};

// The chunk's tensor index in the op's lists (Task::base holds it).
template <int Depth>
__device__ __forceinline__ int tensor_of(const Chunk<Depth>& c) {
  return c.index - static_cast<int>(c.begin / kChunkElems);
}

// Loads lists `Read` (a bit mask) of kIlp elements per thread into fp32
// registers, calls update(r) for each element (r[k] is list k's value), and
// stores lists `Write`. Absent lists (null pointers) are neither read nor written.
template <int Depth, unsigned Read, unsigned Write, typename Update>
__device__ __forceinline__ void sweep_chunk(const Chunk<Depth>& c, const int8_t* dt, Update&& update) {
  for (int base = threadIdx.x; base < c.n; base += kIlp * kBlockThreads) {
    float r[kIlp][Depth];
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int i = base + u * kBlockThreads;
#pragma unroll
      for (int k = 0; k < Depth; ++k) {
        r[u][k] = 0.0f;
        if ((Read >> k & 1u) && i < c.n && c.ptr[k] != nullptr) {
          r[u][k] = load_as_float(c.ptr[k], dt[k], c.begin + i);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      if (base + u * kBlockThreads < c.n) {
        update(r[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int i = base + u * kBlockThreads;
#pragma unroll
      for (int k = 0; k < Depth; ++k) {
        if ((Write >> k & 1u) && i < c.n && c.ptr[k] != nullptr) {
          store_from_float(c.ptr[k], dt[k], c.begin + i, r[u][k]);
        }
      }
    }
  }
}

// The per-tensor value a sweep needs besides the hyper-parameters (NovoGrad's
// denominator, LAMB's trust ratio): by default none.
struct NoPerTensor {
  __device__ __forceinline__ float operator()(int) const { return 0.0f; }
};

// Whether Rule has hyper-parameters prepared on the device: `Rule::prepare(Hyper&)` (C++17's
// detection idiom: torch 2.11 and older compile the sources as C++17, so no `requires`).
template <typename Rule, typename Hyper, typename = void>
struct HasPrepare : std::false_type {};
template <typename Rule, typename Hyper>
struct HasPrepare<Rule, Hyper, std::void_t<decltype(Rule::prepare(std::declval<Hyper&>()))>>
    : std::true_type {};

// The kernel functor of a single-sweep optimizer op: returns at once when the
// noop flag is set, else reads inv_scale and the tensor's per-tensor value and
// calls Rule::apply(r, hyper, value) on each element's fp32 values r[list].
template <int Depth, unsigned Read, unsigned Written, typename Rule, typename Hyper,
          typename PerTensor = NoPerTensor>
struct SweepOp {
  OptimCommon common;
  Hyper h;
  PerTensor per_tensor;

  __device__ void operator()(const Chunk<Depth>& c) const {
    if (common.skipped()) {
      return;
    }
    Hyper hh = h;
    hh.inv_scale = common.scale();
    if constexpr (HasPrepare<Rule, Hyper>::value) {
      Rule::prepare(hh);  // hyper-parameters that live on the device (AdamDeviceBcRule)
    }
    const float value = per_tensor(tensor_of(c));
    sweep_chunk<Depth, Read, Written>(c, common.dt, [&](float* r) { Rule::apply(r, hh, value); });
  }
};

using optim::ListArg;
using optim::Use;

// An op's lists as multi_tensor_apply tasks, grouped by the dtypes of their
// lists. Rows whose tensors cannot all be walked as one flat range in the same
// element order use contiguous stand-ins, written back after the launches.
template <int Depth>
class OptimPlan {
 public:
  using Dtypes = std::array<int8_t, Depth>;

  OptimPlan(const char* op, const optim::Lists<Depth>& lists, const at::Device& device)
      : lists_(lists) {
    const size_t n = lists_[0].tensors.size();
    for (const ListArg& l : lists_) {
      AMP_CHECK(l.use == Use::kAbsent || l.tensors.size() == n, "amp_patch::", op,
                  ": list lengths differ (", lists_[0].name, " has ", n, ", ", l.name, " has ",
                  l.tensors.size(), ")");
      if (l.use != Use::kAbsent) {
        check_list(op, l.name, l.tensors, device, "the flag and scale tensors");
      }
    }
    for (size_t i = 0; i < n; ++i) {
      add_row(op, i);
    }
  }

  // Calls launch(dtypes, tasks) per group, then copies the stand-ins back.
  template <typename Launch>
  void run(Launch&& launch) {
    for (const auto& [dtypes, tasks] : groups_) {
      launch(dtypes, tasks);
    }
    for (auto& [user, stand_in] : write_back_) {
      user.copy_(stand_in);
    }
  }

 private:
  void add_row(const char* op, size_t i) {
    const at::Tensor& lead = lists_[0].tensors[i];
    bool flat = true;
    for (const ListArg& l : lists_) {
      if (l.use == Use::kAbsent) {
        continue;
      }
      const at::Tensor& t = l.tensors[i];
      AMP_CHECK(t.sizes() == lead.sizes(), "amp_patch::", op, ": ", l.name, "[", i,
                  "] has shape ", t.sizes(), " but ", lists_[0].name, "[", i, "] has ",
                  lead.sizes());
      if (l.use != Use::kChecked) {
        flat = flat && t.is_non_overlapping_and_dense() && t.strides() == lead.strides();
      }
    }
    if (lead.numel() == 0) {
      return;
    }
    Task<Depth> task{};
    task.numel = lead.numel();
    task.base = static_cast<int32_t>(i);
    Dtypes dtypes{};
    for (int k = 0; k < Depth; ++k) {
      const ListArg& l = lists_[k];
      task.ptr[k] = nullptr;
      dtypes[k] = 0;
      if (l.use == Use::kAbsent || l.use == Use::kChecked) {
        continue;
      }
      at::Tensor t = l.tensors[i];
      dtypes[k] = static_cast<int8_t>(dtype_index(t.scalar_type()));
      if (!flat && !t.is_contiguous()) {
        // Even a write-only stand-in starts as a copy: a kernel that skips the
        // step (noop set on the device) must leave the copy-back a no-op.
        at::Tensor stand_in = t.contiguous();
        if (l.use != Use::kRead) {
          write_back_.emplace_back(t, stand_in);
        } else {
          keep_alive_.push_back(stand_in);
        }
        t = stand_in;
      }
      task.ptr[k] = t.data_ptr();
    }
    groups_[dtypes].push_back(task);
  }

  optim::Lists<Depth> lists_;
  std::map<Dtypes, std::vector<Task<Depth>>> groups_;
  // Stand-ins are freed after the launches; the caching allocator reuses
  // memory in stream order, so that is safe.
  std::vector<at::Tensor> keep_alive_;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back_;
};

// Launches op over every dtype group of the plan, on the current stream.
template <int Depth, typename Op>
void launch_groups(OptimPlan<Depth>& plan, Op o) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  plan.run([&](const typename OptimPlan<Depth>::Dtypes& dtypes,
               const std::vector<Task<Depth>>& tasks) {
    std::copy(dtypes.begin(), dtypes.end(), o.common.dt);
    multi_tensor_apply<Depth>(tasks, o, stream);
  });
}

// The noop flag (float32 found_inf or Apex's int32 buffer) and inv_scale, checked.
inline OptimCommon optim_common(const char* op, const std::optional<at::Tensor>& noop,
                                const std::optional<at::Tensor>& inv_scale,
                                const at::Device& device) {
  OptimCommon common;
  if (noop.has_value()) {
    AMP_CHECK(noop->device() == device && noop->numel() == 1 &&
                    (noop->scalar_type() == at::kFloat || noop->scalar_type() == at::kInt),
                "amp_patch::", op, ": noop must be a one-element float32 or int32 tensor on ",
                device, ", got ", noop->scalar_type(), " with ", noop->numel(), " elements on ",
                noop->device());
    if (noop->scalar_type() == at::kFloat) {
      common.noop_f32 = noop->const_data_ptr<float>();
    } else {
      common.noop_i32 = noop->const_data_ptr<int32_t>();
    }
  }
  if (inv_scale.has_value()) {
    check_inv_scale(op, *inv_scale, device);
    common.inv_scale = inv_scale->const_data_ptr<float>();
  }
  return common;
}

// The device of an op's call: the first tensor of its lead list (or of the flags).
inline std::optional<at::Device> call_device(at::TensorList lead,
                                             const std::optional<at::Tensor>& noop) {
  if (!lead.empty()) {
    return lead[0].device();
  }
  if (noop.has_value()) {
    return noop->device();
  }
  return std::nullopt;
}

// A per-tensor vector (NovoGrad's grad norms, LAMB's norms) on the call's device.
inline const float* per_tensor(const char* op, const char* what, const at::Tensor& t, size_t n,
                               const at::Device& device) {
  AMP_CHECK(t.device() == device && t.scalar_type() == at::kFloat && t.dim() == 1 &&
                  static_cast<size_t>(t.numel()) == n && t.is_contiguous(),
              "amp_patch::", op, ": ", what, " must be a contiguous 1-D float32 tensor of ", n,
              " elements (one per tensor) on ", device, ", got ", t.scalar_type(), " of shape ",
              t.sizes(), " on ", t.device());
  return t.const_data_ptr<float>();
}

// LAMB's (fp32 and lean ops): the clipping divisor from the global grad norm
// of the scaled grads, rounded as the CPU kernels round it on the host.
__device__ __forceinline__ float clip_divisor(float global_norm, float inv_scale, float max_norm) {
  const float norm = __fmul_rn(global_norm, inv_scale);
  return max_norm > 0.0f && norm > max_norm ? __fdiv_rn(norm, max_norm) : 1.0f;
}

// LAMB's: a tensor's step size, lr times its trust ratio when it has one and
// both norms are non-zero, rounded as the CPU kernels round it on the host.
struct TrustRatio {
  const float* param_norms;
  const float* update_norms;
  float lr;
  bool enabled;

  __device__ float operator()(int t) const {
    const float pn = param_norms[t], un = update_norms[t];
    return enabled && pn != 0.0f && un != 0.0f ? __fmul_rn(lr, __fdiv_rn(pn, un)) : lr;
  }
};

// LAMB's two sums of squares (p^2 and u^2) over the calling thread block of
// kThreads threads, each a cub block reduction in its fixed order; valid in
// thread 0. Once per block and call site: the temp storage is not guarded
// against a next call.
template <int kThreads>
__device__ __forceinline__ void lamb_block_totals(float& p, float& u) {
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  p = Reduce(storage).Sum(p);
  __syncthreads();  // the temp storage is reused
  u = Reduce(storage).Sum(u);
}

// LAMB's global grad norm, checked: one float32 element on the call's device.
inline const float* global_norm_ptr(const char* op, const at::Tensor& global_grad_norm,
                                    const at::Device& device) {
  AMP_CHECK(global_grad_norm.numel() == 1 && global_grad_norm.scalar_type() == at::kFloat &&
                global_grad_norm.device() == device,
            "amp_patch::", op, ": global_grad_norm must be a one-element float32 tensor on ",
            device, ", got ", global_grad_norm.scalar_type(), " with ", global_grad_norm.numel(),
            " elements on ", global_grad_norm.device());
  return global_grad_norm.const_data_ptr<float>();
}

// A whole single-sweep op: the plan of its lists on their device, then one
// SweepOp launch sequence per dtype group. make_per_tensor(device) returns
// the per-tensor functor (its inputs checked against the device).
template <typename Rule, unsigned Read, unsigned Written, size_t Depth, typename Hyper,
          typename MakePerTensor>
void run_sweep(const char* op, const optim::Lists<Depth>& lists, const optim::Flags& flags,
               const Hyper& h, MakePerTensor&& make_per_tensor) {
  const std::optional<at::Device> device = call_device(lists[0].tensors, flags.noop);
  if (!device) {
    return;
  }
  const c10::cuda::CUDAGuard guard(*device);
  OptimPlan<Depth> plan(op, lists, *device);
  auto per_tensor = make_per_tensor(*device);
  launch_groups(plan, SweepOp<Depth, Read, Written, Rule, Hyper, decltype(per_tensor)>{
                          optim_common(op, flags.noop, flags.inv_scale, *device), h, per_tensor});
}

template <typename Rule, unsigned Read, unsigned Written, size_t Depth, typename Hyper>
void run_sweep(const char* op, const optim::Lists<Depth>& lists, const optim::Flags& flags,
               const Hyper& h) {
  run_sweep<Rule, Read, Written>(op, lists, flags, h,
                                 [](const at::Device&) { return NoPerTensor{}; });
}

}  // namespace amp_patch::cuda
