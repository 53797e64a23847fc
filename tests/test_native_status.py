"""zero_ext.native_status(), the require-native mode and the JIT cache key (zero_ext/kernels/_loader.py)."""
import os
import re
import shutil
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
        # chosen by the user, or set by conftest.py after a failed build (then "failed")
        assert not st["native"] and st["state"] in ("reference chosen", "failed"), st
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
        for load in (False, None, True):
            st = zero_ext.native_status(load=load)
            print(st)
            assert not st["native"] and st["state"] == "reference chosen", st
            assert st["error"] is None, st  # a choice, not a failure
            assert "ZERO_EXT_REFERENCE=1 chose the pure-PyTorch references" in str(st), st
            assert "NOT loaded" not in str(st) and "Error" not in str(st), st
            assert st["ops"]["flatten_into"]["cpu"] == "reference: chosen by ZERO_EXT_REFERENCE=1"
        assert not has("zero_ext::fused_adamw_", "CPU"), "library loaded under REFERENCE=1"
        out = torch.ops.zero_ext.flat_offsets(torch.tensor([3, 5]), 2, 4)  # the default kernel
        assert out.tolist() == [0, 4, 16], out
    """, tmp_path, ZERO_EXT_REFERENCE="1", ZERO_EXT_REQUIRE_NATIVE="1")
    assert out.returncode == 0, out.stdout + out.stderr


def test_no_compiler_is_reported_and_fatal_when_required(tmp_path):
    code = """
        import os, warnings
        import zero_ext
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the report itself attempts nothing, warns nothing
            st = zero_ext.native_status()
        print(st)
        assert not st["native"] and "no C++ compiler" in st["ops"]["fused_adamw_"]["cpu"], st
        assert st["state"] == "cannot build", st
        if os.environ.get("ZERO_EXT_REQUIRE_NATIVE") == "1":
            assert "raises an error (ZERO_EXT_REQUIRE_NATIVE=1)" in str(st), st
        else:
            assert "runs the pure-PyTorch references" in str(st), st
        zero_ext.load_native()
        st = zero_ext.native_status()
        assert st["state"] == "failed" and "no C++ compiler" in st["error"], st
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
        # load=True builds (the old default) and reports the failure, never raises
        print(zero_ext.native_status(load=True)["ops"]["flatten_into"]["cpu"])
        zero_ext.load_native()
    """, tmp_path, ZERO_EXT_REQUIRE_NATIVE="1", ZERO_EXT_JIT_SOURCES="partition.cpp",
        ZERO_EXT_JIT_NAME="zero_ext_broken_test", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    assert out.returncode != 0
    assert "zero_ext: building native ops for CPU" in out.stderr
    assert "deliberately broken" in out.stderr
    assert "ZERO_EXT_REQUIRE_NATIVE=1" in out.stderr
    assert "native build failed: " in out.stdout and "error: #error zero_ext deliberately" in out.stdout


FAKE_CXX = """#!/bin/sh
# a C++ compiler that answers --version and records any other call (a build) in $MARKER
if [ "$1" = "--version" ]; then echo "fake-c++ 9.9"; exit 0; fi
echo "$@" >> "$MARKER"
exit 1
"""


@pytest.mark.parametrize("require", ["0", "1"])
def test_status_on_an_empty_cache_builds_nothing_and_says_what_the_first_use_will(
        tmp_path, require):
    """With nothing built, native_status() (the default, and load=False) returns at once and
    says what the first use will do: build the CPU ops, with which compiler, into which
    directory, about how long. The old native_status() built them then and there (about a
    minute; here the fake compiler would have been called and the marker file written)."""
    cxx = tmp_path / "fake-c++"
    cxx.write_text(FAKE_CXX)
    cxx.chmod(0o755)
    ext = tmp_path / "ext"
    marker = tmp_path / "compiler-called"
    out = _child("""
        import os, time, warnings
        import zero_ext
        from zero_ext.kernels import _loader
        for load in (None, False):
            t0 = time.monotonic()
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                st = zero_ext.native_status() if load is None else zero_ext.native_status(load=load)
            dt = time.monotonic() - t0
            print(st)
            print(f"native_status(load={load}) took {dt:.2f} s")
            assert dt < 10, dt
            assert not st["native"] and st["state"] == "not built", st
            assert not _loader._state["tried"], "the report used up the first use's attempt"
            text = " ".join(str(st).split())  # unwrapped
            assert "not built yet" in text and "zero_ext.load_native()" in text, text
            assert "builds the CPU ops" in text and "about 20 s to 3 minutes" in text, text
            assert "fake-c++ 9.9" in text, text  # the compiler a build would use
            assert st["build_dir"].startswith(os.environ["TORCH_EXTENSIONS_DIR"]), st
            assert st["build_dir"] in text, text
            assert ("a failed build raises an error" in text) == (
                os.environ["ZERO_EXT_REQUIRE_NATIVE"] == "1"), text
            assert st["ops"]["fused_adamw_"]["cpu"] == (
                "reference: not built yet (the first use builds it)"), st
        assert not os.path.exists(os.environ["TORCH_EXTENSIONS_DIR"]), "a build was started"
    """, tmp_path, CXX=str(cxx), MARKER=str(marker), TORCH_EXTENSIONS_DIR=str(ext),
        ZERO_EXT_BUILD_CUDA="0", ZERO_EXT_REQUIRE_NATIVE=require)
    assert out.returncode == 0, out.stdout + out.stderr
    assert not marker.exists(), "the compiler was called: " + marker.read_text()
    assert "zero_ext: building" not in out.stderr, out.stderr


def test_status_loads_a_cached_build_without_building(tmp_path):
    """A JIT build cached for the current sources (the one conftest.py made) is loaded by
    native_status() and reported as loaded; with load=False it is reported, not loaded."""
    if not _loader._state["native"] or not str(_loader._state["library"]).endswith(".so"):
        pytest.skip("no JIT build of the native ops in this session")
    out = _child("""
        import time
        import zero_ext
        from zero_ext.kernels import _loader
        st = zero_ext.native_status(load=False)
        print(st)
        assert st["state"] == "not loaded" and not _loader._state["tried"], st
        assert "first use" in str(st) and st["library"] in " ".join(str(st).split()), st
        t0 = time.monotonic()
        st = zero_ext.native_status()
        dt = time.monotonic() - t0
        print(st)
        assert st["native"] and st["state"] == "loaded", st
        assert st["ops"]["fused_adamw_"]["cpu"] == "native", st
        assert dt < 10, dt
    """, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "zero_ext: building" not in out.stderr, out.stderr


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


def test_cache_key_ignores_where_the_version_script_lies(tmp_path, monkeypatch):
    """The linker flags name csrc/exports.map by its path: two checkouts with the same
    sources still share one build."""
    from zero_ext import _build_config

    keys = []
    for where in ("one", "two"):
        csrc = tmp_path / where / "csrc"
        shutil.copytree(_build_config.CSRC, csrc)
        monkeypatch.setattr(_build_config, "CSRC", str(csrc))
        kwargs = _kwargs(str(tmp_path / where))
        kwargs["extra_ldflags"] = [f"-Wl,--version-script={csrc}/exports.map"]
        keys.append(_loader.cache_key(kwargs, False))
    assert keys[0] == keys[1]


def test_the_loaded_library_exports_nothing_of_its_own():
    """The library this session loaded (the CPU build, JIT or setup.py's) exports nothing but
    setup.py's PyInit__C: no std:: or other weak template copies, no static libstdc++ (see
    tests/_symbols.py; the CUDA build is checked by test_cuda_build.py)."""
    import _symbols

    if not _loader._state["native"]:
        pytest.skip("no native library loaded in this session")
    library = str(_loader._state["library"])
    if not library.endswith(".so"):
        import zero_ext._C

        library = zero_ext._C.__file__
    missing = _symbols.tools_missing()
    if missing:
        pytest.skip(missing)
    assert _symbols.problems(library) == []


def test_a_second_copy_of_the_library_loads_in_one_process(tmp_path):
    """Two copies of the library in one process (another build of the same sources): the
    second registers its kernels over the first's and leaves the AdamWPlan class to the
    first, instead of aborting the process (torch refuses a class registered twice, and a
    library's static initializer cannot pass that error on)."""
    library = str(_loader._state["library"])
    if not _loader._state["native"] or not library.endswith(".so"):
        pytest.skip("no JIT build of the native ops in this session")
    copy = tmp_path / "zero_ext_copy.so"
    shutil.copyfile(library, copy)
    out = _child(f"""
        import torch
        from zero_ext.kernels import _ops
        torch.ops.load_library({library!r})
        torch.ops.load_library({str(copy)!r})
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        assert has("zero_ext::fused_adamw_", "CPU")
        print("class:", torch.classes.zero_ext.AdamWPlan)
    """, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "class:" in out.stdout
