// The AVX-512 ISA macros (the F/BW/VL/DQ subset that torch's AVX512 capability
// needs), for the translation units that switch the target with a pragma
// (avx512.cpp, optim_avx512.cpp). avx2_macros.h says why they are needed;
// include this right after the pragma.
#pragma once

#include "cpu/isa/avx2_macros.h"

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
