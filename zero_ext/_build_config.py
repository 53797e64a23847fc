"""Sources and compiler flags of the native ops: one list for the JIT build and setup.py.

Imports nothing from torch so that setup.py can read it before the extension exists.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")

# Order does not matter. The sources only register CPU / CUDA kernels
# (TORCH_LIBRARY_IMPL); the schemas and the default (reference) kernels are defined in Python,
# zero_ext/kernels/_ops.py, which the loader imports before it loads the library.
CPU_SOURCES = ["partition.cpp", "flatten_cpu.cpp", "fused_adamw_cpu.cpp", "fused_adamw_plan.cpp",
               "process_groups.cpp"]
CUDA_SOURCES = ["flatten.cu", "fused_adamw.cu"]

# The library exports nothing of its own (docs/build.md, "What the library exports"): hidden
# visibility for host code (g++ and nvcc's host compiler alike), and a linker version script
# that keeps every symbol local but setup.py's PyInit__C. Template code instantiated from
# torch's and libstdc++'s headers (std::string, ostream inserters, ...) would otherwise be
# exported as weak symbols that other libraries can bind to (or the other way round), and
# with a toolchain other than torch's, one call can then run code of two libstdc++ versions:
# the suspected cause of a crash in TORCH_CHECK's message formatting with torch built by
# gcc-toolset-13 and the extension by Ubuntu's g++ 13. libstdc++ itself stays the shared
# libstdc++.so (no -static-libstdc++).
VISIBILITY_FLAGS = ["-fvisibility=hidden", "-fvisibility-inlines-hidden"]
CXX_FLAGS = ["-O3", "-fopenmp"] + VISIBILITY_FLAGS
NVCC_FLAGS = ["-O3", "-lineinfo", "-Xcompiler=" + ",".join(VISIBILITY_FLAGS)]
EXPORTS_MAP = os.path.join(CSRC, "exports.map")


def _ld_flags() -> list:
    flags = ["-fopenmp"]
    if sys.platform.startswith("linux"):  # GNU ld / gold / lld syntax
        # --exclude-libs: symbols of any static archive linked in stay local too
        flags += ["-Wl,--version-script=" + EXPORTS_MAP, "-Wl,--exclude-libs,ALL"]
    return flags


LD_FLAGS = _ld_flags()


def sources(cuda: bool, root: str = CSRC) -> list:
    names = CPU_SOURCES + (CUDA_SOURCES if cuda else [])
    return [os.path.join(root, n) for n in names]
