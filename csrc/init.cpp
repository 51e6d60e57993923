// Module initialisation for amp_patch._C.
//
// Importing the module loads the shared library, whose static initialisers
// register the C++ kernels with the dispatcher (TORCH_LIBRARY_IMPL in
// csrc/cpu and csrc/cuda); the op schemas are defined in amp_patch/ops.py. The
// module itself exposes one diagnostic, so no pybind11 is needed.
#include <Python.h>

#include "cpu/kernel_table.h"

namespace {

PyObject* cpu_capability(PyObject*, PyObject*) {
  return PyUnicode_FromString(amp_patch::cpu::kernel_capability().c_str());
}

PyMethodDef methods[] = {
    {"cpu_capability", cpu_capability, METH_NOARGS,
     "cpu_capability() -> str\n\nThe instruction set the CPU kernels run with: "
     "\"AVX512\", \"AVX2\" or \"DEFAULT\"."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "_C",
    "Compiled multi-tensor kernels of amp_patch (registered with torch's dispatcher on import).",
    -1,
    methods,
};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) {
  return PyModule_Create(&module_def);
}
