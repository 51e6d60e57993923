// The optimizer loops of one instruction set, and the table that holds them
// (optim_table.h's OptimTable): the update rules over fp32 arrays
// (optim_rule_loops.h), the lean state codes (optim_state_codes.h) and the
// fused lean loops (optim_lean_loops.h). Like vec_loops.h, this header is
// compiled once per instruction set: csrc/cpu/isa/{default,avx2,avx512}.cpp
// include it after vec_loops.h, with CPU_CAPABILITY and
// the compiler's target set first; vec_loops.h explains how the copies coexist
// in one library and stay off CPUs that lack the ISA.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>

#include "cpu/optim_lean_loops.h"
#include "cpu/optim_rule_loops.h"
#include "cpu/optim_state_codes.h"
#include "cpu/optim_table.h"

namespace amp_patch::cpu {
namespace CPU_CAPABILITY {

// The fused tables' indices of a grad type and a param type.
template <typename G>
constexpr int kGradIndex =
    std::is_same_v<G, float> ? kF32 : (std::is_same_v<G, c10::Half> ? kF16 : kBF16);
template <typename P>
constexpr int kParamIndex = std::is_same_v<P, float> ? 0 : 1;

template <typename G, typename P, int MI, int VI>
void fill_adam_lean(OptimTable& t) {
  constexpr optim::StateCode kM[] = {optim::StateCode::kBF16, optim::StateCode::kInt8,
                                     optim::StateCode::kE4M3, optim::StateCode::kF32};
  constexpr optim::StateCode kV[] = {optim::StateCode::kBF16, optim::StateCode::kSqrtU8,
                                     optim::StateCode::kE4M3, optim::StateCode::kF32};
  constexpr int gi = kGradIndex<G>, pi = kParamIndex<P>;
  t.adam_lean_fused[gi][pi][MI][VI] = &adam_lean_loop<G, P, kM[MI], kV[VI]>;
  t.lamb_lean_fused[gi][pi][MI][VI] = &lamb_lean_loop<G, P, kM[MI], kV[VI]>;
  t.lamb_lean_norms_fused[gi][pi][MI][VI] = &lamb_lean_norms_loop<G, P, kM[MI], kV[VI]>;
}

template <typename G, typename P>
void fill_lean_codes(OptimTable& t) {
  constexpr int gi = kGradIndex<G>, pi = kParamIndex<P>;
  t.sgd_lean_fused[gi][pi][0] = &sgd_lean_loop<G, P, kNoState>;
  t.sgd_lean_fused[gi][pi][1] = &sgd_lean_loop<G, P, optim::StateCode::kBF16>;
  t.sgd_lean_fused[gi][pi][2] = &sgd_lean_loop<G, P, optim::StateCode::kInt8>;
  t.sgd_lean_fused[gi][pi][3] = &sgd_lean_loop<G, P, optim::StateCode::kE4M3>;
  t.sgd_lean_fused[gi][pi][4] = &sgd_lean_loop<G, P, optim::StateCode::kF32>;
  // The pairs StateFormat makes (the other pairs run the tiles): every pair
  // compiled is three loops per grad and param dtype and instruction set.
  fill_adam_lean<G, P, 0, 0>(t);  // "bf16"
  fill_adam_lean<G, P, 1, 1>(t);  // "int8": int8 m, uint8 sqrt(v)
  fill_adam_lean<G, P, 2, 0>(t);  // "fp8": e4m3 m, bf16 v
  fill_adam_lean<G, P, 3, 3>(t);  // "fp32" (and the small tensors of the others)
}

OptimTable optim_table() {
  using optim::StateCode;
  // Each member by name; null (value-initialised) where no loop is compiled.
  OptimTable t{};
  t.adam = &adam_tile_loop<false>;
  t.adam_lean = &adam_tile_loop<true>;
  t.sgd = &sgd_loop;
  t.adagrad = &adagrad_loop;
  t.novograd = &novograd_loop;
  t.lamb_moments = &lamb_moments_loop;
  t.lamb_apply = &lamb_apply_loop;
  t.stochastic_bf16 = &stochastic_bf16_loop;
  // [StateCode]
  static_assert(optim::kNumStateCodes == 5, "each state code needs its decode and encode loop here");
  constexpr auto code = [](StateCode c) { return static_cast<int>(c); };
  t.lean_decode[code(StateCode::kF32)] = &f32_decode;
  t.lean_encode[code(StateCode::kF32)] = &f32_encode;
  t.lean_decode[code(StateCode::kBF16)] = &bf16_decode;
  t.lean_encode[code(StateCode::kBF16)] = &bf16_encode;
  t.lean_decode[code(StateCode::kInt8)] = &scaled_decode<StateCode::kInt8>;
  t.lean_encode[code(StateCode::kInt8)] = &scaled_encode<StateCode::kInt8>;
  t.lean_decode[code(StateCode::kSqrtU8)] = &scaled_decode<StateCode::kSqrtU8>;
  t.lean_encode[code(StateCode::kSqrtU8)] = &scaled_encode<StateCode::kSqrtU8>;
  t.lean_decode[code(StateCode::kE4M3)] = &scaled_decode<StateCode::kE4M3>;
  t.lean_encode[code(StateCode::kE4M3)] = &scaled_encode<StateCode::kE4M3>;
  using c10::BFloat16;
  using c10::Half;
  // [grad dtype][model dtype, or kNumDt for no model]
  t.adam_mixed[kF32][kNumDt] = &adam_mixed_loop<float, void>;
  t.adam_mixed[kF16][kNumDt] = &adam_mixed_loop<Half, void>;
  t.adam_mixed[kBF16][kNumDt] = &adam_mixed_loop<BFloat16, void>;
  t.adam_mixed[kF32][kF16] = &adam_mixed_loop<float, Half>;
  t.adam_mixed[kF32][kBF16] = &adam_mixed_loop<float, BFloat16>;
  t.adam_mixed[kF16][kF16] = &adam_mixed_loop<Half, Half>;
  t.adam_mixed[kBF16][kBF16] = &adam_mixed_loop<BFloat16, BFloat16>;
  t.adam_mixed[kF16][kBF16] = &adam_mixed_loop<Half, BFloat16>;
  t.adam_mixed[kBF16][kF16] = &adam_mixed_loop<BFloat16, Half>;
  fill_lean_codes<float, float>(t);
  fill_lean_codes<Half, float>(t);
  fill_lean_codes<BFloat16, float>(t);
  fill_lean_codes<float, BFloat16>(t);
  fill_lean_codes<Half, BFloat16>(t);
  fill_lean_codes<BFloat16, BFloat16>(t);
  return t;
}

}  // namespace CPU_CAPABILITY
}  // namespace amp_patch::cpu
