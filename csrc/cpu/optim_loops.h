// The vectorised fp32 loops of the optimizer ops, one per update rule of
// optim_math.h. Like vec_loops.h, and in the same translation units
// (csrc/cpu/isa/{default,avx2,avx512}.cpp include both), this header is
// compiled once per instruction set with CPU_CAPABILITY and the compiler's
// target set first; vec_loops.h explains how the copies coexist in one library
// and stay off CPUs that lack the ISA.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace amp_patch::optim {
// Correctly rounded in every ISA (vsqrtps, or std::sqrt per lane), unlike
// torch.sqrt on CPU; the reference ops round a float64 sqrt instead.
inline at::vec::Vectorized<float> sqrt_rn(const at::vec::Vectorized<float>& x) {
  return x.sqrt();
}
}  // namespace amp_patch::optim

#include "cpu/optim_table.h"

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

// Each loop copies its hyper-parameters into a local first: the stores through
// the float pointers could alias a struct behind a reference, so the compiler
// would reload every field (and re-test every flag) once per vector.

void adam_loop(const float* g, float* p, float* m, float* v, int64_t n,
               const optim::AdamHyper& hyper) {
  const optim::AdamHyper h = hyper;
  for_vectors(n, [&](int64_t i, int64_t c) {
    FVec pv = load(p + i, c), mv = load(m + i, c), vv = load(v + i, c);
    // The moments are stored before the param's division and square-root chain:
    // it holds the loads of the next vectors back less (2-5% in a harness over
    // 20 M params, at 1 and 2 threads).
    optim::adam_update_moments(load(g + i, c), pv, mv, vv, h);
    mv.store(m + i, c);
    vv.store(v + i, c);
    optim::adam_update_param(pv, mv, vv, h);
    pv.store(p + i, c);
  });
}

// Adam over fp32 params and moments with grads of type G, writing the updated
// params rounded to M into the model copy (M = void: none): the one-pass O2
// step (bf16 grads, fp32 masters, bf16 model) reads and writes each element
// once, with the grads widened and the params narrowed in registers rather
// than through fp32 tiles. The conversions are the copy loops' own
// (load_block, store_block) and the update is adam_loop's, so the bits are
// those of adam_loop between copy_loop calls.
template <typename G, typename M>
void adam_mixed_loop(const void* grads, float* p, float* m, float* v, void* model, int64_t n,
                     const optim::AdamHyper& hyper) {
  const optim::AdamHyper h = hyper;
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
      optim::adam_update_param(pk, mk, vk, h);
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

// ---------------------------------------------------------------- lean state
// The codes of the lean-state ops (optim_math.h's StateCode; the rules and the
// reference in amp_patch/ops/lean_state_ops.py). Each loop covers n elements
// of one row from a block boundary; block b of them has scales[b].

// Calls f(block, offset, length) for each block of [0, n).
template <typename F>
inline void for_code_blocks(int64_t n, int64_t block_size, F&& f) {
  int64_t b = 0;
  for (int64_t j = 0; j < n; j += block_size, ++b) {
    f(b, j, std::min(block_size, n - j));
  }
}

void f32_decode(const void* codes, const float*, float* out, int64_t n, int64_t) {
  std::memcpy(out, codes, n * sizeof(float));
}

void f32_encode(float* x, void* codes, float*, int64_t n, int64_t) {
  std::memcpy(codes, x, n * sizeof(float));
}

void bf16_decode(const void* codes, const float*, float* out, int64_t n, int64_t) {
  copy_loop<c10::BFloat16, float>(codes, out, n);
}

void bf16_encode(float* x, void* codes, float*, int64_t n, int64_t) {
  copy_loop<float, c10::BFloat16>(x, codes, n);
}

template <optim::StateCode C>
using CodeType = std::conditional_t<C == optim::StateCode::kInt8, int8_t, uint8_t>;

// q * (s / max), one fp32 division per block; the square-root code squares it.
template <optim::StateCode C>
void scaled_decode(const void* codes, const float* scales, float* out, int64_t n,
                   int64_t block_size) {
  const float top = optim::code_max(C);
  const CodeType<C>* c = static_cast<const CodeType<C>*>(codes);
  for_code_blocks(n, block_size, [&](int64_t b, int64_t j, int64_t len) {
    const float f = scales[b] / top;
    const CodeType<C>* cb = c + j;
    float* ob = out + j;
    if constexpr (C == optim::StateCode::kE4M3) {
      for (int64_t k = 0; k < len; ++k) {
        ob[k] = static_cast<float>(c10::Float8_e4m3fn(cb[k], c10::Float8_e4m3fn::from_bits())) * f;
      }
    } else if constexpr (C == optim::StateCode::kSqrtU8) {
      for (int64_t k = 0; k < len; ++k) {
        const float r = static_cast<float>(cb[k]) * f;
        ob[k] = r * r;
      }
    } else {
      for (int64_t k = 0; k < len; ++k) {
        ob[k] = static_cast<float>(cb[k]) * f;
      }
    }
  });
}

// The largest |x| of a block, NaN when any element is NaN (torch's amax).
inline float block_absmax(const float* x, int64_t len) {
  FVec acc(0.0f);
  for_vectors(len, [&](int64_t i, int64_t c) {
    acc = at::vec::maximum(acc, load(x + i, c).abs());  // the zero padding changes nothing
  });
  float lanes[FVec::size()];
  acc.store(lanes);
  float m = 0.0f;
  for (float v : lanes) {
    m = (v != v || v > m) ? v : m;  // once NaN, stays NaN
  }
  return m;
}

// s = the block's largest magnitude (of sqrt(x) for the square-root code),
// factor = max / s; a block whose factor is not finite stores codes 0. The
// integer codes are rne(x * factor) clamped, a NaN product (an inf beside a
// finite factor) stored as 0, as torch casts NaN to an integer type.
template <optim::StateCode C>
void scaled_encode(float* x, void* codes, float* scales, int64_t n, int64_t block_size) {
  const float top = optim::code_max(C);
  CodeType<C>* c = static_cast<CodeType<C>*>(codes);
  for_code_blocks(n, block_size, [&](int64_t b, int64_t j, int64_t len) {
    float* xb = x + j;
    CodeType<C>* cb = c + j;
    if constexpr (C == optim::StateCode::kSqrtU8) {
      for_vectors(len, [&](int64_t i, int64_t w) { load(xb + i, w).sqrt().store(xb + i, w); });
    }
    const float s = block_absmax(xb, len);
    scales[b] = s;
    const float factor = top / s;
    if (!std::isfinite(factor)) {
      std::memset(static_cast<void*>(cb), 0, len);
      return;
    }
    const FVec fv(factor);
    if constexpr (C == optim::StateCode::kE4M3) {
      for_vectors(len, [&](int64_t i, int64_t w) { (load(xb + i, w) * fv).store(xb + i, w); });
      for (int64_t k = 0; k < len; ++k) {
        cb[k] = c10::Float8_e4m3fn(xb[k]).x;
      }
    } else {
      for_vectors(len, [&](int64_t i, int64_t w) {
        (load(xb + i, w) * fv).round().store(xb + i, w);  // round half to even
      });
      const float lo = C == optim::StateCode::kInt8 ? -127.0f : 1.0f;
      for (int64_t k = 0; k < len; ++k) {
        const float q = xb[k];
        const float clamped = std::min(std::max(q, lo), top);
        cb[k] = q != q ? CodeType<C>(0)
                       : static_cast<CodeType<C>>(static_cast<int32_t>(clamped));
      }
    }
  });
}

// The bits of element e0 + k of the tensor with key `key` are added to the
// low half of its fp32 pattern, which is then cut; a non-finite value keeps
// its high half (a NaN stays a NaN).
void stochastic_bf16_loop(const float* x, void* out, int64_t n, uint32_t key, int64_t e0) {
  uint16_t* o = static_cast<uint16_t*>(out);
  const uint32_t first = static_cast<uint32_t>(static_cast<uint64_t>(e0));
  for (int64_t k = 0; k < n; ++k) {
    uint32_t u;
    std::memcpy(&u, x + k, sizeof(u));
    const uint32_t r =
        optim::fmix32(key ^ ((first + static_cast<uint32_t>(k)) * optim::kHashK0)) >> 16;
    const uint32_t nearest = (u >> 16) | ((u & 0x7FFFFFu) != 0 ? 0x40u : 0u);
    o[k] = static_cast<uint16_t>(optim::finite_bits(u) ? (u + r) >> 16 : nearest);
  }
}

OptimTable optim_table() {
  using optim::StateCode;
  // By position: the members of OptimTable in order; the codes in StateCode's order.
  OptimTable t{&adam_loop,
               &sgd_loop,
               &adagrad_loop,
               &novograd_loop,
               &lamb_moments_loop,
               &lamb_apply_loop,
               {&f32_decode, &bf16_decode, &scaled_decode<StateCode::kInt8>,
                &scaled_decode<StateCode::kSqrtU8>, &scaled_decode<StateCode::kE4M3>},
               {&f32_encode, &bf16_encode, &scaled_encode<StateCode::kInt8>,
                &scaled_encode<StateCode::kSqrtU8>, &scaled_encode<StateCode::kE4M3>},
               &stochastic_bf16_loop,
               {}};
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
  return t;
}

}  // namespace CPU_CAPABILITY
}  // namespace amp_patch::cpu
