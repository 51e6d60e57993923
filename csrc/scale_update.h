// The loss-scale update of amp_C.update_scale_hysteresis (Apex's dynamic scale
// with hysteresis), shared by the CPU and CUDA kernels so both run the very
// same step: the CPU calls it on host pointers, a one-thread CUDA kernel on
// device pointers. The reference body in amp_patch/ops.py spells out the same
// rules with tensor ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace amp_patch {

// A found inf first uses up the hysteresis: while some is left, the scale
// holds and only the growth count restarts. Once it is used up, each inf
// multiplies the scale by backoff_factor. growth_interval clean steps in a row
// multiply it by growth_factor (unless that overflows fp32), and any clean
// step restores the hysteresis. The products are taken in double and rounded
// once to fp32, and found_inf is compared as Apex's kernel did (> 0, != 0 and
// <= 0), so even a NaN or negative flag takes the same branches.
C10_HOST_DEVICE inline void update_scale_hysteresis_step(
    float* scale,
    int32_t* growth_tracker,
    int32_t* hysteresis_tracker,
    const float* found_inf,
    double growth_factor,
    double backoff_factor,
    int64_t growth_interval,
    int64_t hysteresis) {
  const float found = *found_inf;
  if (found > 0.0f) {
    *hysteresis_tracker -= 1;
    if (*hysteresis_tracker > 0) {
      *growth_tracker = 0;
      return;
    }
  }
  if (found != 0.0f) {
    *scale = static_cast<float>(static_cast<double>(*scale) * backoff_factor);
    *growth_tracker = 0;
  } else {
    const int32_t successful = *growth_tracker + 1;
    if (successful == growth_interval) {
      const float grown = static_cast<float>(static_cast<double>(*scale) * growth_factor);
      // x - x is 0 exactly when x is finite (the build has no fast-math).
      if (grown - grown == 0.0f) {
        *scale = grown;
      }
      *growth_tracker = 0;
    } else {
      *growth_tracker = successful;
    }
  }
  if (found <= 0.0f) {
    *hysteresis_tracker = static_cast<int32_t>(hysteresis);
  }
}

// The state tensors: one float32 scale, two int32 trackers and a float32
// found_inf, each of one element, all on the scale's device.
inline void check_scale_state(
    const char* op,
    const at::Tensor& current_scale,
    const at::Tensor& growth_tracker,
    const at::Tensor& hysteresis_tracker,
    const at::Tensor& found_inf) {
  const struct {
    const char* name;
    const at::Tensor& t;
    at::ScalarType dtype;
  } args[] = {
      {"current_scale", current_scale, at::kFloat},
      {"growth_tracker", growth_tracker, at::kInt},
      {"hysteresis_tracker", hysteresis_tracker, at::kInt},
      {"found_inf", found_inf, at::kFloat},
  };
  for (const auto& a : args) {
    TORCH_CHECK(a.t.scalar_type() == a.dtype && a.t.numel() == 1, "amp_patch::", op, ": ",
                a.name, " must be a one-element ", a.dtype, " tensor, got ", a.t.scalar_type(),
                " with ", a.t.numel(), " elements");
    TORCH_CHECK(a.t.device() == current_scale.device(), "amp_patch::", op, ": ", a.name,
                " is on ", a.t.device(), " but current_scale is on ", current_scale.device());
  }
}

}  // namespace amp_patch
