// The baseline (x86-64 / any architecture) build of the multi-tensor loops:
// at::vec's generic Vectorized, which the compiler may still auto-vectorise
// for the baseline ISA. See vec_loops.h for how the ISA copies coexist.
#define CPU_CAPABILITY DEFAULT
#include "cpu/vec_loops.h"
#include "cpu/optim_loops.h"
