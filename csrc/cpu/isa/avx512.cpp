// The AVX-512 build of the multi-tensor loops (the F/BW/VL/DQ subset that
// torch's own AVX512 capability needs). See vec_loops.h for why this is a
// target pragma rather than a compile flag, and what keeps it off older CPUs.
#if defined(__x86_64__) || defined(_M_X64)
#if defined(__clang__)
#pragma clang attribute push(                                                          \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2"))), \
    apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2")
#endif
#include "cpu/isa/avx2_macros.h"
// The AVX-512 macros the pragma likewise leaves undefined.
#ifndef __AVX512F__
#define __AVX512F__ 1
#endif
#ifndef __AVX512BW__
#define __AVX512BW__ 1
#endif
#ifndef __AVX512VL__
#define __AVX512VL__ 1
#endif
#ifndef __AVX512DQ__
#define __AVX512DQ__ 1
#endif
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#include "cpu/vec_loops.h"
#include "cpu/optim_loops.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif
#else
// Not x86: the AVX-512 table is the baseline one, never selected at run time.
#include "cpu/kernel_table.h"
namespace amp_patch::cpu::AVX512 {
KernelTable kernel_table() { return DEFAULT::kernel_table(); }
}  // namespace amp_patch::cpu::AVX512
#endif
