// The O1 casting wrappers' fast path (o1_wrappers.cpp), registered by init.cpp.
#pragma once

#include <Python.h>

namespace amp_patch::o1 {

// Adds the CastWrapper type to the module. Returns 0, or -1 with a Python error set.
int add_types(PyObject* module);

}  // namespace amp_patch::o1
