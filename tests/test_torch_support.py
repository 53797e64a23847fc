"""The torch versions zero_ext supports (zero_ext/torch_support.py): an older torch is
refused at import with a clear ImportError, and the floor is declared alike in setup.py,
the README and docs/build.md."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from zero_ext.torch_support import MIN_TORCH, version_tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOOR = ".".join(map(str, MIN_TORCH))


@pytest.mark.parametrize("version, want", [
    ("2.6.0", (2, 6)), ("2.6.0+cu124", (2, 6)), ("2.15.0+cu132", (2, 15)),
    ("2.16.0a0+git1234abc", (2, 16)), ("10.0.1", (10, 0))])
def test_version_tuple(version, want):
    assert version_tuple(version) == want


def _import_with_torch_version(version: str) -> subprocess.CompletedProcess:
    code = ("import torch; torch.__version__ = %r\n"
            "import zero_ext\n"
            "print('imported')\n") % version
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)


def test_an_older_torch_is_refused_at_import():
    older = f"{MIN_TORCH[0]}.{MIN_TORCH[1] - 1}.1+cpu"
    proc = _import_with_torch_version(older)
    assert proc.returncode != 0 and "imported" not in proc.stdout
    assert "ImportError" in proc.stderr, proc.stderr[-2000:]
    assert f"zero_ext needs torch >= {FLOOR}; this environment has torch {older}" \
        in proc.stderr, proc.stderr[-2000:]
    proc = _import_with_torch_version(f"{FLOOR}.0")
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr[-2000:]


def test_the_floor_is_declared_alike():
    with open(os.path.join(ROOT, "setup.py")) as f:
        setup = f.read()
    assert re.findall(r'"torch[^"]*"', setup) == [f'"torch>={FLOOR}"'], \
        re.findall(r'"torch[^"]*"', setup)
    for doc in ("README.md", os.path.join("docs", "build.md")):
        with open(os.path.join(ROOT, doc)) as f:
            assert f"torch>={FLOOR}" in f.read(), f"{doc} does not declare torch>={FLOOR}"
