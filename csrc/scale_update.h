// The loss-scale update of amp_C.update_scale_hysteresis (Apex's dynamic scale
// with hysteresis), shared by the CPU and CUDA kernels so both run the very
// same step: the CPU calls it on host pointers, a one-thread CUDA kernel on
// device pointers. The reference body in amp_patch/ops/scaling_ops.py spells out the same
// rules with tensor ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <cstdint>

#include "check.h"

namespace amp_patch {

// Where the step reads and writes: device pointers for the CUDA kernel, host
// pointers for the CPU one.
struct ScaleState {
  float* scale;
  int32_t* growth_tracker;
  int32_t* hysteresis_tracker;
  const float* found_inf;
};

struct HysteresisConfig {
  double growth_factor;
  double backoff_factor;
  int64_t growth_interval;
  int64_t hysteresis;
};

// A found inf first uses up the hysteresis: while some is left, the scale
// holds and only the growth count restarts. Once it is used up, each inf
// multiplies the scale by backoff_factor. growth_interval clean steps in a row
// multiply it by growth_factor (unless that overflows fp32), and any clean
// step restores the hysteresis. The products are taken in double and rounded
// once to fp32, and found_inf is compared as Apex's kernel did (> 0, != 0 and
// <= 0), so even a NaN or negative flag takes the same branches.
C10_HOST_DEVICE inline void update_scale_hysteresis_step(
    const ScaleState& s,
    const HysteresisConfig& c) {
  const float found = *s.found_inf;
  if (found > 0.0f) {
    *s.hysteresis_tracker -= 1;
    if (*s.hysteresis_tracker > 0) {
      *s.growth_tracker = 0;
      return;
    }
  }
  if (found != 0.0f) {
    *s.scale = static_cast<float>(static_cast<double>(*s.scale) * c.backoff_factor);
    *s.growth_tracker = 0;
  } else {
    const int32_t successful = *s.growth_tracker + 1;
    if (successful == c.growth_interval) {
      const float grown = static_cast<float>(static_cast<double>(*s.scale) * c.growth_factor);
      // x - x is 0 exactly when x is finite (the build has no fast-math).
      if (grown - grown == 0.0f) {
        *s.scale = grown;
      }
      *s.growth_tracker = 0;
    } else {
      *s.growth_tracker = successful;
    }
  }
  if (found <= 0.0f) {
    *s.hysteresis_tracker = static_cast<int32_t>(c.hysteresis);
  }
}

// The state tensors, checked: one float32 scale, two int32 trackers and a
// float32 found_inf, each of one element, all on the scale's device.
inline ScaleState scale_state(
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
    AMP_CHECK(a.t.scalar_type() == a.dtype && a.t.numel() == 1, "amp_patch::", op, ": ",
                a.name, " must be a one-element ", a.dtype, " tensor, got ", a.t.scalar_type(),
                " with ", a.t.numel(), " elements");
    AMP_CHECK(a.t.device() == current_scale.device(), "amp_patch::", op, ": ", a.name,
                " is on ", a.t.device(), " but current_scale is on ", current_scale.device());
  }
  return {current_scale.mutable_data_ptr<float>(), growth_tracker.mutable_data_ptr<int32_t>(),
          hysteresis_tracker.mutable_data_ptr<int32_t>(), found_inf.const_data_ptr<float>()};
}

}  // namespace amp_patch
