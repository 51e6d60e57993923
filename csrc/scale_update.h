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

// amp's own loss scale (amp_patch/scaler.py, AmpScaler.update_on_device): the
// whole state in seven float64 fields, so that counts stay exact and the scale
// is the host's double. The fields, in order: scale, clean updates, skipped
// updates, consecutive skips, this update's overflow, overflows not read by the
// host yet, collapse. The reference body (amp_patch/ops/scaling_ops.py) spells
// out the same rules with tensor ops.
constexpr int64_t kLossScaleFields = 7;

struct LossScaleConfig {
  double scale_window;
  double floor;
  bool floor_is_min;  // the floor is the user's min_loss_scale: it may be reached
  double max_scale;
  bool dynamic;
  double max_consecutive;
};

// An overflow (found_inf != 0, NaN included) halves a dynamic scale, floored,
// unless that would pass the floor (a collapse: the scale then holds), and
// restarts the clean count; scale_window clean updates double it, capped. A
// static scale holds, and more than max_consecutive overflows in a row are a
// collapse. Then inv_scale = 1 / scale (divided in double, rounded once) and
// the fp32 scale are written, the overflow goes to `overflow`, and found_inf
// is cleared for the next iteration.
C10_HOST_DEVICE inline void loss_scale_update_step(double* state, float* inv_scale, float* scale,
                                                   float* found_inf, float* overflow,
                                                   const LossScaleConfig& c) {
  const bool hit = *found_inf != 0.0f;
  double s = state[0];
  double clean = hit ? 0.0 : state[1] + 1.0;
  const double consecutive = hit ? state[3] + 1.0 : 0.0;
  bool collapse = false;
  if (c.dynamic) {
    if (hit) {
      const double halved = s * 0.5;
      collapse = halved < c.floor && (!c.floor_is_min || s <= c.floor);
      if (!collapse) {
        s = halved < c.floor ? c.floor : halved;
      }
    } else if (clean >= c.scale_window) {
      const double grown = s * 2.0;
      s = grown > c.max_scale ? c.max_scale : grown;
      clean = 0.0;
    }
  } else {
    collapse = hit && consecutive > c.max_consecutive;
  }
  const double h = hit ? 1.0 : 0.0;
  state[0] = s;
  state[1] = clean;
  state[2] += h;
  state[3] = consecutive;
  state[4] = h;
  state[5] += h;
  if (collapse) {
    state[6] = 1.0;
  }
  *inv_scale = static_cast<float>(1.0 / s);
  *scale = static_cast<float>(s);
  *overflow = static_cast<float>(h);
  *found_inf = 0.0f;
}

struct LossScalePointers {
  double* state;
  float* inv_scale;
  float* scale;
  float* found_inf;
  float* overflow;
};

// The tensors, checked: the float64 state of kLossScaleFields elements and four
// one-element float32 tensors (the scale may be 0-dim), all on one device.
inline LossScalePointers loss_scale_pointers(const char* op, const at::Tensor& state,
                                             const at::Tensor& inv_scale, const at::Tensor& scale,
                                             const at::Tensor& found_inf,
                                             const at::Tensor& overflow) {
  AMP_CHECK(state.scalar_type() == at::kDouble && state.numel() == kLossScaleFields &&
                state.is_contiguous(),
            "amp_patch::", op, ": state must be a contiguous float64 tensor of ",
            kLossScaleFields, " elements, got ", state.scalar_type(), " with ", state.numel());
  const struct {
    const char* name;
    const at::Tensor& t;
  } args[] = {{"inv_scale", inv_scale}, {"scale", scale}, {"found_inf", found_inf},
              {"overflow", overflow}};
  for (const auto& a : args) {
    AMP_CHECK(a.t.scalar_type() == at::kFloat && a.t.numel() == 1, "amp_patch::", op, ": ",
              a.name, " must be a one-element float32 tensor, got ", a.t.scalar_type(), " with ",
              a.t.numel(), " elements");
    AMP_CHECK(a.t.device() == state.device(), "amp_patch::", op, ": ", a.name, " is on ",
              a.t.device(), " but state is on ", state.device());
  }
  return {state.mutable_data_ptr<double>(), inv_scale.mutable_data_ptr<float>(),
          scale.mutable_data_ptr<float>(), found_inf.mutable_data_ptr<float>(),
          overflow.mutable_data_ptr<float>()};
}

C10_HOST_DEVICE inline void loss_scale_update_step(const LossScalePointers& p,
                                                   const LossScaleConfig& c) {
  loss_scale_update_step(p.state, p.inv_scale, p.scale, p.found_inf, p.overflow, c);
}

}  // namespace amp_patch
