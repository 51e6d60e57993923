// Host side shared by the CUDA ops: argument checks, and turning tensor lists
// into per-dtype task lists for multi_tensor_apply.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <array>
#include <utility>
#include <vector>

#include "check.h"
#include "multi_tensor_apply.cuh"

namespace amp_patch::cuda {

template <typename T>
struct TypeTag {
  using type = T;
};

inline int dtype_index(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return 0;
    case at::kHalf:
      return 1;
    case at::kBFloat16:
      return 2;
    case at::kDouble:
      return 3;
    default:
      return -1;
  }
}

template <typename F>
void visit_dtype(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat:
      f(TypeTag<float>{});
      break;
    case at::kHalf:
      f(TypeTag<c10::Half>{});
      break;
    case at::kBFloat16:
      f(TypeTag<c10::BFloat16>{});
      break;
    case at::kDouble:
      f(TypeTag<double>{});
      break;
    default:
      TORCH_INTERNAL_ASSERT(false, "unchecked dtype ", t);
  }
}

// Every tensor on `device`, and of a dtype the kernels are built for.
inline void check_list(
    const char* op,
    const char* name,
    at::TensorList tensors,
    const at::Device& device,
    const char* device_source) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    AMP_CHECK(
        t.device() == device,
        "amp_patch::", op, ": expected all tensors on ", device, " (the device of ",
        device_source, "), but ", name, "[", i, "] is on ", t.device());
    AMP_CHECK(
        dtype_index(t.scalar_type()) >= 0,
        "amp_patch::", op, ": ", name, "[", i, "] has dtype ", t.scalar_type(),
        "; the CUDA kernel takes float32, float16, bfloat16 and float64");
  }
}

inline void check_pairs(const char* op, at::TensorList a, at::TensorList b) {
  AMP_CHECK(
      a.size() == b.size(), "amp_patch::", op, ": list lengths differ (", a.size(), " vs ",
      b.size(), ")");
  for (size_t i = 0; i < a.size(); ++i) {
    AMP_CHECK(
        a[i].sizes() == b[i].sizes(), "amp_patch::", op, ": tensor ", i, " has shape ",
        a[i].sizes(), " in the first list but ", b[i].sizes(), " in the second");
  }
}

// The one-element flag and scale tensors that the kernels read and write on
// the device, never through the host.
inline void check_found_inf(const char* op, const at::Tensor& found_inf) {
  AMP_CHECK(
      found_inf.is_cuda(), "amp_patch::", op, ": found_inf must be a CUDA tensor, got ",
      found_inf.device());
  AMP_CHECK(
      found_inf.numel() == 1 && found_inf.scalar_type() == at::kFloat, "amp_patch::", op,
      ": found_inf must be a one-element float32 tensor, got ", found_inf.scalar_type(),
      " with ", found_inf.numel(), " elements");
}

inline void check_inv_scale(
    const char* op,
    const at::Tensor& inv_scale,
    const at::Device& device,
    const char* device_source = "found_inf") {
  AMP_CHECK(
      inv_scale.device() == device, "amp_patch::", op, ": inv_scale is on ", inv_scale.device(),
      " but ", device_source, " is on ", device);
  AMP_CHECK(
      inv_scale.numel() == 1 && inv_scale.scalar_type() == at::kFloat, "amp_patch::", op,
      ": inv_scale must be a one-element float32 tensor, got ", inv_scale.scalar_type(),
      " with ", inv_scale.numel(), " elements");
}

// Tasks grouped by (input dtype, output dtype), one launch sequence per group.
//
// The kernels walk each tensor as one flat range of numel elements. That is
// right for any non-overlapping dense tensor (contiguous, transposed,
// channels-last), and for a pair when both share the same strides, because
// element k of one range then sits at the same index as element k of the
// other. Anything else is the slow path: a contiguous stand-in is used, and
// an output stand-in is copied back after the launches, on the same stream.
template <int Depth>
class Plan {
 public:
  // Depth 1: `t` is read (and, with `in_place`, written back).
  void add(const at::Tensor& t, bool in_place, int32_t base = 0) {
    static_assert(Depth == 1);
    if (t.numel() == 0) {
      return;
    }
    at::Tensor flat = t;
    if (!t.is_non_overlapping_and_dense()) {
      flat = t.contiguous();
      keep(t, flat, in_place);
    }
    push(flat, flat, {{flat.data_ptr()}, flat.numel(), base});
  }

  // Depth 2: `src` is read, `dst` written (and read first, with `read_dst`).
  void add(const at::Tensor& src, const at::Tensor& dst, bool read_dst) {
    static_assert(Depth == 2);
    if (src.numel() == 0) {
      return;
    }
    at::Tensor s = src;
    at::Tensor d = dst;
    const bool flat = src.is_non_overlapping_and_dense() &&
        dst.is_non_overlapping_and_dense() && src.strides() == dst.strides();
    if (!flat) {
      if (!src.is_contiguous()) {
        s = src.contiguous();
        keep(src, s, false);
      }
      if (!dst.is_contiguous()) {
        d = read_dst ? dst.contiguous() : at::empty(dst.sizes(), dst.options());
        keep(dst, d, true);
      }
    }
    push(s, d, {{s.data_ptr(), d.data_ptr()}, s.numel(), 0});
  }

  // Calls launch(TypeTag<In>, TypeTag<Out>, tasks) for each non-empty group,
  // then copies the output stand-ins back. Depth-1 groups have In == Out.
  template <typename Launch>
  void run(Launch&& launch) {
    for (size_t g = 0; g < groups_.size(); ++g) {
      if (groups_[g].empty()) {
        continue;
      }
      visit_dtype(kDtypes[g / kNumDtypes], [&](auto in) {
        if constexpr (Depth == 1) {
          launch(in, in, groups_[g]);
        } else {
          visit_dtype(kDtypes[g % kNumDtypes], [&](auto out) { launch(in, out, groups_[g]); });
        }
      });
    }
    for (auto& [user, stand_in] : write_back_) {
      user.copy_(stand_in);
    }
  }

 private:
  static constexpr int kNumDtypes = 4;
  // In dtype_index order.
  static constexpr at::ScalarType kDtypes[kNumDtypes] = {
      at::kFloat, at::kHalf, at::kBFloat16, at::kDouble};

  void push(const at::Tensor& in, const at::Tensor& out, Task<Depth> task) {
    groups_[dtype_index(in.scalar_type()) * kNumDtypes + dtype_index(out.scalar_type())]
        .push_back(task);
  }

  // Stand-ins live until run() has launched on them; freeing them afterwards
  // is safe because the caching allocator reuses memory in stream order.
  void keep(const at::Tensor& user, const at::Tensor& stand_in, bool copy_back) {
    if (copy_back) {
      write_back_.emplace_back(user, stand_in);
    } else {
      keep_alive_.push_back(stand_in);
    }
  }

  std::array<std::vector<Task<Depth>>, kNumDtypes * kNumDtypes> groups_;
  std::vector<at::Tensor> keep_alive_;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back_;
};

}  // namespace amp_patch::cuda
