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

// Adam over fp32 tiles: Apex's rule (OptimTable::adam), or the lean ops'
// (OptimTable::adam_lean: the decoded state of a tile the fused loop does not cover).
template <bool kLean>
void adam_tile_loop(const float* g, float* p, float* m, float* v, int64_t n,
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
    if constexpr (kLean) {
      optim::adam_lean_param(pv, mv, vv, h);
    } else {
      optim::adam_update_param(pv, mv, vv, h);
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

// The state a fused loop does not have: SGD's second, or its only one when
// momentum is 0. Nothing is read or written for it (decode_vectors and
// keep_vectors), and it is not block-scaled.
constexpr optim::StateCode kNoState = static_cast<optim::StateCode>(optim::kNumStateCodes);

#if defined(CPU_CAPABILITY_AVX512)
// float8_e4m3fn codes <-> fp32 for 16 lanes, bit for bit c10's scalar
// conversions (fp8e4m3fn_to_fp32_value / fp8e4m3fn_from_fp32_value, whose
// steps are named below), which the reference's .to() runs.
AMP_CPU_INLINE __m512 e4m3_to_float(const __m128i bytes) {
  const __m512i x = _mm512_cvtepu8_epi32(bytes);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
  const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi32(0x7F));
  // Normal: the exponent rebased by 127 - 7 and the 3 mantissa bits moved up;
  // 0x7F (NaN) gets the all-ones exponent on top, as inf_nan_mask does.
  __m512i bits = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
  bits = _mm512_mask_or_epi32(bits, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)), bits,
                              _mm512_set1_epi32(0x7F800000));
  // Zero and subnormal (exponent 0): m * 2^-9, exact (the renormalising shift).
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f));
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)),
                               _mm512_castps_si512(sub));
  return _mm512_castsi512_ps(_mm512_or_si512(bits, sign));
}

// The e4m3 code of each lane (in its low byte).
AMP_CPU_INLINE __m512i e4m3_codes(const __m512 y) {
  const __m512i f_bits = _mm512_castps_si512(y);
  const __m512i sign = _mm512_and_si512(f_bits, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512i a = _mm512_xor_si512(f_bits, sign);
  // Normal: round to nearest even by adding 0x7FFFF plus the lowest kept bit, rebase the exponent.
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  __m512i code = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(static_cast<int>(0xC407FFFFu))), odd),
      20);
  // Subnormal (below 2^-6): added to 2^14 in fp32, the rounding done by the addition.
  const __m512i denorm = _mm512_set1_epi32(141 << 23);
  const __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(denorm))),
      denorm);
  code = _mm512_mask_mov_epi32(code, _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(121 << 23)), sub);
  // At or above 480 (fp8_max): 0x7E (448, saturated) when finite or inf, 0x7F for NaN, as
  // torch 2.13's c10 does (older ones gave 0x7F). A usable block never gets here: |x * f|
  // rounds to at most 448.
  const __m512i over = _mm512_mask_mov_epi32(
      _mm512_set1_epi32(0x7E), _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000)),
      _mm512_set1_epi32(0x7F));
  code = _mm512_mask_mov_epi32(code, _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(1087 << 20)),
                               over);
  return _mm512_or_si512(_mm512_and_si512(code, _mm512_set1_epi32(0xFF)),
                         _mm512_srli_epi32(sign, 24));
}

// The fp32 values of 16 codes (before the block's decode factor).
template <optim::StateCode C>
AMP_CPU_INLINE __m512 code_values(const __m128i bytes) {
  if constexpr (C == optim::StateCode::kInt8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  } else if constexpr (C == optim::StateCode::kSqrtU8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
  } else {
    return e4m3_to_float(bytes);
  }
}

// The codes of 16 values of a block whose encode factor f is finite and
// non-zero, one per int32 lane (int8: the signed value; uint8 and e4m3: the
// byte, 0-255). Every value is then finite (|x| <= s), and so is x * f. For the
// integer codes, converting with round-to-nearest-even, then clamping the
// integers, is rne and clamp in fp32; |x| <= s, so |x * f| rounds to at most
// the largest code, and only the uint8 code's floor of 1 needs a clamp (the
// int8 code is -127 at its lowest), which the callers apply.
template <optim::StateCode C>
AMP_CPU_INLINE __m512i lane_codes(const __m512 x, const __m512 f) {
  const __m512 y = _mm512_mul_ps(x, f);
  if constexpr (C == optim::StateCode::kE4M3) {
    return e4m3_codes(y);
  } else {
    return _mm512_cvt_roundps_epi32(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
}

// Two in-lane packs of four vectors of lane_codes (exact: every code is in
// range), leaving lane k with q0[4k..4k+3], q1[4k..], q2[4k..], q3[4k..].
template <optim::StateCode C>
AMP_CPU_INLINE __m512i pack_codes(const __m512i q0, const __m512i q1, const __m512i q2,
                                  const __m512i q3) {
  if constexpr (C == optim::StateCode::kInt8) {
    return _mm512_packs_epi16(_mm512_packs_epi32(q0, q1), _mm512_packs_epi32(q2, q3));
  } else {
    return _mm512_packus_epi16(_mm512_packus_epi32(q0, q1), _mm512_packus_epi32(q2, q3));
  }
}

// The permutation that puts pack_codes' dwords in order.
AMP_CPU_INLINE __m512i pack_order() {
  return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}

// Packed codes in order, the uint8 code's floor of 1 applied to the bytes.
template <optim::StateCode C>
AMP_CPU_INLINE __m512i ordered_codes(const __m512i packed) {
  const __m512i bytes = _mm512_permutexvar_epi32(pack_order(), packed);
  return C == optim::StateCode::kSqrtU8 ? _mm512_max_epu8(bytes, _mm512_set1_epi8(1)) : bytes;
}

// Stores the codes of the 64 values x of such a block.
template <optim::StateCode C>
AMP_CPU_INLINE void store_codes64(const float* x, CodeType<C>* out, const __m512 f) {
  const __m512i packed = pack_codes<C>(
      lane_codes<C>(_mm512_loadu_ps(x), f), lane_codes<C>(_mm512_loadu_ps(x + 16), f),
      lane_codes<C>(_mm512_loadu_ps(x + 32), f), lane_codes<C>(_mm512_loadu_ps(x + 48), f));
  _mm512_storeu_si512(out, ordered_codes<C>(packed));
}

// Stores the codes of `count` (<= kBlock) values x of such a block.
template <optim::StateCode C>
AMP_CPU_INLINE void store_codes(const float* x, CodeType<C>* out, int64_t count, const __m512 f) {
  if (count == kBlock) {
    const __m512i q0 = lane_codes<C>(_mm512_loadu_ps(x), f);
    const __m512i q1 = lane_codes<C>(_mm512_loadu_ps(x + 16), f);
    const __m512i bytes = ordered_codes<C>(pack_codes<C>(q0, q1, q0, q1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_castsi512_si256(bytes));
    return;
  }
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 m = lane_mask(count - i);
    __m512i q = lane_codes<C>(_mm512_maskz_loadu_ps(m, x + i), f);
    if constexpr (C == optim::StateCode::kSqrtU8) {
      q = _mm512_max_epi32(q, _mm512_set1_epi32(1));
    }
    _mm_mask_storeu_epi8(out + i, m, C == optim::StateCode::kInt8 ? _mm512_cvtsepi32_epi8(q)
                                                                 : _mm512_cvtusepi32_epi8(q));
  }
}
#endif

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
#if defined(CPU_CAPABILITY_AVX512)
    for (int64_t k = 0; k < len; k += 16) {
      const __mmask16 m = lane_mask(len - k);
      __m512 x = _mm512_mul_ps(code_values<C>(_mm_maskz_loadu_epi8(m, cb + k)), _mm512_set1_ps(f));
      if constexpr (C == optim::StateCode::kSqrtU8) {
        x = _mm512_mul_ps(x, x);
      }
      _mm512_mask_storeu_ps(ob + k, m, x);
    }
    return;
#endif
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
  if (factor != 0.0f) {
    const __m512 f = _mm512_set1_ps(factor);
    int64_t i = 0;
    for (; i + 64 <= len; i += 64) {
      store_codes64<C>(x + i, out + i, f);
    }
    for (; i < len; i += kBlock) {
      store_codes<C>(x + i, out + i, std::min<int64_t>(kBlock, len - i), f);
    }
    return;
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

// The bf16 bits of fp32 x, element e of the tensor with key `key`: its
// rounding bits (optim::rounding_bits) added to the low half of its pattern,
// which is then cut; a non-finite value keeps its high half (a NaN stays a
// NaN, made quiet).
inline uint16_t stochastic_bf16_value(float x, uint32_t key, uint32_t e) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if (!optim::finite_bits(u)) {
    return static_cast<uint16_t>((u >> 16) | ((u & 0x7FFFFFu) != 0 ? 0x40u : 0u));
  }
  return optim::stochastic_bf16_bits(u, optim::rounding_bits(key, e));
}

// Folds the magnitudes of the first `count` (<= kBlock) lanes of lo, hi into
// amax, a running largest magnitude that magnitude_max() reads; a NaN sticks.
// AVX-512: an integer maximum of the fp32 bit patterns with the sign cleared,
// which orders magnitudes as floats do and puts NaN above inf, in two
// instructions per vector (at::vec::maximum's NaN-propagating float maximum
// takes three, after the abs). The square-root code's values are never
// negative (sqrt of a sum of a square and a decoded square: +0 at the least)
// unless NaN, so an unsigned maximum of the patterns themselves serves there,
// one instruction per vector: it orders them as floats and puts a NaN of
// either sign above inf; magnitude_max<C> reads it unsigned.
template <optim::StateCode C>
AMP_CPU_INLINE void fold_magnitudes(FVec& amax, const FVec& lo, const FVec& hi, int64_t count) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i a = _mm512_castps_si512(__m512(amax));
  const __m512i l = _mm512_castps_si512(__m512(lo)), h = _mm512_castps_si512(__m512(hi));
  __m512i m;
  if constexpr (C == optim::StateCode::kSqrtU8) {
    if (count == kBlock) {
      m = _mm512_max_epu32(a, _mm512_max_epu32(l, h));
    } else {  // lanes past count: 0, the least pattern
      m = _mm512_max_epu32(a, _mm512_maskz_mov_epi32(lane_mask(count), l));
      m = _mm512_max_epu32(m, _mm512_maskz_mov_epi32(lane_mask(count - kW), h));
    }
  } else if (count == kBlock) {
    m = _mm512_max_epi32(a, _mm512_max_epi32(_mm512_and_si512(l, magnitude),
                                             _mm512_and_si512(h, magnitude)));
  } else {
    m = _mm512_max_epi32(a, _mm512_maskz_and_epi32(lane_mask(count), l, magnitude));
    m = _mm512_max_epi32(m, _mm512_maskz_and_epi32(lane_mask(count - kW), h, magnitude));
  }
  amax = FVec(_mm512_castsi512_ps(m));
#else
  if (count == kBlock) {
    amax = at::vec::maximum(amax, at::vec::maximum(lo.abs(), hi.abs()));
  } else {
    const int64_t c0 = std::min<int64_t>(count, kW), c1 = count - c0;
    amax = at::vec::maximum(amax, FVec::set(FVec(0.0f), lo.abs(), c0));
    amax = at::vec::maximum(amax, FVec::set(FVec(0.0f), hi.abs(), c1));
  }
#endif
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

// The largest magnitude folded into amax by fold_magnitudes<C>, NaN when any was NaN.
template <optim::StateCode C>
inline float magnitude_max(const FVec& amax) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i patterns = _mm512_castps_si512(__m512(amax));
  const uint32_t bits = C == optim::StateCode::kSqrtU8 ? _mm512_reduce_max_epu32(patterns)
                                                       : static_cast<uint32_t>(
                                                             _mm512_reduce_max_epi32(patterns));
  float m;
  std::memcpy(&m, &bits, sizeof(m));
  return m;
#else
  return lanes_max(amax);
#endif
}

// Reads `count` (<= kBlock) values of state code C at element `at` as two fp32
// vectors: the codes times the block's decode factor f (squared for the
// square-root code), or the bf16 / fp32 state itself (kNoState: zeros). Lanes
// past count are 0.
template <optim::StateCode C>
AMP_CPU_INLINE void decode_vectors(const void* codes, int64_t at, int64_t count, const FVec& f, FVec& lo,
                           FVec& hi) {
  using optim::StateCode;
  if constexpr (C == kNoState) {
    lo = FVec(0.0f);
    hi = FVec(0.0f);
  } else if constexpr (C == StateCode::kBF16) {
    load_block(static_cast<const c10::BFloat16*>(codes) + at, count, lo, hi);
  } else if constexpr (C == StateCode::kF32) {
    load_block(static_cast<const float*>(codes) + at, count, lo, hi);
  } else {
    const CodeType<C>* q = static_cast<const CodeType<C>*>(codes) + at;
#if defined(CPU_CAPABILITY_AVX512)
    {
      static_assert(kW == 16, "AVX-512 holds 16 floats");
      const bool whole = count == kBlock;
      const __m128i b0 = whole ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(q))
                               : _mm_maskz_loadu_epi8(lane_mask(count), q);
      const __m128i b1 = whole ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))
                               : _mm_maskz_loadu_epi8(lane_mask(count - 16), q + 16);
      lo = FVec(code_values<C>(b0)) * f;
      hi = FVec(code_values<C>(b1)) * f;
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
// largest magnitude of the lanes written; kNoState writes nothing.
template <optim::StateCode C>
AMP_CPU_INLINE void keep_vectors(void* codes, float* tile, int64_t at, int64_t tile_at, int64_t count,
                         const FVec& lo, const FVec& hi, FVec& amax) {
  using optim::StateCode;
  if constexpr (C == kNoState) {
    return;
  } else if constexpr (C == StateCode::kBF16) {
    store_block(static_cast<c10::BFloat16*>(codes) + at, count, lo, hi);
  } else if constexpr (C == StateCode::kF32) {
    store_block(static_cast<float*>(codes) + at, count, lo, hi);
  } else {
    store_block(tile + tile_at, count, lo, hi);
    fold_magnitudes<C>(amax, lo, hi, count);
  }
}

// `count` params from two fp32 vectors: fp32 as they are, bf16 stochastically
// rounded with the bits of elements e .. e + count (see stochastic_bf16_value).
template <typename P>
AMP_CPU_INLINE void store_param(P* p, int64_t count, const FVec& lo, const FVec& hi, uint32_t key,
                        uint32_t e) {
  if constexpr (std::is_same_v<P, float>) {
    store_block(p, count, lo, hi);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    // optim::rounding_bits per lane. The element index times K0 is the scalar
    // (e * K0) plus lane * K0 (mod 2^32). Lanes of one hash are 16 apart, so when
    // e is a multiple of 32 the two vectors share one: its high halves for the
    // first, its low halves for the second.
    const __m512i lane_k0 = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(static_cast<int>(optim::kHashK0)));
    const __m512i k1 = _mm512_set1_epi32(static_cast<int>(optim::kHashK1));
    const __m512i k2 = _mm512_set1_epi32(static_cast<int>(optim::kHashK2));
    const __m512i low_half = _mm512_set1_epi32(0xFFFF);
    auto fmix = [&](__m512i x) {
      x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
      x = _mm512_mullo_epi32(x, k1);
      x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 13));
      x = _mm512_mullo_epi32(x, k2);
      return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    };
    // The hash inputs key ^ (e * K0) of the 16 elements from `first`, lane by lane.
    auto hashed = [&](uint32_t first) {
      return _mm512_xor_si512(
          _mm512_set1_epi32(static_cast<int>(key)),
          _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first * optim::kHashK0)), lane_k0));
    };
    __m512i bits0, bits1;
    if (e % (2 * optim::kPairBit) == 0) {
      const __m512i h = fmix(hashed(e));
      bits0 = _mm512_srli_epi32(h, 16);
      bits1 = _mm512_and_si512(h, low_half);
    } else {
      // Any alignment: each lane hashes its index with the pair bit cleared
      // (e * K0 less 16 * K0 where the bit is set) and takes its half.
      auto bits = [&](uint32_t first) {
        const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)),
                                               _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                                 10, 11, 12, 13, 14, 15));
        const __mmask16 second =
            _mm512_test_epi32_mask(index, _mm512_set1_epi32(static_cast<int>(optim::kPairBit)));
        const __m512i base = _mm512_add_epi32(
            _mm512_set1_epi32(static_cast<int>(first * optim::kHashK0)), lane_k0);
        const __m512i paired = _mm512_mask_sub_epi32(
            base, second, base,
            _mm512_set1_epi32(static_cast<int>(optim::kPairBit * optim::kHashK0)));
        const __m512i h = fmix(_mm512_xor_si512(_mm512_set1_epi32(static_cast<int>(key)), paired));
        return _mm512_mask_and_epi32(_mm512_srli_epi32(h, 16), second, h, low_half);
      };
      bits0 = bits(e);
      bits1 = bits(e + 16u);
    }
    const __m512i u0 = _mm512_castps_si512(__m512(lo)), u1 = _mm512_castps_si512(__m512(hi));
    const __m512i sum0 = _mm512_add_epi32(u0, bits0), sum1 = _mm512_add_epi32(u1, bits1);
    // fpclass 0x99: NaN (quiet 0x01, signalling 0x80) or infinite (0x08, 0x10).
    const __mmask16 finite0 = static_cast<__mmask16>(~_mm512_fpclass_ps_mask(__m512(lo), 0x99));
    const __mmask16 finite1 = static_cast<__mmask16>(~_mm512_fpclass_ps_mask(__m512(hi), 0x99));
    __m512i out;
    if ((finite0 & finite1) == 0xFFFF) {
      // The high halves of the 32 sums, in order, in one permutation.
      const __m512i high_words = _mm512_set_epi16(
          63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
          31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
      out = _mm512_permutex2var_epi16(sum0, high_words, sum1);
    } else {
      // A non-finite value rounds to nearest: its high half, a NaN kept quiet.
      auto half = [&](const __m512i u, const __m512i sum, const __mmask16 finite) {
        const __mmask16 nan_bits = _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x7FFFFF));
        const __m512i high = _mm512_srli_epi32(u, 16);
        const __m512i nearest = _mm512_mask_or_epi32(high, nan_bits, high, _mm512_set1_epi32(0x40));
        return _mm512_cvtepi32_epi16(
            _mm512_mask_blend_epi32(finite, nearest, _mm512_srli_epi32(sum, 16)));
      };
      out = _mm512_inserti64x4(_mm512_castsi256_si512(half(u0, sum0, finite0)),
                               half(u1, sum1, finite1), 1);
    }
    uint16_t* dst = reinterpret_cast<uint16_t*>(p);
    if (count == kBlock) {
      _mm512_storeu_si512(dst, out);
    } else {
      _mm512_mask_storeu_epi16(dst, static_cast<__mmask32>((uint64_t{1} << count) - 1u), out);
    }
    return;
#endif
    alignas(64) float x[kBlock];
    lo.store(x);
    hi.store(x + kW);
    alignas(64) uint16_t o[kBlock];
    for (int64_t k = 0; k < kBlock; ++k) {
      o[k] = stochastic_bf16_value(x[k], key, e + static_cast<uint32_t>(k));
    }
    if (count == kBlock) {
      std::memcpy(static_cast<void*>(p), o, sizeof(o));
    } else {
      std::memcpy(static_cast<void*>(p), o, count * sizeof(uint16_t));
    }
  }
}

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

// x[0, n) stochastically rounded to bf16 with the bits of elements e0 .. e0 + n
// (the tile path's params; the fused loops call store_param themselves).
void stochastic_bf16_loop(const float* x, void* out, int64_t n, uint32_t key, int64_t e0) {
  const uint32_t first = static_cast<uint32_t>(static_cast<uint64_t>(e0));
  c10::BFloat16* o = static_cast<c10::BFloat16*>(out);
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t c = std::min<int64_t>(kBlock, n - i);
    FVec lo, hi;
    load_block(x + i, c, lo, hi);
    store_param(o + i, c, lo, hi, key, first + static_cast<uint32_t>(i));
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
// note on aliasing above).
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
  // By position: the members of OptimTable in order; the codes in StateCode's order.
  OptimTable t{&adam_tile_loop<false>,
               &adam_tile_loop<true>,
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
               {},
               {},
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
