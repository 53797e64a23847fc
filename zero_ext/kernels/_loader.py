"""Find or build the native kernels of torch.ops.zero_ext.*, once per process.

The ops themselves (schemas, reference kernels as the default, fake kernels) are defined in
Python by zero_ext/kernels/_ops.py at import, so torch.ops.zero_ext.X always exists and runs.
This module loads the compiled library, which only registers CPU / CUDA kernels: once loaded,
the dispatcher runs those for tensors of their device, the references everywhere else.

Order: an extension built by setup.py (zero_ext._C), else a JIT build of csrc/ with
torch.utils.cpp_extension (cached in TORCH_EXTENSIONS_DIR, MAX_JOBS honoured). If both fail,
or ZERO_EXT_REFERENCE=1 (the library is then never loaded), the pure-PyTorch references run
instead and (unless forced) one loud warning says so;
with ZERO_EXT_REQUIRE_NATIVE=1 (CI) a failed build raises instead, with the compiler's output.
ZERO_EXT_BUILD_CUDA=1/0 forces the CUDA sources in or out of the JIT build (default: in when a
GPU is visible).

The native kernels load lazily, on first use (constructing an optimizer, calling a kernel wrapper) or on
zero_ext.native_status() / zero_ext.load_native(): `import zero_ext` alone builds nothing, so
ZERO_EXT_REFERENCE=1 set after the import still takes effect.

A JIT build goes to <TORCH_EXTENSIONS_DIR>/<name>_<hash>, where <hash> covers every file in
csrc/, the sources and flags, torch's version, and the host CPU's ISA flags when -march=native
is used: two checkouts with the same sources share one build, different sources or CPUs never
overwrite each other's.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
import warnings

import torch

from .. import _build_config

_lock = threading.Lock()
_state: dict = {"tried": False, "native": False, "error": None, "library": None,
                "cuda_built": False}

# The ops of zero_ext/kernels/_ops.py (SCHEMAS), in that order; a test checks they agree.
OPS = ("flatten_into", "unflatten_from", "assign_params", "flat_offsets", "fused_adamw_")
# Host-side ops: partition metadata is computed on the CPU whatever device the params are on.
CPU_ONLY_OPS = frozenset({"assign_params", "flat_offsets"})


def _flag(name: str, default: str = "0") -> bool:
    return os.environ.get(name, default).strip().lower() in ("1", "true", "yes", "on")


def require_native() -> bool:
    """ZERO_EXT_REQUIRE_NATIVE=1: a failed native build is an error, not a fallback."""
    return _flag("ZERO_EXT_REQUIRE_NATIVE")


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
    # ATen/cuda headers pull in cusparse.h, which the nvidia pip wheels ship in
    # site-packages/nvidia/cu13/include (docs/design.md section 9).
    import site

    out = []
    for base in site.getsitepackages():
        for sub in ("nvidia/cu13/include", "nvidia/cusparse/include"):
            p = os.path.join(base, sub)
            if os.path.isdir(p):
                out.append(p)
    return out


def _say(msg: str) -> None:
    print(f"zero_ext: {msg}", file=sys.stderr, flush=True)


def _host_isa() -> str:
    """The CPU's feature flags (what -march=native compiles for), for the cache key."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):  # x86, arm
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.machine() + " " + platform.processor()


def _import_cpp_extension(cuda: bool):
    """torch.utils.cpp_extension, without its "No CUDA runtime is found" warning for a CPU
    build (it guesses a CUDA toolkit at import; irrelevant when no CUDA source is built)."""
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    if not cuda:
        log.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        log.setLevel(level)
    return cpp_extension


def _ensure_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; a venv used without activation (.venv/bin/python) has the
    pip-installed ninja next to its python but not on PATH."""
    if shutil.which("ninja"):
        return
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja  # the pip package

        dirs.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    for d in dirs:
        if os.path.isfile(os.path.join(d, "ninja")):
            os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", "")
            return
    raise RuntimeError("ninja not found (pip install ninja)")


def _check_compiler() -> None:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler found ({cxx!r} is not on PATH; install g++ or "
                           "set CXX)")
    _ensure_ninja_on_path()


def jit_build(cuda: bool, name: str | None = None, verbose: bool = False):
    """JIT-compile and load csrc/; returns the library path. Raises on failure."""
    from . import _ops  # noqa: F401  the schemas first: the library only registers kernels
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
    name = name or os.environ.get("ZERO_EXT_JIT_NAME") or (
        "zero_ext_native_cuda" if cuda else "zero_ext_native_cpu")
    kwargs = dict(
        name=name,
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
    # unchanged build be loaded directly. The directory name carries a hash of the same key.
    key = cache_key(kwargs, cuda)
    build_dir = os.path.join(_extensions_root(), f"{name}_{key[:12]}")
    library = os.path.join(build_dir, name + ".so")
    stamp_file = library + ".stamp"
    if os.path.exists(library) and _read(stamp_file) == key:
        torch.ops.load_library(library)
        return library
    _check_compiler()
    os.makedirs(build_dir, exist_ok=True)
    kwargs["build_directory"] = build_dir
    # One build per key at a time: other processes (the ranks of a torchrun job) wait here and
    # then load what the first one built, instead of each printing and starting a build.
    with _file_lock(os.path.join(build_dir, "zero_ext.lock")):
        if os.path.exists(library) and _read(stamp_file) == key:
            torch.ops.load_library(library)
            return library
        return _build(kwargs, cuda, build_dir, library, stamp_file, key)


@contextlib.contextmanager
def _file_lock(path: str):
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock in cpp_extension.load still applies
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(kwargs, cuda, build_dir, library, stamp_file, key):
    what = "CPU/CUDA" if cuda else "CPU"
    _say(f"building native ops for {what}, first use only, about "
         f"{'4-7 minutes' if cuda else '1-3 minutes'} on 2 cores (MAX_JOBS={os.environ['MAX_JOBS']}); "
         f"cache: {build_dir}")
    t0 = time.monotonic()
    cpp_extension = _import_cpp_extension(cuda)  # slow import; only needed to build
    try:
        cpp_extension.load(**kwargs)
    except BaseException as exc:
        _say(f"native build FAILED after {time.monotonic() - t0:.0f} s "
             f"({type(exc).__name__}); the compiler's output follows in the error")
        raise
    with open(stamp_file + ".tmp", "w") as f:
        f.write(key)
    os.replace(stamp_file + ".tmp", stamp_file)
    _say(f"native ops built in {time.monotonic() - t0:.0f} s, cached in {build_dir} "
         "(later runs load them in well under a second)")
    return library


def _extensions_root() -> str:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        root = os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions", "zero_ext")
    return root


def cache_key(kwargs: dict, cuda: bool) -> str:
    """Hash of everything the build depends on: every file in csrc/ (by name and content, not
    by path, so identical checkouts share), the sources, flags, torch, and the host ISA when
    -march=native is on. The venv's include paths are left out: torch's version covers them."""
    h = hashlib.sha256(b"zero_ext jit v2\0")

    def add(tag, value):
        h.update(f"{tag}={value!r}\0".encode())

    add("name", kwargs["name"])
    add("sources", sorted(os.path.basename(s) for s in kwargs["sources"]))
    for k in ("extra_cflags", "extra_ldflags", "extra_cuda_cflags", "with_cuda"):
        add(k, kwargs.get(k))
    add("torch", (torch.__version__, torch.version.cuda, getattr(torch.version, "git_version", "")))
    add("python", sys.version_info[:2])
    add("cxx", os.environ.get("CXX", "c++"))
    if cuda:
        add("arch", os.environ.get("TORCH_CUDA_ARCH_LIST"))
    if "-march=native" in kwargs["extra_cflags"]:
        add("isa", _host_isa())
    for fname in sorted(os.listdir(_build_config.CSRC)):
        path = os.path.join(_build_config.CSRC, fname)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                add(fname, hashlib.sha256(f.read()).hexdigest())
    return h.hexdigest()


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _load() -> None:
    """One attempt, under the lock; fills _state."""
    t0 = time.monotonic()
    from . import _ops  # noqa: F401  the schemas first: the library only registers kernels
    try:
        if _flag("ZERO_EXT_REFERENCE"):
            raise RuntimeError("ZERO_EXT_REFERENCE=1 forces the pure-PyTorch references")
        try:
            importlib.import_module("zero_ext._C")  # built by setup.py
            _state["library"] = "zero_ext._C (setup.py build)"
            _state["cuda_built"] = torch._C._dispatch_has_kernel_for_dispatch_key(
                "zero_ext::flatten_into", "CUDA")
        except ImportError:
            cuda = _want_cuda()
            _state["library"] = jit_build(cuda)
            _state["cuda_built"] = cuda
        _state["native"] = True
    except Exception as exc:  # no compiler, failed build, forced reference
        _state["error"] = exc
        forced = _flag("ZERO_EXT_REFERENCE")
        if not forced and require_native():
            _state["required_failure"] = exc
        elif not forced:
            warnings.warn(
                "zero_ext: native ops unavailable, using the pure-PyTorch reference kernels "
                f"(slow). Reason: {type(exc).__name__}: {exc}",
                RuntimeWarning,
                stacklevel=3,
            )
    _state["seconds"] = time.monotonic() - t0
    _state["tried"] = True


def ensure_loaded() -> bool:
    """Load the native ops if possible; True when torch.ops.zero_ext runs compiled code.

    With ZERO_EXT_REQUIRE_NATIVE=1 a failed build raises RuntimeError (every call) instead of
    falling back to the references; ZERO_EXT_REFERENCE=1 still selects the references."""
    if not _state["tried"]:
        with _lock:
            if not _state["tried"]:
                _load()
    exc = _state.get("required_failure")
    if exc is not None:
        raise RuntimeError(
            "zero_ext: the native ops are required (ZERO_EXT_REQUIRE_NATIVE=1) but could not "
            f"be loaded: {type(exc).__name__}: {exc}") from exc
    return _state["native"]


def load_native() -> "NativeStatus":
    """Load (or build, first time) the native ops now, so that torch.ops.zero_ext.* exist;
    returns native_status(). Raises under ZERO_EXT_REQUIRE_NATIVE=1 when they cannot load."""
    ensure_loaded()
    return native_status()


class NativeStatus(dict):
    """native_status()'s result: a dict, printed as a short table.

    Keys: "native" (bool: compiled ops loaded), "library" (what was loaded), "error" (why
    not, or None), "ops": {op: {"cpu": str, "cuda": str}} where each value is "native" or
    "reference: <why>" (or "n/a: ..." for host-side ops on CUDA)."""

    def __str__(self) -> str:
        if self["native"]:
            head = f"zero_ext native ops: loaded from {self['library']}"
        elif self["error"]:
            head = f"zero_ext native ops: NOT loaded, pure-PyTorch references in use: {self['error']}"
        else:
            head = "zero_ext native ops: not loaded yet (first use loads them)"
        width = max(len(op) for op in self["ops"])
        lines = [head]
        for op, devs in self["ops"].items():
            lines.append(f"  {op:<{width}}  cpu: {devs['cpu']:<10} cuda: {devs['cuda']}")
        return "\n".join(lines)


def _short(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}"
    first = text.strip().splitlines()[0] if text.strip() else text
    if "Error building extension" in text:
        # keep the first compiler error line, the full log is in the exception
        errs = [ln.strip() for ln in str(exc).splitlines()[1:] if ": error:" in ln
                or ": fatal error:" in ln]  # gcc/clang "f.cpp:1:2: error:", nvcc "f.cu(3): error:"
        first = "native build failed: " + (errs[0] if errs else first)
    return first[:limit]


def native_status(load: bool = True) -> NativeStatus:
    """Which zero_ext ops run compiled code on which device, and why not where they don't.

    load=True (default) loads the ops first (a first call may build them: about a minute);
    it never raises, also under ZERO_EXT_REQUIRE_NATIVE=1 (the failure is in "error")."""
    if load:
        try:
            ensure_loaded()
        except RuntimeError:
            pass
    err = _state["error"]
    if not _state["tried"]:
        why = "reference: not loaded yet (first use loads them)"
    elif err is not None:
        why = ("reference: ZERO_EXT_REFERENCE=1" if _flag("ZERO_EXT_REFERENCE")
               and "ZERO_EXT_REFERENCE" in str(err) else "reference: " + _short(err))
    else:
        why = None
    ops = {}
    for op in OPS:
        if why is not None:
            cpu = why
        elif _has_kernel(op, "CPU"):
            cpu = "native"
        else:
            cpu = "reference: no CPU kernel in the loaded library"
        if op in CPU_ONLY_OPS:
            cuda = "n/a: host-side op (runs on the CPU for any device)"
        elif torch.version.cuda is None:
            cuda = "reference: this torch build has no CUDA"
        elif why is not None:
            cuda = why
        elif _has_kernel(op, "CUDA"):
            cuda = "native"
        elif not _state["cuda_built"]:
            cuda = "reference: not built (no GPU seen; ZERO_EXT_BUILD_CUDA=1 builds it)"
        else:
            cuda = "reference: no CUDA kernel registered"
        ops[op] = {"cpu": cpu, "cuda": cuda}
    return NativeStatus(native=bool(_state["native"]), library=_state["library"],
                        error=None if err is None else _short(err, 2000), ops=ops)


def _has_kernel(op: str, key: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"zero_ext::{op}", key)
    except RuntimeError:
        return False


def native_available(op: str, device: torch.device | str | None = None) -> bool:
    """True when torch.ops.zero_ext.<op> has a compiled kernel for this device type."""
    if not ensure_loaded():
        return False
    dev = torch.device(device) if device is not None else torch.device("cpu")
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(dev.type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
        f"zero_ext::{op}", key)
