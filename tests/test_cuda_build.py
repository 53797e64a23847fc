"""CI proof that every .cu file compiles and links, on machines without a GPU.

With a CUDA build of torch and nvcc, the full JIT build (all CPU and CUDA sources of
zero_ext/_build_config.py) runs in a subprocess, so that the CUDA library never lands in the
test process. One build per CI run: the JIT cache (TORCH_EXTENSIONS_DIR) makes reruns cheap.
Skipped where torch has no CUDA (the CPU-only setup, requirements-cpu.txt) or no toolkit is
found; under ZERO_EXT_REQUIRE_NATIVE=1 (CI) a missing toolkit with a CUDA torch fails instead.
The build's own "zero_ext: ..." start / end lines are shown on the terminal while it runs
(a cold build takes minutes), the rest of its output only when it fails.
"""
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_NAME = "zero_ext_cuda_compile_check"
# ~20 minutes: a cold build of the CUDA sources on 2 cores takes several minutes.
TIMEOUT_S = 1200


def _cuda_home():
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        if os.path.isdir(os.path.join(home, "include")):
            return home
    return None


CHILD = textwrap.dedent(f"""
    import torch
    from zero_ext.kernels import _loader
    _loader.jit_build(cuda=True, name={BUILD_NAME!r})
    ops = ["flatten_into", "unflatten_from", "fused_adamw_"]
    cuda = [op for op in ops
            if torch._C._dispatch_has_kernel_for_dispatch_key("zero_ext::" + op, "CUDA")]
    print("CUDA kernels registered:", cuda)
    assert "flatten_into" in cuda and "unflatten_from" in cuda and "fused_adamw_" in cuda, cuda
    # the schemas and default kernels come from Python (zero_ext/kernels/_ops.py)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("zero_ext::fused_adamw_",
                                                          "CompositeExplicitAutograd")
""")


def _run_streaming(cmd, env, capsys):
    """Run the child; echo its "zero_ext:" lines (build start / end) to the terminal as they
    come, keep all of its output. Returns (returncode, stdout, stderr)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = [], []

    def pump_stdout():
        out.append(proc.stdout.read())

    t = threading.Thread(target=pump_stdout, daemon=True)
    t.start()
    deadline = time.monotonic() + TIMEOUT_S
    for line in proc.stderr:
        err.append(line)
        if line.startswith("zero_ext:"):
            with capsys.disabled():
                sys.stderr.write("\n[cuda compile check] " + line)
                sys.stderr.flush()
        if time.monotonic() > deadline:
            break
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        t.join(5)
        pytest.fail(f"CUDA build did not finish in {TIMEOUT_S} s:\n{''.join(err)[-4000:]}")
    t.join(30)
    return proc.returncode, "".join(out), "".join(err)


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_cuda_sources_compile_and_link(capsys):
    if torch.version.cuda is None:
        pytest.skip("this torch has no CUDA support (CPU build of torch)")
    home = _cuda_home()
    if home is None:
        if os.environ.get("ZERO_EXT_REQUIRE_NATIVE", "0") == "1":
            pytest.fail("ZERO_EXT_REQUIRE_NATIVE=1 and torch has CUDA, but no CUDA toolkit "
                        "(nvcc) was found: set CUDA_HOME")
        pytest.skip("no CUDA toolkit (nvcc) found")
    env = dict(os.environ)
    env.setdefault("CUDA_HOME", home)  # torch reads it when cpp_extension is imported
    env.setdefault("MAX_JOBS", "2")
    if not torch.cuda.is_available():
        env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # nothing to detect: one arch suffices
    for dev_only in ("ZERO_EXT_JIT_SOURCES", "ZERO_EXT_JIT_NAME", "ZERO_EXT_REFERENCE"):
        env.pop(dev_only, None)  # always the full build
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    rc, stdout, stderr = _run_streaming([sys.executable, "-c", CHILD], env, capsys)
    out = stdout + stderr
    assert rc == 0, f"CUDA build failed:\n{out[-8000:]}"
    assert "CUDA kernels registered" in stdout
