"""Builds csrc/ into the extension module te_compile._C (metadata lives in pyproject.toml).

Sources are found by glob, so adding a kernel never needs an edit here: every csrc/**/*.cpp is
compiled; when torch was built with CUDA and nvcc is found (torch.utils.cpp_extension.CUDA_HOME)
the module is a CUDAExtension that also compiles every csrc/**/*.cu and defines
TE_COMPILE_WITH_CUDA; otherwise it is a CppExtension and .cu files are left out.

CUDA architectures: sm_90 plus compute_90 PTX for newer GPUs, unless TORCH_CUDA_ARCH_LIST is
set, in which case torch's own handling of that variable picks them.

Install with `pip install -e . --no-build-isolation` (the build must use the torch already
installed, never a fresh one from the index).
"""

import glob
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _sources(suffix: str) -> list[str]:
    """Paths of csrc/**/*<suffix>, relative to the project root, in a stable order."""
    found = glob.glob(os.path.join(ROOT, "csrc", "**", f"*{suffix}"), recursive=True)
    return sorted(os.path.relpath(path, ROOT) for path in found)


def _extension():
    # No -std flag: BuildExtension adds the standard the installed torch's headers need
    # (C++20 for torch 2.13, whose headers warn under C++17). Our own sources are C++17.
    cxx_flags = ["-O3"]
    if torch.version.cuda is None or CUDA_HOME is None:
        return CppExtension(
            "te_compile._C", _sources(".cpp"), extra_compile_args={"cxx": cxx_flags}
        )

    nvcc_flags = ["-O3"]
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        # Any arch flag here stops torch from adding its own (from TORCH_CUDA_ARCH_LIST or
        # the visible GPU), so only add ours when the user has not asked for something else.
        nvcc_flags += [
            "-gencode=arch=compute_90,code=sm_90",
            "-gencode=arch=compute_90,code=compute_90",
        ]
    return CUDAExtension(
        "te_compile._C",
        _sources(".cpp") + _sources(".cu"),
        # C++ files can guard CUDA-only code (CUDA headers, TORCH_LIBRARY_IMPL(te, CUDA, m))
        # with #ifdef TE_COMPILE_WITH_CUDA.
        define_macros=[("TE_COMPILE_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )


os.chdir(ROOT)  # setuptools wants source paths relative to the directory of setup.py
setup(ext_modules=[_extension()], cmdclass={"build_ext": BuildExtension})
