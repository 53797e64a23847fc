"""Sources and compiler flags of the native ops: one list for the JIT build and setup.py.

Imports nothing from torch so that setup.py can read it before the extension exists.
"""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")

# Order does not matter. The sources only register CPU / CUDA kernels
# (TORCH_LIBRARY_IMPL); the schemas and the default (reference) kernels are defined in Python,
# zero_ext/kernels/_ops.py, which the loader imports before it loads the library.
CPU_SOURCES = ["partition.cpp", "flatten_cpu.cpp", "fused_adamw_cpu.cpp"]
CUDA_SOURCES = ["flatten.cu", "fused_adamw.cu"]

CXX_FLAGS = ["-O3", "-fopenmp"]
NVCC_FLAGS = ["-O3", "-lineinfo"]
LD_FLAGS = ["-fopenmp"]


def sources(cuda: bool, root: str = CSRC) -> list:
    names = CPU_SOURCES + (CUDA_SOURCES if cuda else [])
    return [os.path.join(root, n) for n in names]
