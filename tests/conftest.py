"""Shared pytest setup.

* Builds (or loads from the TORCH_EXTENSIONS_DIR cache) the native ops once, in the pytest
  process, before any test runs: the multi-rank workers then only load the cached library
  instead of racing to compile it under a test timeout.
* If the build fails: with ZERO_EXT_REQUIRE_NATIVE=1 (CI) the session stops at once with the
  compiler's output and a non-zero exit status; otherwise the workers are told to use the
  pure-PyTorch references (ZERO_EXT_REFERENCE=1) instead of each retrying a multi-minute
  compile, and the native tests skip.
* Prints zero_ext.native_status() at the start of the session, also under -q.
"""
from __future__ import annotations

import os
import sys
import time

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # source checkout without `pip install`
    sys.path.insert(0, _ROOT)
_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:  # so `import _dist` works under any import mode
    sys.path.insert(0, _TESTS)

_native = {"status": "not tried", "lines": [], "fatal": None}


def _prebuild_native() -> None:
    import torch

    _native["lines"] = [f"torch {torch.__version__} (CUDA {torch.version.cuda}), cuda available: "
                        f"{torch.cuda.is_available()}, threads: {torch.get_num_threads()}"]
    t0 = time.monotonic()
    try:
        from zero_ext.kernels import _loader
    except Exception as exc:  # package not importable: nothing to build
        _native["status"] = f"cannot import zero_ext.kernels ({type(exc).__name__}: {exc})"
        _native["lines"].append(_native["status"])
        if os.environ.get("ZERO_EXT_REQUIRE_NATIVE", "0") == "1":
            _native["fatal"] = _native["status"]
        return
    try:
        ok = _loader.ensure_loaded()
    except RuntimeError as exc:  # ZERO_EXT_REQUIRE_NATIVE=1 and the build failed
        ok = False
        _native["fatal"] = str(exc)
    dt = time.monotonic() - t0
    status = _loader.native_status(load=False)
    _native["lines"] += str(status).splitlines()
    if ok:
        _native["status"] = f"loaded ({dt:.1f} s)"
        _native["lines"][1] += f" ({dt:.1f} s)"
    elif _native["fatal"] is None:
        _native["status"] = "UNAVAILABLE: workers use the references"
        if os.environ.get("ZERO_EXT_REFERENCE", "0") != "1":
            _native["lines"].append("zero_ext: multi-rank workers use the references too "
                                    "(ZERO_EXT_REFERENCE=1); native tests skip")
        os.environ["ZERO_EXT_REFERENCE"] = "1"


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    if _native["status"] == "not tried":
        _prebuild_native()
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    for line in _native["lines"]:
        if tr is not None:
            tr.write_line(line)
        else:
            print(line, file=sys.stderr)
    if _native["fatal"] is not None:
        msg = ("ZERO_EXT_REQUIRE_NATIVE=1: the native ops failed to build or load; stopping.\n"
               + _native["fatal"])
        if tr is not None:
            tr.write_line(msg, red=True, bold=True)
        else:
            print(msg, file=sys.stderr)
        pytest.exit("native build failed under ZERO_EXT_REQUIRE_NATIVE=1 (output above)",
                    returncode=3)
