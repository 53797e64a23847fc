"""Shared pytest setup.

* Builds (or loads from the TORCH_EXTENSIONS_DIR cache) the native ops once, in the pytest
  process, before any test runs: the multi-rank workers then only load the cached library
  instead of racing to compile it under a test timeout.  If the build fails, the workers are
  told to use the pure-PyTorch references (ZERO_EXT_REFERENCE=1) instead of each retrying a
  multi-minute compile; the failure is printed in the session header.
* Reports torch / native-op status in the pytest header.
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

_native = {"status": "not tried"}


def _prebuild_native() -> None:
    if os.environ.get("ZERO_EXT_REFERENCE", "0") == "1":
        _native["status"] = "off (ZERO_EXT_REFERENCE=1): pure-PyTorch references"
        return
    t0 = time.monotonic()
    try:
        from zero_ext.kernels import _loader
    except Exception as exc:  # package not importable yet: nothing to build
        _native["status"] = f"not built: cannot import zero_ext.kernels ({type(exc).__name__}: {exc})"
        return
    try:
        ok = _loader.ensure_loaded()
    except Exception as exc:
        ok, _loader._state["error"] = False, exc
    dt = time.monotonic() - t0
    if ok:
        _native["status"] = f"loaded ({dt:.1f} s)"
    else:
        err = _loader._state.get("error")
        _native["status"] = (f"UNAVAILABLE after {dt:.1f} s ({type(err).__name__}: {err}); "
                             "workers use the references")
        os.environ["ZERO_EXT_REFERENCE"] = "1"


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    _prebuild_native()


def pytest_report_header(config):
    import torch

    lines = [f"torch {torch.__version__}, cuda available: {torch.cuda.is_available()}, "
             f"threads: {torch.get_num_threads()}"]
    if _native["status"] == "not tried":
        _prebuild_native()
    lines.append(f"zero_ext native ops: {_native['status']}")
    return lines
