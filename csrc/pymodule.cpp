// Python entry point of the setup.py build (zero_ext._C). The module itself is empty: loading
// the shared library runs the TORCH_LIBRARY_IMPL registrations of the other sources (CPU and
// CUDA kernels of the ops whose schemas zero_ext/kernels/_ops.py defines). The JIT build does
// not need this file (it loads the library with is_python_module=False).
#include <Python.h>

static struct PyModuleDef zero_ext_c_module = {
    PyModuleDef_HEAD_INIT, "_C", "zero_ext native ops, registered as torch.ops.zero_ext.*",
    -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&zero_ext_c_module); }
