// The per-element update rules of the fused optimizers, written once for the
// CPU loops (csrc/cpu/optim_rule_loops.h and optim_lean_loops.h, T =
// at::vec::Vectorized<float>) and the CUDA kernels (csrc/cuda/optim_*.cu and
// optim_lean_rules.cuh, T = RnFloat, whose operators are the round-to-nearest
// intrinsics that nvcc never contracts into an FMA).
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
#define AMP_OPTIM_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
// Always inlined into the loops: left to the heuristics, a rule used by several
// loops of one ISA became an out-of-line call in some (the fp32 Adam step took 2x).
#define AMP_OPTIM_FN inline __attribute__((always_inline))
#define AMP_OPTIM_HD inline
#else
#define AMP_OPTIM_FN inline
#define AMP_OPTIM_HD inline
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

// 1 / (1 - beta^step) and 1 / sqrt(1 - beta^step) in float64, rounded once (1 when disabled).
inline float inv_bias_correction(float beta, int64_t step, bool enabled) {
  return enabled ? static_cast<float>(1.0 / one_minus_power(beta, step)) : 1.0f;
}

// lr * (1 / (1 - beta^step)): the fp32 product of lr and inv_bias_correction.
inline float lean_step_size(float lr, float beta, int64_t step, bool enabled) {
  return static_cast<float>(static_cast<double>(lr) *
                            static_cast<double>(inv_bias_correction(beta, step, enabled)));
}

inline float inv_sqrt_bias_correction(float beta, int64_t step, bool enabled) {
  return enabled ? static_cast<float>(1.0 / std::sqrt(one_minus_power(beta, step))) : 1.0f;
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
  // The lean ops' constants (adam_lean_param), each rounded to fp32 once:
  // lr * (1 / bc1) (the product of the two fp32 values; 1 / bc1 computed in
  // float64 and rounded), 1 / sqrt(bc2) (float64), and AdamW's decay factor
  // 1 - lr * weight_decay (float64, of the fp32 lr and weight decay).
  float lean_step_size;
  float inv_sqrt_bias_correction2;
  float lean_decay;
  bool adam_w_mode;
  // CPU only (CUDA ignores it; it sits in the struct's padding): divide by the
  // bias corrections with a float64 multiply, to the same bits
  // (csrc/cpu/optim_rule_loops.h's FixedDivisor). The CPU op sets it when its
  // lists fit in the last-level cache; streaming from memory, the division,
  // whose latency the loads hide, costs less.
  bool multiply_divisions = false;
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
          bias_correction(b2, step, bias_correction_on),
          lean_step_size(f32(lr), b1, step, bias_correction_on),
          inv_sqrt_bias_correction(b2, step, bias_correction_on),
          f32(1.0 - static_cast<double>(f32(lr)) * static_cast<double>(f32(weight_decay))),
          adam_w_mode};
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

// ---------------------------------------------------------------- lean state
// The ops over low-precision state and bf16 params (multi_tensor_adam_lean_,
// multi_tensor_sgd_lean_; reference bodies and the rules in
// amp_patch/ops/lean_state_ops.py). Their arithmetic on the decoded fp32 values
// is the rules above, unchanged; what they add is how each state tensor is
// stored (its code) and how a bf16 param is rounded (stochastically).

// A state tensor's code, from its dtype.
enum class StateCode : uint8_t {
  kF32 = 0,   // float32: the value
  kBF16 = 1,  // bfloat16: the value rounded to nearest even
  kInt8 = 2,  // int8: rne(x * (127 / s)) in [-127, 127], s the block's largest |x|
  kSqrtU8 = 3,  // uint8: rne(sqrt(x) * (255 / s)) in [1, 255], s the block's largest sqrt(x)
  kE4M3 = 4,  // float8_e4m3fn: e4m3(x * (448 / s)), round to nearest even
};
constexpr int kNumStateCodes = 5;

// Whether a code keeps one fp32 scale per block.
AMP_OPTIM_HD constexpr bool block_scaled(StateCode c) {
  return c == StateCode::kInt8 || c == StateCode::kSqrtU8 || c == StateCode::kE4M3;
}

// The largest code of a block-scaled code, as its fp32 constant: a block's
// encode factor is code_max / s and its decode factor s / code_max, each one
// fp32 division per block. A block whose encode factor is not finite (s is 0,
// inf or NaN, or so small that the division overflows) stores codes 0 and keeps s.
AMP_OPTIM_HD constexpr float code_max(StateCode c) {
  return c == StateCode::kInt8 ? 127.0f : (c == StateCode::kSqrtU8 ? 255.0f : 448.0f);
}

// The constants of the rounding hash: the golden ratio and murmur3's finaliser.
constexpr uint32_t kHashK0 = 0x9E3779B9u;
constexpr uint32_t kHashK1 = 0x85EBCA6Bu;
constexpr uint32_t kHashK2 = 0xC2B2AE35u;
// The element-index bit that tells the two elements of one hash apart (rounding_bits).
constexpr uint32_t kPairBit = 16u;

// The helpers below are host and device functions (AMP_OPTIM_HD): the CUDA
// ops' host code checks the codes too.

// What the lean ops add to the hyper-parameters of their rule. The tensor key
// of tensor i of the call is key_base + i * kHashK2 (mod 2^32), where key_base
// is seed * kHashK0 + step * kHashK1 (mod 2^32).
struct LeanHyper {
  int64_t block_size;
  uint32_t key_base;
};

inline LeanHyper lean_hyper(int64_t block_size, int64_t seed, int64_t step) {
  // Two's complement wrap-around: Python's `& 0xFFFFFFFF` of the same sums.
  const uint32_t base = static_cast<uint32_t>(static_cast<uint64_t>(seed)) * kHashK0 +
                        static_cast<uint32_t>(static_cast<uint64_t>(step)) * kHashK1;
  return {block_size, base};
}

AMP_OPTIM_HD uint32_t lean_tensor_key(const LeanHyper& h, int64_t index) {
  return h.key_base + static_cast<uint32_t>(static_cast<uint64_t>(index)) * kHashK2;
}

// murmur3's 32-bit finaliser.
AMP_OPTIM_HD uint32_t fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= kHashK1;
  x ^= x >> 13;
  x *= kHashK2;
  return x ^ (x >> 16);
}

// The 16 random bits of element e (row-major index within its tensor, mod
// 2^32) of the tensor with key `key`: random_bits() of lean_state_ops.py.
// Elements e and e ^ 16 share one hash, of e with bit 4 cleared: the element
// with bit 4 clear takes its high half, the other its low half, so that a
// vector loop hashes once for 32 aligned elements.
AMP_OPTIM_HD uint32_t rounding_bits(uint32_t key, int64_t e) {
  const uint32_t e32 = static_cast<uint32_t>(static_cast<uint64_t>(e));
  const uint32_t h = fmix32(key ^ ((e32 & ~kPairBit) * kHashK0));
  return (e32 & kPairBit) != 0 ? (h & 0xFFFFu) : (h >> 16);
}

// Whether the fp32 bit pattern u is finite.
AMP_OPTIM_HD bool finite_bits(uint32_t u) {
  return (u & 0x7F800000u) != 0x7F800000u;
}

// A finite fp32 value (bit pattern u) stochastically rounded to bf16 with the
// 16 bits r: added to the low half, then cut. A non-finite value is rounded
// to nearest instead (the backend's ordinary fp32 -> bf16 conversion).
AMP_OPTIM_HD uint16_t stochastic_bf16_bits(uint32_t u, uint32_t r) {
  return static_cast<uint16_t>((u + r) >> 16);
}

// Adam's update direction from the moments, with AdamW's decay term. A bias
// correction of exactly 1.0f (bias_correction=False, or a late step: 1 - 0.9^t
// rounds to 1.0f from t = 165, 1 - 0.999^t from t = 16,600) divides nothing
// away: x / 1 is x in IEEE arithmetic (no flush-to-zero here), so its division,
// the dearest operation of the rule, is skipped without changing a bit.
template <typename T>
AMP_OPTIM_FN T bias_corrected(const T& x, float correction) {
  return correction == 1.0f ? x : x / T(correction);
}

// The direction from the bias-corrected moments m / bc1 and v / bc2 (which
// the CPU's Adam loops divide in a way of their own, to the same bits: see
// csrc/cpu/optim_rule_loops.h's FixedDivisor).
template <typename T>
AMP_OPTIM_FN T adam_direction_corrected(const T& m_hat, const T& v_hat, const T& p,
                                        const AdamHyper& h) {
  T u = m_hat / (sqrt_rn(v_hat) + T(h.eps));
  if (h.adam_w_mode && h.weight_decay != 0.0f) {
    u = u + T(h.weight_decay) * p;
  }
  return u;
}

template <typename T>
AMP_OPTIM_FN T adam_direction(const T& m, const T& v, const T& p, const AdamHyper& h) {
  return adam_direction_corrected(bias_corrected(m, h.bias_correction1),
                                  bias_corrected(v, h.bias_correction2), p, h);
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

// Adam / AdamW in two halves, so that a loop can store the moments before the
// long division and square-root chain of the second: the moments from the
// scaled grad, then the param from the moments.
template <typename T>
AMP_OPTIM_FN void adam_update_moments(const T& g, const T& p, T& m, T& v, const AdamHyper& h) {
  adam_new_moments(h.inv_scale == 1.0f ? g : g * T(h.inv_scale), p, m, v, h);  // g * 1 is g
}

template <typename T>
AMP_OPTIM_FN void adam_update_param_corrected(T& p, const T& m_hat, const T& v_hat,
                                              const AdamHyper& h) {
  p = p - T(h.lr) * adam_direction_corrected(m_hat, v_hat, p, h);
}

template <typename T>
AMP_OPTIM_FN void adam_update_param(T& p, const T& m, const T& v, const AdamHyper& h) {
  adam_update_param_corrected(p, bias_corrected(m, h.bias_correction1),
                              bias_corrected(v, h.bias_correction2), h);
}

// Adam / AdamW. adam_w_mode: decoupled weight decay; else L2 added to the grad.
template <typename T>
AMP_OPTIM_FN void adam_update(T g, T& p, T& m, T& v, const AdamHyper& h) {
  adam_update_moments(g, p, m, v, h);
  adam_update_param(p, m, v, h);
}

// The lean ops' Adam (multi_tensor_adam_lean_): Apex's moments, then the step
// (m * (lr / bc1)) / (sqrt(v) * (1 / sqrt(bc2)) + eps), subtracted from the
// param, which AdamW first multiplies by 1 - lr * weight_decay (as torch's
// AdamW does), with the constants rounded on the host. The same AdamW as
// adam_update's p - lr * ((m / bc1) / (sqrt(v / bc2) + eps) + wd * p) up to
// rounding, in one division, one square root and five or six other operations
// per element instead of three, one and eight; the root is also the value the
// square-root code stores. adam_lean_param takes the new moments and returns
// sqrt(v).
template <typename T>
AMP_OPTIM_FN void adam_lean_param_from_root(T& p, const T& m, const T& r, const AdamHyper& h) {
  const T step = (m * T(h.lean_step_size)) / (r * T(h.inv_sqrt_bias_correction2) + T(h.eps));
  if (h.adam_w_mode && h.weight_decay != 0.0f) {
    p = p * T(h.lean_decay);
  }
  p = p - step;
}

template <typename T>
AMP_OPTIM_FN T adam_lean_param(T& p, const T& m, const T& v, const AdamHyper& h) {
  const T r = sqrt_rn(v);
  adam_lean_param_from_root(p, m, r, h);
  return r;
}

template <typename T>
AMP_OPTIM_FN T adam_lean_update(const T& g, T& p, T& m, T& v, const AdamHyper& h) {
  adam_update_moments(g, p, m, v, h);
  return adam_lean_param(p, m, v, h);
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
// divisor (lamb_new_moments, which the lean stage 2 runs again). Returns the
// update direction (for its norm); stage 2 recomputes it from the stored
// moments, so no update buffer is needed. An unclipped step (divisor 1) skips
// the division, which would change no bit: the product is never a signalling
// NaN, and x / 1 is x for every other x.
template <typename T>
AMP_OPTIM_FN void lamb_new_moments(const T& g, const T& p, T& m, T& v, const LambHyper& h) {
  const T scaled = g * T(h.inv_scale);
  adam_new_moments(h.clip == 1.0f ? scaled : scaled / T(h.clip), p, m, v, h);
}

template <typename T>
AMP_OPTIM_FN T lamb_moments(const T& g, const T& p, T& m, T& v, const LambHyper& h) {
  lamb_new_moments(g, p, m, v, h);
  return adam_direction(m, v, p, h);
}

// LAMB stage 2: the step along the direction, scaled by the tensor's trust ratio.
template <typename T>
AMP_OPTIM_FN void lamb_apply(T& p, const T& m, const T& v, T ratio, const LambHyper& h) {
  p = p - ratio * adam_direction(m, v, p, h);
}

}  // namespace amp_patch::optim
