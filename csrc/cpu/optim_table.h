// The interface between the optimizer ops (optim_ops.cpp) and their vectorised
// fp32 loops (optim_loops.h), compiled once per instruction set next to the
// loss-scaling loops (csrc/cpu/isa/*.cpp), as kernel_table.h is for those.
//
// The loops see fp32 arrays only. optim_ops.cpp hands them fp32 tensors where
// they lie and converts fp16/bf16 tensors through small fp32 tiles (with the
// copy loops of kernel_table.h), so each update rule is compiled once per ISA
// whatever the mix of dtypes.
#pragma once

#include <cstdint>

#include "cpu/kernel_table.h"
#include "optim_math.h"

namespace amp_patch::cpu {

// Each covers n elements; p, the moments and the momentum are updated in place.
using AdamLoop = void (*)(const float* g, float* p, float* m, float* v, int64_t n,
                          const optim::AdamHyper& h);
// mom is null when momentum is 0.
using SgdLoop = void (*)(const float* g, float* p, float* mom, int64_t n, const optim::SgdHyper& h);
using AdagradLoop = void (*)(const float* g, float* p, float* sum, int64_t n,
                             const optim::AdagradHyper& h);
using NovoGradLoop = void (*)(const float* g, float* p, float* m, int64_t n, float denom,
                              const optim::NovoGradHyper& h);
// Updates the moments and adds sum(p^2) to sums[0] (only when p is not null)
// and sum(u^2) of the update direction u to sums[1].
using LambMomentsLoop = void (*)(const float* g, const float* p, float* m, float* v, int64_t n,
                                 const optim::LambHyper& h, double* sums);
using LambApplyLoop = void (*)(float* p, const float* m, const float* v, int64_t n, float ratio,
                               const optim::LambHyper& h);

// Adam over fp32 params and moments, with grads of any 16/32-bit float type
// and an optional half model copy that receives the updated params (null: none).
using AdamMixedLoop = void (*)(const void* g, float* p, float* m, float* v, void* model,
                               int64_t n, const optim::AdamHyper& h);

// The lean-state ops (optim_math.h's StateCode). Each covers n elements of one
// row that start at a block boundary: blocks of block_size elements, the last
// one shorter when the row ends there; scales holds one fp32 scale per block.
// Decode writes the fp32 values of the codes (scales unused for float32 and
// bfloat16 codes).
using LeanDecodeLoop = void (*)(const void* codes, const float* scales, float* out, int64_t n,
                                int64_t block_size);
// Encode stores fp32 x as codes and writes each block's scale; x is scratch
// (the square-root code overwrites it).
using LeanEncodeLoop = void (*)(float* x, void* codes, float* scales, int64_t n,
                                int64_t block_size);
// bf16 out = x with stochastic rounding: the bits of element e0 + k of the
// tensor with hash key `key` (optim::rounding_bits); non-finite x to nearest.
using StochasticBf16Loop = void (*)(const float* x, void* out, int64_t n, uint32_t key,
                                    int64_t e0);

// One chunk of a lean-state row for the fused loops: n elements from a block
// boundary (element e0 of its tensor) with the grads and params where they lie,
// the moments' codes and their block scales (null for unscaled codes; SGD's
// momentum is m, and v is null); for the loops that write, `model` (null:
// none) is an fp32 param's model copy of dtype model_dt (kF32, kF16, kBF16),
// which receives the updated params rounded as the copy loops round, tiles
// holds two fp32 tiles of `tile` >= block elements, and key is the tensor's
// rounding key. block_size must be a multiple of kLeanFusedAlign.
struct LeanChunkArgs {
  const void* g;
  void* p;
  void* m_codes;
  float* m_scales;
  void* v_codes;
  float* v_scales;
  void* model;
  int model_dt;
  float* tiles;
  int64_t tile;
  int64_t n;
  int64_t block_size;
  uint32_t key;
  int64_t e0;
};
constexpr int64_t kLeanFusedAlign = 32;

// The fused loops over a chunk (grads fp32/fp16/bf16, params fp32 or bf16, the
// moments' codes a pair that a state format makes), each bit-identical to the
// tile loops it stands for, run one after another:
// Adam's lean op (decode, adam, encode, store);
using AdamLeanLoop = void (*)(const LeanChunkArgs& a, const optim::AdamHyper& h);
// LAMB's lean stage 2 with the tensor's step size (lr times its trust ratio)
// (decode, lamb_moments, lamb_apply, encode, store);
using LambLeanLoop = void (*)(const LeanChunkArgs& a, float ratio, const optim::LambHyper& h);
// SGD's lean op, the momentum (if any) as the first state (decode, sgd,
// encode, store);
using SgdLeanLoop = void (*)(const LeanChunkArgs& a, const optim::SgdHyper& h);
// LAMB's lean stage 1, writing nothing: LambMomentsLoop's sums (sums[0] only
// when with_params).
using LambLeanNormsLoop = void (*)(const LeanChunkArgs& a, bool with_params,
                                   const optim::LambHyper& h, double* sums);

struct OptimTable {
  AdamLoop adam;
  AdamLoop adam_lean;  // the lean ops' rule (optim_math.h's adam_lean_update)
  SgdLoop sgd;
  AdagradLoop adagrad;
  NovoGradLoop novograd;
  LambMomentsLoop lamb_moments;
  LambApplyLoop lamb_apply;
  LeanDecodeLoop lean_decode[optim::kNumStateCodes];  // [StateCode]
  LeanEncodeLoop lean_encode[optim::kNumStateCodes];
  StochasticBf16Loop stochastic_bf16;
  // [grad dtype][model dtype, kNumDt for none]; null where the tiles of
  // optim_ops.cpp serve (fp64, an fp32 model copy).
  AdamMixedLoop adam_mixed[kNumDt][kNumDt + 1];
  // [grad dtype: kF32, kF16, kBF16][param: fp32, bf16][m: bf16, int8, e4m3, fp32]
  // [v: bf16, uint8, e4m3, fp32]: the pairs of optimizers/state_format.py's
  // formats (bf16/bf16, int8/uint8, e4m3/bf16, fp32/fp32); null elsewhere (the
  // tiles of optim_ops.cpp serve).
  AdamLeanLoop adam_lean_fused[3][2][4][4];
  LambLeanLoop lamb_lean_fused[3][2][4][4];  // indexed as adam_lean_fused
  LambLeanNormsLoop lamb_lean_norms_fused[3][2][4][4];
  // [grad dtype][param][momentum: none (momentum 0), bf16, int8, e4m3, fp32]
  SgdLeanLoop sgd_lean_fused[3][2][5];
};

// One table per instruction set; the AVX ones exist on x86 only.
namespace DEFAULT { OptimTable optim_table(); }
namespace AVX2 { OptimTable optim_table(); }
namespace AVX512 { OptimTable optim_table(); }

// The table of the instruction set that kernels() chose (kernel_capability()).
const OptimTable& optim_kernels();

}  // namespace amp_patch::cpu
