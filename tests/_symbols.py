"""What a built native library exports and links (binutils' nm and readelf), for the tests
of test_cuda_build.py and test_native_status.py (docs/build.md, "What the library exports").

The library must export nothing but setup.py's Python entry point (PyInit__C): no symbol of
its own code, and no weak copy of template code from torch's or libstdc++'s headers (std::,
c10::, ...) that another library could bind to, or ours to another's. And it must take
libstdc++ from libstdc++.so: no static copy of libstdc++'s own compiled code (locales,
codecvt, the ostream inserters, the __throw_* helpers) in its symbol table.
"""
from __future__ import annotations

import shutil
import subprocess

ALLOWED_EXPORT_PREFIXES = ("PyInit_",)
# Code that lives in libstdc++.so only (compiled into it, declared extern template or
# out-of-line in the headers): a definition of it in our library is a static copy.
LIBSTDCXX_OWN_CODE = ("std::locale::", "std::codecvt<", "std::ios_base::", "std::__throw_",
                      "std::basic_ostream<char, std::char_traits<char> >::_M_insert<",
                      "std::__cxx11::basic_ostringstream<char, std::char_traits<char>, "
                      "std::allocator<char> >::basic_ostringstream(")


def tools_missing() -> str | None:
    for tool in ("nm", "readelf"):
        if shutil.which(tool) is None:
            return f"{tool} (binutils) not found"
    return None


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120).stdout


def defined_symbols(path: str, dynamic: bool) -> list:
    """(type letter, demangled name) of every symbol the library defines: its dynamic
    (exported) symbols, or the whole symbol table (empty when the library is stripped)."""
    out = _run("nm", "-C", "--defined-only", *(["-D"] if dynamic else []), path)
    syms = []
    for line in out.splitlines():
        parts = line.split(" ", 2)  # "<address> <type> <name>"
        if len(parts) == 3:
            syms.append((parts[1], parts[2]))
    return syms


def needed(path: str) -> list:
    """The shared libraries the library names as NEEDED."""
    out = _run("readelf", "-d", path)
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines()
            if "(NEEDED)" in line and "[" in line]


def problems(path: str) -> list:
    """Why the library breaks the rules above (empty: it keeps them)."""
    out = []
    exported = [(t, n) for t, n in defined_symbols(path, dynamic=True)
                if not n.startswith(ALLOWED_EXPORT_PREFIXES)]
    if exported:
        std = sum("std::" in n for _, n in exported)
        weak = sum(t in "VWu" for t, _ in exported)
        out.append(f"{len(exported)} exported symbols besides PyInit_* ({std} of std::, "
                   f"{weak} weak or unique), e.g. {[n[:120] for _, n in exported[:5]]}")
    copies = sorted({n for _, n in defined_symbols(path, dynamic=False)
                     if n.startswith(LIBSTDCXX_OWN_CODE)})
    if copies:
        out.append(f"static copies of libstdc++'s own code: {[n[:120] for n in copies[:5]]}")
    libs = needed(path)
    if not any(lib.startswith("libstdc++.so") for lib in libs):
        out.append(f"libstdc++.so is not among the NEEDED libraries: {libs}")
    return out
