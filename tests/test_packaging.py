"""What `pip install .` ships: every module of the zero_ext package (setup.py's egg_info,
which lists the installed sources without compiling anything)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_module_of_the_package_is_installed(tmp_path):
    env = {**os.environ, "ZERO_EXT_SETUP_CUDA": "0"}
    proc = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (info,) = [d for d in os.listdir(tmp_path) if d.endswith(".egg-info")]
    shipped = set((tmp_path / info / "SOURCES.txt").read_text().split())
    modules = {os.path.relpath(os.path.join(d, f), ROOT)
               for d, _, files in os.walk(os.path.join(ROOT, "zero_ext"))
               for f in files if f.endswith(".py")}
    missing = sorted(m for m in modules if m.replace(os.sep, "/") not in shipped)
    assert not missing, f"setup.py leaves out {missing}"
