// The AVX2-level ISA macros, for the translation units that switch the target
// with a pragma (avx2.cpp, avx512.cpp). In C++ the target pragma does not update
// the predefined ISA macros (the front end lexes the file first), yet headers
// such as sleef.h test them. Include it right after the pragma.
#pragma once

#ifndef __AVX__
#define __AVX__ 1
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#endif
#ifndef __FMA__
#define __FMA__ 1
#endif
#ifndef __F16C__
#define __F16C__ 1
#endif
#ifndef __BMI__
#define __BMI__ 1
#endif
#ifndef __BMI2__
#define __BMI2__ 1
#endif
