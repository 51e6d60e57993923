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

// The lean ops' Adam (optim_math.h's adam_lean_update) over fp32 tiles: the
// decoded state of a tile the fused loop does not cover.
void adam_lean_tile_loop(const float* g, float* p, float* m, float* v, int64_t n,
                         const optim::AdamHyper& hyper) {
  const optim::AdamHyper h = hyper;
  for_vectors(n, [&](int64_t i, int64_t c) {
    FVec pv = load(p + i, c), mv = load(m + i, c), vv = load(v + i, c);
    optim::adam_lean_update(load(g + i, c), pv, mv, vv, h);
    mv.store(m + i, c);
    vv.store(v + i, c);
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

// The per-vector helpers of the fused loop must inline into it (as calls they
// pass their vectors through memory).
#if defined(__GNUC__)
#define AMP_LEAN_INLINE inline __attribute__((always_inline))
#else
#define AMP_LEAN_INLINE inline
#endif

// The first n (<= 16) lanes of an AVX-512 vector.
#if defined(CPU_CAPABILITY_AVX512)
inline __mmask16 lane_mask(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : (n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1u));
}
#endif

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

// Stores the block x (len values; sqrt(x) already for the square-root code)
// whose largest magnitude is s: factor = max / s; a block whose factor or s is
// not finite stores codes 0. The integer codes are rne(x * factor) clamped, a NaN
// product (an inf beside a finite factor) stored as 0, as torch casts NaN to
// an integer type. x is scratch.
template <optim::StateCode C>
inline void quantise_block(float* x, CodeType<C>* out, int64_t len, float s) {
  const float top = optim::code_max(C);
  const float factor = top / s;
  // An inf s gives the finite factor 0: such a block is unusable too (the reference's rule).
  if (!std::isfinite(factor) || !std::isfinite(s)) {
    std::memset(static_cast<void*>(out), 0, len);
    return;
  }
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (C != optim::StateCode::kE4M3) {
    // A finite non-zero factor: every x is finite (|x| <= s), so is x * factor,
    // and converting with round-to-nearest-even then clamping the integers is
    // rne and clamp in fp32.
    if (factor != 0.0f) {
      const __m512 f = _mm512_set1_ps(factor);
      const __m512i lo = _mm512_set1_epi32(C == optim::StateCode::kInt8 ? -127 : 1);
      // Clamped below, then narrowed with saturation above (top is the type's largest).
      auto code = [&](const __m512 xv) {
        const __m512 y = _mm512_mul_ps(xv, f);
        const __m512i q = _mm512_max_epi32(
            _mm512_cvt_roundps_epi32(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo);
        return C == optim::StateCode::kInt8 ? _mm512_cvtsepi32_epi8(q) : _mm512_cvtusepi32_epi8(q);
      };
      int64_t i = 0;
      for (; i + 16 <= len; i += 16) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), code(_mm512_loadu_ps(x + i)));
      }
      if (i < len) {
        const __mmask16 m = lane_mask(len - i);
        _mm_mask_storeu_epi8(out + i, m, code(_mm512_maskz_loadu_ps(m, x + i)));
      }
      return;
    }
  }
#endif
  const FVec fv(factor);
  if constexpr (C == optim::StateCode::kE4M3) {
    for_vectors(len, [&](int64_t i, int64_t w) { (load(x + i, w) * fv).store(x + i, w); });
    for (int64_t k = 0; k < len; ++k) {
      out[k] = c10::Float8_e4m3fn(x[k]).x;
    }
  } else {
    for_vectors(len, [&](int64_t i, int64_t w) {
      (load(x + i, w) * fv).round().store(x + i, w);  // round half to even
    });
    const float lo = C == optim::StateCode::kInt8 ? -127.0f : 1.0f;
    for (int64_t k = 0; k < len; ++k) {
      const float q = x[k];
      const float clamped = std::min(std::max(q, lo), top);
      out[k] = q != q ? CodeType<C>(0) : static_cast<CodeType<C>>(static_cast<int32_t>(clamped));
    }
  }
}

// s = the block's largest magnitude (of sqrt(x) for the square-root code).
template <optim::StateCode C>
void scaled_encode(float* x, void* codes, float* scales, int64_t n, int64_t block_size) {
  CodeType<C>* c = static_cast<CodeType<C>*>(codes);
  for_code_blocks(n, block_size, [&](int64_t b, int64_t j, int64_t len) {
    float* xb = x + j;
    if constexpr (C == optim::StateCode::kSqrtU8) {
      for_vectors(len, [&](int64_t i, int64_t w) { load(xb + i, w).sqrt().store(xb + i, w); });
    }
    const float s = block_absmax(xb, len);
    scales[b] = s;
    quantise_block<C>(xb, c + j, len, s);
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

// The largest lane of a vector of magnitudes, NaN when any lane is NaN.
inline float lanes_max(const FVec& acc) {
  float lanes[FVec::size()];
  acc.store(lanes);
  float m = 0.0f;
  for (float v : lanes) {
    m = (v != v || v > m) ? v : m;
  }
  return m;
}

// Reads `count` (<= kBlock) values of state code C at element `at` as two fp32
// vectors: the codes times the block's decode factor f (squared for the
// square-root code), or the bf16 / fp32 state itself. Lanes past count are 0.
template <optim::StateCode C>
AMP_LEAN_INLINE void decode_vectors(const void* codes, int64_t at, int64_t count, const FVec& f, FVec& lo,
                           FVec& hi) {
  using optim::StateCode;
  if constexpr (C == StateCode::kBF16) {
    load_block(static_cast<const c10::BFloat16*>(codes) + at, count, lo, hi);
  } else if constexpr (C == StateCode::kF32) {
    load_block(static_cast<const float*>(codes) + at, count, lo, hi);
  } else {
    const CodeType<C>* q = static_cast<const CodeType<C>*>(codes) + at;
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (C != StateCode::kE4M3) {
      static_assert(kW == 16, "AVX-512 holds 16 floats");
      const __m128i b0 = _mm_maskz_loadu_epi8(lane_mask(count), q);
      const __m128i b1 = _mm_maskz_loadu_epi8(lane_mask(count - 16), q + 16);
      const bool s8 = C == StateCode::kInt8;
      lo = FVec(_mm512_cvtepi32_ps(s8 ? _mm512_cvtepi8_epi32(b0) : _mm512_cvtepu8_epi32(b0))) * f;
      hi = FVec(_mm512_cvtepi32_ps(s8 ? _mm512_cvtepi8_epi32(b1) : _mm512_cvtepu8_epi32(b1))) * f;
      if constexpr (C == StateCode::kSqrtU8) {
        lo = lo * lo;
        hi = hi * hi;
      }
      return;
    }
#endif
    alignas(64) float t[kBlock];
    auto value = [&](int64_t k) {
      if constexpr (C == StateCode::kE4M3) {
        return static_cast<float>(c10::Float8_e4m3fn(q[k], c10::Float8_e4m3fn::from_bits()));
      } else {
        return static_cast<float>(q[k]);
      }
    };
    if (count == kBlock) {
      for (int64_t k = 0; k < kBlock; ++k) {
        t[k] = value(k);
      }
    } else {
      for (int64_t k = 0; k < kBlock; ++k) {
        t[k] = k < count ? value(k) : 0.0f;
      }
    }
    lo = FVec::loadu(t) * f;
    hi = FVec::loadu(t + kW) * f;
    if constexpr (C == StateCode::kSqrtU8) {
      lo = lo * lo;
      hi = hi * hi;
    }
  }
}

// Writes `count` values of the new state (sqrt already taken for the
// square-root code): bf16 / fp32 state where it lies, block-scaled codes into
// the block's fp32 tile (quantised once the block is done), tracking the
// largest magnitude of the lanes written.
template <optim::StateCode C>
AMP_LEAN_INLINE void keep_vectors(void* codes, float* tile, int64_t at, int64_t tile_at, int64_t count,
                         const FVec& lo, const FVec& hi, FVec& amax) {
  using optim::StateCode;
  if constexpr (C == StateCode::kBF16) {
    store_block(static_cast<c10::BFloat16*>(codes) + at, count, lo, hi);
  } else if constexpr (C == StateCode::kF32) {
    store_block(static_cast<float*>(codes) + at, count, lo, hi);
  } else {
    store_block(tile + tile_at, count, lo, hi);
    if (count == kBlock) {
      amax = at::vec::maximum(amax, at::vec::maximum(lo.abs(), hi.abs()));
    } else {
      const int64_t c0 = std::min<int64_t>(count, kW), c1 = count - c0;
      amax = at::vec::maximum(amax, FVec::set(FVec(0.0f), lo.abs(), c0));
      amax = at::vec::maximum(amax, FVec::set(FVec(0.0f), hi.abs(), c1));
    }
  }
}

// `count` params from two fp32 vectors: fp32 as they are, bf16 stochastically
// rounded with the bits of elements e .. e + count (see stochastic_bf16_loop).
template <typename P>
AMP_LEAN_INLINE void store_param(P* p, int64_t count, const FVec& lo, const FVec& hi, uint32_t key,
                        uint32_t e) {
  if constexpr (std::is_same_v<P, float>) {
    store_block(p, count, lo, hi);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i k0 = _mm512_set1_epi32(static_cast<int>(optim::kHashK0));
    const __m512i k1 = _mm512_set1_epi32(static_cast<int>(optim::kHashK1));
    const __m512i k2 = _mm512_set1_epi32(static_cast<int>(optim::kHashK2));
    const __m512i exp_mask = _mm512_set1_epi32(0x7F800000);
    for (int half = 0; half < 2; ++half) {
      const __m512i u = _mm512_castps_si512(half == 0 ? __m512(lo) : __m512(hi));
      const __m512i idx =
          _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(e + 16u * half)), iota);
      __m512i x = _mm512_xor_si512(_mm512_set1_epi32(static_cast<int>(key)),
                                   _mm512_mullo_epi32(idx, k0));
      x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
      x = _mm512_mullo_epi32(x, k1);
      x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 13));
      x = _mm512_mullo_epi32(x, k2);
      x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
      const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_srli_epi32(x, 16)), 16);
      const __mmask16 finite =
          _mm512_cmpneq_epi32_mask(_mm512_and_si512(u, exp_mask), exp_mask);
      const __mmask16 nan_bits = _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x7FFFFF));
      const __m512i high = _mm512_srli_epi32(u, 16);
      const __m512i nearest = _mm512_mask_or_epi32(high, nan_bits, high, _mm512_set1_epi32(0x40));
      const __m256i out = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(finite, nearest, rounded));
      uint16_t* dst = reinterpret_cast<uint16_t*>(p) + 16 * half;
      if (count == kBlock) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), out);
      } else {
        _mm256_mask_storeu_epi16(dst, lane_mask(count - 16 * half), out);
      }
    }
    return;
#endif
    alignas(64) float x[kBlock];
    lo.store(x);
    hi.store(x + kW);
    alignas(64) uint16_t o[kBlock];
    for (int64_t k = 0; k < kBlock; ++k) {
      uint32_t u;
      std::memcpy(&u, x + k, sizeof(u));
      const uint32_t r =
          optim::fmix32(key ^ ((e + static_cast<uint32_t>(k)) * optim::kHashK0)) >> 16;
      const uint32_t nearest = (u >> 16) | ((u & 0x7FFFFFu) != 0 ? 0x40u : 0u);
      o[k] = static_cast<uint16_t>(optim::finite_bits(u) ? (u + r) >> 16 : nearest);
    }
    if (count == kBlock) {
      std::memcpy(static_cast<void*>(p), o, sizeof(o));
    } else {
      std::memcpy(static_cast<void*>(p), o, count * sizeof(uint16_t));
    }
  }
}

// Adam over a chunk in one pass per block: grads of type G and params of type
// P (float or BFloat16) read and written in registers, the moments decoded in
// registers, updated by adam_lean_tile_loop's rule, and the block-scaled ones kept in an
// fp32 tile until the block's scale is known. The bits are those of the
// decode / adam_lean_tile / encode / stochastic_bf16 loops run one after another.
// Blocks must be whole kBlock groups except the last of a row (block_size a
// multiple of 32). p_out (may be null) receives the updated fp32 params.
template <typename G, typename P, optim::StateCode MC, optim::StateCode VC>
void adam_lean_loop(const void* grads, void* params, void* m_codes, float* m_scales,
                    void* v_codes, float* v_scales, float* p_out, float* tiles, int64_t tile,
                    int64_t n, int64_t block_size, uint32_t key, int64_t e0,
                    const optim::AdamHyper& hyper) {
  const optim::AdamHyper h = hyper;
  const G* g = static_cast<const G*>(grads);
  P* p = static_cast<P*>(params);
  float* mt = tiles;
  float* vt = tiles + tile;
  const uint32_t e_first = static_cast<uint32_t>(static_cast<uint64_t>(e0));
  for_code_blocks(n, block_size, [&](int64_t b, int64_t j, int64_t len) {
    const FVec fm(optim::block_scaled(MC) ? m_scales[b] / optim::code_max(MC) : 1.0f);
    const FVec fv(optim::block_scaled(VC) ? v_scales[b] / optim::code_max(VC) : 1.0f);
    FVec am(0.0f), av(0.0f);
    for (int64_t i = 0; i < len; i += kBlock) {
      const int64_t c = std::min<int64_t>(kBlock, len - i);
      const int64_t at = j + i;
      FVec gv[2], pv[2], mv[2], vv[2];
      if (c == kBlock) {  // (load_block's partial path keeps it from inlining)
        Block<G>::load(g + at, gv[0], gv[1]);
        Block<P>::load(p + at, pv[0], pv[1]);
      } else {
        load_block(g + at, c, gv[0], gv[1]);
        load_block(p + at, c, pv[0], pv[1]);
      }
      decode_vectors<MC>(m_codes, at, c, fm, mv[0], mv[1]);
      decode_vectors<VC>(v_codes, at, c, fv, vv[0], vv[1]);
      for (int k = 0; k < 2; ++k) {
        const FVec r = optim::adam_lean_update(gv[k], pv[k], mv[k], vv[k], h);
        if constexpr (VC == optim::StateCode::kSqrtU8) {
          vv[k] = r;  // the square-root code stores sqrt(v)
        }
      }
      keep_vectors<MC>(m_codes, mt, at, i, c, mv[0], mv[1], am);
      keep_vectors<VC>(v_codes, vt, at, i, c, vv[0], vv[1], av);
      if (p_out != nullptr) {
        store_block(p_out + at, c, pv[0], pv[1]);
      }
      store_param(p + at, c, pv[0], pv[1], key, e_first + static_cast<uint32_t>(at));
    }
    if constexpr (optim::block_scaled(MC)) {
      const float s = lanes_max(am);
      m_scales[b] = s;
      quantise_block<MC>(mt, static_cast<CodeType<MC>*>(m_codes) + j, len, s);
    }
    if constexpr (optim::block_scaled(VC)) {
      const float s = lanes_max(av);
      v_scales[b] = s;
      quantise_block<VC>(vt, static_cast<CodeType<VC>*>(v_codes) + j, len, s);
    }
  });
}

template <typename G, typename P, int MI, int VI>
void fill_adam_lean(OptimTable& t) {
  constexpr optim::StateCode kM[] = {optim::StateCode::kBF16, optim::StateCode::kInt8,
                                     optim::StateCode::kE4M3};
  constexpr optim::StateCode kV[] = {optim::StateCode::kBF16, optim::StateCode::kSqrtU8,
                                     optim::StateCode::kE4M3};
  constexpr int gi = std::is_same_v<G, float> ? kF32 : (std::is_same_v<G, c10::Half> ? kF16 : kBF16);
  constexpr int pi = std::is_same_v<P, float> ? 0 : 1;
  t.adam_lean_fused[gi][pi][MI][VI] = &adam_lean_loop<G, P, kM[MI], kV[VI]>;
}

template <typename G, typename P>
void fill_adam_lean_codes(OptimTable& t) {
  fill_adam_lean<G, P, 0, 0>(t);
  fill_adam_lean<G, P, 0, 1>(t);
  fill_adam_lean<G, P, 0, 2>(t);
  fill_adam_lean<G, P, 1, 0>(t);
  fill_adam_lean<G, P, 1, 1>(t);
  fill_adam_lean<G, P, 1, 2>(t);
  fill_adam_lean<G, P, 2, 0>(t);
  fill_adam_lean<G, P, 2, 1>(t);
  fill_adam_lean<G, P, 2, 2>(t);
}

OptimTable optim_table() {
  using optim::StateCode;
  // By position: the members of OptimTable in order; the codes in StateCode's order.
  OptimTable t{&adam_loop,
               &adam_lean_tile_loop,
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
               {},
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
  fill_adam_lean_codes<float, float>(t);
  fill_adam_lean_codes<Half, float>(t);
  fill_adam_lean_codes<BFloat16, float>(t);
  fill_adam_lean_codes<float, BFloat16>(t);
  fill_adam_lean_codes<Half, BFloat16>(t);
  fill_adam_lean_codes<BFloat16, BFloat16>(t);
  return t;
}

}  // namespace CPU_CAPABILITY
}  // namespace amp_patch::cpu
