// Python entry point of the extension module te_compile._C.
//
// The module has no Python-visible functions. Importing it loads this shared library, and the
// library's static initialisers (TORCH_LIBRARY_FRAGMENT / TORCH_LIBRARY_IMPL blocks in the other
// files of csrc/) register the te:: ops with the PyTorch dispatcher, after which they are
// reachable as torch.ops.te.<name>. te_compile/_csrc.py does the import.
#include <Python.h>

static PyModuleDef te_compile_c_module = {
    PyModuleDef_HEAD_INIT,
    "te_compile._C",  // m_name
    "C++/CUDA ops of te_compile, registered as torch.ops.te.* on import.",  // m_doc
    -1,  // m_size: no per-module state
    nullptr,  // m_methods: none
};

PyMODINIT_FUNC PyInit__C(void) {
  return PyModule_Create(&te_compile_c_module);
}
