// The lean optimizer ops on CUDA: multi_tensor_adam_lean_,
// multi_tensor_sgd_lean_ and LAMB's two lean stages
// (amp_patch/ops/lean_state_ops.py holds their reference bodies, which these
// kernels equal bit for bit; stage 1's norms to rounding, as the fp32 stage 1's).
//
// Each state tensor is stored in a code (fp32, bf16, or block-scaled int8,
// uint8 = square root, float8_e4m3fn) with one fp32 scale per block of
// block_size consecutive elements of a row. One warp handles one state block,
// in chunks of kLeanChunk elements, kLeanVec consecutive ones per lane: it
// decodes the state with the block's old scale, applies the update rule of
// csrc/optim_math.h on RnFloat (the reference's fp32 arithmetic, one
// rounding per operation), takes the block's largest magnitude of each new
// state with warp shuffles (NaN propagating, as torch's amax), and then encodes
// the state with the new scale and writes the param (stochastically rounded
// when it is bf16), the half model copy and the codes. No barrier is needed:
// the warp is the block. The first kLeanCachedChunks chunks keep their results
// in registers between the two passes; a longer block computes the rest again
// in the second pass (the same arithmetic, so the same bits).
//
// A tensor whose rows and blocks are whole multiples of kLeanVec and whose
// data are 16-byte aligned is read and written in vectors (16 bytes of fp32,
// fp16 or bf16, 8 bytes of a byte code per lane); any other takes the same
// path element by element, lane-interleaved so that the loads still coalesce.
//
// A launch carries up to kLeanTensors tensors in its kernel arguments; each
// warp walks state blocks [warp, total) with a stride of the grid's warps and
// finds its tensor by a binary search over the tensors' first block numbers.
// A set noop flag returns before anything is read or written.
//
// LAMB's stage 1 (lamb_norms_kernel) walks the same blocks and writes nothing
// but each block's sums of p^2 and u^2 (u the update direction); a second
// launch gives each tensor one thread block that adds its blocks' sums in a
// fixed order, so the norms are the same from run to run. Stage 2 is the
// update kernel with LAMB's rule and each tensor's step size.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "check.h"
#include "optim_lists.cuh"

namespace amp_patch::cuda {
namespace {

using optim::RnFloat;
using optim::StateCode;

// ------------------------------------------------------------------ state codes

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

// ------------------------------------------------------------------ launch arguments

// Up to two state lists per tensor (Adam: exp_avg, exp_avg_sq; SGD: the
// momentum buffer). A null state is absent (SGD without momentum).
constexpr int kMaxStates = 2;

struct LeanTensor {
  const void* grad;
  void* param;
  void* model;  // null: no model copy
  void* state[kMaxStates];
  float* scale[kMaxStates];  // null unless the code is block-scaled
  int64_t row_len;           // elements per row
  int64_t first_block;       // the launch's number of this tensor's first state block
  int64_t blocks_per_row;
  uint32_t key;              // stochastic rounding (bf16 params)
  int32_t index;             // in the op's lists (LAMB's norms)
  int8_t grad_dt, param_dt, model_dt;  // tensor_lists.cuh's dtype_index
  StateCode code[kMaxStates];
  bool vec;  // read and written in vectors of kLeanVec (the plan's rule)
};

constexpr int kLeanThreads = 256;  // 8 warps, each a state block at a time
constexpr int kLeanWarps = kLeanThreads / 32;
// Thread blocks per SM the registers must allow (more warps in flight hide
// more of the memory latency). At 3, on sm_90 (nvcc 13.0), Adam's specialised
// kernels take 80 registers with 4 B of spills: 37.5% occupancy, against 25% at
// 2 (87 registers, no spills).
constexpr int kLeanMinBlocks = 3;
// Elements a warp covers per chunk of a state block.
constexpr int kLeanChunk = 32 * kLeanVec;
// Chunks whose results stay in registers between the two passes (the default
// block of 256 elements is one chunk).
constexpr int kLeanCachedChunks = 1;
// Grid size cap; warps loop over the rest.
constexpr int64_t kLeanMaxGrid = int64_t{1} << 16;
constexpr int kLeanOwnBytes = 256;  // the launch's other fields, checked below
constexpr int kLeanTensors = (kParamBytes - kLeanOwnBytes) / static_cast<int>(sizeof(LeanTensor));

template <typename Hyper>
struct LeanLaunch {
  LeanTensor t[kLeanTensors];
  OptimCommon common;
  Hyper h;
  int64_t total_blocks;
  int32_t n;
  int32_t block_size;
};

// ------------------------------------------------------------------ update rules

// A rule's hyper-parameters as its launch uses them (prepare: the loss scale
// read on the device) and as one tensor's blocks use them (for_tensor).
template <typename H>
struct PlainLeanHyper {
  using Hyper = H;
  __device__ static H prepare(H h, const OptimCommon& common) {
    h.inv_scale = common.scale();
    return h;
  }
  __device__ static const H& for_tensor(const H& h, const LeanTensor&) { return h; }
};

// Adam (optim_math.h's adam_lean_update): state 0 exp_avg, state 1 exp_avg_sq.
struct AdamLeanRule : PlainLeanHyper<optim::AdamHyper> {
  static constexpr int kStates = 2;
  // The param is updated after the block maximum, from the moments (see lean_block).
  static constexpr bool kSplit = true;
  __device__ static bool reads_state(const Hyper&) { return true; }
  __device__ static bool writes_state(const Hyper&) { return true; }
  // Whether the moments use the param (L2 decay added to the grad).
  __device__ static bool moments_read_param(const Hyper& h) {
    return !h.adam_w_mode && h.weight_decay != 0.0f;
  }
  __device__ static void moments(float g, float p, float (&s)[kStates], const Hyper& h) {
    RnFloat m = s[0], v = s[1];
    optim::adam_update_moments<RnFloat>(g, p, m, v, h);
    s[0] = m.v;
    s[1] = v.v;
  }
  // r: the new second moment's square root.
  __device__ static void param(float& p, float m, float r, const Hyper& h) {
    RnFloat pp = p;
    optim::adam_lean_param_from_root<RnFloat>(pp, m, r, h);
    p = pp.v;
  }
};

// SGD: state 0 the momentum buffer (absent without momentum; not read on the first run).
struct SgdLeanRule : PlainLeanHyper<optim::SgdHyper> {
  static constexpr int kStates = 1;
  static constexpr bool kSplit = false;  // one step per element: the param with the buffer
  __device__ static bool moments_read_param(const Hyper&) { return true; }
  __device__ static bool reads_state(const Hyper& h) { return h.momentum != 0.0f && !h.first_run; }
  __device__ static bool writes_state(const Hyper& h) { return h.momentum != 0.0f; }
  __device__ static void step(float g, float& p, float (&s)[kStates], const Hyper& h) {
    RnFloat pp = p, mom = s[0];
    optim::sgd_update<RnFloat>(g, pp, h.momentum != 0.0f ? &mom : nullptr, h);
    p = pp.v;
    s[0] = mom.v;
  }
};

// What LAMB's lean stages take: the rule, the clipping inputs (the divisor is
// computed on the device, as the fp32 stage 1 computes it), whether the trust
// ratio applies (stage 1 then sums p^2), stage 2's trust ratios and the
// tensor's step size (for_tensor's), and stage 1's block sums (per launch).
struct LambLeanHyper {
  optim::LambHyper lamb;
  const float* global_grad_norm;
  float max_grad_norm;
  bool use_ratio;
  TrustRatio ratio;
  float step_size;
  float* sums;  // stage 1: sums[2 b], sums[2 b + 1] for block b of the launch
};

// LAMB's stage 2 (optim_math.h's lamb_new_moments, the same moments as stage
// 1's, then lamb_apply with the tensor's step size): state 0 exp_avg, state 1
// exp_avg_sq.
struct LambLeanRule {
  using Hyper = LambLeanHyper;
  static constexpr int kStates = 2;
  static constexpr bool kSplit = false;
  __device__ static Hyper prepare(Hyper h, const OptimCommon& common) {
    h.lamb.inv_scale = common.scale();
    h.lamb.clip = clip_divisor(*h.global_grad_norm, h.lamb.inv_scale, h.max_grad_norm);
    return h;
  }
  __device__ static Hyper for_tensor(Hyper h, const LeanTensor& t) {
    h.step_size = h.ratio(t.index);
    return h;
  }
  __device__ static bool moments_read_param(const Hyper&) { return true; }
  __device__ static bool reads_state(const Hyper&) { return true; }
  __device__ static bool writes_state(const Hyper&) { return true; }
  __device__ static void step(float g, float& p, float (&s)[kStates], const Hyper& h) {
    RnFloat pp = p, m = s[0], v = s[1];
    optim::lamb_new_moments<RnFloat>(g, pp, m, v, h.lamb);
    optim::lamb_apply<RnFloat>(pp, m, v, RnFloat(h.step_size), h.lamb);
    p = pp.v;
    s[0] = m.v;
    s[1] = v.v;
  }
};

// ------------------------------------------------------------------ the kernel

// The NaN-propagating maximum of K values over the warp; every lane gets it.
template <int K>
__device__ __forceinline__ void warp_max_nan(float (&v)[K]) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      v[k] = max_nan(v[k], __shfl_xor_sync(0xffffffffu, v[k], off));
    }
  }
}

// The param as stored (a bf16 param stochastically rounded, an fp16 one to
// nearest) as a 16-bit pattern in `bits` (unused for an fp32 param), and as fp32:
// the value the model copy receives, so that the model is always its master rounded.
__device__ __forceinline__ float round_param(const LeanTensor& t, int64_t e, float p,
                                             uint32_t& bits) {
  if (t.param_dt == 2) {
    bits = stochastic_round_bf16(p, t.key, e).x;
    return bits16_to_float(2, bits);
  }
  if (t.param_dt == 1) {
    bits = float_to_bits16(1, p);
    return bits16_to_float(1, bits);
  }
  return p;
}

// The code of state k: the launch's constant (kCodes = first * 8 + second,
// the kernel compiled for it), or the tensor's own (kCodes < 0).
template <int kCodes>
__device__ __forceinline__ StateCode code_of(const LeanTensor& t, int k) {
  if constexpr (kCodes < 0) {
    return t.code[k];
  } else {
    return static_cast<StateCode>(k == 0 ? kCodes / 8 : kCodes % 8);
  }
}

// Value i of `lane` in chunk c of a state block is element lane_index of the
// block: its kLeanVec consecutive elements in a vector tensor, every 32nd
// element else.
__device__ __forceinline__ int lane_index(const LeanTensor& t, int c, int i, int lane) {
  return c * kLeanChunk + (t.vec ? lane * kLeanVec + i : i * 32 + lane);
}

// Whether lane's values of chunk c of a block of n elements are one whole vector.
__device__ __forceinline__ bool lane_whole(const LeanTensor& t, int c, int n, int lane) {
  return t.vec && c * kLeanChunk + (lane + 1) * kLeanVec <= n;
}

// Loads lane's values of chunk c of the block of n elements at `base`: grads,
// params (zeros unless with_param) and the K states (zeros where not
// state_read), decoded with the block's factors s / code_max. Values past the
// block are zeros.
template <int K, int kCodes>
__device__ __forceinline__ void load_lane(const LeanTensor& t, int64_t base, int c, int n, int lane,
                                          bool with_param, const bool (&state_read)[K],
                                          const float (&decode)[K], float (&g)[kLeanVec],
                                          float (&p)[kLeanVec], float (&s)[K][kLeanVec]) {
  constexpr int V = kLeanVec;
  if (lane_whole(t, c, n, lane)) {
    const int64_t e = base + lane_index(t, c, 0, lane);
    load_vec(t.grad, t.grad_dt, e, g);
    if (with_param) {
      load_vec(t.param, t.param_dt, e, p);
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        p[i] = 0.0f;
      }
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (state_read[k]) {
        load_state_vec(t.state[k], code_of<kCodes>(t, k), e, decode[k], s[k]);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) {
          s[k][i] = 0.0f;
        }
      }
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int j = lane_index(t, c, i, lane);
    const int64_t e = base + j;
    const bool in = j < n;
    g[i] = in ? load_as_float(t.grad, t.grad_dt, e) : 0.0f;
    p[i] = in && with_param ? load_as_float(t.param, t.param_dt, e) : 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      s[k][i] = in && state_read[k] ? load_state(t.state[k], code_of<kCodes>(t, k), e, decode[k])
                                    : 0.0f;
    }
  }
}

// One state block of one tensor, elements [base, base + n), scale slot `slot`,
// by the calling warp (lane `lane`).
template <typename Rule, int kCodes>
__device__ void lean_block(const LeanTensor& t, const typename Rule::Hyper& h, int64_t base,
                           int n, int64_t slot, int lane) {
  constexpr int K = Rule::kStates;
  constexpr int V = kLeanVec;
  const bool reads = Rule::reads_state(h), writes = Rule::writes_state(h);
  bool scaled[K], state_read[K];
  float decode[K];
  bool any_scaled = false;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    scaled[k] = t.state[k] != nullptr && writes && optim::block_scaled(code_of<kCodes>(t, k));
    state_read[k] = t.state[k] != nullptr && reads;
    any_scaled = any_scaled || scaled[k];
    // s / code_max, one division per block, as the reference's decode factor.
    decode[k] = scaled[k] && reads ? __fdiv_rn(t.scale[k][slot], optim::code_max(code_of<kCodes>(t, k))) : 0.0f;
  }

  auto index = [&](int c, int i) { return lane_index(t, c, i, lane); };
  auto whole = [&](int c) { return lane_whole(t, c, n, lane); };

  // The new params and states of this lane's values of chunk c; a uint8 state
  // is returned as its square root, the value its code scales. Values past
  // the block compute on zeros and are neither counted nor stored.
  // A split rule's moments read the param only for L2 decay; its param is
  // updated in store(), after the block maximum, so that it is not held across it.
  const bool param_now = !Rule::kSplit || Rule::moments_read_param(h);
  auto compute = [&](int c, float (&p)[V], float (&s)[K][V]) {
    float g[V];
    load_lane<K, kCodes>(t, base, c, n, lane, param_now, state_read, decode, g, p, s);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      float si[K];
#pragma unroll
      for (int k = 0; k < K; ++k) {
        si[k] = s[k][i];
      }
      if constexpr (Rule::kSplit) {
        Rule::moments(g[i], p[i], si, h);
      } else {
        Rule::step(g[i], p[i], si, h);
      }
#pragma unroll
      for (int k = 0; k < K; ++k) {
        s[k][i] = code_of<kCodes>(t, k) == StateCode::kSqrtU8 ? __fsqrt_rn(si[k]) : si[k];
      }
    }
  };
  auto count = [&](int c, const float (&s)[K][V], float (&top)[K]) {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      if (index(c, i) < n) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
          top[k] = max_nan(top[k], fabsf(s[k][i]));
        }
      }
    }
  };

  const int chunks = (n + kLeanChunk - 1) / kLeanChunk;
  float cached_p[kLeanCachedChunks][V];
  float cached_s[kLeanCachedChunks][K][V];
  float top[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    top[k] = 0.0f;
  }
#pragma unroll
  for (int c = 0; c < kLeanCachedChunks; ++c) {
    if (c < chunks) {
      compute(c, cached_p[c], cached_s[c]);
      count(c, cached_s[c], top);
    }
  }
  if (any_scaled) {
    for (int c = kLeanCachedChunks; c < chunks; ++c) {
      float p[V], s[K][V];
      compute(c, p, s);
      count(c, s, top);
    }
    // Every lane has read the old scales (decode) before the shuffles.
    warp_max_nan<K>(top);
  }

  float encode[K];
  bool usable[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    // code_max / s, one division per block, as the reference's encode factor.
    encode[k] = scaled[k] ? __fdiv_rn(optim::code_max(code_of<kCodes>(t, k)), top[k]) : 0.0f;
    // An inf scale gives the finite factor 0: unusable too (the reference's rule).
    usable[k] = isfinite(encode[k]) && isfinite(top[k]);
    if (scaled[k] && lane == 0) {
      t.scale[k][slot] = top[k];
    }
  }

  // A split rule's new params from the moments: the param loaded (again, for L2) and stepped.
  auto step_params = [&](int c, float (&p)[V], const float (&s)[K][V]) {
    if constexpr (Rule::kSplit) {
      if (whole(c)) {
        load_vec(t.param, t.param_dt, base + index(c, 0), p);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const int j = index(c, i);
          p[i] = j < n ? load_as_float(t.param, t.param_dt, base + j) : 0.0f;
        }
      }
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float r = code_of<kCodes>(t, 1) == StateCode::kSqrtU8 ? s[1][i] : __fsqrt_rn(s[1][i]);
        Rule::param(p[i], s[0][i], r, h);
      }
    }
  };
  auto store = [&](int c, float (&p)[V], const float (&s)[K][V]) {
    step_params(c, p, s);
    if (whole(c)) {
      const int64_t e = base + index(c, 0);
      float stored[V];
      uint32_t bits[V];
#pragma unroll
      for (int i = 0; i < V; ++i) {
        stored[i] = round_param(t, e + i, p[i], bits[i]);
      }
      if (t.param_dt == 0) {
        store_vec(t.param, 0, e, stored);
      } else {
        store_vec_bits16(t.param, e, bits);
      }
      if (t.model != nullptr) {
        store_vec(t.model, t.model_dt, e, stored);
      }
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (writes && t.state[k] != nullptr) {
          store_state_vec(t.state[k], code_of<kCodes>(t, k), e, s[k], encode[k], usable[k]);
        }
      }
      return;
    }
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int j = index(c, i);
      if (j >= n) {
        continue;
      }
      const int64_t e = base + j;
      uint32_t bits = 0;
      const float stored = round_param(t, e, p[i], bits);
      if (t.param_dt == 0) {
        static_cast<float*>(t.param)[e] = stored;
      } else {
        static_cast<uint16_t*>(t.param)[e] = static_cast<uint16_t>(bits);
      }
      if (t.model != nullptr) {
        store_from_float(t.model, t.model_dt, e, stored);
      }
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (writes && t.state[k] != nullptr) {
          store_state(t.state[k], code_of<kCodes>(t, k), e, s[k][i], encode[k], usable[k]);
        }
      }
    }
  };
#pragma unroll
  for (int c = 0; c < kLeanCachedChunks; ++c) {
    if (c < chunks) {
      store(c, cached_p[c], cached_s[c]);
    }
  }
  // Each element is computed again by the lane that computed it first, and
  // only that lane writes it, so nothing it reads has been written yet.
  for (int c = kLeanCachedChunks; c < chunks; ++c) {
    float p[V], s[K][V];
    compute(c, p, s);
    store(c, p, s);
  }
}

// Calls f(t, base, n, slot, b) for each state block b of the launch that the
// calling warp takes: tensor t's elements [base, base + n), its scale slot.
template <typename Hyper, typename F>
__device__ __forceinline__ void for_warp_blocks(const LeanLaunch<Hyper>& a, F&& f) {
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kLeanWarps;
  // b is the same in all lanes of a warp, so its shuffles see every lane.
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * kLeanWarps + (threadIdx.x >> 5);
       b < a.total_blocks; b += warps) {
    int lo = 0, hi = a.n - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (a.t[mid].first_block <= b) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const LeanTensor& t = a.t[lo];
    const int64_t slot = b - t.first_block;  // row * blocks_per_row + block: the scale's index
    const int64_t row = slot / t.blocks_per_row;
    const int64_t start = (slot - row * t.blocks_per_row) * a.block_size;
    const int64_t left = t.row_len - start;
    const int n = static_cast<int>(left < a.block_size ? left : a.block_size);
    f(t, row * t.row_len + start, n, slot, b);
  }
}

template <typename Rule, int kCodes>
__global__ void __launch_bounds__(kLeanThreads, kLeanMinBlocks)
    lean_kernel(const __grid_constant__ LeanLaunch<typename Rule::Hyper> a) {
  if (a.common.skipped()) {
    return;
  }
  const typename Rule::Hyper h = Rule::prepare(a.h, a.common);
  const int lane = static_cast<int>(threadIdx.x & 31);
  for_warp_blocks(a, [&](const LeanTensor& t, int64_t base, int n, int64_t slot, int64_t) {
    lean_block<Rule, kCodes>(t, Rule::for_tensor(h, t), base, n, slot, lane);
  });
}

// LAMB's lean stage 1 over one state block (the calling warp): the new moments
// from the decoded ones and the update direction u (optim_math.h's
// lamb_moments), and the block's sums of p^2 (when the trust ratio applies;
// else 0, as the fp32 stage 1 without params) and u^2 into sums[0], sums[1].
// Nothing else is written.
template <int kCodes>
__device__ void lamb_norms_block(const LeanTensor& t, const LambLeanHyper& h, int64_t base, int n,
                                 int64_t slot, int lane, float* sums) {
  constexpr int V = kLeanVec;
  const bool state_read[2] = {true, true};
  float decode[2];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const StateCode code = code_of<kCodes>(t, k);
    decode[k] = optim::block_scaled(code) ? __fdiv_rn(t.scale[k][slot], optim::code_max(code))
                                          : 0.0f;
  }
  float p_sq = 0.0f, u_sq = 0.0f;
  const int chunks = (n + kLeanChunk - 1) / kLeanChunk;
  for (int c = 0; c < chunks; ++c) {
    float g[V], p[V], s[2][V];
    load_lane<2, kCodes>(t, base, c, n, lane, h.use_ratio, state_read, decode, g, p, s);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      if (lane_index(t, c, i, lane) < n) {
        RnFloat m = s[0][i], v = s[1][i];
        const RnFloat u = optim::lamb_moments<RnFloat>(g[i], p[i], m, v, h.lamb);
        p_sq = fmaf(p[i], p[i], p_sq);
        u_sq = fmaf(u.v, u.v, u_sq);
      }
    }
  }
  p_sq = warp_sum(p_sq);
  u_sq = warp_sum(u_sq);
  if (lane == 0) {
    sums[0] = p_sq;
    sums[1] = u_sq;
  }
}

template <int kCodes>
__global__ void __launch_bounds__(kLeanThreads)
    lamb_norms_kernel(const __grid_constant__ LeanLaunch<LambLeanHyper> a) {
  if (a.common.skipped()) {
    return;  // the sums stay 0: so do the norms
  }
  const LambLeanHyper h = LambLeanRule::prepare(a.h, a.common);
  const int lane = static_cast<int>(threadIdx.x & 31);
  for_warp_blocks(a, [&](const LeanTensor& t, int64_t base, int n, int64_t slot, int64_t b) {
    lamb_norms_block<kCodes>(t, h, base, n, slot, lane, h.sums + 2 * b);
  });
}

constexpr int kNormThreads = 256;

// LAMB's lean stage 1, second launch: one thread block per tensor of the
// launch adds its state blocks' sums (in a fixed order) and writes their roots
// to the tensor's elements of the norms.
__global__ void __launch_bounds__(kNormThreads)
    lamb_norms_finalize(const __grid_constant__ LeanLaunch<LambLeanHyper> a, float* param_norms,
                        float* update_norms) {
  const int k = static_cast<int>(blockIdx.x);
  const int64_t end = k + 1 < a.n ? a.t[k + 1].first_block : a.total_blocks;
  float p = 0.0f, u = 0.0f;
  for (int64_t b = a.t[k].first_block + threadIdx.x; b < end; b += kNormThreads) {
    p += a.h.sums[2 * b];
    u += a.h.sums[2 * b + 1];
  }
  lamb_block_totals<kNormThreads>(p, u);
  if (threadIdx.x == 0) {
    param_norms[a.t[k].index] = sqrtf(p);
    update_norms[a.t[k].index] = sqrtf(u);
  }
}

// ------------------------------------------------------------------ host side

// The checks the CUDA kernel adds to the reference's (optim::check_lean_lists):
// every tensor on the device of grads[0], dtypes the kernel reads, and a block
// size that fits its int32 arithmetic.
template <size_t S>
void check_cuda_lists(const char* op, const optim::LeanLists<S>& l, const at::Device& device,
                      int64_t block_size) {
  AMP_CHECK(block_size <= std::numeric_limits<int32_t>::max(), "amp_patch::", op,
              ": block_size ", block_size, " is too large for the CUDA kernel");
  auto on_device = [&](const char* name, at::TensorList tensors) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      AMP_CHECK(tensors[i].device() == device, "amp_patch::", op, ": expected all tensors on ",
                  device, " (the device of grads[0]), but ", name, "[", i, "] is on ",
                  tensors[i].device());
    }
  };
  auto half_or_float = [&](const char* name, at::TensorList tensors) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      const int dt = dtype_index(tensors[i].scalar_type());
      AMP_CHECK(dt >= 0 && dt <= 2, "amp_patch::", op, ": ", name, "[", i, "] has dtype ",
                  tensors[i].scalar_type(),
                  "; the CUDA kernel takes float32, float16 and bfloat16 ", name);
    }
  };
  on_device("grads", l.grads);
  on_device("params", l.params);
  on_device("model_params", l.model_params);
  half_or_float("grads", l.grads);
  half_or_float("model_params", l.model_params);
  for (const optim::LeanStateArg& s : l.states) {
    if (!s.used) {
      continue;
    }
    on_device(s.name, s.codes);
    for (size_t i = 0; i < s.codes.size(); ++i) {
      if (optim::block_scaled(optim::state_code(s.codes[i].scalar_type()))) {
        AMP_CHECK(s.scales[i].device() == device, "amp_patch::", op,
                    ": expected all tensors on ", device, " (the device of grads[0]), but ",
                    s.scale_name, "[", i, "] is on ", s.scales[i].device());
      }
    }
  }
}

// (rows, row length) of a tensor as the codes see it.
std::pair<int64_t, int64_t> rows_of(const at::Tensor& t) {
  return optim::lean_rows(t.sizes());
}

// The tensors of one call as LeanTensor rows. A tensor the kernel cannot walk
// in row-major order (not contiguous) is replaced by a contiguous stand-in,
// copied back after the launches when the op writes it (`writes`: LAMB's
// stage 1 writes nothing). Even a written stand-in starts as a copy: a set
// noop must leave the copy-back a no-op. (The block-scaled codes and their
// scales are contiguous: the checks ask it.)
class LeanPlan {
 public:
  template <size_t S>
  LeanPlan(const optim::LeanLists<S>& l, const optim::LeanHyper& lh, bool writes = true)
      : block_size_(lh.block_size), writes_(writes) {
    static_assert(S <= kMaxStates);
    for (size_t i = 0; i < l.grads.size(); ++i) {
      const at::Tensor& grad = l.grads[i];
      if (grad.numel() == 0) {
        continue;
      }
      LeanTensor t{};
      const auto [rows, len] = rows_of(grad);
      t.row_len = len;
      t.blocks_per_row = (len + block_size_ - 1) / block_size_;
      t.key = optim::lean_tensor_key(lh, static_cast<int64_t>(i));
      t.index = static_cast<int32_t>(i);
      t.grad = flat(grad, false);
      t.grad_dt = static_cast<int8_t>(dtype_index(grad.scalar_type()));
      t.param = flat(l.params[i], true);
      t.param_dt = static_cast<int8_t>(dtype_index(l.params[i].scalar_type()));
      t.model = nullptr;
      if (!l.model_params.empty()) {
        t.model = flat(l.model_params[i], true);
        t.model_dt = static_cast<int8_t>(dtype_index(l.model_params[i].scalar_type()));
      }
      for (size_t k = 0; k < kMaxStates; ++k) {
        t.state[k] = nullptr;
        t.scale[k] = nullptr;
        t.code[k] = StateCode::kF32;
        if (k >= S || !l.states[k].used) {
          continue;
        }
        const at::Tensor& s = l.states[k].codes[i];
        t.code[k] = optim::state_code(s.scalar_type());
        t.state[k] = flat(s, true);
        if (optim::block_scaled(t.code[k])) {
          t.scale[k] = static_cast<float*>(l.states[k].scales[i].data_ptr());
        }
      }
      t.vec = vector_access(t);
      tensors_.push_back(t);
      block_counts_.push_back(rows * t.blocks_per_row);
    }
  }

  // Launches the kernel of Rule over the tensors, then copies the stand-ins back.
  template <typename Rule>
  void run(const OptimCommon& common, const typename Rule::Hyper& h) {
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    each_launch(common, h, [&](int pair, const LeanLaunch<typename Rule::Hyper>& a, int64_t) {
      by_codes<Rule::kStates>(pair, [&](auto codes) {
        lean_kernel<Rule, decltype(codes)::value><<<grid(a), kLeanThreads, 0, stream>>>(a);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
    for (auto& [user, stand_in] : write_back_) {
      user.copy_(stand_in);
    }
  }

  // LAMB's lean stage 1: each state block's sums of p^2 and u^2, then each
  // tensor's norms (the roots of its blocks' totals) into its elements of
  // param_norms and update_norms (zeros where nothing is written).
  void lamb_norms(const OptimCommon& common, LambLeanHyper h, float* param_norms,
                  float* update_norms, const at::TensorOptions& fp32) {
    int64_t blocks = 0;
    for (const int64_t count : block_counts_) {
      blocks += count;
    }
    const at::Tensor sums = at::zeros({2 * blocks}, fp32);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    each_launch(common, h, [&](int pair, const LeanLaunch<LambLeanHyper>& launch, int64_t first) {
      LeanLaunch<LambLeanHyper> a = launch;
      a.h.sums = sums.data_ptr<float>() + 2 * first;
      by_codes<2>(pair, [&](auto codes) {
        lamb_norms_kernel<decltype(codes)::value><<<grid(a), kLeanThreads, 0, stream>>>(a);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      lamb_norms_finalize<<<static_cast<unsigned>(a.n), kNormThreads, 0, stream>>>(
          a, param_norms, update_norms);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }

 private:
  // Calls launch(pair, a, first) for each launch of the call: the tensors by
  // code pair, in order of first appearance (each pair runs the kernel
  // compiled for it, or the one that reads the codes), kLeanTensors at a
  // time; `first` is the call's number of the launch's first state block.
  template <typename Hyper, typename Launch>
  void each_launch(const OptimCommon& common, const Hyper& h, const Launch& launch) const {
    static_assert(sizeof(LeanLaunch<Hyper>) <= kParamBytes,
                  "the lean launch arguments exceed the kernel parameter space");
    std::vector<int> pairs;
    std::vector<std::vector<size_t>> groups;
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const int pair = code_pair(tensors_[i].code[0], tensors_[i].code[1]);
      const auto at = std::find(pairs.begin(), pairs.end(), pair);
      if (at == pairs.end()) {
        pairs.push_back(pair);
        groups.push_back({i});
      } else {
        groups[at - pairs.begin()].push_back(i);
      }
    }
    int64_t call_blocks = 0;
    for (size_t g = 0; g < groups.size(); ++g) {
      const std::vector<size_t>& group = groups[g];
      for (size_t first = 0; first < group.size(); first += kLeanTensors) {
        const size_t count = std::min<size_t>(kLeanTensors, group.size() - first);
        LeanLaunch<Hyper> a{};
        int64_t blocks = 0;
        for (size_t k = 0; k < count; ++k) {
          a.t[k] = tensors_[group[first + k]];
          a.t[k].first_block = blocks;
          blocks += block_counts_[group[first + k]];
        }
        a.total_blocks = blocks;
        a.n = static_cast<int32_t>(count);
        a.block_size = static_cast<int32_t>(block_size_);
        a.common = common;
        a.h = h;
        launch(pairs[g], a, call_blocks);
        call_blocks += blocks;
      }
    }
  }

  template <typename Hyper>
  static unsigned grid(const LeanLaunch<Hyper>& a) {
    return static_cast<unsigned>(
        std::min((a.total_blocks + kLeanWarps - 1) / kLeanWarps, kLeanMaxGrid));
  }

  static constexpr int code_pair(StateCode first, StateCode second) {
    return static_cast<int>(first) * 8 + static_cast<int>(second);
  }

  // f(std::integral_constant<int, kCodes>) for code pair `pair`: the kernels
  // are compiled for the pairs the formats make (initialize's optimizer_state,
  // and fp32 for the tensors a format leaves in fp32), kCodes -1 elsewhere (the
  // kernel that reads each tensor's codes).
  template <int kStates, typename F>
  static void by_codes(int pair, F&& f) {
    using C = StateCode;
    constexpr bool kTwo = kStates == 2;
    constexpr int kF32 = code_pair(C::kF32, C::kF32);
    constexpr int kInt8 = code_pair(C::kInt8, kTwo ? C::kSqrtU8 : C::kF32);
    constexpr int kFp8 = code_pair(C::kE4M3, kTwo ? C::kBF16 : C::kF32);
    constexpr int kBf16 = code_pair(C::kBF16, kTwo ? C::kBF16 : C::kF32);
    switch (pair) {
      case kInt8: return f(std::integral_constant<int, kInt8>{});
      case kFp8: return f(std::integral_constant<int, kFp8>{});
      case kBf16: return f(std::integral_constant<int, kBf16>{});
      case kF32: return f(std::integral_constant<int, kF32>{});
      default: return f(std::integral_constant<int, -1>{});
    }
  }

  // Whether the kernel may read and write tensor t in vectors: every state
  // block, and so every lane's run of kLeanVec elements, starts at a multiple
  // of kLeanVec, and every pointer is 16-byte aligned.
  bool vector_access(const LeanTensor& t) const {
    auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    bool ok = t.row_len % kLeanVec == 0 && block_size_ % kLeanVec == 0 && aligned(t.grad) &&
              aligned(t.param) && (t.model == nullptr || aligned(t.model));
    for (int k = 0; k < kMaxStates; ++k) {
      ok = ok && (t.state[k] == nullptr || aligned(t.state[k]));
    }
    return ok;
  }

  void* flat(const at::Tensor& t, bool written) {
    if (t.is_contiguous()) {
      return t.data_ptr();
    }
    at::Tensor stand_in = t.contiguous();
    if (written && writes_) {
      write_back_.emplace_back(t, stand_in);
    } else {
      keep_alive_.push_back(stand_in);
    }
    return stand_in.data_ptr();
  }

  int64_t block_size_;
  bool writes_;
  std::vector<LeanTensor> tensors_;
  std::vector<int64_t> block_counts_;  // state blocks of each tensor
  // Stand-ins are freed after the launches; the caching allocator reuses
  // memory in stream order, so that is safe.
  std::vector<at::Tensor> keep_alive_;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back_;
};

// An update op: make_hyper(device) gives the rule's hyper-parameters (its
// inputs checked against the call's device).
template <typename Rule, size_t S, typename MakeHyper>
void run_lean(const char* op, const optim::LeanLists<S>& l, const optim::Flags& flags,
              const optim::LeanHyper& lh, MakeHyper&& make_hyper) {
  if (l.grads.empty()) {
    return;
  }
  const at::Device device = l.grads[0].device();
  check_cuda_lists(op, l, device, lh.block_size);
  const c10::cuda::CUDAGuard guard(device);
  const OptimCommon common = optim_common(op, flags.noop, flags.inv_scale, device);
  const typename Rule::Hyper h = make_hyper(device);
  LeanPlan plan(l, lh);
  plan.run<Rule>(common, h);
}

template <typename Rule, size_t S>
void run_lean(const char* op, const optim::LeanLists<S>& l, const optim::Flags& flags,
              const typename Rule::Hyper& h, const optim::LeanHyper& lh) {
  run_lean<Rule>(op, l, flags, lh, [&](const at::Device&) { return h; });
}

// LAMB's lean hyper-parameters for a call on `device` (ratio: stage 2's).
inline LambLeanHyper lamb_lean_hyper(const char* op, const optim::LambLeanArgs& args,
                                     const at::Device& device, TrustRatio ratio = {}) {
  return {args.hyper, global_norm_ptr(op, args.global_grad_norm, device), args.max_grad_norm,
          args.use_ratio, ratio, 0.0f, nullptr};
}

// The CUDA side of optim_args.h's lean entry points (which ran the reference's checks).
struct CudaLean {
  static void adam_lean(const char* op, const optim::LeanLists<2>& l, const optim::Flags& flags,
                        const optim::AdamHyper& h, const optim::LeanHyper& lh) {
    run_lean<AdamLeanRule>(op, l, flags, h, lh);
  }

  static void sgd_lean(const char* op, const optim::LeanLists<1>& l, const optim::Flags& flags,
                       const optim::SgdHyper& h, const optim::LeanHyper& lh) {
    run_lean<SgdLeanRule>(op, l, flags, h, lh);
  }

  static std::tuple<at::Tensor, at::Tensor> lamb_lean_moments(
      const char* op, const optim::LeanLists<2>& l, const optim::Flags& flags,
      const optim::LambLeanArgs& args, const optim::LeanHyper& lh) {
    // The call's device: the global grad norm's, which an empty call has too.
    const at::Device device = args.global_grad_norm.device();
    const c10::cuda::CUDAGuard guard(device);
    const LambLeanHyper h = lamb_lean_hyper(op, args, device);
    const auto fp32 = at::TensorOptions().device(device).dtype(at::kFloat);
    const int64_t n = static_cast<int64_t>(l.grads.size());
    // Two tensors, not two rows of one: the op's outputs must not alias.
    at::Tensor param_norms = at::zeros({n}, fp32);
    at::Tensor update_norms = at::zeros({n}, fp32);
    if (n == 0) {
      return {param_norms, update_norms};
    }
    check_cuda_lists(op, l, device, lh.block_size);
    const OptimCommon common = optim_common(op, flags.noop, flags.inv_scale, device);
    LeanPlan plan(l, lh, /*writes=*/false);
    plan.lamb_norms(common, h, param_norms.data_ptr<float>(), update_norms.data_ptr<float>(), fp32);
    return {param_norms, update_norms};
  }

  static void lamb_lean_apply(const char* op, const optim::LeanLists<2>& l,
                              const optim::Flags& flags, const optim::LambLeanArgs& args,
                              const at::Tensor& param_norms, const at::Tensor& update_norms,
                              float lr, const optim::LeanHyper& lh) {
    run_lean<LambLeanRule>(op, l, flags, lh, [&](const at::Device& device) {
      const size_t n = l.grads.size();
      return lamb_lean_hyper(op, args, device,
                             TrustRatio{per_tensor(op, "param_norms", param_norms, n, device),
                                        per_tensor(op, "update_norms", update_norms, n, device),
                                        lr, args.use_ratio});
    });
  }
};

}  // namespace
}  // namespace amp_patch::cuda

TORCH_LIBRARY_IMPL(amp_patch, CUDA, m) {
  using amp_patch::cuda::CudaLean;
  namespace optim = amp_patch::optim;
  m.impl("multi_tensor_adam_lean_", &optim::adam_lean_op<CudaLean>);
  m.impl("multi_tensor_sgd_lean_", &optim::sgd_lean_op<CudaLean>);
  m.impl("multi_tensor_lamb_lean_stage1_", &optim::lamb_lean_stage1_op<CudaLean>);
  m.impl("multi_tensor_lamb_lean_stage2_", &optim::lamb_lean_stage2_op<CudaLean>);
}
