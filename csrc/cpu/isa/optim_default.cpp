// The baseline build of the optimizer loops (see optim_loops.h and vec_loops.h).
#define CPU_CAPABILITY DEFAULT
#include "cpu/optim_loops.h"
