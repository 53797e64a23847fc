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

The native kernels load lazily, on first use (constructing an optimizer, calling a kernel
wrapper) or on zero_ext.load_native(): `import zero_ext` alone builds nothing, so
ZERO_EXT_REFERENCE=1 set after the import still takes effect. zero_ext.native_status() builds
nothing either: it loads a build that already exists (setup.py's, or a JIT build cached for the
current sources), else it says what the first use would do (build where, with which compiler,
about how long; or run the references, and why).

A JIT build goes to <TORCH_EXTENSIONS_DIR>/<name>_<hash>, where <hash> covers every file in
csrc/, the sources and flags, torch's version, and the host CPU's ISA flags when -march=native
is used: two checkouts with the same sources share one build, different sources or CPUs never
overwrite each other's.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import torch

from .. import _build_config

_lock = threading.Lock()
_state: dict = {"tried": False, "native": False, "error": None, "library": None,
                "cuda_built": False, "reference_chosen": False}

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


def _find_ninja() -> tuple:
    """(path of the ninja a build would run, whether its directory must be put on PATH), or
    (None, False). torch runs `ninja` from PATH; a venv used without activation
    (.venv/bin/python) has the pip-installed ninja next to its python but not on PATH."""
    found = shutil.which("ninja")
    if found:
        return found, False
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja  # the pip package

        dirs.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    for d in dirs:
        if os.path.isfile(os.path.join(d, "ninja")):
            return os.path.join(d, "ninja"), True
    return None, False


def _ensure_ninja_on_path() -> None:
    path, add = _find_ninja()
    if path is None:
        raise RuntimeError("ninja not found (pip install ninja)")
    if add:
        os.environ["PATH"] = os.path.dirname(path) + os.pathsep + os.environ.get("PATH", "")


def _missing_tool() -> str | None:
    """Why a JIT build cannot start here (no compiler, no ninja), or None."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler found ({cxx!r} is not on PATH; install g++ or set CXX)"
    if _find_ninja()[0] is None:
        return "ninja not found (pip install ninja)"
    return None


def _check_compiler() -> None:
    missing = _missing_tool()
    if missing:
        raise RuntimeError(missing)
    _ensure_ninja_on_path()


def _compiler_description() -> str:
    """The C++ compiler a build would run: its name, path and first --version line."""
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx)
    if path is None:
        return f"{cxx} (not found)"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
        version = (out.stdout.strip().splitlines() or [""])[0]
    except (OSError, subprocess.SubprocessError):
        version = ""
    if os.path.abspath(cxx) == path:  # CXX is a path
        return f"{path} ({version})" if version else path
    return f"{cxx} ({path}{': ' + version if version else ''})"


def _nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def _build_estimate(cuda: bool) -> str:
    """How long a cold JIT build takes (the same words in the build's own message and in
    native_status())."""
    return (f"about {'1-7 minutes' if cuda else '20 s to 3 minutes'} on 2 cores "
            f"(MAX_JOBS={os.environ.get('MAX_JOBS', '2')})")


def _jit_env_defaults(cuda: bool) -> dict:
    """The environment defaults jit_build sets (TORCH_CUDA_ARCH_LIST enters the cache key)."""
    out = {"MAX_JOBS": "2"}
    if cuda and not torch.cuda.is_available():
        # torch asks the (absent) GPU for its architecture otherwise; this build only
        # proves that the sources compile and link.
        out["TORCH_CUDA_ARCH_LIST"] = "9.0"
    return out


def _jit_target(cuda: bool, name: str | None = None, verbose: bool = False,
                env=None) -> tuple:
    """What jit_build(cuda, name) builds and where: (kwargs for cpp_extension.load, cache key,
    build directory, library path). Builds nothing and changes nothing; env (default
    os.environ) is the environment the build would see."""
    env = os.environ if env is None else env
    cflags = list(_build_config.CXX_FLAGS)
    if env.get("ZERO_EXT_NATIVE_ARCH", "1") == "1":
        cflags.append("-march=native")  # fine for a build on the machine that runs it
    srcs = _build_config.sources(cuda)
    only = env.get("ZERO_EXT_JIT_SOURCES")  # development: build a subset of csrc/
    if only:
        srcs = [os.path.join(_build_config.CSRC, n.strip()) for n in only.split(",")]
    name = name or env.get("ZERO_EXT_JIT_NAME") or (
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
    key = cache_key(kwargs, cuda, env)
    build_dir = os.path.join(_extensions_root(env), f"{name}_{key[:12]}")
    return kwargs, key, build_dir, os.path.join(build_dir, name + ".so")


def _is_built(library: str, key: str) -> bool:
    """A finished build of exactly these inputs is there (its stamp holds the key)."""
    return os.path.exists(library) and _read(library + ".stamp") == key


def _planned_target(cuda: bool) -> tuple:
    """_jit_target as the next jit_build(cuda) will see it (with its environment defaults)."""
    return _jit_target(cuda, env={**_jit_env_defaults(cuda), **os.environ})


def jit_build(cuda: bool, name: str | None = None, verbose: bool = False):
    """JIT-compile and load csrc/; returns the library path. Raises on failure."""
    from . import _ops  # noqa: F401  the schemas first: the library only registers kernels
    if cuda:
        _cuda_home_hint()  # before torch.utils.cpp_extension is imported: it reads CUDA_HOME
    for var, value in _jit_env_defaults(cuda).items():
        os.environ.setdefault(var, value)
    kwargs, key, build_dir, library = _jit_target(cuda, name, verbose)
    stamp_file = library + ".stamp"
    if _is_built(library, key):
        torch.ops.load_library(library)
        return library
    _check_compiler()
    os.makedirs(build_dir, exist_ok=True)
    kwargs["build_directory"] = build_dir
    # One build per key at a time: other processes (the ranks of a torchrun job) wait here and
    # then load what the first one built, instead of each printing and starting a build.
    with _file_lock(os.path.join(build_dir, "zero_ext.lock")):
        if _is_built(library, key):
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
    _say(f"building native ops for {what}, first use only, {_build_estimate(cuda)}; "
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


def _extensions_root(env=None) -> str:
    root = (os.environ if env is None else env).get("TORCH_EXTENSIONS_DIR")
    if not root:
        root = os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions", "zero_ext")
    return root


def cache_key(kwargs: dict, cuda: bool, env=None) -> str:
    """Hash of everything the build depends on: every file in csrc/ (by name and content, not
    by path, so identical checkouts share), the sources, flags, torch, and the host ISA when
    -march=native is on. The venv's include paths are left out: torch's version covers them.
    env (default os.environ) supplies CXX and TORCH_CUDA_ARCH_LIST."""
    env = os.environ if env is None else env
    h = hashlib.sha256(b"zero_ext jit v2\0")

    def add(tag, value):
        h.update(f"{tag}={value!r}\0".encode())

    add("name", kwargs["name"])
    add("sources", sorted(os.path.basename(s) for s in kwargs["sources"]))
    for k in ("extra_cflags", "extra_ldflags", "extra_cuda_cflags", "with_cuda"):
        v = kwargs.get(k)
        if isinstance(v, list):  # csrc/ paths (the linker's version script) by name only
            v = [x.replace(_build_config.CSRC, "<csrc>") for x in v]
        add(k, v)
    add("torch", (torch.__version__, torch.version.cuda, getattr(torch.version, "git_version", "")))
    add("python", sys.version_info[:2])
    add("cxx", env.get("CXX", "c++"))
    if cuda:
        add("arch", env.get("TORCH_CUDA_ARCH_LIST"))
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


def _load(build: bool = True) -> bool:
    """One attempt, under the lock; fills _state and returns True. With build=False nothing is
    compiled: when loading would need a build, it returns False and leaves _state untouched
    (not tried), so that the first use still builds."""
    t0 = time.monotonic()
    from . import _ops  # noqa: F401  the schemas first: the library only registers kernels
    if _flag("ZERO_EXT_REFERENCE"):
        # A choice, not a failure: the library is never loaded, the default kernels (the
        # references) serve every call, and no warning is given.
        _state.update(reference_chosen=True, seconds=time.monotonic() - t0, tried=True)
        return True
    try:
        try:
            importlib.import_module("zero_ext._C")  # built by setup.py
            library = "zero_ext._C (setup.py build)"
            cuda_built = torch._C._dispatch_has_kernel_for_dispatch_key(
                "zero_ext::flatten_into", "CUDA")
        except ImportError as exc:
            if importlib.util.find_spec("zero_ext._C") is not None:
                _state["setup_build_error"] = exc  # there but unusable: the JIT build serves
            cuda = _want_cuda()
            if not build:
                _, key, _, planned = _planned_target(cuda)
                if not _is_built(planned, key):
                    return False
            library = jit_build(cuda)
            cuda_built = cuda
        _state.update(library=library, cuda_built=cuda_built, native=True)
    except Exception as exc:  # no compiler, failed build, a cached library that does not load
        _state["error"] = exc
        if require_native():
            _state["required_failure"] = exc
        else:
            warnings.warn(
                "zero_ext: native ops unavailable, using the pure-PyTorch reference kernels "
                f"(slow). Reason: {type(exc).__name__}: {exc}",
                RuntimeWarning,
                stacklevel=3,
            )
    _state["seconds"] = time.monotonic() - t0
    _state["tried"] = True
    return True


def ensure_loaded() -> bool:
    """Load the native ops if possible, building them on the first use; True when
    torch.ops.zero_ext runs compiled code.

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


def load_if_built() -> bool:
    """Load the native ops if that needs no compiler: setup.py's zero_ext._C, or a JIT build
    cached for the current sources (well under a second). Builds nothing, never raises;
    True when torch.ops.zero_ext runs compiled code."""
    if not _state["tried"] and not _flag("ZERO_EXT_REFERENCE"):
        with _lock:
            if not _state["tried"]:
                _load(build=False)
    return _state["native"]


def load_native() -> "NativeStatus":
    """Load (or build, first time) the native ops now, so that torch.ops.zero_ext.* exist;
    returns native_status(). Raises under ZERO_EXT_REQUIRE_NATIVE=1 when they cannot load."""
    ensure_loaded()
    return native_status(load=False)


class NativeStatus(dict):
    """native_status()'s result: a dict, printed as a short report.

    Keys:
    - "native" (bool): compiled ops loaded in this process;
    - "state": "loaded", "reference chosen" (ZERO_EXT_REFERENCE=1), "failed" (no compiler,
      failed build: the references run, "error" says why), or, before the first use,
      "not loaded" (a build exists; the first use loads it), "not built" (the first use
      builds it) or "cannot build" (no compiler or ninja: the first use runs the references);
    - "summary": one line saying that; "plan": what the first use will do (or None);
    - "reason": the "reference: <why>" of every op not run natively for that reason (or None);
    - "library": what was loaded (or would be); "build_dir": where a JIT build goes (or None);
    - "error": why loading failed, or None (ZERO_EXT_REFERENCE=1 is not an error);
    - "ops": {op: {"cpu": str, "cuda": str}}, each "native", "reference: <why>", or "n/a: ..."
      for the host-side ops on CUDA."""

    def __str__(self) -> str:
        lines = [f"zero_ext native ops: {self['summary']}"]
        if self.get("plan"):
            lines += textwrap.wrap(self["plan"], 96, initial_indent="  ", subsequent_indent="  ",
                                   break_long_words=False, break_on_hyphens=False)
        reason = self.get("reason")  # said above: the table only says "reference"

        def short(what):
            return "reference" if reason and what == reason else what

        width = max(len(op) for op in self["ops"])
        lines.append("  what runs now, per op:")
        for op, devs in self["ops"].items():
            lines.append(f"  {op:<{width}}  cpu: {short(devs['cpu']):<10}  "
                         f"cuda: {short(devs['cuda'])}")
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


_FIRST_USE = ("The first use (building or stepping an optimizer, a kernel call) or "
              "zero_ext.load_native()")


def _plan() -> dict:
    """What the first use will do, while nothing has been tried yet (and ZERO_EXT_REFERENCE is
    not set). Builds and loads nothing: reads the JIT cache, looks for the tools."""
    if importlib.util.find_spec("zero_ext._C") is not None and "setup_build_error" not in _state:
        return dict(state="not loaded", library="zero_ext._C (setup.py build)", build_dir=None,
                    cuda=None, why="reference: not loaded yet (built; the first use loads it)",
                    summary="built by setup.py (zero_ext._C), not loaded yet",
                    plan=f"{_FIRST_USE} loads it, in well under a second.")
    cuda = _want_cuda()
    _, key, build_dir, library = _planned_target(cuda)
    if _is_built(library, key):
        return dict(state="not loaded", library=library, build_dir=build_dir, cuda=cuda,
                    why="reference: not loaded yet (built; the first use loads it)",
                    summary="built for these sources, not loaded yet",
                    plan=f"{_FIRST_USE} loads {library}, in well under a second.")
    missing = _missing_tool()
    if missing:
        then = ("raises an error (ZERO_EXT_REQUIRE_NATIVE=1)" if require_native() else
                "runs the pure-PyTorch references instead (slow), with one warning")
        return dict(state="cannot build", library=None, build_dir=build_dir, cuda=cuda,
                    why="reference: " + missing,
                    summary=f"not built, and no build is possible here: {missing}",
                    plan=f"{_FIRST_USE} {then}.")
    what = "CPU and CUDA" if cuda else "CPU"
    tools = _compiler_description()
    if cuda:
        nvcc = _nvcc()
        tools += f" and nvcc ({nvcc})" if nvcc else " and nvcc (NOT found: set CUDA_HOME)"
    plan = (f"{_FIRST_USE} builds the {what} ops with {tools}, {_build_estimate(cuda)}, into "
            f"{build_dir}; later runs load that build in well under a second. Until then the "
            "pure-PyTorch references run; "
            + ("a failed build raises an error (ZERO_EXT_REQUIRE_NATIVE=1)." if require_native()
               else "if the build fails they keep running, with one warning."))
    return dict(state="not built", library=None, build_dir=build_dir, cuda=cuda,
                why="reference: not built yet (the first use builds it)",
                summary="not built yet for these sources (this report built nothing)", plan=plan)


def native_status(load: bool | None = None) -> NativeStatus:
    """Which zero_ext ops run compiled code on which device, and why not where they don't;
    before the first use, what that first use will do. Never raises.

    load=None (default): load the native ops if they are already built (setup.py's
    zero_ext._C, or a JIT build cached for the current sources: well under a second), never
    compile; when a build is needed, say so (where, with which compiler, about how long).
    load=True: load them now, building them if needed (minutes on an empty cache), like
    zero_ext.load_native() but never raising, also under ZERO_EXT_REQUIRE_NATIVE=1.
    load=False: report only; load nothing."""
    if load:
        try:
            ensure_loaded()
        except RuntimeError:
            pass
    elif load is None:
        load_if_built()
    err = _state["error"]
    info = dict(library=_state["library"], build_dir=None, plan=None, cuda=_state["cuda_built"])
    if _state["tried"] and _state["native"]:
        info.update(state="loaded", why=None, summary=f"loaded from {_state['library']}")
    elif _state["reference_chosen"] or (not _state["tried"] and _flag("ZERO_EXT_REFERENCE")):
        info.update(state="reference chosen", why="reference: chosen by ZERO_EXT_REFERENCE=1",
                    summary="not used: ZERO_EXT_REFERENCE=1 chose the pure-PyTorch references "
                            "(a choice, not an error; unset it to use the compiled ops)")
    elif _state["tried"]:
        info.update(state="failed", why="reference: " + _short(err),
                    summary="NOT loaded, the pure-PyTorch references run instead: "
                            + _short(err))
    else:
        info.update(_plan())
    why = info["why"]
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
        elif info["state"] == "loaded" and _has_kernel(op, "CUDA"):
            cuda = "native"
        elif info["state"] in ("loaded", "not loaded", "not built") and info["cuda"] is False:
            cuda = "reference: not built (no GPU seen; ZERO_EXT_BUILD_CUDA=1 builds it)"
        elif why is not None:
            cuda = why
        else:
            cuda = "reference: no CUDA kernel registered"
        ops[op] = {"cpu": cpu, "cuda": cuda}
    return NativeStatus(native=bool(_state["native"]), state=info["state"],
                        summary=info["summary"], plan=info["plan"], reason=why,
                        library=info["library"],
                        build_dir=info["build_dir"],
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
