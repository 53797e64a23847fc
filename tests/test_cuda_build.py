"""CI proof that every .cu file compiles and links, on machines without a GPU, and that the
CUDA library is safe to load: it raises its ops' argument errors (no crash) and exports nothing
of its own or of libstdc++ (docs/build.md, "What the library exports").

With a CUDA build of torch and nvcc, the full JIT build (all CPU and CUDA sources of
zero_ext/_build_config.py) runs in a subprocess, so that the CUDA library never lands in the
test process. One build per CI run: the JIT cache (TORCH_EXTENSIONS_DIR) makes reruns cheap,
and the build is the loader's own (zero_ext_native_cuda, the same key), so that on a machine
with a GPU the tests reuse the build that the test session's first use made.
Skipped where torch has no CUDA (the CPU-only setup, requirements-cpu.txt) or no toolkit is
found; under ZERO_EXT_REQUIRE_NATIVE=1 (CI) a missing toolkit with a CUDA torch fails instead.
The build's own "zero_ext: ..." start / end lines are shown on the terminal while it runs
(a cold build takes minutes), the rest of its output only when it fails.
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import _symbols

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


CHILD = textwrap.dedent("""
    import torch
    from zero_ext.kernels import _loader
    library = _loader.jit_build(cuda=True)
    ops = ["flatten_into", "unflatten_from", "fused_adamw_"]
    cuda = [op for op in ops
            if torch._C._dispatch_has_kernel_for_dispatch_key("zero_ext::" + op, "CUDA")]
    print("CUDA kernels registered:", cuda)
    assert "flatten_into" in cuda and "unflatten_from" in cuda and "fused_adamw_" in cuda, cuda
    # the schemas and default kernels come from Python (zero_ext/kernels/_ops.py)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("zero_ext::fused_adamw_",
                                                          "CompositeExplicitAutograd")
    print("LIBRARY=" + library)
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


# Each op called with bad input through the CUDA library: its CPU kernels (the library holds
# them too) with CPU tensors, and its CUDA kernels, reached without a GPU by redispatching CPU
# tensors to the CUDA key: their argument checks run before anything touches a device. Every
# call must raise RuntimeError with the op's message (formatting integers, dtypes, devices
# and sizes into it, where the crash was seen); a crash ends the child with a signal.
BAD_INPUT_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from zero_ext.kernels import _ops, adamw
    torch.ops.load_library(sys.argv[1])
    z, i64 = torch.zeros, torch.int64
    table = adamw.group_hparams_table([[1e-3, 0.9, 0.999, 1e-8, 0.0, 0.0, 0.0]])
    steps, groups = torch.ones(1), torch.zeros(1, dtype=i64)

    def adamw_args(p=None, g=None, m=None, groups=groups):
        p, g, m = (x if x is not None else z(4) for x in (p, g, m))
        return ([p], [g], [m], [z(4)], [], steps, groups, table, None, None, [])

    CASES = {
        "flatten_into": [([z(4)], z(16), [0, 4]), ([z(4, dtype=torch.float64)], z(16), [0]),
                         ([z(4)], z(16), [14]), ([z(4)], z(4, 4), [0])],
        "unflatten_from": [(z(16), [z(4)], [0, 4]), (z(16), [z(4, dtype=torch.float64)], [0]),
                           (z(16), [z(4)], [14]), (z(4, 4), [z(4)], [0])],
        "assign_params": [(torch.tensor([1, 2]), torch.tensor([0, 0]), 0),
                          (torch.tensor([1, -2]), torch.tensor([0, 0]), 2),
                          (torch.tensor([1, 2]), torch.tensor([0]), 2)],
        "flat_offsets": [(torch.tensor([3, 5]), 2, 0), (torch.tensor([3, -5]), 2, 4)],
        "fused_adamw_": [adamw_args(g=z(5)), adamw_args(groups=torch.ones(1, dtype=i64)),
                         adamw_args(g=z(4, dtype=torch.float16)),
                         ([z(4)], [z(4), z(4)], [z(4)], [z(4)], [], steps, groups, table,
                          None, None, [])],
    }
    keys = {"CPU": None, "CUDA": torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)}
    out = []
    for op, cases in CASES.items():
        for key, keyset in keys.items():
            if not torch._C._dispatch_has_kernel_for_dispatch_key("zero_ext::" + op, key):
                continue
            for k, args in enumerate(cases):
                overload = getattr(torch.ops.zero_ext, op).default
                try:
                    overload(*args) if keyset is None else overload.redispatch(keyset, *args)
                    out.append([op, key, k, None, "no error"])
                except Exception as exc:
                    out.append([op, key, k, type(exc).__name__, str(exc).splitlines()[0]])
    # the step plan's constructor (a class of the library, not an op) checks like the op
    try:
        src = torch.nn.Parameter(z(5))  # a segment's grad: a run of its source's grad
        src.grad = z(5)
        torch.classes.zero_ext.AdamWPlan([z(4)], [z(4)], [z(4)], [], [], [src],
                                         torch.zeros(1, dtype=i64), torch.tensor([3]),
                                         [], groups, table)
        out.append(["AdamWPlan", "CPU", 0, None, "no error"])
    except Exception as exc:
        out.append(["AdamWPlan", "CPU", 0, type(exc).__name__, str(exc).splitlines()[0]])
    print("RESULTS=" + json.dumps(out))
""")

# (op, case index) -> the message's start, for the CPU and the CUDA kernels alike except
# where the CUDA kernel rejects CPU tensors first (its own device check).
# (flatten_into and unflatten_from share their argument checks: the same cases, each
# message after its op's name)
_FLATTEN_MESSAGES = (
    "got 1 tensors but 2 offsets",
    "tensors[0] has dtype Double but flat has dtype Float",
    "tensors[0] (4 elements at offset 14) does not fit in flat of 16 elements",
    "flat must be 1-D, got 2-D",
)
EXPECTED = {
    **{(op, k): f"{op}: {msg}" for op in ("flatten_into", "unflatten_from")
       for k, msg in enumerate(_FLATTEN_MESSAGES)},
    ("assign_params", 0): "assign_params: world_size must be in [1, 2^31), got 0",
    ("assign_params", 1): "assign_params: numels[1] = -2 is negative",
    ("assign_params", 2): "assign_params: numels and groups must have the same length, got 2 "
                          "and 1",
    ("flat_offsets", 0): "flat_offsets: alignment must be >= 1, got 0",
    ("flat_offsets", 1): "flat_offsets: numels[1] = -5 is negative",
    ("fused_adamw_", 0): "fused_adamw_: segment 0 has mismatched numel: param 4, grad 5, "
                         "exp_avg 4, exp_avg_sq 4",
    ("fused_adamw_", 1): "fused_adamw_: segment_groups[0] = 1 is out of range for 1 groups",
    ("fused_adamw_", 2): "fused_adamw_: grads[0] has dtype Half but params[0] has Float",
    ("fused_adamw_", 3): "fused_adamw_: params, grads, exp_avgs and exp_avg_sqs must have the "
                         "same length, got 1, 2, 1, 1",
    ("AdamWPlan", 0): "AdamWPlan: segment 0 (4 elements at grad offset 3) does not fit in the "
                      "grad of source 0 (5 elements)",
}
CUDA_DEVICE_CHECK = "fused_adamw_ (CUDA): params[0] is on cpu"

_built: dict = {}


def _require_toolkit() -> str:
    if torch.version.cuda is None:
        pytest.skip("this torch has no CUDA support (CPU build of torch)")
    home = _cuda_home()
    if home is None:
        if os.environ.get("ZERO_EXT_REQUIRE_NATIVE", "0") == "1":
            pytest.fail("ZERO_EXT_REQUIRE_NATIVE=1 and torch has CUDA, but no CUDA toolkit "
                        "(nvcc) was found: set CUDA_HOME")
        pytest.skip("no CUDA toolkit (nvcc) found")
    return home


def _child_env(home: str) -> dict:
    env = dict(os.environ)
    env.setdefault("CUDA_HOME", home)  # torch reads it when cpp_extension is imported
    env.setdefault("MAX_JOBS", "2")
    if not torch.cuda.is_available():
        env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # nothing to detect: one arch suffices
    for dev_only in ("ZERO_EXT_JIT_SOURCES", "ZERO_EXT_JIT_NAME", "ZERO_EXT_REFERENCE"):
        env.pop(dev_only, None)  # always the full build
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _cuda_library(capsys) -> str:
    """Build (or find in the JIT cache) the CUDA library, once per test session; its path."""
    home = _require_toolkit()
    if "result" not in _built:
        env = _child_env(home)
        _built["env"] = env
        _built["result"] = _run_streaming([sys.executable, "-c", CHILD], env, capsys)
    rc, stdout, stderr = _built["result"]
    assert rc == 0, f"CUDA build failed:\n{(stdout + stderr)[-8000:]}"
    assert "CUDA kernels registered" in stdout
    return stdout.split("LIBRARY=", 1)[1].splitlines()[0].strip()


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_cuda_sources_compile_and_link(capsys):
    assert os.path.isfile(_cuda_library(capsys))


@pytest.mark.timeout(TIMEOUT_S + 120)
def test_cuda_library_raises_every_ops_argument_errors(capsys):
    library = _cuda_library(capsys)
    out = subprocess.run([sys.executable, "-c", BAD_INPUT_CHILD, library], cwd=ROOT,
                         env=_built["env"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (f"the child that loads the CUDA library and calls its ops with "
                                 f"bad input ended with {out.returncode} (a negative value is "
                                 f"the signal that killed it):\n{out.stdout[-3000:]}"
                                 f"{out.stderr[-3000:]}")
    results = json.loads(out.stdout.split("RESULTS=", 1)[1])
    seen = {(op, key) for op, key, *_ in results}
    # every op's CPU kernel; the CUDA kernels of the ops that run on a GPU
    assert seen == {(op, "CPU") for op in ("flatten_into", "unflatten_from", "assign_params",
                                           "flat_offsets", "fused_adamw_", "AdamWPlan")} | {
        (op, "CUDA") for op in ("flatten_into", "unflatten_from", "fused_adamw_")}, seen
    for op, key, k, exc_type, message in results:
        want = EXPECTED[(op, k)]
        if key == "CUDA" and op == "fused_adamw_" and k != 3:
            want = CUDA_DEVICE_CHECK  # its list lengths first, then the params' device
        assert exc_type == "RuntimeError" and message.startswith(want), (
            op, key, k, exc_type, message, want)


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_cuda_library_exports_nothing_of_its_own(capsys):
    library = _cuda_library(capsys)
    missing = _symbols.tools_missing()
    if missing:
        pytest.skip(missing)
    assert _symbols.problems(library) == []
