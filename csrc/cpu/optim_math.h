// The per-element update rules of the fused optimizers, written once for the
// CPU loops (csrc/cpu/optim_loops.h, T = at::vec::Vectorized<float>) and the
// CUDA kernels (csrc/cuda/optim_*.cu, T = RnFloat, whose operators are the
// round-to-nearest intrinsics that nvcc never contracts into an FMA).
//
// Every operation is one IEEE fp32 operation rounded on its own, in the order
// written, which is also the order of the reference bodies in amp_patch/ops/optimizer_ops.py:
// the compiled kernels are bit-identical to them. That is why the CPU build
// uses -ffp-contract=off and why T must provide a correctly rounded sqrt_rn.
// The formulas follow Apex's kernels (csrc/multi_tensor_{adam,sgd_kernel,
// adagrad,novograd,lamb}.cu); where Apex adds `decay * p` with decay == 0,
// these skip the term (it would turn an inf parameter into NaN).
//
// T needs a free function sqrt_rn(T), declared before this header (found by
// ordinary lookup) or in T's namespace (found by argument-dependent lookup).
//
// The hyper-parameter structs hold values already rounded to fp32 on the host;
// they are plain data so that a CUDA op can carry them in its kernel arguments.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define AMP_OPTIM_FN __device__ __forceinline__
#else
#define AMP_OPTIM_FN inline
#endif

namespace amp_patch::optim {

// Host side: 1 - beta^step in float64, as Apex's host code computes its bias
// corrections (and the reference ops do).
inline double one_minus_power(float beta, int64_t step) {
  return 1.0 - std::pow(static_cast<double>(beta), static_cast<double>(step));
}

// Adam's bias correction, rounded once to fp32 (1 when disabled).
inline float bias_correction(float beta, int64_t step, bool enabled) {
  return enabled ? static_cast<float>(one_minus_power(beta, step)) : 1.0f;
}

// NovoGrad's second moment is a norm, not a square: its correction is the square root.
inline float norm_bias_correction(float beta, int64_t step, bool enabled) {
  return enabled ? static_cast<float>(std::sqrt(one_minus_power(beta, step))) : 1.0f;
}

struct AdamHyper {
  float inv_scale;
  float lr;
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float weight_decay;
  float bias_correction1;
  float bias_correction2;
  bool adam_w_mode;
};

struct SgdHyper {
  float inv_scale;
  float lr;
  float weight_decay;
  float momentum;
  float one_minus_dampening;
  bool nesterov;
  bool first_run;
  bool wd_after_momentum;
};

struct AdagradHyper {
  float inv_scale;
  float lr;
  float eps;
  float weight_decay;
  bool adagrad_w_mode;
};

struct NovoGradHyper {
  float inv_scale;
  float lr;
  float beta1;
  float beta3;  // 1 - beta1 with grad averaging, else 1
  float weight_decay;
  float bias_correction1;
  bool reg_inside_moment;
};

// LAMB's moments and direction are Adam's, with beta3 (1 - beta1 with grad
// averaging, else 1) in one_minus_beta1 and lr unused; the grad is divided by
// the global-norm clipping divisor first.
struct LambHyper : AdamHyper {
  float clip;  // >= 1
};

// The host-side constructors, shared by the CPU and CUDA ops: each rounds the
// op's float64 arguments to fp32 once. inv_scale starts at 1 and the LAMB
// clipping divisor at 1; the ops fill them in.
inline float f32(double x) {
  return static_cast<float>(x);
}

inline AdamHyper adam_hyper(double lr, double beta1, double beta2, double eps, double weight_decay,
                            int64_t step, bool adam_w_mode, bool bias_correction_on) {
  const float b1 = f32(beta1), b2 = f32(beta2);
  return {1.0f, f32(lr), b1, b2, 1.0f - b1, 1.0f - b2, f32(eps), f32(weight_decay),
          bias_correction(b1, step, bias_correction_on),
          bias_correction(b2, step, bias_correction_on), adam_w_mode};
}

inline SgdHyper sgd_hyper(double lr, double weight_decay, double momentum, double dampening,
                          bool nesterov, bool first_run, bool wd_after_momentum) {
  return {1.0f, f32(lr), f32(weight_decay), f32(momentum), 1.0f - f32(dampening),
          nesterov, first_run, wd_after_momentum};
}

inline AdagradHyper adagrad_hyper(double lr, double eps, double weight_decay, bool adagrad_w_mode) {
  return {1.0f, f32(lr), f32(eps), f32(weight_decay), adagrad_w_mode};
}

inline NovoGradHyper novograd_hyper(double lr, double beta1, double weight_decay, int64_t step,
                                    bool bias_correction_on, bool grad_averaging,
                                    bool reg_inside_moment) {
  const float b1 = f32(beta1);
  return {1.0f, f32(lr), b1, grad_averaging ? 1.0f - b1 : 1.0f, f32(weight_decay),
          bias_correction(b1, step, bias_correction_on), reg_inside_moment};
}

inline LambHyper lamb_hyper(double beta1, double beta2, double eps, double weight_decay,
                            int64_t step, bool bias_correction_on, bool grad_averaging,
                            bool adam_w_mode) {
  LambHyper h{adam_hyper(0.0, beta1, beta2, eps, weight_decay, step, adam_w_mode,
                         bias_correction_on),
              1.0f};
  if (!grad_averaging) {
    h.one_minus_beta1 = 1.0f;
  }
  return h;
}

// Adam's update direction from the moments, with AdamW's decay term.
template <typename T>
AMP_OPTIM_FN T adam_direction(const T& m, const T& v, const T& p, const AdamHyper& h) {
  T u = (m / T(h.bias_correction1)) / (sqrt_rn(v / T(h.bias_correction2)) + T(h.eps));
  if (h.adam_w_mode && h.weight_decay != 0.0f) {
    u = u + T(h.weight_decay) * p;
  }
  return u;
}

// Adam's moments from an unscaled grad (plus L2 decay when not in AdamW mode).
template <typename T>
AMP_OPTIM_FN void adam_new_moments(T g, const T& p, T& m, T& v, const AdamHyper& h) {
  if (!h.adam_w_mode && h.weight_decay != 0.0f) {
    g = g + T(h.weight_decay) * p;
  }
  m = T(h.beta1) * m + T(h.one_minus_beta1) * g;
  v = T(h.beta2) * v + T(h.one_minus_beta2) * g * g;
}

// Adam's moments as adam_new_moments; returns the update direction.
template <typename T>
AMP_OPTIM_FN T adam_moments(T g, const T& p, T& m, T& v, const AdamHyper& h) {
  adam_new_moments(g, p, m, v, h);
  return adam_direction(m, v, p, h);
}

// Adam / AdamW in two halves, so that a loop can store the moments before the
// long division and square-root chain of the second: the moments from the
// scaled grad, then the param from the moments.
template <typename T>
AMP_OPTIM_FN void adam_update_moments(const T& g, const T& p, T& m, T& v, const AdamHyper& h) {
  adam_new_moments(g * T(h.inv_scale), p, m, v, h);
}

template <typename T>
AMP_OPTIM_FN void adam_update_param(T& p, const T& m, const T& v, const AdamHyper& h) {
  p = p - T(h.lr) * adam_direction(m, v, p, h);
}

// Adam / AdamW. adam_w_mode: decoupled weight decay; else L2 added to the grad.
template <typename T>
AMP_OPTIM_FN void adam_update(T g, T& p, T& m, T& v, const AdamHyper& h) {
  adam_update_moments(g, p, m, v, h);
  adam_update_param(p, m, v, h);
}

// SGD with Apex's momentum rule (v = momentum * v + (1 - dampening) * g, the
// first step taking v = g), optional Nesterov, and weight decay before or after
// the momentum. `mom` is null when momentum is 0.
template <typename T>
AMP_OPTIM_FN void sgd_update(T g, T& p, T* mom, const SgdHyper& h) {
  g = g * T(h.inv_scale);
  if (h.weight_decay != 0.0f && !h.wd_after_momentum) {
    g = g + T(h.weight_decay) * p;
  }
  if (h.momentum != 0.0f) {
    if (h.first_run) {
      *mom = g;
    } else {
      *mom = T(h.momentum) * *mom + T(h.one_minus_dampening) * g;
    }
    g = h.nesterov ? g + T(h.momentum) * *mom : *mom;
  }
  if (h.weight_decay != 0.0f && h.wd_after_momentum) {
    g = g + T(h.weight_decay) * p;
  }
  p = p - T(h.lr) * g;
}

// Adagrad. adagrad_w_mode: decoupled weight decay; else L2 added to the grad.
template <typename T>
AMP_OPTIM_FN void adagrad_update(T g, T& p, T& sum, const AdagradHyper& h) {
  g = g * T(h.inv_scale);
  if (!h.adagrad_w_mode && h.weight_decay != 0.0f) {
    g = g + T(h.weight_decay) * p;
  }
  sum = sum + g * g;
  T update = g / (sqrt_rn(sum) + T(h.eps));
  if (h.adagrad_w_mode && h.weight_decay != 0.0f) {
    update = update + T(h.weight_decay) * p;
  }
  p = p - T(h.lr) * update;
}

// NovoGrad's element step. `denom` is the tensor's blended grad norm over its
// bias correction, plus eps: one value per tensor.
template <typename T>
AMP_OPTIM_FN void novograd_update(T g, T& p, T& m, T denom, const NovoGradHyper& h) {
  g = g * T(h.inv_scale);
  if (h.reg_inside_moment) {
    g = g / denom;
    if (h.weight_decay != 0.0f) {
      g = g + T(h.weight_decay) * p;
    }
    m = T(h.beta1) * m + T(h.beta3) * g;
    p = p - T(h.lr) * (m / T(h.bias_correction1));
    return;
  }
  m = T(h.beta1) * m + T(h.beta3) * g;
  T update = (m / T(h.bias_correction1)) / denom;
  if (h.weight_decay != 0.0f) {
    update = update + T(h.weight_decay) * p;
  }
  p = p - T(h.lr) * update;
}

// LAMB stage 1: the moments, from the grad unscaled and divided by the clipping
// divisor. Returns the update direction (for its norm); stage 2 recomputes it
// from the stored moments, so no update buffer is needed.
template <typename T>
AMP_OPTIM_FN T lamb_moments(T g, const T& p, T& m, T& v, const LambHyper& h) {
  return adam_moments((g * T(h.inv_scale)) / T(h.clip), p, m, v, h);
}

// LAMB stage 2: the step along the direction, scaled by the tensor's trust ratio.
template <typename T>
AMP_OPTIM_FN void lamb_apply(T& p, const T& m, const T& v, T ratio, const LambHyper& h) {
  p = p - ratio * adam_direction(m, v, p, h);
}

}  // namespace amp_patch::optim
