// The interface between the tensor-level CPU ops (multi_tensor_ops.cpp) and the
// vectorised inner loops (vec_loops.h), which are compiled once per instruction
// set in csrc/cpu/isa/*.cpp.
//
// Only raw pointers cross this boundary, so the per-ISA translation units need
// nothing from ATen beyond at::vec and never touch a Tensor: code compiled for
// AVX-512 must not end up where a baseline CPU could run it (see vec_loops.h).
#pragma once

#include <cstdint>
#include <string>

namespace amp_patch::cpu {

// The element types the kernels handle, as table indices.
enum Dt : int { kF32 = 0, kF16 = 1, kBF16 = 2, kF64 = 3, kNumDt = 4 };

// Each loop covers n contiguous elements and returns true when it saw an inf or
// NaN in the input it checks. Arithmetic is in fp32 ("opmath"), or in fp64 when
// either side of the pair is fp64, rounded once to the output type.

// out = in * scale (in and out may alias); checks in.
using ScaleFn = bool (*)(const void* in, void* out, int64_t n, float scale);
// y = a * x + b * y; checks x.
using AxpbyFn = bool (*)(const void* x, void* y, int64_t n, double a, double b);
// out = in, converted.
using CopyFn = void (*)(const void* in, void* out, int64_t n);
// Sum of squares of (in * scale), each product rounded to opmath, accumulated in
// opmath vector lanes.
using SumsqFn = double (*)(const void* in, int64_t n, float scale);

struct KernelTable {
  ScaleFn scale[kNumDt][kNumDt];  // [in][out]
  AxpbyFn axpby[kNumDt][kNumDt];  // [x][y]
  CopyFn copy[kNumDt][kNumDt];    // [in][out]
  SumsqFn sumsq[kNumDt];         // scale is 1: l2norm
  SumsqFn scaled_sumsq[kNumDt];  // unscale_l2norm
};

// One table per instruction set, each defined in its own translation unit.
namespace DEFAULT { KernelTable kernel_table(); }
namespace AVX2 { KernelTable kernel_table(); }
namespace AVX512 { KernelTable kernel_table(); }

// The table for this CPU, chosen once on first use.
const KernelTable& kernels();

// The name of the instruction set kernels() chose: "AVX512", "AVX2" or "DEFAULT".
const std::string& kernel_capability();

}  // namespace amp_patch::cpu
