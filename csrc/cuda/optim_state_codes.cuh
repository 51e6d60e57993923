// The state codes of the lean optimizer ops on CUDA: a state element decoded
// to fp32 and encoded from it (fp32, bf16, or block-scaled int8, uint8 =
// square root, float8_e4m3fn, each block with one fp32 scale; csrc/optim_math.h's
// StateCode), one element or kLeanVec at a time, the vector loads and stores of
// fp32 / fp16 / bf16 values, the NaN-propagating maximum that sets a block's
// scale, and a bf16 param's stochastic rounding. The reference:
// amp_patch/ops/lean_state_ops.py.
// Included by optim_lean.cu alone, whose translation unit it is part of: its
// names stay in that unit's anonymous namespace.
#pragma once

#include <c10/util/Float8_e4m3fn.h>

#include <cstdint>

#include "optim_lists.cuh"

namespace amp_patch::cuda {
namespace {

using optim::StateCode;

// The fp32 value of a byte code (int8, uint8 = square root, float8_e4m3fn);
// `factor` is s / code_max.
__device__ __forceinline__ float decode_byte(StateCode code, uint32_t byte, float factor) {
  switch (code) {
    case StateCode::kInt8:
      return __fmul_rn(static_cast<float>(static_cast<int8_t>(byte)), factor);
    case StateCode::kSqrtU8: {
      const float r = __fmul_rn(static_cast<float>(byte), factor);
      return __fmul_rn(r, r);
    }
    default:
      return __fmul_rn(c10::detail::fp8e4m3fn_to_fp32_value(static_cast<uint8_t>(byte)), factor);
  }
}

// The byte code of x (for the uint8 code: the square root of the value).
// `factor` is code_max / s and `usable` whether it is finite. As the
// reference: y = x * factor (0 where the factor is not usable), rounded half
// to even and clamped for the integer codes (a NaN, from an inf element of a
// block whose scale is inf, is stored as 0, as torch's cast stores it on
// CUDA; the uint8 code of an unusable block is 0, not the clamp's 1), or
// converted by torch's own float -> float8_e4m3fn conversion.
__device__ __forceinline__ uint8_t encode_byte(StateCode code, float x, float factor, bool usable) {
  if (code == StateCode::kE4M3) {
    return c10::detail::fp8e4m3fn_from_fp32_value(usable ? __fmul_rn(x, factor) : 0.0f);
  }
  const float q = rintf(usable ? __fmul_rn(x, factor) : 0.0f);
  if (!usable || isnan(q)) {
    return 0;
  }
  if (code == StateCode::kInt8) {
    return static_cast<uint8_t>(static_cast<int8_t>(fminf(fmaxf(q, -127.0f), 127.0f)));
  }
  return static_cast<uint8_t>(fminf(fmaxf(q, 1.0f), 255.0f));
}

// tensor_lists.cuh's dtype_index of the codes that are plain floats.
__device__ __forceinline__ int float_code_dtype(StateCode code) {
  return code == StateCode::kF32 ? 0 : 2;
}

// The fp32 value of element e of a state tensor; `factor` is s / code_max.
__device__ __forceinline__ float load_state(const void* base, StateCode code, int64_t e,
                                            float factor) {
  if (!optim::block_scaled(code)) {
    return load_as_float(base, float_code_dtype(code), e);
  }
  return decode_byte(code, static_cast<const uint8_t*>(base)[e], factor);
}

// Stores x in its code (encode_byte's rule for the byte codes).
__device__ __forceinline__ void store_state(void* base, StateCode code, int64_t e, float x,
                                            float factor, bool usable) {
  if (!optim::block_scaled(code)) {
    store_from_float(base, float_code_dtype(code), e, x);
  } else {
    static_cast<uint8_t*>(base)[e] = encode_byte(code, x, factor, usable);
  }
}

// ------------------------------------------------------------------ vector access

// Consecutive elements per lane in a vector access.
constexpr int kLeanVec = 8;

// fp32 of the 16-bit pattern b of a float16 (dt 1) or bfloat16 (dt 2).
__device__ __forceinline__ float bits16_to_float(int dt, uint32_t b) {
  return dt == 1 ? __half2float(__ushort_as_half(static_cast<unsigned short>(b)))
                 : __uint_as_float(b << 16);
}

__device__ __forceinline__ uint32_t float_to_bits16(int dt, float x) {
  return dt == 1 ? from_float<c10::Half>(x).x : from_float<c10::BFloat16>(x).x;
}

// kLeanVec values of dtype dt (0 fp32, 1 fp16, 2 bf16) from element e, which
// the caller keeps a multiple of kLeanVec of a 16-byte aligned tensor.
__device__ __forceinline__ void load_vec(const void* base, int dt, int64_t e,
                                         float (&x)[kLeanVec]) {
  if (dt == 0) {
    const float4* q = reinterpret_cast<const float4*>(static_cast<const float*>(base) + e);
    const float4 a = q[0], b = q[1];
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
    x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
    return;
  }
  const uint4 u = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + e);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = bits16_to_float(dt, w[i] & 0xFFFFu);
    x[2 * i + 1] = bits16_to_float(dt, w[i] >> 16);
  }
}

// Stores 16-bit patterns (an fp16 or bf16 tensor) from element e.
__device__ __forceinline__ void store_vec_bits16(void* base, int64_t e,
                                                 const uint32_t (&b)[kLeanVec]) {
  *reinterpret_cast<uint4*>(static_cast<uint16_t*>(base) + e) =
      make_uint4(b[0] | (b[1] << 16), b[2] | (b[3] << 16), b[4] | (b[5] << 16),
                 b[6] | (b[7] << 16));
}

// Stores kLeanVec values in dtype dt, rounded to nearest even as store_from_float.
__device__ __forceinline__ void store_vec(void* base, int dt, int64_t e,
                                          const float (&x)[kLeanVec]) {
  if (dt == 0) {
    float4* q = reinterpret_cast<float4*>(static_cast<float*>(base) + e);
    q[0] = make_float4(x[0], x[1], x[2], x[3]);
    q[1] = make_float4(x[4], x[5], x[6], x[7]);
    return;
  }
  uint32_t b[kLeanVec];
#pragma unroll
  for (int i = 0; i < kLeanVec; ++i) {
    b[i] = float_to_bits16(dt, x[i]);
  }
  store_vec_bits16(base, e, b);
}

// kLeanVec state values from element e (load_state's values).
__device__ __forceinline__ void load_state_vec(const void* base, StateCode code, int64_t e,
                                               float factor, float (&x)[kLeanVec]) {
  if (!optim::block_scaled(code)) {
    load_vec(base, float_code_dtype(code), e, x);
    return;
  }
  const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(base) + e);
#pragma unroll
  for (int i = 0; i < kLeanVec; ++i) {
    x[i] = decode_byte(code, ((i < 4 ? u.x : u.y) >> (8 * (i & 3))) & 0xFFu, factor);
  }
}

// Stores kLeanVec state values from element e (store_state's codes).
__device__ __forceinline__ void store_state_vec(void* base, StateCode code, int64_t e,
                                                const float (&x)[kLeanVec], float factor,
                                                bool usable) {
  if (!optim::block_scaled(code)) {
    store_vec(base, float_code_dtype(code), e, x);
    return;
  }
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < kLeanVec; ++i) {
    w[i / 4] |= static_cast<uint32_t>(encode_byte(code, x[i], factor, usable)) << (8 * (i & 3));
  }
  *reinterpret_cast<uint2*>(static_cast<uint8_t*>(base) + e) = make_uint2(w[0], w[1]);
}

// The larger of a and b, NaN when either is (torch.amax's rule).
__device__ __forceinline__ float max_nan(float a, float b) {
  return isnan(a) ? a : ((isnan(b) || b > a) ? b : a);
}

// ------------------------------------------------------------------ stochastic rounding

// fp32 p to bf16 bits: the 16 random bits of element e added to the low half
// of p's bit pattern, then cut; a non-finite p rounds to nearest.
__device__ __forceinline__ c10::BFloat16 stochastic_round_bf16(float p, uint32_t key, int64_t e) {
  if (!isfinite(p)) {
    return from_float<c10::BFloat16>(p);
  }
  return c10::BFloat16(
      optim::stochastic_bf16_bits(__float_as_uint(p), optim::rounding_bits(key, e)),
      c10::BFloat16::from_bits());
}

}  // namespace
}  // namespace amp_patch::cuda
