// The AVX2 build of the optimizer loops; avx2.cpp explains the pragma.
#if defined(__x86_64__) || defined(_M_X64)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,bmi,bmi2"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")
#endif
#include "cpu/isa/avx2_macros.h"
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include "cpu/optim_loops.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif
#else
// Not x86: never selected at run time.
#include "cpu/optim_table.h"
namespace amp_patch::cpu::AVX2 {
OptimTable optim_table() { return DEFAULT::optim_table(); }
}  // namespace amp_patch::cpu::AVX2
#endif
