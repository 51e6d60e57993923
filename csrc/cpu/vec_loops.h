// The vectorised inner loops of the multi-tensor CPU kernels.
//
// This header is compiled three times, by csrc/cpu/isa/{default,avx2,avx512}.cpp.
// Each of those defines CPU_CAPABILITY (and CPU_CAPABILITY_AVX2/AVX512, which
// select at::vec's intrinsic implementations) and switches the compiler's
// target ISA with a pragma before including it. That is how one .so carries
// fast AVX-512 and AVX2 loops and still loads on a CPU without AVX:
//
//   * at::vec::Vectorized lives in the inline namespace at::vec::CPU_CAPABILITY,
//     and our loops in amp_patch::cpu::CPU_CAPABILITY, so each ISA's copies have
//     distinct symbols;
//   * these translation units define no globals with dynamic initialisers, so
//     no AVX instruction runs at load time;
//   * inline functions from shared headers (c10, libstdc++) that more than one
//     TU emits out of line are COMDAT: the linker keeps the first copy, and
//     setup.py links the ISA objects in increasing order (default, AVX2,
//     AVX-512), so a lower ISA never calls a higher ISA's copy;
//   * multi_tensor_ops.cpp picks the table at run time from torch's own CPU
//     capability (which honours ATEN_CPU_CAPABILITY) and the CPU's features.
//
// The alternative, building at::vec with -mavx2 for the whole extension, would
// either crash on older CPUs or leave everything on the slow generic path.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

#include "cpu/kernel_table.h"

namespace amp_patch::cpu {
namespace CPU_CAPABILITY {

// For the per-vector helpers of the hot loops: as calls, they would pass their
// vectors through memory (and make the compiler reload what they might alias).
#if defined(__GNUC__)
#define AMP_CPU_INLINE inline __attribute__((always_inline))
#else
#define AMP_CPU_INLINE inline
#endif

using Vec = at::vec::Vectorized<float>;
// A block is what one Vectorized of a 16-bit type holds: two float vectors.
constexpr int64_t kW = Vec::size();
constexpr int64_t kBlock = 2 * kW;

// Loads and stores one block of T as two float vectors. Partial blocks (the
// tail of a span) go through a zeroed stack buffer: the padding must be a
// finite value, or the inf/NaN check would see garbage.
template <typename T>
struct Block {
  static_assert(at::vec::Vectorized<T>::size() == kBlock, "16-bit vector must hold two float vectors");

  AMP_CPU_INLINE static void load(const T* p, Vec& lo, Vec& hi) {
    std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p));
  }
  AMP_CPU_INLINE static void store(T* p, const Vec& lo, const Vec& hi) {
    at::vec::convert_from_float<T>(lo, hi).store(p);
  }
};

template <>
struct Block<float> {
  AMP_CPU_INLINE static void load(const float* p, Vec& lo, Vec& hi) {
    lo = Vec::loadu(p);
    hi = Vec::loadu(p + kW);
  }
  AMP_CPU_INLINE static void store(float* p, const Vec& lo, const Vec& hi) {
    lo.store(p);
    hi.store(p + kW);
  }
};

template <typename T>
AMP_CPU_INLINE void load_block(const T* p, int64_t n, Vec& lo, Vec& hi) {
  if (n == kBlock) {
    Block<T>::load(p, lo, hi);
    return;
  }
  T buf[kBlock];
  std::memset(static_cast<void*>(buf), 0, sizeof(buf));
  std::memcpy(static_cast<void*>(buf), p, n * sizeof(T));
  Block<T>::load(buf, lo, hi);
}

template <typename T>
AMP_CPU_INLINE void store_block(T* p, int64_t n, const Vec& lo, const Vec& hi) {
  if (n == kBlock) {
    Block<T>::store(p, lo, hi);
    return;
  }
  T buf[kBlock];
  Block<T>::store(buf, lo, hi);
  std::memcpy(static_cast<void*>(p), buf, n * sizeof(T));
}

// Calls body(offset, count) over [begin, n) in blocks; count < kBlock only for the last.
template <typename Body>
inline void for_blocks(int64_t begin, int64_t n, Body&& body) {
  int64_t i = begin;
  for (; i + kBlock <= n; i += kBlock) {
    body(i, kBlock);
  }
  if (i < n) {
    body(i, n - i);
  }
}

// x - x is 0 for finite x and NaN for inf or NaN, so a running sum of it turns
// NaN on the first non-finite element: one add per vector, no branch.
inline void track_nonfinite(Vec& acc, const Vec& lo, const Vec& hi) {
  acc = acc + (lo - lo) + (hi - hi);
}

inline bool any_nan(const Vec& acc) {
  float lanes[kW];
  acc.store(lanes);
  return std::any_of(lanes, lanes + kW, [](float v) { return std::isnan(v); });
}

// Non-temporal stores of whole fp32 blocks. An ordinary store first reads each
// destination cache line (read for ownership), so an out-of-place pass into
// fp32 would move 4 more bytes per element than it writes: 10 instead of 6 for
// bf16 -> fp32. Streaming stores skip that read. They need an aligned address
// and are only worth it where the output is not read back soon from cache.
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kCanStream = true;
inline void stream_block(float* p, const Vec& lo, const Vec& hi) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm512_stream_ps(p, lo);
  _mm512_stream_ps(p + kW, hi);
#else
  _mm256_stream_ps(p, lo);
  _mm256_stream_ps(p + kW, hi);
#endif
}
inline void stream_fence() { _mm_sfence(); }
#else
constexpr bool kCanStream = false;
inline void stream_block(float* p, const Vec& lo, const Vec& hi) { Block<float>::store(p, lo, hi); }
inline void stream_fence() {}
#endif

template <typename TI, typename TO>
bool scale_loop(const void* in_, void* out_, int64_t n, float scale) {
  const TI* in = static_cast<const TI*>(in_);
  TO* out = static_cast<TO*>(out_);
  const Vec s(scale);
  Vec acc(0.f);
  // Out of place into fp32 (unscaling half grads into fp32 master grads): a
  // short head up to the first vector-aligned output element (spans start
  // anywhere in a tensor), then whole blocks streamed.
  if constexpr (std::is_same_v<TO, float> && kCanStream) {
    if (in_ != out_) {
      const auto misalign = reinterpret_cast<std::uintptr_t>(out) % sizeof(Vec);
      const int64_t head =
          std::min<int64_t>(n, misalign ? (sizeof(Vec) - misalign) / sizeof(float) : 0);
      if (head > 0) {
        Vec lo, hi;
        load_block(in, head, lo, hi);
        track_nonfinite(acc, lo, hi);
        store_block(out, head, lo * s, hi * s);
      }
      for_blocks(head, n, [&](int64_t i, int64_t c) {
        Vec lo, hi;
        load_block(in + i, c, lo, hi);
        track_nonfinite(acc, lo, hi);
        if (c == kBlock) {
          stream_block(out + i, lo * s, hi * s);
        } else {
          store_block(out + i, c, lo * s, hi * s);
        }
      });
      stream_fence();
      return any_nan(acc);
    }
  }
  for_blocks(0, n, [&](int64_t i, int64_t c) {
    Vec lo, hi;
    load_block(in + i, c, lo, hi);
    track_nonfinite(acc, lo, hi);
    store_block(out + i, c, lo * s, hi * s);
  });
  return any_nan(acc);
}

// Matches the reference's rounding: a*x and b*y are each rounded to fp32 before
// the add (setup.py builds with -ffp-contract=off so no FMA fuses them). The
// reference multiplies fp32 tensors by Python floats, which torch rounds to fp32.
template <typename TX, typename TY>
bool axpby_loop(const void* x_, void* y_, int64_t n, double a, double b) {
  const TX* x = static_cast<const TX*>(x_);
  TY* y = static_cast<TY*>(y_);
  const Vec av(static_cast<float>(a)), bv(static_cast<float>(b));
  Vec acc(0.f);
  for_blocks(0, n, [&](int64_t i, int64_t c) {
    Vec xlo, xhi, ylo, yhi;
    load_block(x + i, c, xlo, xhi);
    load_block(y + i, c, ylo, yhi);
    track_nonfinite(acc, xlo, xhi);
    store_block(y + i, c, av * xlo + bv * ylo, av * xhi + bv * yhi);
  });
  return any_nan(acc);
}

// Pairs with an fp64 side compute in fp64. They are rare (a parameter kept in
// double), so they are plain loops, which the compiler vectorises where the
// conversions allow; the finiteness test is on the bits, an integer OR.
template <typename T>
inline double to_f64(T x) {
  return static_cast<double>(static_cast<float>(x));
}
template <>
inline double to_f64<double>(double x) {
  return x;
}

// Through float, as torch's own casts from double to Half and BFloat16 go
// (their constructors take a float): rounded twice.
template <typename T>
inline T from_f64(double v) {
  if constexpr (std::is_same_v<T, double>) {
    return v;
  } else {
    return static_cast<T>(static_cast<float>(v));
  }
}

inline bool nonfinite_f64(double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return (bits & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
}

template <typename TI, typename TO>
bool scale_loop_f64(const void* in_, void* out_, int64_t n, float scale) {
  const TI* in = static_cast<const TI*>(in_);
  TO* out = static_cast<TO*>(out_);
  const double s = scale;
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) {
    const double v = to_f64(in[i]);
    bad |= nonfinite_f64(v);
    out[i] = from_f64<TO>(v * s);
  }
  return bad;
}

template <typename TX, typename TY>
bool axpby_loop_f64(const void* x_, void* y_, int64_t n, double a, double b) {
  const TX* x = static_cast<const TX*>(x_);
  TY* y = static_cast<TY*>(y_);
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) {
    const double xv = to_f64(x[i]);
    bad |= nonfinite_f64(xv);
    y[i] = from_f64<TY>(a * xv + b * to_f64(y[i]));
  }
  return bad;
}

template <typename TI, typename TO>
void copy_loop(const void* in_, void* out_, int64_t n) {
  if constexpr (std::is_same_v<TI, TO>) {
    std::memcpy(out_, in_, n * sizeof(TI));
  } else if constexpr (std::is_same_v<TI, double> || std::is_same_v<TO, double>) {
    const TI* in = static_cast<const TI*>(in_);
    TO* out = static_cast<TO*>(out_);
    for (int64_t i = 0; i < n; ++i) {
      out[i] = from_f64<TO>(to_f64(in[i]));
    }
  } else {
    const TI* in = static_cast<const TI*>(in_);
    TO* out = static_cast<TO*>(out_);
    for_blocks(0, n, [&](int64_t i, int64_t c) {
      Vec lo, hi;
      load_block(in + i, c, lo, hi);
      store_block(out + i, c, lo, hi);
    });
  }
}

// Four independent accumulators (two blocks per step) so the FMA latency
// chain does not limit a loop that should run at memory bandwidth. kScaled
// multiplies each element by scale first (unscale_l2norm), rounded to fp32.
template <typename TI, bool kScaled>
double sumsq_loop(const void* in_, int64_t n, float scale) {
  const TI* in = static_cast<const TI*>(in_);
  const Vec s(scale);
  Vec acc0(0.f), acc1(0.f), acc2(0.f), acc3(0.f);
  int64_t i = 0;
  for (; i + 2 * kBlock <= n; i += 2 * kBlock) {
    Vec a, b, c, d;
    Block<TI>::load(in + i, a, b);
    Block<TI>::load(in + i + kBlock, c, d);
    if constexpr (kScaled) {
      a = a * s;
      b = b * s;
      c = c * s;
      d = d * s;
    }
    acc0 = at::vec::fmadd(a, a, acc0);
    acc1 = at::vec::fmadd(b, b, acc1);
    acc2 = at::vec::fmadd(c, c, acc2);
    acc3 = at::vec::fmadd(d, d, acc3);
  }
  for_blocks(i, n, [&](int64_t j, int64_t c) {
    Vec lo, hi;
    load_block(in + j, c, lo, hi);
    if constexpr (kScaled) {
      lo = lo * s;  // the zero padding stays zero
      hi = hi * s;
    }
    acc0 = at::vec::fmadd(lo, lo, acc0);
    acc1 = at::vec::fmadd(hi, hi, acc1);
  });
  float lanes[kW];
  ((acc0 + acc1) + (acc2 + acc3)).store(lanes);
  double total = 0.0;
  for (float v : lanes) {
    total += v;
  }
  return total;
}

// fp64: the squares of the (scaled) values summed in fp64, four sums at a time.
template <bool kScaled>
double sumsq_loop_f64(const void* in_, int64_t n, float scale) {
  const double* in = static_cast<const double*>(in_);
  const double s = scale;
  double acc[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int k = 0; k < 4; ++k) {
      const double v = kScaled ? in[i + k] * s : in[i + k];
      acc[k] += v * v;
    }
  }
  for (; i < n; ++i) {
    const double v = kScaled ? in[i] * s : in[i];
    acc[0] += v * v;
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// Index order matches Dt: kF32, kF16, kBF16, kF64.
template <int I>
using TypeAt = std::tuple_element_t<I, std::tuple<float, c10::Half, c10::BFloat16, double>>;

template <int I, int J>
void fill_pair(KernelTable& t) {
  using TI = TypeAt<I>;
  using TO = TypeAt<J>;
  if constexpr (std::is_same_v<TI, double> || std::is_same_v<TO, double>) {
    t.scale[I][J] = &scale_loop_f64<TI, TO>;
    t.axpby[I][J] = &axpby_loop_f64<TI, TO>;
  } else {
    t.scale[I][J] = &scale_loop<TI, TO>;
    t.axpby[I][J] = &axpby_loop<TI, TO>;
  }
  t.copy[I][J] = &copy_loop<TI, TO>;
}

template <bool kScaled>
void fill_sumsq(SumsqFn (&f)[kNumDt]) {
  f[kF32] = &sumsq_loop<float, kScaled>;
  f[kF16] = &sumsq_loop<c10::Half, kScaled>;
  f[kBF16] = &sumsq_loop<c10::BFloat16, kScaled>;
  f[kF64] = &sumsq_loop_f64<kScaled>;
}

template <int... K>
KernelTable make_table(std::integer_sequence<int, K...>) {
  KernelTable t{};
  (fill_pair<K / kNumDt, K % kNumDt>(t), ...);
  fill_sumsq<false>(t.sumsq);
  fill_sumsq<true>(t.scaled_sumsq);
  return t;
}

KernelTable kernel_table() {
  return make_table(std::make_integer_sequence<int, kNumDt * kNumDt>{});
}

}  // namespace CPU_CAPABILITY
}  // namespace amp_patch::cpu
