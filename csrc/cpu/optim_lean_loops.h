// The fused loops of the lean optimizer ops on CPU (optim_table.h's
// *_lean_fused): one pass over a chunk of a low-bit state row that decodes the
// moments (optim_state_codes.h), applies the update rule (csrc/optim_math.h),
// encodes the new state with each block's new scale, and stores the param and
// its model copy. Each is bit-identical to the tile path of optim_ops.cpp it
// stands for. Like vec_loops.h, this header is compiled once per instruction set: csrc/cpu/isa/{default,avx2,avx512}.cpp
// include it (through optim_loops.h) after vec_loops.h, with CPU_CAPABILITY and
// the compiler's target set first; vec_loops.h explains how the copies coexist
// in one library and stay off CPUs that lack the ISA.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/optim_rule_loops.h"
#include "cpu/optim_state_codes.h"
#include "cpu/optim_table.h"
#include "cpu/vec_loops.h"

namespace amp_patch::cpu {
namespace CPU_CAPABILITY {

// `count` updated fp32 params at element `at` of their model copy of dtype dt
// (kF32, kF16, kBF16), rounded as copy_loop rounds them.
AMP_CPU_INLINE void store_model(void* model, int dt, int64_t at, int64_t count, const FVec& lo,
                                const FVec& hi) {
  if (dt == kBF16) {
    store_block(static_cast<c10::BFloat16*>(model) + at, count, lo, hi);
  } else if (dt == kF16) {
    store_block(static_cast<c10::Half*>(model) + at, count, lo, hi);
  } else {
    store_block(static_cast<float*>(model) + at, count, lo, hi);
  }
}

// Whether the fused loop writes state code C's codes a block late (see lean_moments_loop).
template <optim::StateCode C>
constexpr bool kLateCodes =
#if defined(CPU_CAPABILITY_AVX512)
    optim::block_scaled(C);
#else
    false;
#endif

// A block whose codes are still to be written from its fp32 tile; len 0: none.
struct LateCodes {
  const float* x = nullptr;
  void* out = nullptr;
  int64_t len = 0;
  float factor = 0.0f;  // finite and non-zero
};

// Writes the codes of the late block's values [from, to) (to <= its len).
template <optim::StateCode C>
AMP_CPU_INLINE void write_late_codes(const LateCodes& late, int64_t from, int64_t to) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (kLateCodes<C>) {
    const __m512 f = _mm512_set1_ps(late.factor);
    for (int64_t i = from; i < to; i += kBlock) {
      store_codes<C>(late.x + i, static_cast<CodeType<C>*>(late.out) + i,
                             std::min<int64_t>(kBlock, to - i), f);
    }
  }
#endif
}

// Writes the codes of the late block due at group i (< late.len). kWhole:
// late.len is a whole number of groups, written 64 codes at each odd group
// (and the last group alone when their number is odd); else group i's.
template <bool kWhole, optim::StateCode C>
AMP_CPU_INLINE void write_late_group(const LateCodes& late, int64_t i) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (kLateCodes<C>) {
    if constexpr (kWhole) {
      const __m512 f = _mm512_set1_ps(late.factor);
      CodeType<C>* out = static_cast<CodeType<C>*>(late.out);
      if (i % (2 * kBlock) == kBlock) {
        store_codes64<C>(late.x + i - kBlock, out + i - kBlock, f);
      } else if (i + kBlock == late.len) {
        store_codes<C>(late.x + i, out + i, kBlock, f);
      }
    } else {
      write_late_codes<C>(late, i, std::min<int64_t>(i + kBlock, late.len));
    }
  }
#endif
}

// The block of len values in tile x (sqrt taken for the square-root code), with
// largest magnitude s, done: its scale stored, and its codes written now, or
// handed on in `late` (a block whose factor or s is not finite stores codes 0
// at once, as quantise_block does).
template <optim::StateCode C>
AMP_CPU_INLINE void finish_block(float* x, void* codes, float* scale, int64_t len, float s,
                                 LateCodes& late) {
  *scale = s;
  if constexpr (kLateCodes<C>) {
    const float factor = optim::code_max(C) / s;
    if (std::isfinite(factor) && std::isfinite(s)) {
      late = {x, codes, len, factor};
    } else {
      std::memset(codes, 0, len);
      late = {};
    }
  } else {
    quantise_block<C>(x, static_cast<CodeType<C>*>(codes), len, s);
  }
}

// The element rules of the fused lean loop. Each updates the moments and the
// param of one vector and returns sqrt(v) when kRoot (the square-root code
// keeps it); the rule object is a local copy of its hyper-parameters (see the
// note on aliasing in optim_rule_loops.h).
struct AdamLeanStep {
  optim::AdamHyper h;
  template <bool kRoot>
  AMP_CPU_INLINE FVec step(const FVec& g, FVec& p, FVec& m, FVec& v) const {
    return optim::adam_lean_update(g, p, m, v, h);  // sqrt(v) is part of the update
  }
};

// LAMB's stage 2: stage 1's moments (the same bits as lamb_moments_loop's),
// then the step along the direction with the tensor's step size.
struct LambLeanStep {
  optim::LambHyper h;
  FVec ratio;
  template <bool kRoot>
  AMP_CPU_INLINE FVec step(const FVec& g, FVec& p, FVec& m, FVec& v) const {
    optim::lamb_new_moments(g, p, m, v, h);
    optim::lamb_apply(p, m, v, ratio, h);
    if constexpr (kRoot) {
      return optim::sqrt_rn(v);
    } else {
      return v;
    }
  }
};

// SGD (Apex's rule, optim_math.h's sgd_update) with its momentum as the first
// state, and no second one (kNoState). With momentum 0 the first is kNoState
// too, and sgd_update does not touch it. A first step's old momentum is
// decoded but unused: sgd_update sets the buffer to the grad.
struct SgdLeanStep {
  optim::SgdHyper h;
  template <bool kRoot>
  AMP_CPU_INLINE FVec step(const FVec& g, FVec& p, FVec& m, FVec& v) const {
    optim::sgd_update(g, p, &m, h);
    return v;
  }
};

// Block b's decode factor of state code C: s / code_max (1 for unscaled codes).
template <optim::StateCode C>
AMP_CPU_INLINE FVec decode_factor(const float* scales, int64_t b) {
  return FVec(optim::block_scaled(C) ? scales[b] / optim::code_max(C) : 1.0f);
}

// Loads `count` (<= kBlock) elements at `at` of a chunk's grads and params
// (lanes past count 0) and decodes its moments with the block's factors.
template <typename G, typename P, optim::StateCode MC, optim::StateCode VC>
AMP_CPU_INLINE void load_group(const G* g, const P* p, const void* m_codes, const void* v_codes,
                               int64_t at, int64_t count, const FVec& fm, const FVec& fv,
                               FVec (&gv)[2], FVec (&pv)[2], FVec (&mv)[2], FVec (&vv)[2]) {
  if (count == kBlock) {  // (load_block's partial path keeps it from inlining)
    Block<G>::load(g + at, gv[0], gv[1]);
    Block<P>::load(p + at, pv[0], pv[1]);
  } else {
    load_block(g + at, count, gv[0], gv[1]);
    load_block(p + at, count, pv[0], pv[1]);
  }
  decode_vectors<MC>(m_codes, at, count, fm, mv[0], mv[1]);
  decode_vectors<VC>(v_codes, at, count, fv, vv[0], vv[1]);
}

// One block's vectors of lean_moments_loop: [j, j + len) of the chunk, the
// previous block's codes written alongside. kWhole: len is a whole number of
// kBlock groups and each late block is empty or len long, so that no group is
// partial and no length is tested per group; the compiled loop then holds no
// partial-group path, which kept values on the stack across the whole loop.
template <bool kWhole, typename G, typename P, optim::StateCode MC, optim::StateCode VC,
          typename Rule>
AMP_CPU_INLINE void lean_block_vectors(const LeanChunkArgs& a, const Rule& rule, int64_t j,
                                       int64_t len, const FVec& fm, const FVec& fv, FVec& am,
                                       FVec& av, const LateCodes& late_m,
                                       const LateCodes& late_v) {
  const G* g = static_cast<const G*>(a.g);
  P* p = static_cast<P*>(a.p);
  float* mt = a.tiles;
  float* vt = a.tiles + a.tile;
  const uint32_t e_first = static_cast<uint32_t>(static_cast<uint64_t>(a.e0));
  for (int64_t i = 0; i < len; i += kBlock) {
    const int64_t c = kWhole ? kBlock : std::min<int64_t>(kBlock, len - i);
    const int64_t at = j + i;
    FVec gv[2], pv[2], mv[2], vv[2];
    load_group<G, P, MC, VC>(g, p, a.m_codes, a.v_codes, at, c, fm, fv, gv, pv, mv, vv);
    for (int k = 0; k < 2; ++k) {
      constexpr bool kRoot = VC == optim::StateCode::kSqrtU8;
      const FVec r = rule.template step<kRoot>(gv[k], pv[k], mv[k], vv[k]);
      if constexpr (kRoot) {
        vv[k] = r;  // the square-root code stores sqrt(v)
      }
    }
    keep_vectors<MC>(a.m_codes, mt, at, at, c, mv[0], mv[1], am);
    keep_vectors<VC>(a.v_codes, vt, at, at, c, vv[0], vv[1], av);
    if (a.model != nullptr) {
      store_model(a.model, a.model_dt, at, c, pv[0], pv[1]);
    }
    store_param(p + at, c, pv[0], pv[1], a.key, e_first + static_cast<uint32_t>(at));
    if (i < late_m.len) {
      write_late_group<kWhole, MC>(late_m, i);
    }
    if (i < late_v.len) {
      write_late_group<kWhole, VC>(late_v, i);
    }
  }
}

// A chunk of a lean-state row in one pass per block: grads of type G and
// params of type P (float or BFloat16) read and written in registers, the
// moments decoded in registers, updated by `rule`, and the block-scaled ones
// kept in an fp32 tile until the block's scale is known. The bits are those of
// the decode / fp32 rule / encode / stochastic_bf16 loops run one after
// another. Blocks must be whole kBlock groups except the last of a row.
//
// The update's square root and division are long-latency operations on one
// unit; the block-scaled codes (AVX-512) are written a block late, 32 values per
// step of the next block's loop, so that this work fills the time spent
// waiting on them rather than following it (the int8 step took 1.3x the bf16
// one when each block was coded after its loop).
template <typename G, typename P, optim::StateCode MC, optim::StateCode VC, typename Rule>
AMP_CPU_INLINE void lean_moments_loop(const LeanChunkArgs& args, const Rule rule) {
  // Locals, and a plain loop over the blocks (for_code_blocks' lambda is not
  // inlined, and behind a reference every float store could alias the fields,
  // which were then reloaded and re-tested for each vector).
  const LeanChunkArgs a = args;
  float* mt = a.tiles;
  float* vt = a.tiles + a.tile;
  LateCodes late_m, late_v;  // the previous block's
  int64_t b = 0;
  for (int64_t j = 0; j < a.n; j += a.block_size, ++b) {
    const int64_t len = std::min(a.block_size, a.n - j);
    const FVec fm = decode_factor<MC>(a.m_scales, b), fv = decode_factor<VC>(a.v_scales, b);
    FVec am(0.0f), av(0.0f);
    const bool whole = len % kBlock == 0 && (late_m.len == 0 || late_m.len == len) &&
                       (late_v.len == 0 || late_v.len == len);
    if (whole) {
      lean_block_vectors<true, G, P, MC, VC>(a, rule, j, len, fm, fv, am, av, late_m, late_v);
    } else {
      lean_block_vectors<false, G, P, MC, VC>(a, rule, j, len, fm, fv, am, av, late_m, late_v);
    }
    // What of the previous block this (shorter, a row's last) block did not cover.
    write_late_codes<MC>(late_m, std::min(len, late_m.len), late_m.len);
    write_late_codes<VC>(late_v, std::min(len, late_v.len), late_v.len);
    late_m = {};
    late_v = {};
    if constexpr (optim::block_scaled(MC)) {
      finish_block<MC>(mt + j, static_cast<CodeType<MC>*>(a.m_codes) + j, a.m_scales + b, len,
                       magnitude_max<MC>(am), late_m);
    }
    if constexpr (optim::block_scaled(VC)) {
      finish_block<VC>(vt + j, static_cast<CodeType<VC>*>(a.v_codes) + j, a.v_scales + b, len,
                       magnitude_max<VC>(av), late_v);
    }
  }
  write_late_codes<MC>(late_m, 0, late_m.len);
  write_late_codes<VC>(late_v, 0, late_v.len);
}

template <typename G, typename P, optim::StateCode MC, optim::StateCode VC>
void adam_lean_loop(const LeanChunkArgs& a, const optim::AdamHyper& h) {
  lean_moments_loop<G, P, MC, VC>(a, AdamLeanStep{h});
}

template <typename G, typename P, optim::StateCode C>
void sgd_lean_loop(const LeanChunkArgs& a, const optim::SgdHyper& h) {
  lean_moments_loop<G, P, C, kNoState>(a, SgdLeanStep{h});
}

template <typename G, typename P, optim::StateCode MC, optim::StateCode VC>
void lamb_lean_loop(const LeanChunkArgs& a, float ratio, const optim::LambHyper& h) {
  lean_moments_loop<G, P, MC, VC>(a, LambLeanStep{h, FVec(ratio)});
}

// LAMB's stage 1 over a chunk, writing nothing: the moments decoded in
// registers, the direction u of lamb_moments_loop's rule, and sums[0] +=
// sum(p^2) (when with_params), sums[1] += sum(u^2), the lanes added in
// lamb_moments_loop's order, so the sums have its bits.
template <typename G, typename P, optim::StateCode MC, optim::StateCode VC>
void lamb_lean_norms_loop(const LeanChunkArgs& args, bool with_params,
                          const optim::LambHyper& hyper, double* sums) {
  const LeanChunkArgs a = args;
  const optim::LambHyper h = hyper;
  const G* g = static_cast<const G*>(a.g);
  const P* p = static_cast<const P*>(a.p);
  FVec p_acc(0.0f), u_acc(0.0f);
  int64_t b = 0;
  for (int64_t j = 0; j < a.n; j += a.block_size, ++b) {
    const int64_t len = std::min(a.block_size, a.n - j);
    const FVec fm = decode_factor<MC>(a.m_scales, b), fv = decode_factor<VC>(a.v_scales, b);
    for (int64_t i = 0; i < len; i += kBlock) {
      const int64_t c = std::min<int64_t>(kBlock, len - i);
      FVec gv[2], pv[2], mv[2], vv[2];
      load_group<G, P, MC, VC>(g, p, a.m_codes, a.v_codes, j + i, c, fm, fv, gv, pv, mv, vv);
      for (int k = 0; k < 2; ++k) {
        const int64_t count = std::min<int64_t>(kW, c - k * kW);  // as for_vectors' counts
        if (count <= 0) {
          break;
        }
        const FVec u = optim::lamb_moments(gv[k], pv[k], mv[k], vv[k], h);
        add_squares(p_acc, pv[k], count);
        add_squares(u_acc, u, count);
      }
    }
  }
  if (with_params) {
    sums[0] += lane_sum(p_acc);
  }
  sums[1] += lane_sum(u_acc);
}

}  // namespace CPU_CAPABILITY
}  // namespace amp_patch::cpu
