// The optimizer ops' C++ entry points, shared by the CPU kernels
// (csrc/cpu/optim_ops.cpp) and the CUDA kernels (csrc/cuda/optim_*.cu): each op's
// signature (as its schema in amp_patch/ops/optimizer_ops.py), its tensor lists and what it
// does with each, and its hyper-parameters, written once. A backend B supplies
// the work: B::adam(op, lists, flags, hyper) and so on; the kernels register
// e.g. &optim::adam_op<CpuBackend>.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "check.h"
#include "optim_math.h"

namespace amp_patch::optim {

// What an op does with one of its lists.
enum class Use : uint8_t {
  kAbsent,   // not part of this call (an empty optional list, unused momentum)
  kChecked,  // validated like the others but not touched (not needed by this call)
  kRead,
  kUpdate,   // read and written in place
  kCopyOut,  // written only: the final values of list `copy_of` (the half model params)
};

struct ListArg {
  const char* name;
  at::TensorList tensors;
  Use use;
  int copy_of = -1;
};

template <size_t N>
using Lists = std::array<ListArg, N>;

// The optional list of half model params, receiving list `source` (the params).
inline ListArg model_params_arg(at::TensorList model_params, int source) {
  return {"model_params", model_params, model_params.empty() ? Use::kAbsent : Use::kCopyOut,
          source};
}

inline Lists<5> adam_lists(at::TensorList grads, at::TensorList params, at::TensorList exp_avgs,
                           at::TensorList exp_avg_sqs, at::TensorList model_params) {
  return {{{"grads", grads, Use::kRead},
           {"params", params, Use::kUpdate},
           {"exp_avgs", exp_avgs, Use::kUpdate},
           {"exp_avg_sqs", exp_avg_sqs, Use::kUpdate},
           model_params_arg(model_params, 1)}};
}

// grad, param, one state list, model copy: SGD (the state is the momentum
// buffer, absent without momentum), Adagrad and NovoGrad.
inline Lists<4> one_state_lists(at::TensorList grads, at::TensorList params, const char* state_name,
                                at::TensorList state, bool with_state, at::TensorList model_params) {
  return {{{"grads", grads, Use::kRead},
           {"params", params, Use::kUpdate},
           {state_name, state, with_state ? Use::kUpdate : Use::kAbsent},
           model_params_arg(model_params, 1)}};
}

inline Lists<4> sgd_lists(const char* op, at::TensorList grads, at::TensorList params,
                          at::TensorList momentum_buffers, at::TensorList model_params,
                          double momentum) {
  const bool with_momentum = momentum != 0.0;
  AMP_CHECK(!with_momentum || momentum_buffers.size() == grads.size(), "amp_patch::", op,
              ": momentum is ", momentum, " but momentum_buffers has ", momentum_buffers.size(),
              " tensors for ", grads.size(), " grads");
  return one_state_lists(grads, params, "momentum_buffers", momentum_buffers, with_momentum,
                         model_params);
}

// Whether LAMB needs the per-tensor norms (and stage 1 the params): for weight
// decay, or for the trust ratio of every tensor.
inline bool lamb_needs_norms(double weight_decay, bool use_nvlamb) {
  return use_nvlamb || weight_decay != 0.0;
}

inline Lists<4> lamb_stage1_lists(at::TensorList grads, at::TensorList params,
                                  at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                                  bool params_needed) {
  return {{{"grads", grads, Use::kRead},
           {"params", params, params_needed ? Use::kRead : Use::kChecked},
           {"exp_avgs", exp_avgs, Use::kUpdate},
           {"exp_avg_sqs", exp_avg_sqs, Use::kUpdate}}};
}

inline Lists<4> lamb_stage2_lists(at::TensorList params, at::TensorList exp_avgs,
                                  at::TensorList exp_avg_sqs, at::TensorList model_params) {
  return {{{"params", params, Use::kUpdate},
           {"exp_avgs", exp_avgs, Use::kRead},
           {"exp_avg_sqs", exp_avg_sqs, Use::kRead},
           model_params_arg(model_params, 0)}};
}

// The device flags every op takes.
struct Flags {
  const std::optional<at::Tensor>& noop;
  const std::optional<at::Tensor>& inv_scale;
};

// Adam's bias corrections given as a tensor (bc1, bc2 in fp32, made on the
// device from a step counter kept there): on the CPU they are read here, into
// the hyper-parameters; on an accelerator the kernel reads them, and the
// pointer is returned. Null without the tensor.
inline const float* device_bias_corrections(const char* op,
                                            const std::optional<at::Tensor>& bias_corrections,
                                            at::TensorList params, AdamHyper& h) {
  if (!bias_corrections.has_value()) {
    return nullptr;
  }
  const at::Tensor& bc = *bias_corrections;
  AMP_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == 2 && bc.is_contiguous(), "amp_patch::",
            op, ": bias_corrections must be a contiguous float32 tensor of 2 elements (bc1, bc2), "
            "got ", bc.scalar_type(), " with ", bc.numel(), " elements");
  AMP_CHECK(params.empty() || params[0].device() == bc.device(), "amp_patch::", op,
            ": bias_corrections is on ", bc.device(), " but params are on ", params[0].device());
  if (!bc.is_cpu()) {
    return bc.const_data_ptr<float>();
  }
  const float* values = bc.const_data_ptr<float>();
  h.bias_correction1 = values[0];
  h.bias_correction2 = values[1];
  return nullptr;
}

// adam_device_step_'s tensors, on either backend (each checks their device):
// a one-element counter and float32 flag, and the float64 betas.
inline void check_device_step_args(const char* op, const at::Tensor& step,
                                   const at::Tensor& found_inf, const at::Tensor& betas) {
  AMP_CHECK(step.numel() == 1 && found_inf.numel() == 1, "amp_patch::", op,
            ": step and found_inf must have one element each, got ", step.numel(), " and ",
            found_inf.numel());
  AMP_CHECK(found_inf.scalar_type() == at::kFloat, "amp_patch::", op,
            ": found_inf must be float32, got ", found_inf.scalar_type());
  AMP_CHECK(betas.scalar_type() == at::kDouble && betas.numel() == 2 && betas.is_contiguous(),
            "amp_patch::", op, ": betas must be a contiguous float64 tensor of 2 elements, got ",
            betas.scalar_type(), " with ", betas.numel());
}

template <typename B>
void adam_op(at::TensorList grads, at::TensorList params, at::TensorList exp_avgs,
             at::TensorList exp_avg_sqs, at::TensorList model_params,
             const std::optional<at::Tensor>& noop, const std::optional<at::Tensor>& inv_scale,
             double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
             bool adam_w_mode, bool bias_correction_on,
             const std::optional<at::Tensor>& bias_corrections) {
  constexpr const char* op = "multi_tensor_adam_";
  AdamHyper h =
      adam_hyper(lr, beta1, beta2, eps, weight_decay, step, adam_w_mode, bias_correction_on);
  const float* device_bc = device_bias_corrections(op, bias_corrections, params, h);
  B::adam(op, adam_lists(grads, params, exp_avgs, exp_avg_sqs, model_params),
          Flags{noop, inv_scale}, h, device_bc);
}

template <typename B>
void sgd_op(at::TensorList grads, at::TensorList params, at::TensorList momentum_buffers,
            at::TensorList model_params, const std::optional<at::Tensor>& noop,
            const std::optional<at::Tensor>& inv_scale, double lr, double weight_decay,
            double momentum, double dampening, bool nesterov, bool first_run,
            bool wd_after_momentum) {
  constexpr const char* op = "multi_tensor_sgd_";
  B::sgd(op, sgd_lists(op, grads, params, momentum_buffers, model_params, momentum),
         Flags{noop, inv_scale},
         sgd_hyper(lr, weight_decay, momentum, dampening, nesterov, first_run, wd_after_momentum));
}

template <typename B>
void adagrad_op(at::TensorList grads, at::TensorList params, at::TensorList state_sums,
                at::TensorList model_params, const std::optional<at::Tensor>& noop,
                const std::optional<at::Tensor>& inv_scale, double lr, double eps,
                double weight_decay, bool adagrad_w_mode) {
  B::adagrad("multi_tensor_adagrad_",
             one_state_lists(grads, params, "state_sums", state_sums, true, model_params),
             Flags{noop, inv_scale}, adagrad_hyper(lr, eps, weight_decay, adagrad_w_mode));
}

// NovoGrad's per-tensor denominator is grad_norms[i] / bias_correction2 + eps.
template <typename B>
void novograd_op(at::TensorList grads, at::TensorList params, at::TensorList exp_avgs,
                 const at::Tensor& grad_norms, at::TensorList model_params,
                 const std::optional<at::Tensor>& noop, const std::optional<at::Tensor>& inv_scale,
                 double lr, double beta1, double beta2, double eps, double weight_decay,
                 int64_t step, bool bias_correction_on, bool grad_averaging,
                 bool reg_inside_moment) {
  B::novograd("multi_tensor_novograd_",
              one_state_lists(grads, params, "exp_avgs", exp_avgs, true, model_params),
              Flags{noop, inv_scale},
              novograd_hyper(lr, beta1, weight_decay, step, bias_correction_on, grad_averaging,
                             reg_inside_moment),
              grad_norms, norm_bias_correction(f32(beta2), step, bias_correction_on), f32(eps));
}

// Stage 1 returns (param_norms, update_norms); the backend computes the
// clipping divisor from global_grad_norm, inv_scale and max_grad_norm.
template <typename B>
std::tuple<at::Tensor, at::Tensor> lamb_stage1_op(
    at::TensorList grads, at::TensorList params, at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs, const std::optional<at::Tensor>& noop,
    const std::optional<at::Tensor>& inv_scale, const at::Tensor& global_grad_norm,
    double max_grad_norm, double beta1, double beta2, double eps, double weight_decay,
    int64_t step, bool bias_correction_on, bool grad_averaging, bool adam_w_mode,
    bool use_nvlamb) {
  return B::lamb_moments(
      "multi_tensor_lamb_stage1_",
      lamb_stage1_lists(grads, params, exp_avgs, exp_avg_sqs,
                        lamb_needs_norms(weight_decay, use_nvlamb)),
      Flags{noop, inv_scale},
      lamb_hyper(beta1, beta2, eps, weight_decay, step, bias_correction_on, grad_averaging,
                 adam_w_mode),
      global_grad_norm, f32(max_grad_norm));
}

// Stage 2 steps each tensor by lr, times its trust ratio when `use_ratio`.
template <typename B>
void lamb_stage2_op(at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                    const at::Tensor& param_norms, const at::Tensor& update_norms,
                    at::TensorList model_params, const std::optional<at::Tensor>& noop, double lr,
                    double beta1, double beta2, double eps, double weight_decay, int64_t step,
                    bool bias_correction_on, bool adam_w_mode, bool use_nvlamb) {
  const std::optional<at::Tensor> no_scale;
  B::lamb_apply("multi_tensor_lamb_stage2_",
                lamb_stage2_lists(params, exp_avgs, exp_avg_sqs, model_params),
                Flags{noop, no_scale},
                lamb_hyper(beta1, beta2, eps, weight_decay, step, bias_correction_on,
                           /*grad_averaging=*/true, adam_w_mode),
                param_norms, update_norms, f32(lr), lamb_needs_norms(weight_decay, use_nvlamb));
}

// ---------------------------------------------------------------- lean state ops
// multi_tensor_adam_lean_ / multi_tensor_sgd_lean_ (amp_patch/ops/lean_state_ops.py):
// state lists whose dtype picks the code (optim_math.h's StateCode), each with
// a list of fp32 block scales, and params that may be bf16. The checks below
// are the reference body's, with its messages; the backends add their device
// checks and do the work:
//   B::adam_lean(op, const LeanLists<2>&, Flags, AdamHyper, LeanHyper)
//   B::sgd_lean(op, const LeanLists<1>&, Flags, SgdHyper, LeanHyper)
//   B::lamb_lean_moments(op, const LeanLists<2>&, Flags, LambLeanArgs, LeanHyper)
//     -> (param_norms, update_norms), writing nothing
//   B::lamb_lean_apply(op, const LeanLists<2>&, Flags, LambLeanArgs, param_norms,
//                      update_norms, lr, LeanHyper)
// after the op returned early for nothing: a set noop is the backend's to test.

// One state list and its scales. `scales` may be empty when no tensor of the
// list is block-scaled; `used` is false for SGD without momentum.
struct LeanStateArg {
  const char* name;
  at::TensorList codes;
  const char* scale_name;
  at::TensorList scales;
  bool used;
};

template <size_t S>
struct LeanLists {
  at::TensorList grads;
  at::TensorList params;
  std::array<LeanStateArg, S> states;
  at::TensorList model_params;  // empty: no model copies
};

// The code of a state tensor's dtype (only after check_lean_lists accepted it).
inline StateCode state_code(at::ScalarType st) {
  switch (st) {
    case at::kFloat:
      return StateCode::kF32;
    case at::kBFloat16:
      return StateCode::kBF16;
    case at::kChar:
      return StateCode::kInt8;
    case at::kByte:
      return StateCode::kSqrtU8;
    default:
      return StateCode::kE4M3;
  }
}

// (rows, row length) of a tensor as the codes see it: a tensor of two or more
// dimensions is size(0) rows, any other tensor one row.
inline std::pair<int64_t, int64_t> lean_rows(at::IntArrayRef sizes) {
  int64_t numel = 1;
  for (int64_t s : sizes) {
    numel *= s;
  }
  const int64_t rows = sizes.size() >= 2 ? sizes[0] : 1;
  return {rows, rows != 0 ? numel / rows : 0};
}

// The scales' shape for a tensor of `sizes`: (rows, ceil(row length / block_size)).
inline std::array<int64_t, 2> lean_scale_shape(at::IntArrayRef sizes, int64_t block_size) {
  const auto [rows, length] = lean_rows(sizes);
  return {rows, (length + block_size - 1) / block_size};
}

// Python's spelling of a dtype and a shape, for the reference's messages.
inline std::string py_dtype(at::ScalarType st) {
  switch (st) {
    case at::kFloat:
      return "torch.float32";
    case at::kDouble:
      return "torch.float64";
    case at::kHalf:
      return "torch.float16";
    case at::kBFloat16:
      return "torch.bfloat16";
    case at::kChar:
      return "torch.int8";
    case at::kByte:
      return "torch.uint8";
    case at::kShort:
      return "torch.int16";
    case at::kInt:
      return "torch.int32";
    case at::kLong:
      return "torch.int64";
    case at::kBool:
      return "torch.bool";
    case at::kFloat8_e4m3fn:
      return "torch.float8_e4m3fn";
    case at::kFloat8_e5m2:
      return "torch.float8_e5m2";
    default:
      return std::string("torch.") + c10::toString(st);
  }
}

inline std::string py_shape(at::IntArrayRef sizes) {
  std::string out = "(";  // no stream: see check.h
  for (size_t i = 0; i < sizes.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(sizes[i]);
  }
  out += sizes.size() == 1 ? ",)" : ")";
  return out;
}

// _check_rows: each list as long as grads, each tensor shaped like its grad.
inline void check_lean_rows(const char* op, at::TensorList lead, const char* name,
                            at::TensorList tensors) {
  AMP_CHECK(tensors.size() == lead.size(), "amp_patch::", op, ": list lengths differ (grads has ",
              lead.size(), ", ", name, " has ", tensors.size(), ")");
  for (size_t i = 0; i < lead.size(); ++i) {
    AMP_CHECK(tensors[i].sizes() == lead[i].sizes(), "amp_patch::", op, ": ", name, "[", i,
                "] has shape ", py_shape(tensors[i].sizes()), " but grads[", i, "] has ",
                py_shape(lead[i].sizes()));
  }
}

// _check_state: codes of a known dtype (uint8 only for second moments), and
// for the block-scaled ones contiguous fp32 scales of the right shape.
inline void check_lean_state(const char* op, const LeanStateArg& s, int64_t block_size) {
  AMP_CHECK(s.scales.empty() || s.scales.size() == s.codes.size(), "amp_patch::", op, ": ",
              s.scale_name, " has ", s.scales.size(), " tensors for ", s.codes.size(), " ",
              s.name, " (give one per tensor, or none)");
  for (size_t i = 0; i < s.codes.size(); ++i) {
    const at::Tensor& t = s.codes[i];
    const at::ScalarType st = t.scalar_type();
    AMP_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kChar || st == at::kByte ||
                    st == at::kFloat8_e4m3fn,
                "amp_patch::", op, ": ", s.name, "[", i, "] has dtype ", py_dtype(st),
                "; state codes are torch.float32, torch.bfloat16, torch.int8, torch.uint8, "
                "torch.float8_e4m3fn");
    AMP_CHECK(st != at::kByte || std::string(s.name) == "exp_avg_sqs", "amp_patch::", op, ": ",
                s.name, "[", i, "] is uint8, the code of a second moment (never negative); "
                "signed state takes int8");
    if (!block_scaled(state_code(st))) {
      continue;
    }
    AMP_CHECK(!s.scales.empty(), "amp_patch::", op, ": ", s.name, "[", i, "] is ",
                py_dtype(st), " but ", s.scale_name, " is empty");
    const at::Tensor& sc = s.scales[i];
    const auto want = lean_scale_shape(t.sizes(), block_size);
    AMP_CHECK(sc.scalar_type() == at::kFloat && sc.dim() == 2 && sc.size(0) == want[0] &&
                    sc.size(1) == want[1],
                "amp_patch::", op, ": ", s.scale_name, "[", i, "] must be float32 of shape (",
                want[0], ", ", want[1], ") for block_size ", block_size, ", got ",
                py_dtype(sc.scalar_type()), " ", py_shape(sc.sizes()));
    AMP_CHECK(t.is_contiguous() && sc.is_contiguous(), "amp_patch::", op, ": ", s.name, "[", i,
                "] and its scales must be contiguous");
  }
}

// The reference body's checks, in its order.
template <size_t S>
void check_lean_lists(const char* op, const LeanLists<S>& l, int64_t block_size) {
  check_lean_rows(op, l.grads, "params", l.params);
  for (const LeanStateArg& s : l.states) {
    if (s.used) {
      check_lean_rows(op, l.grads, s.name, s.codes);
    }
  }
  if (!l.model_params.empty()) {
    check_lean_rows(op, l.grads, "model_params", l.model_params);
  }
  AMP_CHECK(block_size >= 1, "amp_patch::", op, ": block_size must be positive, got ",
              block_size);
  for (size_t i = 0; i < l.params.size(); ++i) {
    const at::ScalarType st = l.params[i].scalar_type();
    AMP_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "amp_patch::", op,
                ": params[", i, "] has dtype ", py_dtype(st),
                "; params are float32, bfloat16 or float16");
  }
  for (const LeanStateArg& s : l.states) {
    if (s.used) {
      check_lean_state(op, s, block_size);
    }
  }
}

// The lists of the ops over Adam's two moments (Adam, LAMB).
inline LeanLists<2> moment_lean_lists(at::TensorList grads, at::TensorList params,
                                      at::TensorList exp_avgs, at::TensorList exp_avg_scales,
                                      at::TensorList exp_avg_sqs,
                                      at::TensorList exp_avg_sq_scales,
                                      at::TensorList model_params) {
  return {grads,
          params,
          {{{"exp_avgs", exp_avgs, "exp_avg_scales", exp_avg_scales, true},
            {"exp_avg_sqs", exp_avg_sqs, "exp_avg_sq_scales", exp_avg_sq_scales, true}}},
          model_params};
}

template <typename B>
void adam_lean_op(at::TensorList grads, at::TensorList params, at::TensorList exp_avgs,
                  at::TensorList exp_avg_scales, at::TensorList exp_avg_sqs,
                  at::TensorList exp_avg_sq_scales, at::TensorList model_params,
                  const std::optional<at::Tensor>& noop,
                  const std::optional<at::Tensor>& inv_scale, double lr, double beta1,
                  double beta2, double eps, double weight_decay, int64_t step, bool adam_w_mode,
                  bool bias_correction_on, int64_t block_size, int64_t seed) {
  constexpr const char* op = "multi_tensor_adam_lean_";
  const LeanLists<2> lists = moment_lean_lists(grads, params, exp_avgs, exp_avg_scales,
                                               exp_avg_sqs, exp_avg_sq_scales, model_params);
  check_lean_lists(op, lists, block_size);
  B::adam_lean(op, lists, Flags{noop, inv_scale},
               adam_hyper(lr, beta1, beta2, eps, weight_decay, step, adam_w_mode,
                          bias_correction_on),
               lean_hyper(block_size, seed, step));
}

template <typename B>
void sgd_lean_op(at::TensorList grads, at::TensorList params, at::TensorList momentum_buffers,
                 at::TensorList momentum_scales, at::TensorList model_params,
                 const std::optional<at::Tensor>& noop,
                 const std::optional<at::Tensor>& inv_scale, double lr, double weight_decay,
                 double momentum, double dampening, bool nesterov, bool first_run,
                 bool wd_after_momentum, int64_t step, int64_t block_size, int64_t seed) {
  constexpr const char* op = "multi_tensor_sgd_lean_";
  const bool with_momentum = momentum != 0.0;
  AMP_CHECK(!with_momentum || momentum_buffers.size() == grads.size(), "amp_patch::", op,
              ": momentum is ", momentum, " but momentum_buffers has ", momentum_buffers.size(),
              " tensors for ", grads.size(), " grads");
  const LeanLists<1> lists{
      grads,
      params,
      {{{"momentum_buffers", momentum_buffers, "momentum_scales", momentum_scales,
         with_momentum}}},
      model_params};
  check_lean_lists(op, lists, block_size);
  B::sgd_lean(op, lists, Flags{noop, inv_scale},
              sgd_hyper(lr, weight_decay, momentum, dampening, nesterov, first_run,
                        wd_after_momentum),
              lean_hyper(block_size, seed, step));
}

// What both lean LAMB stages take besides their lists: the rule, the clipping
// inputs (the backend computes the divisor, as lamb_stage1_op's), and whether
// the trust ratio applies (and so whether stage 1 needs the params).
struct LambLeanArgs {
  LambHyper hyper;
  const at::Tensor& global_grad_norm;
  float max_grad_norm;
  bool use_ratio;
};

inline LambLeanArgs lamb_lean_args(const at::Tensor& global_grad_norm, double max_grad_norm,
                                   double beta1, double beta2, double eps, double weight_decay,
                                   int64_t step, bool bias_correction_on, bool grad_averaging,
                                   bool adam_w_mode, bool use_nvlamb) {
  return {lamb_hyper(beta1, beta2, eps, weight_decay, step, bias_correction_on, grad_averaging,
                     adam_w_mode),
          global_grad_norm, f32(max_grad_norm), lamb_needs_norms(weight_decay, use_nvlamb)};
}

// multi_tensor_lamb_lean_stage1_: stage 1 on the decoded moments, which it
// leaves as they are; stage 2 computes the same new moments again.
template <typename B>
std::tuple<at::Tensor, at::Tensor> lamb_lean_stage1_op(
    at::TensorList grads, at::TensorList params, at::TensorList exp_avgs,
    at::TensorList exp_avg_scales, at::TensorList exp_avg_sqs, at::TensorList exp_avg_sq_scales,
    const std::optional<at::Tensor>& noop, const std::optional<at::Tensor>& inv_scale,
    const at::Tensor& global_grad_norm, double max_grad_norm, double beta1, double beta2,
    double eps, double weight_decay, int64_t step, bool bias_correction_on, bool grad_averaging,
    bool adam_w_mode, bool use_nvlamb, int64_t block_size) {
  constexpr const char* op = "multi_tensor_lamb_lean_stage1_";
  const LeanLists<2> lists = moment_lean_lists(grads, params, exp_avgs, exp_avg_scales,
                                             exp_avg_sqs, exp_avg_sq_scales, {});
  check_lean_lists(op, lists, block_size);
  return B::lamb_lean_moments(
      op, lists, Flags{noop, inv_scale},
      lamb_lean_args(global_grad_norm, max_grad_norm, beta1, beta2, eps, weight_decay, step,
                     bias_correction_on, grad_averaging, adam_w_mode, use_nvlamb),
      lean_hyper(block_size, 0, step));
}

// multi_tensor_lamb_lean_stage2_: stage 1's moments again, stage 2's step,
// the moments encoded and the params stored.
template <typename B>
void lamb_lean_stage2_op(at::TensorList grads, at::TensorList params, at::TensorList exp_avgs,
                         at::TensorList exp_avg_scales, at::TensorList exp_avg_sqs,
                         at::TensorList exp_avg_sq_scales, const at::Tensor& param_norms,
                         const at::Tensor& update_norms, at::TensorList model_params,
                         const std::optional<at::Tensor>& noop,
                         const std::optional<at::Tensor>& inv_scale,
                         const at::Tensor& global_grad_norm, double max_grad_norm, double lr,
                         double beta1, double beta2, double eps, double weight_decay,
                         int64_t step, bool bias_correction_on, bool grad_averaging,
                         bool adam_w_mode, bool use_nvlamb, int64_t block_size, int64_t seed) {
  constexpr const char* op = "multi_tensor_lamb_lean_stage2_";
  const LeanLists<2> lists = moment_lean_lists(grads, params, exp_avgs, exp_avg_scales,
                                             exp_avg_sqs, exp_avg_sq_scales, model_params);
  check_lean_lists(op, lists, block_size);
  B::lamb_lean_apply(
      op, lists, Flags{noop, inv_scale},
      lamb_lean_args(global_grad_norm, max_grad_norm, beta1, beta2, eps, weight_decay, step,
                     bias_correction_on, grad_averaging, adam_w_mode, use_nvlamb),
      param_norms, update_norms, f32(lr), lean_hyper(block_size, seed, step));
}

}  // namespace amp_patch::optim
