// The optimizer ops' C++ entry points, shared by the CPU kernels
// (optim_ops.cpp) and the CUDA kernels (csrc/cuda/optim_*.cu): each op's
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
#include <tuple>

#include "cpu/optim_math.h"

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
  TORCH_CHECK(!with_momentum || momentum_buffers.size() == grads.size(), "amp_patch::", op,
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

template <typename B>
void adam_op(at::TensorList grads, at::TensorList params, at::TensorList exp_avgs,
             at::TensorList exp_avg_sqs, at::TensorList model_params,
             const std::optional<at::Tensor>& noop, const std::optional<at::Tensor>& inv_scale,
             double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
             bool adam_w_mode, bool bias_correction_on) {
  B::adam("multi_tensor_adam_", adam_lists(grads, params, exp_avgs, exp_avg_sqs, model_params),
          Flags{noop, inv_scale},
          adam_hyper(lr, beta1, beta2, eps, weight_decay, step, adam_w_mode, bias_correction_on));
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

}  // namespace amp_patch::optim
