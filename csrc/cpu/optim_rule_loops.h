// The vectorised fp32 loops of the optimizer ops' update rules, one per rule
// of csrc/optim_math.h, over fp32 arrays (optim_table.h's adam, adam_lean,
// sgd, adagrad, novograd, lamb_moments and lamb_apply), and the vector
// helpers the lean loops share with them. Like vec_loops.h, this header is
// compiled once per instruction set: csrc/cpu/isa/{default,avx2,avx512}.cpp
// include it (through optim_loops.h) after vec_loops.h, with CPU_CAPABILITY and
// the compiler's target set first; vec_loops.h explains how the copies coexist
// in one library and stay off CPUs that lack the ISA.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace amp_patch::optim {
// Correctly rounded in every ISA (vsqrtps, or std::sqrt per lane), unlike
// torch.sqrt on CPU; the reference ops round a float64 sqrt instead.
inline at::vec::Vectorized<float> sqrt_rn(const at::vec::Vectorized<float>& x) {
  return x.sqrt();
}
}  // namespace amp_patch::optim

#include "cpu/optim_table.h"
#include "cpu/vec_loops.h"

namespace amp_patch::cpu {
namespace CPU_CAPABILITY {

using FVec = at::vec::Vectorized<float>;

// Calls body(i, count) over [0, n) one vector at a time; count < FVec::size()
// only for the last. Partial loads fill the missing lanes with zeros, and
// partial stores leave the memory past the end alone.
template <typename Body>
inline void for_vectors(int64_t n, Body&& body) {
  constexpr int64_t w = FVec::size();
  int64_t i = 0;
  for (; i + w <= n; i += w) {
    body(i, w);
  }
  if (i < n) {
    body(i, n - i);
  }
}

inline FVec load(const float* p, int64_t count) {
  return FVec::loadu(p, count);
}

// The sum of the first `count` lanes of x * x, added into acc.
inline void add_squares(FVec& acc, const FVec& x, int64_t count) {
  const FVec y = count == FVec::size() ? x : FVec::set(FVec(0.0f), x, count);
  acc = at::vec::fmadd(y, y, acc);
}

inline double lane_sum(const FVec& acc) {
  float lanes[FVec::size()];
  acc.store(lanes);
  double total = 0.0;
  for (float v : lanes) {
    total += v;
  }
  return total;
}

// Division by one of Adam's bias corrections d, as optim::bias_corrected
// divides (nothing when d is 1), made once per loop. With `multiply` (the op's
// data fits in the last-level cache: AdamHyper::multiply_divisions) and d in
// (0, 1], on AVX2 and AVX-512, x is widened to float64, multiplied by 1 / d
// (float64, computed here once) and rounded once to fp32: the division's bits for every x, zeros,
// infinities and NaN included. The float64 product is within 2**-52 of x / d,
// relative, and a quotient of two fp32 values with 0 < d <= 1 is never an fp32
// rounding midpoint and lies at least 2**-49 from one (the argument is in
// docs/optimizers.md, "Dividing by a bias correction"). Two conversions each
// way and two multiplies take the place of a division, whose unit the rule's
// square root and other division also need: 20-25% off a step whose data is
// in cache. A step that streams from memory ran 5-10% slower so, so it
// divides, as do other divisors and the build without AVX2. Round-to-nearest (the default, which torch never
// changes) is assumed, as by every rule here.
class FixedDivisor {
 public:
  FixedDivisor(float d, bool multiply)
      : d_(d),
        inverse_(multiply && d > 0.0f && d <= 1.0f ? 1.0 / static_cast<double>(d) : 0.0) {}

  AMP_CPU_INLINE FVec operator()(const FVec& x) const {
    if (d_ == 1.0f) {
      return x;
    }
#if defined(CPU_CAPABILITY_AVX512)
    if (inverse_ != 0.0) {
      const __m512d inv = _mm512_set1_pd(inverse_);
      const __m512 v = x;
      const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
      const __m512d hi =
          _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
      const __m256 qlo = _mm512_cvtpd_ps(_mm512_mul_pd(lo, inv));
      const __m256 qhi = _mm512_cvtpd_ps(_mm512_mul_pd(hi, inv));
      return _mm512_insertf32x8(_mm512_castps256_ps512(qlo), qhi, 1);
    }
#elif defined(CPU_CAPABILITY_AVX2)
    if (inverse_ != 0.0) {
      const __m256d inv = _mm256_set1_pd(inverse_);
      const __m256 v = x;
      const __m128 qlo =
          _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), inv));
      const __m128 qhi =
          _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)), inv));
      return _mm256_insertf128_ps(_mm256_castps128_ps256(qlo), qhi, 1);
    }
#endif
    return x / FVec(d_);
  }

 private:
  float d_;
  double inverse_;  // 1 / d_ when d_ is in (0, 1], else 0 (divide)
};

// Each loop copies its hyper-parameters into a local first: the stores through
// the float pointers could alias a struct behind a reference, so the compiler
// would reload every field (and re-test every flag) once per vector.

// Adam over fp32 tiles: Apex's rule (OptimTable::adam), or the lean ops'
// (OptimTable::adam_lean: the decoded state of a tile the fused loop does not cover).
template <bool kLean>
void adam_tile_loop(const float* g, float* p, float* m, float* v, int64_t n,
                    const optim::AdamHyper& hyper) {
  const optim::AdamHyper h = hyper;
  const FixedDivisor bc1(h.bias_correction1, h.multiply_divisions),
      bc2(h.bias_correction2, h.multiply_divisions);
  for_vectors(n, [&](int64_t i, int64_t c) {
    FVec pv = load(p + i, c), mv = load(m + i, c), vv = load(v + i, c);
    // The moments are stored before the param's division and square-root chain:
    // it holds the loads of the next vectors back less (2-5% in a harness over
    // 20 M params, at 1 and 2 threads).
    optim::adam_update_moments(load(g + i, c), pv, mv, vv, h);
    mv.store(m + i, c);
    vv.store(v + i, c);
    if constexpr (kLean) {
      optim::adam_lean_param(pv, mv, vv, h);
    } else {
      optim::adam_update_param_corrected(pv, bc1(mv), bc2(vv), h);
    }
    pv.store(p + i, c);
  });
}

// Adam over fp32 params and moments with grads of type G, writing the updated
// params rounded to M into the model copy (M = void: none): the one-pass O2
// step (bf16 grads, fp32 masters, bf16 model) reads and writes each element
// once, with the grads widened and the params narrowed in registers rather
// than through fp32 tiles. The conversions are the copy loops' own
// (load_block, store_block) and the update is adam_tile_loop<false>'s, so the
// bits are those of that loop between copy_loop calls.
template <typename G, typename M>
void adam_mixed_loop(const void* grads, float* p, float* m, float* v, void* model, int64_t n,
                     const optim::AdamHyper& hyper) {
  const optim::AdamHyper h = hyper;
  const FixedDivisor bc1(h.bias_correction1, h.multiply_divisions),
      bc2(h.bias_correction2, h.multiply_divisions);
  const G* g = static_cast<const G*>(grads);
  for_blocks(0, n, [&](int64_t i, int64_t c) {
    FVec gv[2], pv[2];
    load_block(g + i, c, gv[0], gv[1]);
    for (int k = 0; k < 2; ++k) {
      const int64_t at = i + k * kW;
      const int64_t ck = std::min<int64_t>(std::max<int64_t>(c - k * kW, 0), kW);
      FVec pk = load(p + at, ck), mk = load(m + at, ck), vk = load(v + at, ck);
      optim::adam_update_moments(gv[k], pk, mk, vk, h);
      mk.store(m + at, ck);
      vk.store(v + at, ck);
      optim::adam_update_param_corrected(pk, bc1(mk), bc2(vk), h);
      pk.store(p + at, ck);
      pv[k] = pk;
    }
    if constexpr (!std::is_void_v<M>) {
      store_block(static_cast<M*>(model) + i, c, pv[0], pv[1]);
    }
  });
}

template <bool WithMomentum>
void sgd_loop_impl(const float* g, float* p, float* mom, int64_t n, const optim::SgdHyper& hyper) {
  const optim::SgdHyper h = hyper;
  for_vectors(n, [&](int64_t i, int64_t c) {
    FVec pv = load(p + i, c);
    if constexpr (WithMomentum) {
      FVec mv = load(mom + i, c);
      optim::sgd_update(load(g + i, c), pv, &mv, h);
      mv.store(mom + i, c);
    } else {
      optim::sgd_update(load(g + i, c), pv, static_cast<FVec*>(nullptr), h);
    }
    pv.store(p + i, c);
  });
}

void sgd_loop(const float* g, float* p, float* mom, int64_t n, const optim::SgdHyper& hyper) {
  if (hyper.momentum != 0.0f) {
    sgd_loop_impl<true>(g, p, mom, n, hyper);
  } else {
    sgd_loop_impl<false>(g, p, mom, n, hyper);
  }
}

void adagrad_loop(const float* g, float* p, float* sum, int64_t n,
                  const optim::AdagradHyper& hyper) {
  const optim::AdagradHyper h = hyper;
  for_vectors(n, [&](int64_t i, int64_t c) {
    FVec pv = load(p + i, c), sv = load(sum + i, c);
    optim::adagrad_update(load(g + i, c), pv, sv, h);
    pv.store(p + i, c);
    sv.store(sum + i, c);
  });
}

void novograd_loop(const float* g, float* p, float* m, int64_t n, float denom,
                   const optim::NovoGradHyper& hyper) {
  const optim::NovoGradHyper h = hyper;
  const FVec d(denom);
  for_vectors(n, [&](int64_t i, int64_t c) {
    FVec pv = load(p + i, c), mv = load(m + i, c);
    optim::novograd_update(load(g + i, c), pv, mv, d, h);
    pv.store(p + i, c);
    mv.store(m + i, c);
  });
}

void lamb_moments_loop(const float* g, const float* p, float* m, float* v, int64_t n,
                       const optim::LambHyper& hyper, double* sums) {
  const optim::LambHyper h = hyper;
  FVec p_acc(0.0f), u_acc(0.0f);
  for_vectors(n, [&](int64_t i, int64_t c) {
    // Without p (no weight decay, no trust ratio wanted) the terms that use it are skipped.
    const FVec pv = p != nullptr ? load(p + i, c) : FVec(0.0f);
    FVec mv = load(m + i, c), vv = load(v + i, c);
    const FVec u = optim::lamb_moments(load(g + i, c), pv, mv, vv, h);
    mv.store(m + i, c);
    vv.store(v + i, c);
    add_squares(p_acc, pv, c);
    add_squares(u_acc, u, c);
  });
  if (p != nullptr) {
    sums[0] += lane_sum(p_acc);
  }
  sums[1] += lane_sum(u_acc);
}

void lamb_apply_loop(float* p, const float* m, const float* v, int64_t n, float ratio,
                     const optim::LambHyper& hyper) {
  const optim::LambHyper h = hyper;
  const FVec r(ratio);
  for_vectors(n, [&](int64_t i, int64_t c) {
    FVec pv = load(p + i, c);
    optim::lamb_apply(pv, load(m + i, c), load(v + i, c), r, h);
    pv.store(p + i, c);
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace amp_patch::cpu
