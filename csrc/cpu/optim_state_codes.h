// The state codes of the lean optimizer ops on CPU: low-bit optimizer state
// (csrc/optim_math.h's StateCode: fp32, bf16, or int8 / uint8 square-root /
// float8_e4m3fn codes with one fp32 scale per block) decoded to fp32 and
// encoded from it, by whole rows (optim_table.h's lean_decode and lean_encode,
// for the tile path of optim_ops.cpp) and two vectors at a time (for the fused
// loops of optim_lean_loops.h), and a bf16 param's stochastic rounding. Like
// vec_loops.h, this header is compiled once per instruction set: csrc/cpu/isa/{default,avx2,avx512}.cpp
// include it (through optim_loops.h) after vec_loops.h, with CPU_CAPABILITY and
// the compiler's target set first; vec_loops.h explains how the copies coexist
// in one library and stay off CPUs that lack the ISA.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/optim_rule_loops.h"
#include "cpu/optim_table.h"
#include "cpu/vec_loops.h"

namespace amp_patch::cpu {
namespace CPU_CAPABILITY {

// The reference: amp_patch/ops/lean_state_ops.py. Each row loop covers n
// elements of one row from a block boundary; block b of them has scales[b].

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

}  // namespace CPU_CAPABILITY
}  // namespace amp_patch::cpu
