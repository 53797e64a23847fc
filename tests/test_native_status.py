"""zero_ext.native_status(), the require-native mode and the JIT cache key (zero_ext/kernels/_loader.py)."""
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import zero_ext
from zero_ext.kernels import _loader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child(code, tmp_path, **env_overrides):
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    for k in ("ZERO_EXT_REFERENCE", "ZERO_EXT_REQUIRE_NATIVE", "ZERO_EXT_JIT_SOURCES",
              "ZERO_EXT_JIT_NAME"):
        env.pop(k, None)
    env.update(env_overrides)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=str(tmp_path),
                          env=env, capture_output=True, text=True, timeout=300)


def test_every_op_of_the_library_is_reported():
    from zero_ext.kernels import _ops

    defined = {re.match(r"([a-z_]+)\(", s).group(1) for s in _ops.SCHEMAS.values()}
    assert defined == set(_ops.SCHEMAS) == set(_loader.OPS)
    st = zero_ext.native_status()
    assert set(st["ops"]) == defined
    for op, devs in st["ops"].items():
        assert set(devs) == {"cpu", "cuda"}
        for dev, what in devs.items():
            assert what == "native" or what.startswith(("reference: ", "n/a: ")), (op, dev, what)
    assert op in str(st)


def test_status_matches_the_dispatcher():
    st = zero_ext.native_status()
    if os.environ.get("ZERO_EXT_REFERENCE", "0") == "1":
        assert not st["native"] and st["error"]
        return
    assert st["native"] and st["error"] is None and st["library"]
    for op, devs in st["ops"].items():
        assert devs["cpu"] == "native", (op, devs)
        assert hasattr(torch.ops.zero_ext, op)
        if torch.version.cuda is None:
            assert "no CUDA" in devs["cuda"] or devs["cuda"].startswith("n/a")


def test_import_builds_nothing_and_reference_mode_is_reported(tmp_path):
    out = _child("""
        import torch, zero_ext, zero_ext.kernels
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        # the ops exist once zero_ext.kernels is imported (Python schemas, reference
        # defaults); importing builds and loads no native kernel
        assert hasattr(torch.ops.zero_ext, "flatten_into")
        assert not has("zero_ext::flatten_into", "CPU"), "native library loaded at import"
        st = zero_ext.native_status(load=False)
        assert not st["native"] and "not loaded yet" in str(st), st
        st = zero_ext.native_status()
        print(st)
        assert not st["native"]
        assert st["ops"]["flatten_into"]["cpu"] == "reference: ZERO_EXT_REFERENCE=1", st
        assert not has("zero_ext::fused_adamw_", "CPU"), "library loaded under REFERENCE=1"
        out = torch.ops.zero_ext.flat_offsets(torch.tensor([3, 5]), 2, 4)  # the default kernel
        assert out.tolist() == [0, 4, 16], out
    """, tmp_path, ZERO_EXT_REFERENCE="1", ZERO_EXT_REQUIRE_NATIVE="1")
    assert out.returncode == 0, out.stdout + out.stderr


def test_no_compiler_is_reported_and_fatal_when_required(tmp_path):
    code = """
        import zero_ext
        st = zero_ext.native_status()
        print(st)
        assert not st["native"] and "no C++ compiler" in st["ops"]["fused_adamw_"]["cpu"], st
        zero_ext.load_native()
    """
    env = dict(CXX="/nonexistent/c++", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"),
               ZERO_EXT_JIT_NAME="zero_ext_no_compiler_test")
    relaxed = _child(code, tmp_path, **env)
    assert relaxed.returncode == 0, relaxed.stdout + relaxed.stderr
    assert "using the pure-PyTorch reference kernels" in relaxed.stderr
    strict = _child(code, tmp_path, ZERO_EXT_REQUIRE_NATIVE="1", **env)
    assert strict.returncode != 0
    assert "ZERO_EXT_REQUIRE_NATIVE=1" in strict.stderr and "no C++ compiler" in strict.stderr


def test_broken_source_fails_with_the_compiler_error(tmp_path):
    """A deliberately broken .cpp under ZERO_EXT_REQUIRE_NATIVE=1: the build's start line, then
    an error carrying the compiler's message (the #error comes before any include: fast)."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    with open(os.path.join(ROOT, "csrc", "partition.cpp")) as f:
        (csrc / "partition.cpp").write_text("#error zero_ext deliberately broken\n" + f.read())
    out = _child(f"""
        from zero_ext import _build_config
        _build_config.CSRC = {str(csrc)!r}
        import zero_ext
        print(zero_ext.native_status()["ops"]["flatten_into"]["cpu"])  # reports, never raises
        zero_ext.load_native()
    """, tmp_path, ZERO_EXT_REQUIRE_NATIVE="1", ZERO_EXT_JIT_SOURCES="partition.cpp",
        ZERO_EXT_JIT_NAME="zero_ext_broken_test", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    assert out.returncode != 0
    assert "zero_ext: building native ops for CPU" in out.stderr
    assert "deliberately broken" in out.stderr
    assert "ZERO_EXT_REQUIRE_NATIVE=1" in out.stderr
    assert "native build failed: " in out.stdout and "error: #error zero_ext deliberately" in out.stdout


def _kwargs(root, cflags=("-O3",)):
    return dict(name="n", sources=[os.path.join(root, "csrc", s) for s in ("a.cpp", "b.cpp")],
                extra_cflags=list(cflags), extra_ldflags=[], is_python_module=False)


def test_cache_key_ignores_the_checkout_path_but_not_flags_or_cpu(monkeypatch):
    k = _loader.cache_key
    assert k(_kwargs("/one/checkout"), False) == k(_kwargs("/another"), False)
    assert k(_kwargs("/x"), False) != k(_kwargs("/x", ("-O2",)), False)
    native = ("-O3", "-march=native")
    before = k(_kwargs("/x", native), False)
    monkeypatch.setattr(_loader, "_host_isa", lambda: "a cpu without avx512")
    assert k(_kwargs("/x", native), False) != before
    assert k(_kwargs("/x"), False) == k(_kwargs("/y"), False)  # ISA only with -march=native
