// The fused kernels of the lean optimizer ops on CUDA: one pass over the
// low-bit state that decodes it, applies the update rule and encodes it again.
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
// LAMB's stage 1 (lamb_norms_kernel) walks the same blocks and writes nothing
// but each block's sums of p^2 and u^2 (u the update direction); a second
// launch gives each tensor one thread block that adds its blocks' sums in a
// fixed order, so the norms are the same from run to run. Stage 2 is the
// update kernel with LAMB's rule and each tensor's step size.
// Included by optim_lean.cu alone, whose translation unit it is part of: its
// names stay in that unit's anonymous namespace.
#pragma once

#include <cstdint>

#include "optim_lean_launch.cuh"
#include "optim_lean_rules.cuh"
#include "optim_lists.cuh"
#include "optim_state_codes.cuh"

namespace amp_patch::cuda {
namespace {

using optim::RnFloat;
using optim::StateCode;

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

}  // namespace
}  // namespace amp_patch::cuda
