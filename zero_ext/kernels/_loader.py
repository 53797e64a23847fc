"""Find or build the native ops (torch.ops.zero_ext.*), once per process.

Order: an extension built by setup.py (zero_ext._C), else a JIT build of csrc/ with
torch.utils.cpp_extension (cached in TORCH_EXTENSIONS_DIR, MAX_JOBS honoured). If both fail,
or ZERO_EXT_REFERENCE=1, the pure-PyTorch references run instead and one loud warning says so.
ZERO_EXT_BUILD_CUDA=1/0 forces the CUDA sources in or out of the JIT build (default: in when a
GPU is visible).
"""
from __future__ import annotations

import hashlib
import importlib
import os
import sys
import threading
import warnings

import torch

from .. import _build_config

_lock = threading.Lock()
_state: dict = {"tried": False, "native": False, "error": None}


def _want_cuda() -> bool:
    flag = os.environ.get("ZERO_EXT_BUILD_CUDA", "auto").lower()
    if flag in ("1", "true", "yes"):
        return True
    if flag in ("0", "false", "no"):
        return False
    return torch.cuda.is_available() and torch.version.cuda is not None


def _cuda_home_hint() -> None:
    # torch guesses CUDA_HOME from `which nvcc`, which can land on /usr/local (no headers).
    if not os.environ.get("CUDA_HOME") and os.path.isdir("/usr/local/cuda/include"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"


def _extra_cuda_includes() -> list:
    # ATen/cuda headers pull in cusparse.h, shipped by the nvidia pip wheels (DESIGN.md §8).
    import site

    out = []
    for base in site.getsitepackages():
        for sub in ("nvidia/cu13/include", "nvidia/cusparse/include"):
            p = os.path.join(base, sub)
            if os.path.isdir(p):
                out.append(p)
    return out


def jit_build(cuda: bool, name: str | None = None, verbose: bool = False):
    """JIT-compile and load csrc/; returns the library path. Raises on failure."""
    if cuda:
        _cuda_home_hint()  # before torch.utils.cpp_extension is imported: it reads CUDA_HOME
        if not torch.cuda.is_available():
            # torch asks the (absent) GPU for its architecture otherwise; this build only
            # proves that the sources compile and link.
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    os.environ.setdefault("MAX_JOBS", "2")
    cflags = list(_build_config.CXX_FLAGS)
    if os.environ.get("ZERO_EXT_NATIVE_ARCH", "1") == "1":
        cflags.append("-march=native")  # fine for a build on the machine that runs it
    srcs = _build_config.sources(cuda)
    only = os.environ.get("ZERO_EXT_JIT_SOURCES")  # development: build a subset of csrc/
    if only:
        srcs = [os.path.join(_build_config.CSRC, n.strip()) for n in only.split(",")]
    kwargs = dict(
        name=name or os.environ.get("ZERO_EXT_JIT_NAME")
        or ("zero_ext_native_cuda" if cuda else "zero_ext_native_cpu"),
        sources=srcs,
        extra_cflags=cflags,
        extra_ldflags=list(_build_config.LD_FLAGS),
        is_python_module=False,
        verbose=verbose,
    )
    if cuda:
        kwargs["extra_cuda_cflags"] = list(_build_config.NVCC_FLAGS)
        kwargs["extra_include_paths"] = _extra_cuda_includes()
        kwargs["with_cuda"] = True
    # cpp_extension.load re-hashes and re-runs ninja in every process (~5 s each on these
    # machines, paid by every rank of every test world); a stamp of the inputs lets an
    # unchanged build be loaded directly.
    build_dir = os.path.join(_extensions_root(), kwargs["name"])
    os.makedirs(build_dir, exist_ok=True)
    kwargs["build_directory"] = build_dir
    library = os.path.join(build_dir, kwargs["name"] + ".so")
    stamp_file, stamp = library + ".stamp", _stamp(kwargs)
    if os.path.exists(library) and _read(stamp_file) == stamp:
        torch.ops.load_library(library)
        return library
    from torch.utils import cpp_extension  # slow import; only needed to build

    cpp_extension.load(**kwargs)
    with open(stamp_file + ".tmp", "w") as f:
        f.write(stamp)
    os.replace(stamp_file + ".tmp", stamp_file)
    return library


def _extensions_root() -> str:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        tag = f"py{sys.version_info.major}{sys.version_info.minor}_" + (
            f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
        root = os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions", tag)
    return root


def _stamp(kwargs: dict) -> str:
    """Hash of everything the build depends on: every file in csrc/, flags, torch."""
    h = hashlib.sha256()
    h.update(repr(sorted((k, v) for k, v in kwargs.items() if k != "verbose")).encode())
    h.update(torch.__version__.encode())
    for name in sorted(os.listdir(_build_config.CSRC)):
        path = os.path.join(_build_config.CSRC, name)
        if os.path.isfile(path):
            h.update(name.encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def ensure_loaded() -> bool:
    """Load the native ops if possible; True when torch.ops.zero_ext runs compiled code."""
    if _state["tried"]:
        return _state["native"]
    with _lock:
        if _state["tried"]:
            return _state["native"]
        try:
            if os.environ.get("ZERO_EXT_REFERENCE", "0") == "1":
                raise RuntimeError("ZERO_EXT_REFERENCE=1 forces the pure-PyTorch references")
            try:
                importlib.import_module("zero_ext._C")  # built by setup.py
            except ImportError:
                jit_build(_want_cuda())
            _state["native"] = True
        except Exception as exc:  # no compiler, failed build, forced reference
            _state["error"] = exc
            warnings.warn(
                "zero_ext: native ops unavailable, using the pure-PyTorch reference kernels "
                f"(slow). Reason: {type(exc).__name__}: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )
        _state["tried"] = True
        return _state["native"]


def native_available(op: str, device: torch.device | str | None = None) -> bool:
    """True when torch.ops.zero_ext.<op> has a compiled kernel for this device type."""
    if not ensure_loaded():
        return False
    dev = torch.device(device) if device is not None else torch.device("cpu")
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(dev.type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
        f"zero_ext::{op}", key)
