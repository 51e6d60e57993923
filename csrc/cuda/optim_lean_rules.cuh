// The update rules of the lean kernels (optim_lean_kernels.cuh): Adam, SGD and
// LAMB's stage 2 as csrc/optim_math.h writes them, on RnFloat (the reference's
// fp32 arithmetic, one rounding per operation), over a state element's
// decoded values, with what each rule reads and writes and how its
// hyper-parameters are prepared per launch and per tensor.
// Included by optim_lean.cu alone, whose translation unit it is part of: its
// names stay in that unit's anonymous namespace.
#pragma once

#include "optim_lean_launch.cuh"
#include "optim_lists.cuh"

namespace amp_patch::cuda {
namespace {

using optim::RnFloat;

// A rule's hyper-parameters as its launch uses them (prepare: the loss scale
// read on the device) and as one tensor's blocks use them (for_tensor).
template <typename H>
struct PlainLeanHyper {
  using Hyper = H;
  __device__ static H prepare(H h, const OptimCommon& common) {
    h.inv_scale = common.scale();
    return h;
  }
  __device__ static const H& for_tensor(const H& h, const LeanTensor&) { return h; }
};

// Adam (optim_math.h's adam_lean_update): state 0 exp_avg, state 1 exp_avg_sq.
struct AdamLeanRule : PlainLeanHyper<optim::AdamHyper> {
  static constexpr int kStates = 2;
  // The param is updated after the block maximum, from the moments (see lean_block).
  static constexpr bool kSplit = true;
  __device__ static bool reads_state(const Hyper&) { return true; }
  __device__ static bool writes_state(const Hyper&) { return true; }
  // Whether the moments use the param (L2 decay added to the grad).
  __device__ static bool moments_read_param(const Hyper& h) {
    return !h.adam_w_mode && h.weight_decay != 0.0f;
  }
  __device__ static void moments(float g, float p, float (&s)[kStates], const Hyper& h) {
    RnFloat m = s[0], v = s[1];
    optim::adam_update_moments<RnFloat>(g, p, m, v, h);
    s[0] = m.v;
    s[1] = v.v;
  }
  // r: the new second moment's square root.
  __device__ static void param(float& p, float m, float r, const Hyper& h) {
    RnFloat pp = p;
    optim::adam_lean_param_from_root<RnFloat>(pp, m, r, h);
    p = pp.v;
  }
};

// SGD: state 0 the momentum buffer (absent without momentum; not read on the first run).
struct SgdLeanRule : PlainLeanHyper<optim::SgdHyper> {
  static constexpr int kStates = 1;
  static constexpr bool kSplit = false;  // one step per element: the param with the buffer
  __device__ static bool moments_read_param(const Hyper&) { return true; }
  __device__ static bool reads_state(const Hyper& h) { return h.momentum != 0.0f && !h.first_run; }
  __device__ static bool writes_state(const Hyper& h) { return h.momentum != 0.0f; }
  __device__ static void step(float g, float& p, float (&s)[kStates], const Hyper& h) {
    RnFloat pp = p, mom = s[0];
    optim::sgd_update<RnFloat>(g, pp, h.momentum != 0.0f ? &mom : nullptr, h);
    p = pp.v;
    s[0] = mom.v;
  }
};

// What LAMB's lean stages take: the rule, the clipping inputs (the divisor is
// computed on the device, as the fp32 stage 1 computes it), whether the trust
// ratio applies (stage 1 then sums p^2), stage 2's trust ratios and the
// tensor's step size (for_tensor's), and stage 1's block sums (per launch).
struct LambLeanHyper {
  optim::LambHyper lamb;
  const float* global_grad_norm;
  float max_grad_norm;
  bool use_ratio;
  TrustRatio ratio;
  float step_size;
  float* sums;  // stage 1: sums[2 b], sums[2 b + 1] for block b of the launch
};

// LAMB's stage 2 (optim_math.h's lamb_new_moments, the same moments as stage
// 1's, then lamb_apply with the tensor's step size): state 0 exp_avg, state 1
// exp_avg_sq.
struct LambLeanRule {
  using Hyper = LambLeanHyper;
  static constexpr int kStates = 2;
  static constexpr bool kSplit = false;
  __device__ static Hyper prepare(Hyper h, const OptimCommon& common) {
    h.lamb.inv_scale = common.scale();
    h.lamb.clip = clip_divisor(*h.global_grad_norm, h.lamb.inv_scale, h.max_grad_norm);
    return h;
  }
  __device__ static Hyper for_tensor(Hyper h, const LeanTensor& t) {
    h.step_size = h.ratio(t.index);
    return h;
  }
  __device__ static bool moments_read_param(const Hyper&) { return true; }
  __device__ static bool reads_state(const Hyper&) { return true; }
  __device__ static bool writes_state(const Hyper&) { return true; }
  __device__ static void step(float g, float& p, float (&s)[kStates], const Hyper& h) {
    RnFloat pp = p, m = s[0], v = s[1];
    optim::lamb_new_moments<RnFloat>(g, pp, m, v, h.lamb);
    optim::lamb_apply<RnFloat>(pp, m, v, RnFloat(h.step_size), h.lamb);
    p = pp.v;
    s[0] = m.v;
    s[1] = v.v;
  }
};

}  // namespace
}  // namespace amp_patch::cuda
