// The multi-tensor-apply launcher shared by every CUDA kernel of amp_patch.
//
// One launch covers many tensors. Each tensor is cut into chunks of
// kChunkElems elements and every chunk gets one block of kBlockThreads
// threads. The kernel argument struct holds the tensors' addresses and sizes
// and a block -> (tensor, chunk) map; when either table is full the host
// launches and starts filling it again, carrying a half-done tensor over.
//
// Inside a chunk, for_each_element reads and writes 16-byte vectors when all
// the chunk's pointers are 16-byte aligned (chunk starts are multiples of the
// vector width, so only the tensor's own offset decides), with a scalar tail
// for the last few elements; otherwise it runs an all-scalar loop.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <vector>

namespace amp_patch::cuda {

// 64K elements and 512 threads per block, as in Apex and ATen's foreach
// kernels: each thread moves 128 elements per chunk, enough to amortise the
// block's start-up, while a few thousand chunks of a large gradient list keep
// all SMs busy across several waves.
constexpr int kBlockThreads = 512;
constexpr int kChunkElems = 64 * 1024;

// CUDA 12.1+ drivers accept 32 KB of kernel parameters on Volta and newer. A
// CUDA 13 build only runs on drivers that new (R580+), so it can rely on the
// large limit; older toolkits may meet older drivers and keep to 4 KB. The
// larger table lets one launch hold 3072 blocks (many waves on an H100's 132
// SMs) instead of 320, which leaves SMs idle at every launch boundary.
#if defined(CUDART_VERSION) && CUDART_VERSION >= 13000
constexpr int kParamBytes = 32764;
constexpr int kMaxBlocks = 3072;
#else
constexpr int kParamBytes = 4096;
constexpr int kMaxBlocks = 320;
#endif
// Room left in the parameter space for the op's own fields (flag and scale
// pointers, coefficients); each op is static_asserted against it at launch.
constexpr int kOpParamBytes = 128;

template <int Depth>
constexpr int max_tensors_per_launch() {
  constexpr int table = kParamBytes - kOpParamBytes -
      kMaxBlocks * static_cast<int>(sizeof(uint16_t) + sizeof(int32_t));
  constexpr int per_tensor = Depth * static_cast<int>(sizeof(void*)) +
      static_cast<int>(sizeof(int64_t) + sizeof(int32_t));
  constexpr int n = table / per_tensor;
  return n < 65535 ? n : 65535;  // block_tensor is 16-bit
}

template <int Depth>
struct LaunchArgs {
  static constexpr int kMaxTensors = max_tensors_per_launch<Depth>();
  void* ptr[Depth][kMaxTensors];
  int64_t numel[kMaxTensors];
  // Op-defined number per tensor; l2norm stores the index of the tensor's
  // first partial sum so that chunk c of the tensor writes slot base + c.
  int32_t base[kMaxTensors];
  int32_t block_chunk[kMaxBlocks];
  uint16_t block_tensor[kMaxBlocks];
};

// One tensor (or a pair, for Depth 2) to be processed; ptr[0] is read, and
// ptr[Depth - 1] written, so a Depth-1 task is updated in place.
template <int Depth>
struct Task {
  void* ptr[Depth];
  int64_t numel;
  int32_t base;
};

// What a block sees of its chunk.
template <int Depth>
struct Chunk {
  void* ptr[Depth];
  int64_t begin;  // in elements, from the start of the tensor
  int n;          // elements in this chunk, 1..kChunkElems
  int32_t index;  // the tensor's base + the chunk's number within it

  template <typename T>
  __device__ __forceinline__ const T* in() const {
    return static_cast<const T*>(ptr[0]) + begin;
  }
  template <typename T>
  __device__ __forceinline__ T* out() const {
    return static_cast<T*>(ptr[Depth - 1]) + begin;
  }
};

// The sum of v over the warp, in a fixed order (a butterfly); every lane gets
// it. All 32 lanes must call it.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

// Conversions on the raw bits with register-only intrinsics. c10's own
// operators reinterpret the object's address, which can keep a whole vector
// of loaded values in local memory (seen as stack spills in ptxas -v).
// Rounding is to nearest even, as in ATen's casts.
__device__ __forceinline__ float to_float(float x) {
  return x;
}
__device__ __forceinline__ float to_float(c10::Half x) {
  return __half2float(__ushort_as_half(x.x));
}
__device__ __forceinline__ float to_float(c10::BFloat16 x) {
  return __uint_as_float(static_cast<uint32_t>(x.x) << 16);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ c10::Half from_float<c10::Half>(float x) {
  return c10::Half(__half_as_ushort(__float2half_rn(x)), c10::Half::from_bits());
}
template <>
__device__ __forceinline__ c10::BFloat16 from_float<c10::BFloat16>(float x) {
  return c10::BFloat16(__bfloat16_as_ushort(__float2bfloat16_rn(x)), c10::BFloat16::from_bits());
}

// The precision an op computes in: fp32, or fp64 when either side is fp64.
template <typename A, typename B>
using opmath_t =
    std::conditional_t<std::is_same_v<A, double> || std::is_same_v<B, double>, double, float>;

template <typename M, typename T>
__device__ __forceinline__ M to_opmath(T x) {
  if constexpr (std::is_same_v<T, double>) {
    return x;
  } else {
    return static_cast<M>(to_float(x));
  }
}

// fp64 narrows through float, rounding twice, as torch's casts from double to
// Half and BFloat16 do (their constructors take a float).
template <typename Out, typename M>
__device__ __forceinline__ Out from_opmath(M v) {
  if constexpr (std::is_same_v<Out, double>) {
    return v;
  } else if constexpr (std::is_same_v<M, double>) {
    return from_float<Out>(__double2float_rn(v));
  } else {
    return from_float<Out>(v);
  }
}

// Products and sums rounded one by one (never contracted into an FMA).
__device__ __forceinline__ float mul_rn(float a, float b) {
  return __fmul_rn(a, b);
}
__device__ __forceinline__ double mul_rn(double a, double b) {
  return __dmul_rn(a, b);
}
__device__ __forceinline__ float add_rn(float a, float b) {
  return __fadd_rn(a, b);
}
__device__ __forceinline__ double add_rn(double a, double b) {
  return __dadd_rn(a, b);
}

// Same-dtype copies move bits untouched (NaN payloads included), like copy_.
template <typename To, typename From>
__device__ __forceinline__ To cast_to(From x) {
  if constexpr (std::is_same_v<To, From>) {
    return x;
  } else {
    return from_opmath<To>(to_opmath<opmath_t<To, From>>(x));
  }
}

// A bit test rather than isfinite(): it cannot be folded away by fast-math
// style assumptions that NaN and inf never occur.
__device__ __forceinline__ bool is_nonfinite(float x) {
  return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
}
__device__ __forceinline__ bool is_nonfinite(double x) {
  return (static_cast<unsigned long long>(__double_as_longlong(x)) & 0x7ff0000000000000ull) ==
      0x7ff0000000000000ull;
}

template <typename T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Vec {
  T v[N];
};

// How a per-element function touches the second array.
enum class Access {
  kRead,       // f(x) -> void; the chunk is only read (reductions)
  kWrite,      // f(x) -> Out, stored; out is not read
  kReadWrite,  // f(x, y) -> Out, stored over y
};

namespace detail {

// N elements per access, U accesses in flight per thread before the first
// use. Index arithmetic stays in int: a chunk is at most 64K elements.
template <int N, int U, Access A, typename In, typename Out, typename F>
__device__ __forceinline__ void sweep(const In* in, Out* out, int count, int first, F& f) {
  using VI = Vec<In, N>;
  using VO = Vec<Out, N>;
  const VI* vin = reinterpret_cast<const VI*>(in);
  VO* vout = reinterpret_cast<VO*>(out);
  for (int base = first; base < count; base += U * kBlockThreads) {
    VI x[U];
    VO y[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = base + u * kBlockThreads;
      if (i < count) {
        x[u] = vin[i];
        if constexpr (A == Access::kReadWrite) {
          y[u] = vout[i];
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = base + u * kBlockThreads;
      if (i < count) {
#pragma unroll
        for (int e = 0; e < N; ++e) {
          if constexpr (A == Access::kRead) {
            f(x[u].v[e]);
          } else if constexpr (A == Access::kWrite) {
            y[u].v[e] = f(x[u].v[e]);
          } else {
            y[u].v[e] = f(x[u].v[e], y[u].v[e]);
          }
        }
        if constexpr (A != Access::kRead) {
          vout[i] = y[u];
        }
      }
    }
  }
}

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

}  // namespace detail

// Applies f to the n elements of one chunk, all threads of the block
// together. The narrower dtype gets a full 16-byte vector per access (8
// bf16/fp16 or 4 fp32); the wider side then moves 32 bytes as two 16-byte
// accesses. About 64 bytes are loaded per thread before the first use (at
// least two accesses), which keeps enough requests in flight for HBM3 even
// when register use limits occupancy. An fp64 side instead gets the 16-byte
// access (2 elements), so that the other side's vector does not take 64 bytes
// of registers.
template <Access A, typename In, typename Out, typename F>
__device__ __forceinline__ void for_each_element(const In* in, Out* out, int n, F&& f) {
  constexpr int kNarrow = sizeof(In) < sizeof(Out) ? sizeof(In) : sizeof(Out);
  constexpr int kWide = sizeof(In) < sizeof(Out) ? sizeof(Out) : sizeof(In);
  constexpr int N = 16 / (kWide == 8 ? kWide : kNarrow);
  constexpr int kLoadBytes =
      N * static_cast<int>(sizeof(In) + (A == Access::kReadWrite ? sizeof(Out) : 0));
  constexpr int kU = 64 / kLoadBytes > 2 ? 64 / kLoadBytes : 2;
  // With an fp64 side each access holds 2 elements, so the 64-byte rule would
  // keep up to 16 of them (and their fp64 results) live: 4 are enough.
  constexpr int U = kWide == 8 && kU > 4 ? 4 : kU;
  const bool vectorised =
      detail::aligned16(in) && (A == Access::kRead || detail::aligned16(out));
  if (vectorised) {
    const int nvec = n / N;
    detail::sweep<N, U, A>(in, out, nvec, threadIdx.x, f);
    detail::sweep<1, 1, A>(in, out, n, nvec * N + threadIdx.x, f);
  } else {
    detail::sweep<1, 4, A>(in, out, n, threadIdx.x, f);
  }
}

// At most 64 registers, so that two blocks (1024 threads) fit on an SM; with
// the loads batched per thread that keeps enough bytes in flight. ptxas
// reports 37-64 registers across the instantiations, spilling 8 bytes at most.
template <int Depth, typename Op>
__global__ void __launch_bounds__(kBlockThreads, 2)
    multi_tensor_kernel(const __grid_constant__ LaunchArgs<Depth> args, const Op op) {
  const int t = args.block_tensor[blockIdx.x];
  const int chunk = args.block_chunk[blockIdx.x];
  Chunk<Depth> c;
#pragma unroll
  for (int d = 0; d < Depth; ++d) {
    c.ptr[d] = args.ptr[d][t];
  }
  c.begin = static_cast<int64_t>(chunk) * kChunkElems;
  const int64_t left = args.numel[t] - c.begin;
  c.n = left < kChunkElems ? static_cast<int>(left) : kChunkElems;
  c.index = args.base[t] + chunk;
  op(c);
}

// Fills the argument tables from tasks and calls launch(args, blocks) each
// time one is full, and once more at the end. Tasks with no elements are
// skipped. Kept apart from the kernel launch so that the batching can be
// checked on a machine without a GPU.
template <int Depth, typename Launch>
void batch_chunks(const std::vector<Task<Depth>>& tasks, LaunchArgs<Depth>& args, Launch&& launch) {
  constexpr int kMaxTensors = LaunchArgs<Depth>::kMaxTensors;
  int tensors = 0;
  int blocks = 0;
  for (const Task<Depth>& task : tasks) {
    if (task.numel == 0) {
      continue;
    }
    for (int d = 0; d < Depth; ++d) {
      args.ptr[d][tensors] = task.ptr[d];
    }
    args.numel[tensors] = task.numel;
    args.base[tensors] = task.base;
    ++tensors;

    const int64_t chunks = (task.numel + kChunkElems - 1) / kChunkElems;
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      args.block_tensor[blocks] = static_cast<uint16_t>(tensors - 1);
      args.block_chunk[blocks] = static_cast<int32_t>(chunk);
      ++blocks;
      const bool last_chunk = chunk == chunks - 1;
      if (blocks == kMaxBlocks || (last_chunk && tensors == kMaxTensors)) {
        launch(static_cast<const LaunchArgs<Depth>&>(args), blocks);
        blocks = 0;
        if (last_chunk) {
          tensors = 0;
        } else {
          // The tensor's remaining chunks go into the next launch: keep it, as entry 0.
          for (int d = 0; d < Depth; ++d) {
            args.ptr[d][0] = args.ptr[d][tensors - 1];
          }
          args.numel[0] = args.numel[tensors - 1];
          args.base[0] = args.base[tensors - 1];
          tensors = 1;
        }
      }
    }
  }
  if (blocks > 0) {
    launch(static_cast<const LaunchArgs<Depth>&>(args), blocks);
  }
}

// Runs op over every chunk of every task, in as few launches as the argument
// tables allow. Op must provide `__device__ void operator()(const Chunk<Depth>&) const`
// and be trivially copyable; it travels in the same parameter space as the tables.
template <int Depth, typename Op>
void multi_tensor_apply(const std::vector<Task<Depth>>& tasks, const Op& op, cudaStream_t stream) {
  using Args = LaunchArgs<Depth>;
  static_assert(sizeof(Op) <= kOpParamBytes, "op fields exceed the space reserved for them");
  static_assert(sizeof(Args) + sizeof(Op) <= kParamBytes, "kernel arguments exceed the limit");
  static_assert(std::is_trivially_copyable_v<Op>, "kernel arguments must be trivially copyable");

  Args args;
  batch_chunks<Depth>(tasks, args, [&](const Args& filled, int blocks) {
    // The launch copies the arguments, so the tables can be refilled at once.
    multi_tensor_kernel<Depth, Op><<<blocks, kBlockThreads, 0, stream>>>(filled, op);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace amp_patch::cuda
