// The AVX2 build of the multi-tensor loops. See vec_loops.h for why this is a
// target pragma rather than a compile flag, and what keeps it off older CPUs.
#if defined(__x86_64__) || defined(_M_X64)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,bmi,bmi2"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")
#endif
#include "cpu/isa/avx2_macros.h"
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include "cpu/vec_loops.h"
#include "cpu/optim_loops.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif
#else
// Not x86: the AVX2 table is the baseline one, never selected at run time.
#include "cpu/kernel_table.h"
namespace amp_patch::cpu::AVX2 {
KernelTable kernel_table() { return DEFAULT::kernel_table(); }
}  // namespace amp_patch::cpu::AVX2
#endif
