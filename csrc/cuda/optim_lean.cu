// The lean optimizer ops on CUDA: multi_tensor_adam_lean_,
// multi_tensor_sgd_lean_ and LAMB's two lean stages
// (amp_patch/ops/lean_state_ops.py holds their reference bodies, which these
// kernels equal bit for bit; stage 1's norms to rounding, as the fp32 stage 1's).
// This file is their host side: the checks, the plan of a call's launches and
// the registration. The kernels and what they are made of:
// optim_state_codes.cuh (state encode / decode), optim_lean_rules.cuh (the
// update rules), optim_lean_launch.cuh (a launch's arguments) and
// optim_lean_kernels.cuh (the fused kernels).
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "check.h"
#include "optim_lean_kernels.cuh"
#include "optim_lists.cuh"

namespace amp_patch::cuda {
namespace {

using optim::StateCode;

// The checks the CUDA kernel adds to the reference's (optim::check_lean_lists):
// every tensor on the device of grads[0], dtypes the kernel reads, and a block
// size that fits its int32 arithmetic.
template <size_t S>
void check_cuda_lists(const char* op, const optim::LeanLists<S>& l, const at::Device& device,
                      int64_t block_size) {
  AMP_CHECK(block_size <= std::numeric_limits<int32_t>::max(), "amp_patch::", op,
              ": block_size ", block_size, " is too large for the CUDA kernel");
  auto on_device = [&](const char* name, at::TensorList tensors) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      AMP_CHECK(tensors[i].device() == device, "amp_patch::", op, ": expected all tensors on ",
                  device, " (the device of grads[0]), but ", name, "[", i, "] is on ",
                  tensors[i].device());
    }
  };
  auto half_or_float = [&](const char* name, at::TensorList tensors) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      const int dt = dtype_index(tensors[i].scalar_type());
      AMP_CHECK(dt >= 0 && dt <= 2, "amp_patch::", op, ": ", name, "[", i, "] has dtype ",
                  tensors[i].scalar_type(),
                  "; the CUDA kernel takes float32, float16 and bfloat16 ", name);
    }
  };
  on_device("grads", l.grads);
  on_device("params", l.params);
  on_device("model_params", l.model_params);
  half_or_float("grads", l.grads);
  half_or_float("model_params", l.model_params);
  for (const optim::LeanStateArg& s : l.states) {
    if (!s.used) {
      continue;
    }
    on_device(s.name, s.codes);
    for (size_t i = 0; i < s.codes.size(); ++i) {
      if (optim::block_scaled(optim::state_code(s.codes[i].scalar_type()))) {
        AMP_CHECK(s.scales[i].device() == device, "amp_patch::", op,
                    ": expected all tensors on ", device, " (the device of grads[0]), but ",
                    s.scale_name, "[", i, "] is on ", s.scales[i].device());
      }
    }
  }
}

// (rows, row length) of a tensor as the codes see it.
std::pair<int64_t, int64_t> rows_of(const at::Tensor& t) {
  return optim::lean_rows(t.sizes());
}

// The tensors of one call as LeanTensor rows. A tensor the kernel cannot walk
// in row-major order (not contiguous) is replaced by a contiguous stand-in,
// copied back after the launches when the op writes it (`writes`: LAMB's
// stage 1 writes nothing). Even a written stand-in starts as a copy: a set
// noop must leave the copy-back a no-op. (The block-scaled codes and their
// scales are contiguous: the checks ask it.)
class LeanPlan {
 public:
  template <size_t S>
  LeanPlan(const optim::LeanLists<S>& l, const optim::LeanHyper& lh, bool writes = true)
      : block_size_(lh.block_size), writes_(writes) {
    static_assert(S <= kMaxStates);
    for (size_t i = 0; i < l.grads.size(); ++i) {
      const at::Tensor& grad = l.grads[i];
      if (grad.numel() == 0) {
        continue;
      }
      LeanTensor t{};
      const auto [rows, len] = rows_of(grad);
      t.row_len = len;
      t.blocks_per_row = (len + block_size_ - 1) / block_size_;
      t.key = optim::lean_tensor_key(lh, static_cast<int64_t>(i));
      t.index = static_cast<int32_t>(i);
      t.grad = flat(grad, false);
      t.grad_dt = static_cast<int8_t>(dtype_index(grad.scalar_type()));
      t.param = flat(l.params[i], true);
      t.param_dt = static_cast<int8_t>(dtype_index(l.params[i].scalar_type()));
      t.model = nullptr;
      if (!l.model_params.empty()) {
        t.model = flat(l.model_params[i], true);
        t.model_dt = static_cast<int8_t>(dtype_index(l.model_params[i].scalar_type()));
      }
      for (size_t k = 0; k < kMaxStates; ++k) {
        t.state[k] = nullptr;
        t.scale[k] = nullptr;
        t.code[k] = StateCode::kF32;
        if (k >= S || !l.states[k].used) {
          continue;
        }
        const at::Tensor& s = l.states[k].codes[i];
        t.code[k] = optim::state_code(s.scalar_type());
        t.state[k] = flat(s, true);
        if (optim::block_scaled(t.code[k])) {
          t.scale[k] = static_cast<float*>(l.states[k].scales[i].data_ptr());
        }
      }
      t.vec = vector_access(t);
      tensors_.push_back(t);
      block_counts_.push_back(rows * t.blocks_per_row);
    }
  }

  // Launches the kernel of Rule over the tensors, then copies the stand-ins back.
  template <typename Rule>
  void run(const OptimCommon& common, const typename Rule::Hyper& h) {
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    each_launch(common, h, [&](int pair, const LeanLaunch<typename Rule::Hyper>& a, int64_t) {
      by_codes<Rule::kStates>(pair, [&](auto codes) {
        lean_kernel<Rule, decltype(codes)::value><<<grid(a), kLeanThreads, 0, stream>>>(a);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
    for (auto& [user, stand_in] : write_back_) {
      user.copy_(stand_in);
    }
  }

  // LAMB's lean stage 1: each state block's sums of p^2 and u^2, then each
  // tensor's norms (the roots of its blocks' totals) into its elements of
  // param_norms and update_norms (zeros where nothing is written).
  void lamb_norms(const OptimCommon& common, LambLeanHyper h, float* param_norms,
                  float* update_norms, const at::TensorOptions& fp32) {
    int64_t blocks = 0;
    for (const int64_t count : block_counts_) {
      blocks += count;
    }
    const at::Tensor sums = at::zeros({2 * blocks}, fp32);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    each_launch(common, h, [&](int pair, const LeanLaunch<LambLeanHyper>& launch, int64_t first) {
      LeanLaunch<LambLeanHyper> a = launch;
      a.h.sums = sums.data_ptr<float>() + 2 * first;
      by_codes<2>(pair, [&](auto codes) {
        lamb_norms_kernel<decltype(codes)::value><<<grid(a), kLeanThreads, 0, stream>>>(a);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      lamb_norms_finalize<<<static_cast<unsigned>(a.n), kNormThreads, 0, stream>>>(
          a, param_norms, update_norms);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }

 private:
  // Calls launch(pair, a, first) for each launch of the call: the tensors by
  // code pair, in order of first appearance (each pair runs the kernel
  // compiled for it, or the one that reads the codes), kLeanTensors at a
  // time; `first` is the call's number of the launch's first state block.
  template <typename Hyper, typename Launch>
  void each_launch(const OptimCommon& common, const Hyper& h, const Launch& launch) const {
    static_assert(sizeof(LeanLaunch<Hyper>) <= kParamBytes,
                  "the lean launch arguments exceed the kernel parameter space");
    std::vector<int> pairs;
    std::vector<std::vector<size_t>> groups;
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const int pair = code_pair(tensors_[i].code[0], tensors_[i].code[1]);
      const auto at = std::find(pairs.begin(), pairs.end(), pair);
      if (at == pairs.end()) {
        pairs.push_back(pair);
        groups.push_back({i});
      } else {
        groups[at - pairs.begin()].push_back(i);
      }
    }
    int64_t call_blocks = 0;
    for (size_t g = 0; g < groups.size(); ++g) {
      const std::vector<size_t>& group = groups[g];
      for (size_t first = 0; first < group.size(); first += kLeanTensors) {
        const size_t count = std::min<size_t>(kLeanTensors, group.size() - first);
        LeanLaunch<Hyper> a{};
        int64_t blocks = 0;
        for (size_t k = 0; k < count; ++k) {
          a.t[k] = tensors_[group[first + k]];
          a.t[k].first_block = blocks;
          blocks += block_counts_[group[first + k]];
        }
        a.total_blocks = blocks;
        a.n = static_cast<int32_t>(count);
        a.block_size = static_cast<int32_t>(block_size_);
        a.common = common;
        a.h = h;
        launch(pairs[g], a, call_blocks);
        call_blocks += blocks;
      }
    }
  }

  template <typename Hyper>
  static unsigned grid(const LeanLaunch<Hyper>& a) {
    return static_cast<unsigned>(
        std::min((a.total_blocks + kLeanWarps - 1) / kLeanWarps, kLeanMaxGrid));
  }

  static constexpr int code_pair(StateCode first, StateCode second) {
    return static_cast<int>(first) * 8 + static_cast<int>(second);
  }

  // f(std::integral_constant<int, kCodes>) for code pair `pair`: the kernels
  // are compiled for the pairs the formats make (initialize's optimizer_state,
  // and fp32 for the tensors a format leaves in fp32), kCodes -1 elsewhere (the
  // kernel that reads each tensor's codes).
  template <int kStates, typename F>
  static void by_codes(int pair, F&& f) {
    using C = StateCode;
    constexpr bool kTwo = kStates == 2;
    constexpr int kF32 = code_pair(C::kF32, C::kF32);
    constexpr int kInt8 = code_pair(C::kInt8, kTwo ? C::kSqrtU8 : C::kF32);
    constexpr int kFp8 = code_pair(C::kE4M3, kTwo ? C::kBF16 : C::kF32);
    constexpr int kBf16 = code_pair(C::kBF16, kTwo ? C::kBF16 : C::kF32);
    switch (pair) {
      case kInt8: return f(std::integral_constant<int, kInt8>{});
      case kFp8: return f(std::integral_constant<int, kFp8>{});
      case kBf16: return f(std::integral_constant<int, kBf16>{});
      case kF32: return f(std::integral_constant<int, kF32>{});
      default: return f(std::integral_constant<int, -1>{});
    }
  }

  // Whether the kernel may read and write tensor t in vectors: every state
  // block, and so every lane's run of kLeanVec elements, starts at a multiple
  // of kLeanVec, and every pointer is 16-byte aligned.
  bool vector_access(const LeanTensor& t) const {
    auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    bool ok = t.row_len % kLeanVec == 0 && block_size_ % kLeanVec == 0 && aligned(t.grad) &&
              aligned(t.param) && (t.model == nullptr || aligned(t.model));
    for (int k = 0; k < kMaxStates; ++k) {
      ok = ok && (t.state[k] == nullptr || aligned(t.state[k]));
    }
    return ok;
  }

  void* flat(const at::Tensor& t, bool written) {
    if (t.is_contiguous()) {
      return t.data_ptr();
    }
    at::Tensor stand_in = t.contiguous();
    if (written && writes_) {
      write_back_.emplace_back(t, stand_in);
    } else {
      keep_alive_.push_back(stand_in);
    }
    return stand_in.data_ptr();
  }

  int64_t block_size_;
  bool writes_;
  std::vector<LeanTensor> tensors_;
  std::vector<int64_t> block_counts_;  // state blocks of each tensor
  // Stand-ins are freed after the launches; the caching allocator reuses
  // memory in stream order, so that is safe.
  std::vector<at::Tensor> keep_alive_;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back_;
};

// An update op: make_hyper(device) gives the rule's hyper-parameters (its
// inputs checked against the call's device).
template <typename Rule, size_t S, typename MakeHyper>
void run_lean(const char* op, const optim::LeanLists<S>& l, const optim::Flags& flags,
              const optim::LeanHyper& lh, MakeHyper&& make_hyper) {
  if (l.grads.empty()) {
    return;
  }
  const at::Device device = l.grads[0].device();
  check_cuda_lists(op, l, device, lh.block_size);
  const c10::cuda::CUDAGuard guard(device);
  const OptimCommon common = optim_common(op, flags.noop, flags.inv_scale, device);
  const typename Rule::Hyper h = make_hyper(device);
  LeanPlan plan(l, lh);
  plan.run<Rule>(common, h);
}

template <typename Rule, size_t S>
void run_lean(const char* op, const optim::LeanLists<S>& l, const optim::Flags& flags,
              const typename Rule::Hyper& h, const optim::LeanHyper& lh) {
  run_lean<Rule>(op, l, flags, lh, [&](const at::Device&) { return h; });
}

// LAMB's lean hyper-parameters for a call on `device` (ratio: stage 2's).
inline LambLeanHyper lamb_lean_hyper(const char* op, const optim::LambLeanArgs& args,
                                     const at::Device& device, TrustRatio ratio = {}) {
  return {args.hyper, global_norm_ptr(op, args.global_grad_norm, device), args.max_grad_norm,
          args.use_ratio, ratio, 0.0f, nullptr};
}

// The CUDA side of optim_args.h's lean entry points (which ran the reference's checks).
struct CudaLean {
  static void adam_lean(const char* op, const optim::LeanLists<2>& l, const optim::Flags& flags,
                        const optim::AdamHyper& h, const optim::LeanHyper& lh) {
    run_lean<AdamLeanRule>(op, l, flags, h, lh);
  }

  static void sgd_lean(const char* op, const optim::LeanLists<1>& l, const optim::Flags& flags,
                       const optim::SgdHyper& h, const optim::LeanHyper& lh) {
    run_lean<SgdLeanRule>(op, l, flags, h, lh);
  }

  static std::tuple<at::Tensor, at::Tensor> lamb_lean_moments(
      const char* op, const optim::LeanLists<2>& l, const optim::Flags& flags,
      const optim::LambLeanArgs& args, const optim::LeanHyper& lh) {
    // The call's device: the global grad norm's, which an empty call has too.
    const at::Device device = args.global_grad_norm.device();
    const c10::cuda::CUDAGuard guard(device);
    const LambLeanHyper h = lamb_lean_hyper(op, args, device);
    const auto fp32 = at::TensorOptions().device(device).dtype(at::kFloat);
    const int64_t n = static_cast<int64_t>(l.grads.size());
    // Two tensors, not two rows of one: the op's outputs must not alias.
    at::Tensor param_norms = at::zeros({n}, fp32);
    at::Tensor update_norms = at::zeros({n}, fp32);
    if (n == 0) {
      return {param_norms, update_norms};
    }
    check_cuda_lists(op, l, device, lh.block_size);
    const OptimCommon common = optim_common(op, flags.noop, flags.inv_scale, device);
    LeanPlan plan(l, lh, /*writes=*/false);
    plan.lamb_norms(common, h, param_norms.data_ptr<float>(), update_norms.data_ptr<float>(), fp32);
    return {param_norms, update_norms};
  }

  static void lamb_lean_apply(const char* op, const optim::LeanLists<2>& l,
                              const optim::Flags& flags, const optim::LambLeanArgs& args,
                              const at::Tensor& param_norms, const at::Tensor& update_norms,
                              float lr, const optim::LeanHyper& lh) {
    run_lean<LambLeanRule>(op, l, flags, lh, [&](const at::Device& device) {
      const size_t n = l.grads.size();
      return lamb_lean_hyper(op, args, device,
                             TrustRatio{per_tensor(op, "param_norms", param_norms, n, device),
                                        per_tensor(op, "update_norms", update_norms, n, device),
                                        lr, args.use_ratio});
    });
  }
};

}  // namespace
}  // namespace amp_patch::cuda

TORCH_LIBRARY_IMPL(amp_patch, CUDA, m) {
  using amp_patch::cuda::CudaLean;
  namespace optim = amp_patch::optim;
  m.impl("multi_tensor_adam_lean_", &optim::adam_lean_op<CudaLean>);
  m.impl("multi_tensor_sgd_lean_", &optim::sgd_lean_op<CudaLean>);
  m.impl("multi_tensor_lamb_lean_stage1_", &optim::lamb_lean_stage1_op<CudaLean>);
  m.impl("multi_tensor_lamb_lean_stage2_", &optim::lamb_lean_stage2_op<CudaLean>);
}
