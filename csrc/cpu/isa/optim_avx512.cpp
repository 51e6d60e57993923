// The AVX-512 build of the optimizer loops; avx512.cpp explains the pragma and
// the feature subset.
#if defined(__x86_64__) || defined(_M_X64)
#if defined(__clang__)
#pragma clang attribute push(                                                          \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2"))), \
    apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2")
#endif
#include "cpu/isa/avx512_macros.h"
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#include "cpu/optim_loops.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif
#else
// Not x86: never selected at run time.
#include "cpu/optim_table.h"
namespace amp_patch::cpu::AVX512 {
OptimTable optim_table() { return DEFAULT::optim_table(); }
}  // namespace amp_patch::cpu::AVX512
#endif
