// Module initialisation for amp_patch._C.
//
// Importing the module loads the shared library, whose static initialisers
// register the C++ kernels with the dispatcher (TORCH_LIBRARY_IMPL in
// csrc/cpu and csrc/cuda); the op schemas are defined in amp_patch/ops/. The
// module exposes one diagnostic and the O1 wrapper type (o1_wrappers.cpp),
// through the CPython API: no pybind11 module.
#include <Python.h>

#include "cpu/kernel_table.h"
#include "o1_wrappers.h"

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
  PyObject* module = PyModule_Create(&module_def);
  if (module != nullptr && amp_patch::o1::add_types(module) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
