"""Mixed-precision master weights in zero_ext.fused_adamw_ (bf16/fp16 params, float32 masters).

The oracle is fused_adamw_reference_ (zero_ext/kernels/adamw.py). Tolerances:
- masters and moments (float32): atol 1e-6, rtol 1e-5, as for fp32 in tests/test_fused_adamw.py
  (the kernels contract multiply-adds where the reference rounds twice: the last ulp).
- params: each is its master rounded to nearest even, so the kernel's params equal the
  rounding of the kernel's masters bit for bit; against the reference they may differ by one
  ulp where the two masters straddle a rounding boundary (bf16 rtol 1.6e-2, fp16 2e-3).
- kernel against kernel (thread splits, pieces of a buffer, the stale re-sync against an
  explicit master reset): bit for bit, every element gets the same arithmetic.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from zero_ext.kernels import adamw as K

# the kernel tests' devices, tolerances and native check: one definition for both files
from test_fused_adamw import CUDA, DEVICES, FP32_TOL, LOW_TOL, _need_native  # noqa: E402
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OP = torch.ops.zero_ext.fused_adamw_

GROUPS = [
    dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
    dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0, amsgrad=True, maximize=True),
    dict(lr=1e-3, betas=(0.3, 0.9), eps=1e-8, weight_decay=0.5),  # beta1 < 0.5: other lerp branch
    dict(lr=5e-2, betas=(0.95, 0.9999), eps=1e-4, weight_decay=1e-3, amsgrad=True),
]
TABLE = K.group_hparams_table(GROUPS)

# (param dtype, state dtype, numel, group, has a master): master and plain segments of both
# low-precision dtypes and fp32 in one call; 70001 and 40000 span several thread ranges.
MIXED = [(BF16, F32, 0, 0, False), (BF16, F32, 1, 1, True), (BF16, F32, 70001, 0, True),
         (F16, F32, 4097, 2, True), (F16, F32, 33, 3, True), (F32, F32, 1000, 1, False),
         (BF16, BF16, 301, 0, False), (BF16, F32, 302, 2, False), (F16, F16, 303, 3, False),
         (F16, F32, 40000, 1, True), (BF16, F32, 17, 3, True)]


def _seg(device, pdt, sdt, n, group, master, gen):
    """[param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, master]. A master carries bits below
    the param's ulp; its param is its rounding (nothing stale)."""
    w = torch.randn(n, generator=gen)
    x = (0.1 * torch.rand(n, generator=gen)).to(sdt) if GROUPS[group].get("amsgrad") \
        else torch.empty(0, dtype=sdt)
    seg = [w.to(pdt), torch.randn(n, generator=gen).to(pdt),
           (0.1 * torch.randn(n, generator=gen)).to(sdt),
           (0.1 * torch.rand(n, generator=gen)).to(sdt), x,
           w if master else torch.empty(0)]
    return [t.to(device) for t in seg]


def _segs(device, spec, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [_seg(device, *s, gen) for s in spec], torch.tensor([s[3] for s in spec])


def _clone(segs):
    return [[t.clone() for t in s] for s in segs]


def _lists(segs):
    return [[s[j] for s in segs] for j in range(6)]


def _op(segs, steps, sg, grad_scale=None, found_inf=None):
    """The registered op directly: the native kernel for contiguous tensors."""
    p, g, m, v, x, w = _lists(segs)
    OP(p, g, m, v, x, steps, sg, TABLE, grad_scale, found_inf, w)


def _ref(segs, steps, sg, grad_scale=None, found_inf=None):
    p, g, m, v, x, w = _lists(segs)
    K.fused_adamw_reference_(p, g, m, v, x, steps, sg, TABLE, grad_scale, found_inf, w)


def _wrapper(segs, steps, sg, grad_scale=None, found_inf=None):
    p, g, m, v, x, w = _lists(segs)
    K.fused_adamw_(p, g, m, v, x, steps, sg, TABLE, grad_scale, found_inf, masters=w)


def _assert_close(a, b, where=""):
    """Kernel results `a` against reference results `b` (tolerances of the module docstring),
    and the kernel's params are exactly its masters' rounding."""
    for i, (sa, sb) in enumerate(zip(a, b)):
        p = sa[0]
        for name, x, y in zip(("param", "grad", "exp_avg", "exp_avg_sq", "max", "master"),
                              sa, sb):
            tol = LOW_TOL[p.dtype] if name == "param" else FP32_TOL
            torch.testing.assert_close(x.float(), y.float(), **tol,
                                       msg=lambda m: f"{where} segment {i} {name}: {m}")
        if sa[5].numel():
            assert sa[5].dtype == F32
            assert torch.equal(p, sa[5].to(p.dtype)), f"{where} segment {i}: param != master"


def _assert_equal(a, b, where=""):
    for i, (sa, sb) in enumerate(zip(a, b)):
        for j, (x, y) in enumerate(zip(sa, sb)):
            assert torch.equal(x, y), f"{where} segment {i} tensor {j} differs"


def _steps(spec, step):
    return torch.tensor([float(step + i % 3) for i in range(len(spec))])


# --------------------------------------------------------------------------- kernel vs reference

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaled", [False, True], ids=["noscale", "gradscale"])
def test_kernel_matches_reference_mixed_call(device, scaled):
    """bf16 and fp16 masters, plain low-precision segments (state in their dtype or fp32) and
    fp32 segments, four groups (amsgrad, maximize, both lerp branches), one call per step."""
    _need_native(device)
    segs, sg = _segs(device, MIXED)
    a, b = _clone(segs), _clone(segs)
    kw = {"grad_scale": torch.tensor([4.0], device=device)} if scaled else {}
    for step in range(1, 5):
        _op(a, _steps(MIXED, step), sg, **kw)
        _ref(b, _steps(MIXED, step), sg, **kw)
        _assert_close(a, b, f"step {step}")
    for sa, s0 in zip(a, segs):
        assert torch.equal(sa[1], s0[1])  # grads are read only
        if sa[0].numel() > 100:
            assert not torch.equal(sa[0], s0[0])
        if s0[5].numel():  # the master moved off its param: bits below the param's ulp
            assert not torch.equal(sa[5], sa[0].float())


@pytest.mark.parametrize("device", DEVICES)
def test_found_inf_skips_everything_and_grad_scale_divides(device):
    _need_native(device)
    segs, sg = _segs(device, MIXED, seed=1)
    for s in segs:  # stale elements: a step that ran would re-sync their masters
        if s[5].numel():
            s[0][::3] = -s[0][::3]
    a = _clone(segs)
    _op(a, _steps(MIXED, 3), sg, grad_scale=torch.tensor([2.0], device=device),
        found_inf=torch.tensor([1.0], device=device))
    _assert_equal(a, segs, "found_inf")
    # a power-of-two scale is exact: scaled grads / scale == plain grads, bit for bit
    scaled, plain = _clone(segs), _clone(segs)
    for s in scaled:
        s[1].mul_(8.0)
    _op(scaled, _steps(MIXED, 3), sg, grad_scale=torch.tensor([8.0], device=device),
        found_inf=torch.tensor([0.0], device=device))
    _op(plain, _steps(MIXED, 3), sg)
    for s1, s2 in zip(scaled, plain):
        for j in (0, 2, 3, 4, 5):
            assert torch.equal(s1[j], s2[j])
    assert not torch.equal(plain[2][5], segs[2][5])


# --------------------------------------------------------------------------- the param is the truth

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pdt", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group", [0, 1], ids=["adamw", "amsgrad-maximize"])
def test_params_written_between_steps_replace_exactly_their_masters(device, pdt, group):
    """Params overwritten between steps (weights loaded, surgery): the step computes those
    elements from the new param value, exactly as if their masters had been set to it; every
    other element keeps its master, bits below the param's ulp included."""
    _need_native(device)
    n = 50001
    spec = [(pdt, F32, n, group, True), (F32, F32, 100, 2, False)]
    segs, sg = _segs(device, spec, seed=2)
    gen = torch.Generator().manual_seed(3)
    idx = torch.randperm(n, generator=gen)[:n // 10].to(device)
    idx = torch.cat([idx[idx != 5], torch.tensor([5], device=device)])
    steps = lambda k: torch.tensor([float(k), float(k)])  # noqa: E731
    a = _clone(segs)  # params overwritten after step 2
    b = _clone(segs)  # untouched
    ref = _clone(segs)
    for k in (1, 2):
        for s in (a, b):
            _op(s, steps(k), sg)
        _ref(ref, steps(k), sg)
    _assert_equal(a, b)
    for s in (a, b, ref):  # element 5: master +0, param +0, no grad, no momentum ...
        for j in (0, 1, 2, 5):
            s[0][j][5] = 0.0
    new = (torch.randn(idx.numel(), generator=gen).to(device) * 3).to(pdt)
    new[:50] = a[0][0][idx[:50]]  # the value it already holds: not stale
    new[-1] = -0.0  # ... then param -0: equal as numbers, other bits: stale too
    differs = new.view(torch.int16) != a[0][0][idx].view(torch.int16)
    assert not differs[:50].any() and differs[-1]
    for s in (a, ref):
        s[0][0][idx] = new
    changed = torch.zeros(n, dtype=torch.bool, device=device)
    changed[idx[differs]] = True
    c = _clone(b)  # the same state with the masters of the changed elements set by hand
    c[0][0][idx] = new
    c[0][5][changed] = c[0][0][changed].float()
    for k in (3, 4, 5):
        for s in (a, b, c):
            _op(s, steps(k), sg)
        _ref(ref, steps(k), sg)
        _assert_equal(a, c, f"step {k}")
        _assert_close(a, ref, f"step {k}")
    assert torch.equal(a[0][5][~changed], b[0][5][~changed])  # other masters: bitwise
    changed[5] = False
    assert (a[0][5][changed] != b[0][5][changed]).all()
    # ... the zero's sign survives the zero update (-0 * decay + -0): the master took -0
    assert torch.signbit(a[0][5][5]) and torch.signbit(ref[0][5][5])
    assert not torch.signbit(b[0][5][5])
    # sub-ulp precision kept: most masters are not their param's value
    kept = (a[0][5][~changed] != a[0][0][~changed].float()).float().mean()
    assert kept > 0.9, kept


def test_resync_of_a_stale_element_does_not_depend_on_its_neighbours():
    """Every element decides alone: one stale element in a vector's worth of fresh ones (and
    the other way round) at every position of a 16-element block."""
    _need_native("cpu")
    for pos in range(16):
        for pdt in (BF16, F16):
            spec = [(pdt, F32, 37, 0, True)]
            segs, sg = _segs("cpu", spec, seed=10 + pos)
            a, ref = _clone(segs), _clone(segs)
            for s in (a, ref):
                s[0][0][pos] = 2.5
                s[0][0][pos + 17:] = -s[0][0][pos + 17:]
            _op(a, torch.tensor([1.0]), sg)
            _ref(ref, torch.tensor([1.0]), sg)
            _assert_close(a, ref, f"pos {pos} {pdt}")


# --------------------------------------------------------------------------- work split (CPU)

def test_thread_ranges_and_pieces_give_the_same_bits():
    """The element space is cut into per-thread ranges at any element; pieces (1-D views) of
    one buffer, as ZeRO passes them, update exactly as the whole buffer does."""
    _need_native("cpu")
    spec = [(BF16, F32, 100003, 1, True), (F16, F32, 65539, 0, True), (F32, F32, 33333, 2, False)]
    segs, sg = _segs("cpu", spec, seed=4)
    for s in segs[:2]:
        s[0][::5] = -s[0][::5]  # some stale elements too
    steps = torch.tensor([3.0, 4.0, 5.0])
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            x = _clone(segs)
            _op(x, steps, sg)
            results.append(x)
    finally:
        torch.set_num_threads(before)
    _assert_equal(results[0], results[1], "1 vs 2 threads")
    _assert_equal(results[0], results[2], "1 vs 3 threads")
    # the bf16 segment as pieces at odd cuts, in one call
    whole = _clone(segs[:1])[0]
    cuts = [0, 1, 7, 32769, 32770, 70001, 100003]
    pieces = [[t[lo:hi] if t.numel() else t for t in whole] for lo, hi in zip(cuts, cuts[1:])]
    n = len(pieces)
    _op(pieces, torch.full((n,), 3.0), torch.ones(n, dtype=torch.long))
    for j in (0, 2, 3, 4, 5):
        assert torch.equal(whole[j], results[0][0][j])
    ref = _clone(segs)
    _ref(ref, steps, sg)
    _assert_close(results[0], ref)


@pytest.mark.parametrize("isa", ["avx2", "default"])
def test_cpu_isa_paths_with_masters(isa):
    """ZERO_EXT_CPU_ISA caps the fp32 path (explicit AVX-512 / AVX2 / portable loops); master
    segments of both dtypes run in the same call, next to the fp32 ones, in a subprocess."""
    _need_native("cpu")
    _run_child(_ISA_CHILD, ZERO_EXT_CPU_ISA=isa)


def test_target_clones_build_with_masters():
    """The shipped build (no -march, setup.py) runs the bf16/fp16 loops through GCC
    target_clones: a JIT build of the AdamW source alone with ZERO_EXT_NATIVE_ARCH=0 runs the
    same checks (the clone the CPU picks). One cold build of one file, cached afterwards."""
    _need_native("cpu")
    _run_child(_ISA_CHILD, ZERO_EXT_NATIVE_ARCH="0", ZERO_EXT_REQUIRE_NATIVE="1",
               ZERO_EXT_JIT_SOURCES="fused_adamw_cpu.cpp",
               ZERO_EXT_JIT_NAME="zero_ext_adamw_generic_arch_test")


_ISA_CHILD = """
    import torch
    from zero_ext.kernels import adamw as K, native_available
    assert native_available("fused_adamw_", "cpu")
    BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
    groups = [dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
              dict(lr=3e-3, betas=(0.3, 0.99), eps=1e-6, weight_decay=0.0, amsgrad=True,
                   maximize=True)]
    g = torch.Generator().manual_seed(0)
    spec = [(F32, 1), (BF16, 7), (F16, 8), (F32, 15), (BF16, 16), (F16, 17), (BF16, 4097),
            (F16, 40001), (F32, 4097)]
    def seg(pdt, n, ams):
        w = torch.randn(n, generator=g)
        p = w.to(pdt)
        p[::4] = -p[::4]  # stale elements
        return [p, torch.randn(n, generator=g).to(pdt), 0.1 * torch.randn(n, generator=g),
                0.1 * torch.rand(n, generator=g),
                0.1 * torch.rand(n, generator=g) if ams else torch.empty(0),
                w if pdt != F32 else torch.empty(0)]
    segs = [seg(pdt, n, i % 2 == 1) for i, (pdt, n) in enumerate(spec)]
    a = [[t.clone() for t in s] for s in segs]
    steps = torch.arange(1, len(spec) + 1, dtype=torch.float32)
    sg = torch.tensor([i % 2 for i in range(len(spec))])
    table = K.group_hparams_table(groups)
    for step in range(3):
        for fn, ss in ((torch.ops.zero_ext.fused_adamw_, a), (K.fused_adamw_reference_, segs)):
            fn(*[[s[j] for s in ss] for j in range(5)], steps + step, sg, table,
               torch.tensor([2.0]), None, [s[5] for s in ss])
    for sa, sb in zip(a, segs):
        for j, (x, y) in enumerate(zip(sa, sb)):
            tol = dict(atol=1e-5, rtol=1.6e-2) if j == 0 else dict(atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(x.float(), y.float(), **tol)
        if sa[5].numel():
            assert torch.equal(sa[0], sa[5].to(sa[0].dtype))
    print("OK")
"""


def _run_child(code, **env_overrides):
    env = dict(os.environ, **env_overrides)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr[-6000:]


# --------------------------------------------------------------------------- the wrapper

@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_inputs_are_staged_by_the_wrapper(device):
    """zero_ext.kernels.fused_adamw_ stages non-contiguous params, grads, moments and masters
    and writes them back in place, layouts kept."""
    _need_native(device)
    gen = torch.Generator().manual_seed(5)

    def t(dtype, scale=1.0, rows=40, cols=30):  # a non-contiguous (cols, rows) view
        return (torch.randn(rows, cols, generator=gen) * scale).to(device, dtype).t()

    w = t(F32)
    seg0 = [w.to(BF16), t(BF16), t(F32, 0.1), t(F32, 0.1).abs(), t(F32, 0.1).abs(), w.clone()]
    w1 = torch.randn(50, generator=gen).to(device)
    seg1 = [w1.to(F16), torch.randn(50, generator=gen).to(device, F16),
            torch.zeros(50, device=device), torch.zeros(50, device=device),
            torch.empty(0, device=device), w1]  # contiguous, in the same call
    segs = [seg0, seg1]
    segs[0][0][::2, ::3] = 1.0  # stale
    a = [[x.clone() for x in s] for s in segs]  # clone keeps the strides
    assert not a[0][0].is_contiguous() and not a[0][5].is_contiguous()
    b = [[x.contiguous().clone() for x in s] for s in segs]
    steps, sg = torch.tensor([2.0, 3.0]), torch.tensor([1, 0])
    _wrapper(a, steps, sg)
    _ref(b, steps, sg)
    assert not a[0][0].is_contiguous() and not a[0][5].is_contiguous()
    _assert_close(a, b)
    assert not torch.equal(a[0][5], segs[0][5])


@pytest.mark.parametrize("device", DEVICES)
def test_wrapper_without_masters_is_unchanged(device):
    """masters=None and masters=[] run the plain kernels (bf16 with bf16 state included)."""
    _need_native(device)
    spec = [(BF16, BF16, 300, 0, False), (BF16, F32, 301, 1, False), (F32, F32, 5, 2, False)]
    segs, sg = _segs(device, spec, seed=6)
    a, b = _clone(segs), _clone(segs)
    p, g, m, v, x, _ = _lists(a)
    K.fused_adamw_(p, g, m, v, x, torch.tensor([1.0, 2.0, 3.0]), sg, TABLE)
    p, g, m, v, x, _ = _lists(b)
    OP(p, g, m, v, x, torch.tensor([1.0, 2.0, 3.0]), sg, TABLE, None, None, [])
    _assert_equal(a, b)


# --------------------------------------------------------------------------- errors

def _bad_cases(device):
    """(description, mutation of segment 1, message with {i} for the segment's index) over
    a valid base of two segments."""
    def base():
        segs, sg = _segs(device, [(BF16, F32, 8, 0, True), (BF16, F32, 8, 0, True)], seed=7)
        return segs, sg

    cases = []

    def fp32_param(segs):
        segs[1][0] = segs[1][0].float()
        segs[1][1] = segs[1][1].float()
    cases.append(("fp32 param", fp32_param, r"masters\[{i}\] is given but params\[{i}\] is"))

    def wrong_dtype(segs):
        segs[1][5] = segs[1][5].double()
    cases.append(("float64 master", wrong_dtype, r"masters\[{i}\] must be float32 with 8 elements"))

    def bf16_master(segs):
        segs[1][5] = segs[1][5].to(BF16)
    cases.append(("bf16 master", bf16_master, r"masters\[{i}\] must be float32 with 8 elements"))

    def wrong_numel(segs):
        segs[1][5] = torch.zeros(9, device=device)
    cases.append(("numel", wrong_numel, r"masters\[{i}\] must be float32 with 8 elements"))

    def bf16_moments(segs):
        segs[1][2] = segs[1][2].to(BF16)
        segs[1][3] = segs[1][3].to(BF16)
    cases.append(("bf16 moments", bf16_moments,
                  r"segment {i} has a master, so its exp_avgs and exp_avg_sqs must be float32"))
    return base, cases


@pytest.mark.parametrize("device", DEVICES)
def test_op_rejects_bad_masters_and_writes_nothing(device):
    _need_native(device)
    base, cases = _bad_cases(device)
    for what, mutate, msg in cases:
        segs, sg = base()
        mutate(segs)
        before = _clone(segs)
        with pytest.raises(RuntimeError, match=msg.format(i=1)):
            _op(segs, torch.tensor([1.0, 1.0]), sg)
        _assert_equal(segs, before, what)  # segment 0 was valid: still untouched
    segs, sg = base()
    p, g, m, v, x, w = _lists(segs)
    with pytest.raises(RuntimeError, match="masters must be empty or have one entry per "
                                           r"segment \(2\), got 1"):
        OP(p, g, m, v, x, torch.ones(2), sg, TABLE, None, None, w[:1])
    with pytest.raises(RuntimeError, match=r"masters\[0\] is not contiguous"):
        OP(p, g, m, v, x, torch.ones(2), sg, TABLE, None, None,
           [torch.zeros(16, device=device)[::2], w[1]])
    if device == "cuda":
        with pytest.raises(RuntimeError, match=r"masters\[0\] must be float32 with 8 elements "
                                               "on cuda"):
            OP(p, g, m, v, x, torch.ones(2), sg, TABLE, None, None, [w[0].cpu(), w[1]])


def test_wrapper_rejects_bad_masters_and_writes_nothing():
    """A bad master is not routed to the reference (which would run after the kernel had
    written the good segments): the op raises for it, names its index, writes nothing."""
    _need_native("cpu")
    base, cases = _bad_cases("cpu")
    for what, mutate, msg in cases:
        segs, sg = base()
        mutate(segs)
        before = _clone(segs)
        with pytest.raises(RuntimeError, match=msg.format(i=1)):
            _wrapper(segs, torch.tensor([1.0, 1.0]), sg)
        _assert_equal(segs, before, what)
    segs, sg = base()
    p, g, m, v, x, w = _lists(segs)
    with pytest.raises(RuntimeError, match="masters must be empty or have one entry"):
        K.fused_adamw_(p, g, m, v, x, torch.ones(2), sg, TABLE, masters=w[:1])
    with pytest.raises(ValueError, match="masters must be empty or have one entry"):
        K.fused_adamw_reference_(p, g, m, v, x, torch.ones(2), sg, TABLE, masters=w[:1])


def test_reference_checks_every_master_before_writing():
    base, cases = _bad_cases("cpu")
    for what, mutate, msg in cases:
        segs, sg = base()
        mutate(segs)
        before = _clone(segs)
        p, g, m, v, x, w = _lists(segs)
        with pytest.raises((ValueError, RuntimeError), match=msg.format(i=1)):
            K.fused_adamw_reference_(p, g, m, v, x, torch.tensor([1.0, 1.0]), sg, TABLE,
                                     masters=w)
        _assert_equal(segs, before, what)


@pytest.mark.parametrize("device", DEVICES)
def test_a_skipped_step_still_reports_bad_inputs(device):
    """found_inf set: nothing is written, but a bad segment is still an error (CPU and CUDA
    alike), so a bug does not hide behind an overflow step."""
    _need_native(device)
    base, cases = _bad_cases(device)
    _, mutate, msg = cases[1]
    segs, sg = base()
    mutate(segs)
    p, g, m, v, x, w = _lists(segs)
    with pytest.raises(RuntimeError, match=msg.format(i=1)):
        OP(p, g, m, v, x, torch.ones(2), sg, TABLE, None,
           torch.ones(1, device=device), w)


# --------------------------------------------------------------------------- parity with torch

@pytest.mark.parametrize("device", DEVICES)
def test_bf16_with_masters_equals_torch_adamw_in_fp32_over_30_steps(device):
    """bf16 params with float32 masters train as torch.optim.AdamW does on float32 params
    (float(param) at the start) fed the bf16 grads upcast: the reference exactly (on the CPU,
    same ops in the same order), the kernel within the fp32 tolerance; the bf16 params are the
    masters' rounding."""
    _need_native(device)
    gen = torch.Generator().manual_seed(8)
    shapes = [(64, 33), (4097,), (1,), (5, 7), (40000,)]
    gids = [0, 1, 2, 3, 0]
    p0 = [torch.randn(s, generator=gen).to(device, BF16) for s in shapes]
    ps = [p.clone() for p in p0]  # the kernel's
    ws = [p.float() for p in p0]
    rp = [p.clone() for p in p0]  # the reference's
    rw = [p.float() for p in p0]
    tp = [torch.nn.Parameter(p.float()) for p in p0]  # torch's, fp32
    opt = torch.optim.AdamW([dict(params=[tp[i] for i in range(len(shapes)) if gids[i] == gi],
                                  **hp) for gi, hp in enumerate(GROUPS)], foreach=False)
    state = {}
    for name in ("m", "v", "x", "rm", "rv", "rx"):
        state[name] = [torch.zeros(s, device=device) for s in shapes]
    for name in ("x", "rx"):
        state[name] = [t if GROUPS[g].get("amsgrad") else torch.empty(0, device=device)
                       for t, g in zip(state[name], gids)]
    sg = torch.tensor(gids)
    for step in range(1, 31):
        grads = [torch.randn(s, generator=gen).to(device, BF16) for s in shapes]
        steps = torch.full((len(shapes),), float(step))
        OP(ps, grads, state["m"], state["v"], state["x"], steps, sg, TABLE, None, None, ws)
        K.fused_adamw_reference_(rp, grads, state["rm"], state["rv"], state["rx"], steps, sg,
                                 TABLE, masters=rw)
        for t, g in zip(tp, grads):
            t.grad = g.float()
        opt.step()
    for i, t in enumerate(tp):
        t = t.detach()
        if device == "cpu":
            assert torch.equal(rw[i], t), f"reference master {i}"
        else:
            torch.testing.assert_close(rw[i], t, **FP32_TOL)
        assert torch.equal(rp[i], rw[i].to(BF16))
        torch.testing.assert_close(ws[i], t, **FP32_TOL)
        assert torch.equal(ps[i], ws[i].to(BF16))
        torch.testing.assert_close(ps[i].float(), t.to(BF16).float(), **LOW_TOL[BF16])
        st = opt.state[tp[i]]
        torch.testing.assert_close(state["m"][i], st["exp_avg"], **FP32_TOL)
        torch.testing.assert_close(state["v"][i], st["exp_avg_sq"], **FP32_TOL)


# --------------------------------------------------------------------------- CUDA specifics

@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_masters_misaligned_views_and_steps_on_device():
    """Views at odd offsets take the scalar path (vector loads need aligned masters too);
    steps on the device compute the scalars in the kernel."""
    _need_native("cuda")
    bufs, _ = _segs("cuda", [(BF16, F32, 5000, 1, True)], seed=9)
    whole = bufs[0]
    whole[0][::7] = 0.5  # stale
    segs = [[t[1:4001] for t in whole], [t[4003:4999] for t in whole]]
    ref = _clone(segs)
    steps, sg = torch.tensor([3.0, 4.0]), torch.tensor([1, 3])
    _op(segs, steps.cuda(), sg)
    _ref(ref, steps, sg)
    _assert_close(segs, ref)
