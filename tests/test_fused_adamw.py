"""zero_ext.fused_adamw_ (kernel vs reference) and zero_ext.FusedAdamW (vs torch.optim.AdamW).

Tolerances (explicit, per dtype):
- float32: atol 1e-6, rtol 1e-5 after 20 steps against torch.optim.AdamW (docs/design.md,
  "AdamW arithmetic": the kernels round like torch's for-loop up to fused multiply-adds, i.e.
  in the last ulp).
- bfloat16 / float16 params: the kernel computes in fp32 and rounds once per store, like
  torch's fused AdamW; against that (or the reference) we allow 2 ulps of the storage dtype
  per step compared (bf16: rtol 1.6e-2, fp16: rtol 2e-3, atol 1e-5), because a different
  fp32 rounding just below a rounding boundary flips the stored value by one ulp.
"""
from __future__ import annotations

import copy

import pytest
import torch

from zero_ext import FusedAdamW
from zero_ext.engine import AdamWEngine
from zero_ext.fused_adamw import fused_path_supported, hparams_row
from zero_ext.kernels import adamw as K
from zero_ext.kernels import native_available

CUDA = torch.cuda.is_available()
DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda",
                        marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU"))]
FP32_TOL = dict(atol=1e-6, rtol=1e-5)
LOW_TOL = {torch.bfloat16: dict(atol=1e-5, rtol=1.6e-2), torch.float16: dict(atol=1e-5, rtol=2e-3),
           torch.float32: FP32_TOL}
DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

GROUPS = [  # several groups with different everything
    dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
    dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0, amsgrad=True, maximize=True),
    dict(lr=1e-3, betas=(0.3, 0.9), eps=1e-8, weight_decay=0.5),  # beta1 < 0.5: other lerp branch
    dict(lr=5e-2, betas=(0.95, 0.9999), eps=1e-4, weight_decay=1e-3, amsgrad=True),
]


def _native(device) -> bool:
    return native_available("fused_adamw_", device)


def _need_native(device):
    if not _native(device):
        pytest.skip(f"native zero_ext ops unavailable on {device}")


def _segments(device, pdt, sdt, sizes, groups, seed=0):
    """Random segments (param, grad, exp_avg, exp_avg_sq, max) for group indices `groups`."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, gi in zip(sizes, groups):
        p = torch.randn(n, generator=g).to(device, pdt)
        gr = torch.randn(n, generator=g).to(device, pdt)
        m = (0.1 * torch.randn(n, generator=g)).to(device, sdt)
        v = (0.1 * torch.rand(n, generator=g)).to(device, sdt)
        x = (0.1 * torch.rand(n, generator=g)).to(device, sdt) if GROUPS[gi].get("amsgrad") \
            else torch.empty(0, device=device, dtype=sdt)
        out.append([p, gr, m, v, x])
    return out


def _call(fn, segs, steps, seg_groups, table, **kw):
    fn([s[0] for s in segs], [s[1] for s in segs], [s[2] for s in segs], [s[3] for s in segs],
       [s[4] for s in segs], steps, seg_groups, table, **kw)


def _clone(segs):
    return [[t.clone() for t in s] for s in segs]


def _assert_segs_close(a, b, tol):
    for i, (sa, sb) in enumerate(zip(a, b)):
        for name, x, y in zip(("param", "grad", "exp_avg", "exp_avg_sq", "max"), sa, sb):
            torch.testing.assert_close(x.float(), y.float(), **tol,
                                       msg=lambda m: f"segment {i} {name}: {m}")


# --------------------------------------------------------------------------- the op

STATE_COMBOS = [("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "fp32"), ("fp16", "fp16"),
                ("fp16", "fp32")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pdt,sdt", STATE_COMBOS, ids=[f"p{a}-s{b}" for a, b in STATE_COMBOS])
@pytest.mark.parametrize("scaled", [False, True], ids=["noscale", "gradscale"])
def test_kernel_matches_reference(device, pdt, sdt, scaled):
    _need_native(device)
    pdt, sdt = DT[pdt], DT[sdt]
    sizes = [0, 1, 4097, 33, 1000, 7, 2]
    groups = [0, 1, 2, 3, 1, 0, 2]
    segs = _segments(device, pdt, sdt, sizes, groups)
    table = K.group_hparams_table(GROUPS)
    sg = torch.tensor(groups)
    a, b = _clone(segs), _clone(segs)
    kw = {"grad_scale": torch.tensor([4.0], device=device)} if scaled else {}
    for step in range(1, 4):
        steps = torch.tensor([float(step + i) for i in range(len(sizes))])
        _call(K.fused_adamw_, a, steps, sg, table, **kw)
        _call(K.fused_adamw_reference_, b, steps, sg, table, **kw)
        _assert_segs_close(a, b, LOW_TOL[pdt] if pdt != torch.float32 or sdt != torch.float32
                           else FP32_TOL)
    # something happened: params moved
    assert not torch.equal(a[2][0], segs[2][0])


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_in_one_call(device):
    _need_native(device)
    parts = [_segments(device, torch.float32, torch.float32, [300], [0], seed=1),
             _segments(device, torch.bfloat16, torch.bfloat16, [301], [1], seed=2),
             _segments(device, torch.bfloat16, torch.float32, [302], [2], seed=3),
             _segments(device, torch.float16, torch.float32, [303], [3], seed=4)]
    segs = [s for p in parts for s in p]
    table = K.group_hparams_table(GROUPS)
    sg, steps = torch.tensor([0, 1, 2, 3]), torch.tensor([1.0, 2.0, 3.0, 4.0])
    a, b = _clone(segs), _clone(segs)
    _call(K.fused_adamw_, a, steps, sg, table)
    _call(K.fused_adamw_reference_, b, steps, sg, table)
    for sa, sb in zip(a, b):
        _assert_segs_close([sa], [sb], LOW_TOL[sa[0].dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_flat_range_segments_equal_whole_param(device):
    """Pieces (1-D views) of one buffer, as the ZeRO optimizer passes them, update exactly as
    the whole tensor does; pieces of one buffer may belong to different groups."""
    _need_native(device)
    whole = _segments(device, torch.float32, torch.float32, [10007], [0], seed=5)[0]
    cuts = [0, 1, 3000, 3001, 7001, 10007]
    pieces = _clone([whole])[0]
    table = K.group_hparams_table(GROUPS)
    segs = [[t[lo:hi] for t in pieces[:4]] + [torch.empty(0, device=device)]
            for lo, hi in zip(cuts[:-1], cuts[1:])]
    n = len(segs)
    _call(K.fused_adamw_, segs, torch.full((n,), 5.0), torch.zeros(n, dtype=torch.long), table)
    w = _clone([whole])
    _call(K.fused_adamw_, w, torch.tensor([5.0]), torch.tensor([0]), table)
    for x, y in zip(pieces[:4], w[0][:4]):
        if device == "cpu":  # the CPU kernel's result does not depend on where a range starts
            assert torch.equal(x, y)
        else:  # CUDA: unaligned pieces take the scalar path, whole tensors the vector path
            torch.testing.assert_close(x, y, **FP32_TOL)
    # and two groups over one buffer: each range follows its own group
    mixed = _clone([whole])[0]
    segs = [[t[:5000] for t in mixed[:4]] + [torch.empty(0, device=device)],
            [t[5000:] for t in mixed[:4]] + [torch.empty(0, device=device)]]
    ref = [[t[:5000].clone() for t in whole[:4]] + [torch.empty(0, device=device)],
           [t[5000:].clone() for t in whole[:4]] + [torch.empty(0, device=device)]]
    steps, sg = torch.tensor([5.0, 5.0]), torch.tensor([0, 2])
    _call(K.fused_adamw_, segs, steps, sg, table)
    _call(K.fused_adamw_reference_, ref, steps, sg, table)
    _assert_segs_close(segs, ref, FP32_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_and_float64_inputs(device):
    """The wrapper stages non-contiguous tensors and runs float64 segments in the reference."""
    table = K.group_hparams_table(GROUPS)
    gen = torch.Generator().manual_seed(7)

    def transposed(scale=1.0):  # a non-contiguous (30, 40) view
        return torch.randn(40, 30, generator=gen).to(device).t().mul_(scale)

    p, g, m, v = transposed(), transposed(), transposed(0.1), transposed(0.1).abs_()
    d = [torch.randn(50, generator=gen, dtype=torch.float64).to(device) for _ in range(2)] + \
        [torch.zeros(50, dtype=torch.float64, device=device) for _ in range(2)]
    segs = [[p, g, m, v, torch.empty(0, device=device)],
            [d[0], d[1], d[2], d[3], torch.empty(0, device=device, dtype=torch.float64)]]
    a = [[t.clone() for t in s] for s in segs]  # clone keeps the strides
    assert not a[0][0].is_contiguous() and not a[0][1].is_contiguous()
    b = [[t.contiguous().clone() for t in s] for s in segs]
    steps, sg = torch.tensor([2.0, 3.0]), torch.tensor([0, 2])
    _call(K.fused_adamw_, a, steps, sg, table)
    _call(K.fused_adamw_reference_, b, steps, sg, table)
    assert not a[0][0].is_contiguous()  # written back in place, layout kept
    _assert_segs_close(a, b, FP32_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_found_inf_is_a_no_op_and_grad_scale_divides(device):
    _need_native(device)
    table = K.group_hparams_table(GROUPS)
    segs = _segments(device, torch.float32, torch.float32, [100, 5], [1, 0], seed=9)
    steps, sg = torch.tensor([3.0, 4.0]), torch.tensor([1, 0])
    a = _clone(segs)
    _call(K.fused_adamw_, a, steps, sg, table, found_inf=torch.tensor([1.0], device=device),
          grad_scale=torch.tensor([2.0], device=device))
    for sa, s in zip(a, segs):
        for x, y in zip(sa, s):
            assert torch.equal(x, y)
    # a power-of-two scale is exact: scaled grads / scale == plain grads, bit for bit
    scaled = _clone(segs)
    for s in scaled:
        s[1].mul_(8.0)
    plain = _clone(segs)
    _call(K.fused_adamw_, scaled, steps, sg, table, grad_scale=torch.tensor([8.0], device=device),
          found_inf=torch.tensor([0.0], device=device))
    _call(K.fused_adamw_, plain, steps, sg, table)
    for s1, s2 in zip(scaled, plain):
        for i in (0, 2, 3, 4):
            assert torch.equal(s1[i], s2[i])


def test_op_rejects_bad_inputs():
    _need_native("cpu")
    table = K.group_hparams_table(GROUPS[:1])
    p, g, m, v = (torch.zeros(4) for _ in range(4))
    with pytest.raises(RuntimeError, match="numel"):
        K.fused_adamw_([p], [torch.zeros(5)], [m], [v], [], torch.ones(1),
                       torch.zeros(1, dtype=torch.long), table)
    with pytest.raises(RuntimeError, match="out of range"):
        K.fused_adamw_([p], [g], [m], [v], [], torch.ones(1), torch.ones(1, dtype=torch.long),
                       table)
    with pytest.raises(RuntimeError, match="dtype"):
        K.fused_adamw_([p], [g.half()], [m], [v], [], torch.ones(1),
                       torch.zeros(1, dtype=torch.long), table)
    with pytest.raises(RuntimeError, match="amsgrad"):
        K.fused_adamw_([p], [g], [m], [v], [], torch.ones(1), torch.zeros(1, dtype=torch.long),
                       K.group_hparams_table([GROUPS[1]]))


def test_errors_of_the_op_propagate_and_nothing_is_retried(monkeypatch):
    """Staging is decided before the call from the inputs; an error of the native op (bad
    input, out of memory) reaches the caller, and neither the staged path nor the reference
    runs afterwards."""
    _need_native("cpu")
    table = K.group_hparams_table(GROUPS[:1])
    segs = _segments("cpu", torch.float32, torch.float32, [8, 8], [0, 0], seed=3)
    calls = []

    def oom(*args):
        calls.append("op")
        raise torch.OutOfMemoryError("simulated out of memory")

    monkeypatch.setattr(K, "_run_staged", lambda *a: calls.append("staged"))
    monkeypatch.setattr(K, "fused_adamw_reference_", lambda *a: calls.append("reference"))
    lib = torch.library.Library("zero_ext", "IMPL")
    try:
        lib.impl("fused_adamw_", oom, "CPU")  # (overrides the compiled kernel, every torch)
        before = _clone(segs)
        with pytest.raises(torch.OutOfMemoryError, match="simulated"):
            _call(K.fused_adamw_, segs, torch.ones(2), torch.zeros(2, dtype=torch.long), table)
    finally:
        lib._destroy()
    assert calls == ["op"]
    for sa, sb in zip(segs, before):
        for x, y in zip(sa, sb):
            assert torch.equal(x, y)


def test_staging_decision_is_cached_per_lists():
    """The all-contiguous check runs once per set of lists (the engine passes the same lists
    every step), so the hot path pays no per-tensor Python work; new lists are checked anew."""
    _need_native("cpu")
    table = K.group_hparams_table(GROUPS[:1])
    segs = _segments("cpu", torch.float32, torch.float32, [8, 8], [0, 0], seed=4)
    lists = [[s[j] for s in segs] for j in range(5)]
    steps, sg = torch.ones(2), torch.zeros(2, dtype=torch.long)
    K._AS_IS_CACHE.clear()
    K.fused_adamw_(*lists, steps, sg, table)
    assert len(K._AS_IS_CACHE) == 1
    K.fused_adamw_(*lists, steps, sg, table)
    assert len(K._AS_IS_CACHE) == 1
    # a non-contiguous param in new lists: checked, staged, and matches the reference
    p = torch.randn(8, 2)[:, 0]
    other = [[p, segs[1][1].clone(), segs[1][2].clone(), segs[1][3].clone(), torch.empty(0)]]
    ref = _clone(other)
    _call(K.fused_adamw_, other, torch.ones(1), torch.zeros(1, dtype=torch.long), table)
    _call(K.fused_adamw_reference_, ref, torch.ones(1), torch.zeros(1, dtype=torch.long), table)
    for x, y in zip(other[0], ref[0]):
        torch.testing.assert_close(x, y, **FP32_TOL)


@pytest.mark.parametrize("isa", ["avx2", "default"])
def test_cpu_isa_paths_match_reference(isa):
    """The CPU kernel picks an explicit AVX-512 / AVX2 path for fp32 or the portable loops;
    ZERO_EXT_CPU_ISA caps the choice, so a subprocess checks the lower paths here too."""
    import os
    import subprocess
    import sys
    import textwrap

    _need_native("cpu")
    code = textwrap.dedent("""
        import torch
        from zero_ext.kernels import adamw as K
        groups = [dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
                  dict(lr=3e-3, betas=(0.3, 0.99), eps=1e-6, weight_decay=0.0, amsgrad=True,
                       maximize=True)]
        g = torch.Generator().manual_seed(0)
        sizes = [1, 7, 8, 15, 16, 17, 4097]
        def seg(n, ams):
            return [torch.randn(n, generator=g), torch.randn(n, generator=g),
                    0.1 * torch.randn(n, generator=g), 0.1 * torch.rand(n, generator=g),
                    0.1 * torch.rand(n, generator=g) if ams else torch.empty(0)]
        segs = [seg(n, i % 2 == 1) for i, n in enumerate(sizes)]
        a = [[t.clone() for t in s] for s in segs]
        steps = torch.arange(1, len(sizes) + 1, dtype=torch.float32)
        sg = torch.tensor([i % 2 for i in range(len(sizes))])
        table = K.group_hparams_table(groups)
        for fn, ss in ((K.fused_adamw_, a), (K.fused_adamw_reference_, segs)):
            fn(*[[s[j] for s in ss] for j in range(5)], steps, sg, table,
               grad_scale=torch.tensor([2.0]))
        for sa, sb in zip(a, segs):
            for x, y in zip(sa, sb):
                torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)
        print("OK")
    """)
    env = dict(os.environ, ZERO_EXT_CPU_ISA=isa)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("isa", ["native", "avx2", "default"])
def test_cpu_unscaled_path_equals_the_scaled_one(isa):
    """Without a grad_scale (or with 1.0) the CPU kernel leaves the division of the grads
    out (a vector division costs about as much as the rest of an element's arithmetic);
    with x / 2 exact, grads 2g with grad_scale 2 must give bitwise what g gives unscaled,
    on every ISA path and dtype mix (fp32, bf16 with float32 masters)."""
    import os
    import subprocess
    import sys
    import textwrap

    _need_native("cpu")
    code = textwrap.dedent("""
        import torch
        from zero_ext.kernels import adamw as K
        groups = [dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
                  dict(lr=3e-3, betas=(0.3, 0.99), eps=1e-6, weight_decay=0.0, amsgrad=True,
                       maximize=True)]
        table = K.group_hparams_table(groups)
        sizes = [1, 15, 16, 17, 33, 4097]
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(0)
            def seg(n, ams):
                st = torch.float32
                return [torch.randn(n, generator=g).to(dtype),
                        torch.randn(n, generator=g).to(dtype),
                        0.1 * torch.randn(n, generator=g), 0.1 * torch.rand(n, generator=g),
                        0.1 * torch.rand(n, generator=g) if ams else torch.empty(0)]
            segs = [seg(n, i % 2 == 1) for i, n in enumerate(sizes)]
            masters = [s[0].float() for s in segs] if dtype != torch.float32 else []
            steps = torch.arange(1, len(sizes) + 1, dtype=torch.float32)
            sg = torch.tensor([i % 2 for i in range(len(sizes))])
            runs = []
            for gs, mul in ((None, 1.0), (torch.tensor([1.0]), 1.0), (torch.tensor([2.0]), 2.0)):
                a = [[t.clone() for t in s] for s in segs]
                for s in a:
                    s[1] = (s[1].float() * mul).to(dtype)
                w = [m.clone() for m in masters]
                K.fused_adamw_(*[[s[j] for s in a] for j in range(5)], steps, sg, table,
                               grad_scale=gs, masters=w)
                runs.append([t for s in a for t in (s[0], s[2], s[3], s[4])] + w)
            for other in runs[1:]:
                for x, y in zip(runs[0], other):
                    assert torch.equal(x, y), (dtype, x, y)
        print("OK")
    """)
    env = dict(os.environ)
    if isa != "native":
        env["ZERO_EXT_CPU_ISA"] = isa
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


def _opcheck_args(device):
    segs = _segments(device, torch.float32, torch.float32, [64, 3], [0, 1], seed=11)
    return ([s[0] for s in segs], [s[1] for s in segs], [s[2] for s in segs],
            [s[3] for s in segs], [s[4] for s in segs], torch.tensor([1.0, 2.0]),
            torch.tensor([0, 1]), K.group_hparams_table(GROUPS), None, None, [])


def _opcheck_master_args(device):
    """A bf16 segment with a float32 master, a bf16 one without, and an fp32 one."""
    segs = (_segments(device, torch.bfloat16, torch.float32, [64, 5], [0, 1], seed=12)
            + _segments(device, torch.float32, torch.float32, [3], [2], seed=13))
    masters = [segs[0][0].float() + 1e-3, torch.empty(0, device=device),
               torch.empty(0, device=device)]
    return ([s[0] for s in segs], [s[1] for s in segs], [s[2] for s in segs],
            [s[3] for s in segs], [s[4] for s in segs], torch.tensor([1.0, 2.0, 3.0]),
            torch.tensor([0, 1, 2]), K.group_hparams_table(GROUPS), None, None, masters)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    _need_native(device)
    torch.library.opcheck(torch.ops.zero_ext.fused_adamw_.default, _opcheck_args(device))
    args = list(_opcheck_args(device))
    args[8] = torch.tensor([2.0], device=device)
    args[9] = torch.tensor([0.0], device=device)
    torch.library.opcheck(torch.ops.zero_ext.fused_adamw_.default, tuple(args))
    torch.library.opcheck(torch.ops.zero_ext.fused_adamw_.default,
                          _opcheck_master_args(device))


def test_group_hparams_table():
    t = K.group_hparams_table([dict(lr=torch.tensor(0.5), betas=(0.8, 0.9), eps=1e-3,
                                    weight_decay=0.2, amsgrad=True), [1, 0.1, 0.2, 0.3, 0.4, 0, 1]])
    assert t.dtype == torch.float64 and t.shape == (2, 7)
    assert t[0].tolist() == [0.5, 0.8, 0.9, 1e-3, 0.2, 1.0, 0.0]
    assert K.group_hparams_table([]).shape == (0, 7)
    with pytest.raises(ValueError):
        K.group_hparams_table([[1, 2, 3]])


# --------------------------------------------------------------------------- the reference

def test_reference_matches_torch_adamw_for_loop():
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n)) for n in (5, 100)]
    ref_ps = [p.detach().clone() for p in ps]
    opt = torch.optim.AdamW([dict(params=ps[:1], **GROUPS[0]), dict(params=ps[1:], **GROUPS[1])],
                            foreach=False)
    m = [torch.zeros_like(p) for p in ref_ps]
    v = [torch.zeros_like(p) for p in ref_ps]
    x = [torch.empty(0), torch.zeros_like(ref_ps[1])]
    table = K.group_hparams_table(GROUPS[:2])
    for step in range(1, 11):
        grads = [torch.randn_like(p) for p in ps]
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opt.step()
        K.fused_adamw_reference_(ref_ps, grads, m, v, x, torch.full((2,), float(step)),
                                 torch.tensor([0, 1]), table)
    for p, r in zip(ps, ref_ps):
        assert torch.equal(p.detach(), r)  # same ops in the same order: bitwise


@pytest.mark.parametrize("impl", ["reference", "native"])
def test_eps_after_the_bias_correction_float32(impl):
    """float32, at the float32 tolerance: eps is added to sqrt(v) / sqrt(1 - beta2^t), as in
    torch's AdamW. Grads of 1e-4 and eps = 1e-4 in the first steps (1 - beta2^t = 1e-3)
    make eps as large as that root, so eps under the root or before the correction moves
    every update by tens of percent; the test above, with eps far below the root, cannot
    see where eps goes."""
    if impl == "native":
        _need_native("cpu")
    fn = K.fused_adamw_ if impl == "native" else K.fused_adamw_reference_
    groups = [dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-4, weight_decay=0.1),
              dict(lr=1e-2, betas=(0.8, 0.999), eps=1e-4, weight_decay=0.0, amsgrad=True)]
    g = torch.Generator().manual_seed(3)
    ps = [torch.nn.Parameter(1e-2 * torch.randn(64, generator=g)) for _ in groups]
    ours = [p.detach().clone() for p in ps]
    opt = torch.optim.AdamW([dict(params=[p], **hp) for p, hp in zip(ps, groups)],
                            foreach=False)
    m = [torch.zeros_like(p) for p in ours]
    v = [torch.zeros_like(p) for p in ours]
    x = [torch.empty(0), torch.zeros_like(ours[1])]
    table = K.group_hparams_table(groups)
    for step in range(1, 6):
        grads = [1e-4 * torch.randn(64, generator=g) for _ in ps]
        for p, gr in zip(ps, grads):
            p.grad = gr.clone()
        opt.step()
        fn(ours, grads, m, v, x, torch.full((2,), float(step)), torch.tensor([0, 1]), table)
        for i, (p, o) in enumerate(zip(ps, ours)):
            torch.testing.assert_close(o, p.detach(), **FP32_TOL,
                                       msg=lambda e: f"step {step} group {i}: {e}")


# --------------------------------------------------------------------------- FusedAdamW

def _model_params(device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 4), (4097,), (1,), (0,), (5, 7), (16,), (2, 3, 4), (33,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device, dtype)) for s in shapes]


def _param_groups(ps):
    return [dict(params=ps[0:2], **GROUPS[0]), dict(params=ps[2:4], **GROUPS[1]),
            dict(params=ps[4:6], **GROUPS[2]), dict(params=ps[6:], **GROUPS[3])]


def _run_pair(opt_a, opt_b, pa, pb, steps, seed=100, skip=None):
    for it in range(steps):
        gen = torch.Generator().manual_seed(seed + it)
        for i, (a, b) in enumerate(zip(pa, pb)):
            if skip is not None and skip(it, i):
                a.grad = b.grad = None
                continue
            g = torch.randn(a.shape, generator=gen).to(a.device, a.dtype)
            a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()


@pytest.mark.parametrize("device", DEVICES)
def test_fused_adamw_matches_torch_fp32_20_steps(device):
    pa, pb = _model_params(device), _model_params(device)
    oa = FusedAdamW(_param_groups(pa))
    ob = torch.optim.AdamW(_param_groups(pb), foreach=False)
    _run_pair(oa, ob, pa, pb, 20, skip=lambda it, i: i == 2 and it % 5 == 3)
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a, b, **FP32_TOL)
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sb:
        assert sa[k].keys() == sb[k].keys()
        assert sa[k]["step"].dtype == torch.float32 and sa[k]["step"].dim() == 0
        assert float(sa[k]["step"]) == float(sb[k]["step"])
        for n in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if n in sb[k]:
                torch.testing.assert_close(sa[k][n], sb[k][n], **FP32_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fused_adamw_low_precision_vs_torch_fused(device, dtype):
    """Against torch's fused AdamW, which also computes in fp32 and keeps bf16/fp16 state;
    compared after 5 steps with 2 ulps per step (see the module docstring)."""
    dt = DT[dtype]
    pa, pb = _model_params(device, dt), _model_params(device, dt)
    oa = FusedAdamW(_param_groups(pa))
    ob = torch.optim.AdamW(_param_groups(pb), fused=True)
    _run_pair(oa, ob, pa, pb, 5)
    tol = dict(atol=5 * LOW_TOL[dt]["atol"], rtol=5 * LOW_TOL[dt]["rtol"])
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_one_op_call_per_step_for_all_groups(device, monkeypatch):
    import zero_ext.engine as F  # the one AdamW engine calls the op, or runs its plan

    calls, plan_runs = [], []
    real, real_run = F.fused_adamw_, K.FusedAdamWPlan.run

    def counting(*args, **kw):
        calls.append(len(args[0]))
        return real(*args, **kw)

    def counting_run(self, *args, **kw):
        plan_runs.append(self.num_segments)
        return real_run(self, *args, **kw)

    monkeypatch.setattr(F, "fused_adamw_", counting)
    monkeypatch.setattr(K.FusedAdamWPlan, "run", counting_run)
    ps = _model_params(device)
    opt = FusedAdamW(_param_groups(ps))
    for _ in range(3):
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
    assert calls + plan_runs == [len(ps)] * 3
    if K._plan_class(torch.device(device)) is not None:  # the compiled plan serves every step
        assert plan_runs == [len(ps)] * 3 and calls == []


@pytest.mark.parametrize("device", DEVICES)
def test_params_without_grad_are_skipped(device):
    ps = _model_params(device)
    opt = FusedAdamW(_param_groups(ps))
    frozen = ps[4]
    before = frozen.detach().clone()
    for it in range(3):
        for p in ps:
            p.grad = None if p is frozen or (p is ps[0] and it == 1) else torch.ones_like(p)
        opt.step()
    assert frozen not in opt.state or len(opt.state[frozen]) == 0
    assert torch.equal(frozen, before)
    assert float(opt.state[ps[0]]["step"]) == 2.0
    assert float(opt.state[ps[1]]["step"]) == 3.0
    # all steps are views of one buffer, so one add_ moves them all
    bases = {opt.state[p]["step"]._base.data_ptr() for p in ps if p in opt.state and opt.state[p]}
    assert len(bases) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_cross_load_both_ways(device):
    # torch -> FusedAdamW
    p_t, p_f = _model_params(device), _model_params(device)
    ot = torch.optim.AdamW(_param_groups(p_t), foreach=False)
    of = FusedAdamW(_param_groups(p_f))
    _run_pair(ot, of, p_t, p_f, 3)
    p_f2 = [torch.nn.Parameter(p.detach().clone()) for p in p_t]
    of2 = FusedAdamW(_param_groups(p_f2))
    of2.load_state_dict(copy.deepcopy(ot.state_dict()))
    _run_pair(ot, of2, p_t, p_f2, 4, seed=500)
    for a, b in zip(p_t, p_f2):
        torch.testing.assert_close(a, b, **FP32_TOL)
    # FusedAdamW -> torch (its step views must keep working in torch's optimizer)
    p_t2 = [torch.nn.Parameter(p.detach().clone()) for p in p_f2]
    ot2 = torch.optim.AdamW(_param_groups(p_t2), foreach=False)
    ot2.load_state_dict(copy.deepcopy(of2.state_dict()))
    _run_pair(of2, ot2, p_f2, p_t2, 4, seed=900, skip=lambda it, i: i == 1 and it == 2)
    for a, b in zip(p_f2, p_t2):
        torch.testing.assert_close(a, b, **FP32_TOL)
    for k, st in ot2.state_dict()["state"].items():
        assert float(st["step"]) == float(of2.state_dict()["state"][k]["step"])
    assert of2.state_dict()["param_groups"][0].keys() == ot.state_dict()["param_groups"][0].keys()


def test_state_dict_round_trip_through_torch_save(tmp_path):
    ps = _model_params("cpu")
    opt = FusedAdamW(_param_groups(ps))
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    sd = torch.load(tmp_path / "opt.pt")
    ps2 = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt2 = FusedAdamW(_param_groups(ps2))
    opt2.load_state_dict(sd)
    for p, q in zip(ps, ps2):
        p.grad, q.grad = torch.full_like(p, 0.5), torch.full_like(q, 0.5)
    opt.step()
    opt2.step()
    for p, q in zip(ps, ps2):
        assert torch.equal(p, q)


def test_add_param_group_and_scheduler_tensor_lr():
    ps = _model_params("cpu")
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    oa = FusedAdamW(ps[:4], lr=torch.tensor(0.01))
    ob = torch.optim.AdamW(qs[:4], lr=torch.tensor(0.01), foreach=False)
    sa = torch.optim.lr_scheduler.StepLR(oa, step_size=2, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(ob, step_size=2, gamma=0.5)
    for it in range(6):
        if it == 3:
            oa.add_param_group(dict(params=ps[4:], lr=0.02, amsgrad=True))
            ob.add_param_group(dict(params=qs[4:], lr=0.02, amsgrad=True))
        for p, q in zip(ps, qs):
            p.grad = torch.full_like(p, 0.1 * (it + 1))
            q.grad = p.grad.clone()
        oa.step()
        ob.step()
        sa.step()
        sb.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, **FP32_TOL)


def test_complex_params_match_torch():
    g = torch.Generator().manual_seed(3)
    pa = [torch.nn.Parameter(torch.randn(6, 2, generator=g, dtype=torch.complex64))]
    pb = [torch.nn.Parameter(pa[0].detach().clone())]
    oa, ob = FusedAdamW(pa, amsgrad=True), torch.optim.AdamW(pb, amsgrad=True, foreach=False)
    _run_pair(oa, ob, pa, pb, 5)
    torch.testing.assert_close(pa[0], pb[0], **FP32_TOL)


def test_float64_params_use_the_reference_path():
    pa = _model_params("cpu", torch.float64)
    pb = _model_params("cpu", torch.float64)
    oa, ob = FusedAdamW(_param_groups(pa)), torch.optim.AdamW(_param_groups(pb), foreach=False)
    _run_pair(oa, ob, pa, pb, 5)
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_found_inf_attribute_skips_and_reverts_steps(device):
    ps = _model_params(device)
    opt = FusedAdamW(_param_groups(ps))
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    before = [p.detach().clone() for p in ps]
    state_before = copy.deepcopy(opt.state_dict()["state"])
    opt.grad_scale = torch.tensor([2.0], device=device)
    opt.found_inf = torch.tensor([1.0], device=device)
    opt.step()
    del opt.grad_scale, opt.found_inf
    for p, b in zip(ps, before):
        assert torch.equal(p, b)
    for k, st in opt.state_dict()["state"].items():
        assert float(st["step"]) == float(state_before[k]["step"]) == 1.0
        assert torch.equal(st["exp_avg"], state_before[k]["exp_avg"])


def test_grad_scaler_matches_torch_adamw():
    pa, pb = _model_params("cpu"), _model_params("cpu")
    oa = FusedAdamW(_param_groups(pa))
    ob = torch.optim.AdamW(_param_groups(pb), foreach=False)
    sc_a = torch.amp.GradScaler("cpu", init_scale=1024.0)
    sc_b = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for it in range(4):
        for ps, opt, sc in ((pa, oa, sc_a), (pb, ob, sc_b)):
            gen = torch.Generator().manual_seed(it)
            loss = sum(((p.float() * torch.randn(p.shape, generator=gen)).sum() for p in ps))
            if it == 2:
                loss = loss * float("inf")  # this step must be skipped by both
            opt.zero_grad()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a, b, **FP32_TOL)
    assert sc_a.get_scale() == sc_b.get_scale()


def test_constructor_and_group_validation():
    p = [torch.nn.Parameter(torch.zeros(2))]
    for kw, msg in [(dict(lr=-1.0), "Invalid learning rate"), (dict(eps=-1.0), "Invalid epsilon"),
                    (dict(betas=(1.0, 0.9)), "index 0"), (dict(betas=(0.9, -0.1)), "index 1"),
                    (dict(weight_decay=-0.1), "Invalid weight_decay"),
                    (dict(lr=torch.tensor([0.1, 0.2])), "1-element")]:
        with pytest.raises(ValueError, match=msg):
            FusedAdamW(p, **kw)
        with torch.no_grad():  # torch.optim.AdamW raises the same error
            with pytest.raises(ValueError, match=msg):
                torch.optim.AdamW(p, **kw)
    with pytest.raises(ValueError, match="param group 1"):
        FusedAdamW([dict(params=p), dict(params=[torch.nn.Parameter(torch.zeros(1))], lr=-1)])
    opt = FusedAdamW(p)
    with pytest.raises(ValueError, match="Invalid beta"):
        opt.add_param_group(dict(params=[torch.nn.Parameter(torch.zeros(1))], betas=(0.9, 1.5)))
    with pytest.raises(ValueError, match="capturable"):
        FusedAdamW(p, capturable=True)
    with pytest.raises(ValueError, match="differentiable"):
        FusedAdamW(p, differentiable=True)
    assert FusedAdamW(p).defaults == torch.optim.AdamW(p).defaults


def test_fused_path_supported_and_hparams_row():
    A, Ad = torch.optim.AdamW, torch.optim.Adam
    assert fused_path_supported(A, {})
    assert fused_path_supported(FusedAdamW, {"lr": 0.1, "amsgrad": True})
    assert fused_path_supported(Ad, {"weight_decay": 0.0})
    assert fused_path_supported(Ad, {"weight_decay": 0.1, "decoupled_weight_decay": True})
    assert not fused_path_supported(Ad, {"weight_decay": 0.1})
    assert not fused_path_supported(A, {"capturable": True})
    assert not fused_path_supported(A, {"differentiable": True})
    assert not fused_path_supported(A, {"betas": (torch.tensor(0.9), torch.tensor(0.99))})
    assert not fused_path_supported(torch.optim.SGD, {})

    class MyAdamW(A):
        pass

    assert not fused_path_supported(MyAdamW, {})
    assert fused_path_supported(A, {"lr": torch.tensor(0.01)})
    row = hparams_row(A, dict(lr=torch.tensor(0.5), betas=(0.8, 0.9), eps=1e-3,
                              weight_decay=0.2, amsgrad=True, maximize=True))
    assert row == [0.5, 0.8, 0.9, 1e-3, 0.2, 1.0, 1.0]
    assert hparams_row(Ad, dict(lr=1.0, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0))[4] == 0.0
    with pytest.raises(ValueError, match="L2"):
        hparams_row(Ad, dict(lr=1.0, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1))


def test_multigroup_engine_on_torch_adam_state():
    """The ZeRO optimizer's use: the engine stepping a torch optimizer's own groups/state."""
    pa, pb = _model_params("cpu"), _model_params("cpu")
    adam_groups = [dict(params=pa[:4], lr=1e-2), dict(params=pa[4:], lr=1e-3, amsgrad=True)]
    local = torch.optim.Adam(adam_groups)
    engine = AdamWEngine(torch.optim.Adam)
    ref = torch.optim.Adam([dict(params=pb[:4], lr=1e-2), dict(params=pb[4:], lr=1e-3,
                                                                amsgrad=True)], foreach=False)
    for it in range(5):
        for a, b in zip(pa, pb):
            a.grad = torch.full_like(a, 0.3 - 0.1 * it)
            b.grad = a.grad.clone()
        engine.step(local.param_groups, local.state)
        ref.step()
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a, b, **FP32_TOL)
    # the local optimizer can still step itself afterwards, on the packed steps
    for a, b in zip(pa, pb):
        a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    local.step()
    ref.step()
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a, b, **FP32_TOL)


# --------------------------------------------------------------------------- CUDA specifics

@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_steps_on_device_and_many_segments():
    _need_native("cuda")
    sizes = [0, 1, 3, 4, 5, 1023, 1024, 1025, 70000] + [17] * 300
    groups = [i % 4 for i in range(len(sizes))]
    segs = _segments("cuda", torch.float32, torch.float32, sizes, groups, seed=21)
    table = K.group_hparams_table(GROUPS)
    sg = torch.tensor(groups)
    steps = torch.arange(1, len(sizes) + 1, dtype=torch.float32)
    a, b, c = _clone(segs), _clone(segs), _clone(segs)
    _call(K.fused_adamw_, a, steps.cuda(), sg, table)   # steps on the device
    _call(K.fused_adamw_, b, steps, sg, table)          # steps on the CPU
    _call(K.fused_adamw_reference_, c, steps, sg, table)
    _assert_segs_close(a, b, FP32_TOL)  # device pow/sqrt in double may differ in the last ulp
    _assert_segs_close(a, c, FP32_TOL)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_misaligned_views():
    """Views starting at odd offsets take the scalar path of the vector loads."""
    _need_native("cuda")
    table = K.group_hparams_table(GROUPS)
    bufs = _segments("cuda", torch.bfloat16, torch.float32, [5000], [0], seed=22)[0]
    segs = [[t[1:4001] for t in bufs[:4]] + [torch.empty(0, device="cuda")],
            [t[4003:4999] for t in bufs[:4]] + [torch.empty(0, device="cuda")]]
    ref = [[t.clone() for t in s] for s in segs]
    steps, sg = torch.tensor([3.0, 4.0]), torch.tensor([0, 2])
    _call(K.fused_adamw_, segs, steps, sg, table)
    _call(K.fused_adamw_reference_, ref, steps, sg, table)
    _assert_segs_close(segs, ref, LOW_TOL[torch.bfloat16])


# --------------------------------------------------------------------------- step counts replaced

# Every path of the one AdamW engine: FusedAdamW with its compiled plan (CPU; CUDA where a GPU
# is seen) and without one (a complex param: the Python path), ZeroRedundancyOptimizer's
# fused step with param and flat sharding, with offload_optimizer (all of the share, half of
# it), and ZeroRedundancyOptimizer(FusedAdamW) with offload (the local FusedAdamW's engine).
STEP_PATHS = [
    "fused", pytest.param("fused-cuda", marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")),
    "fused-python-path", "zero-param", "zero-flat", "zero-param-offload", "zero-flat-offload",
    "zero-offload-0.5", "zero-FusedAdamW-offload"]
# how the count is replaced: its memory (the dict still holds the same tensor: `.data =`,
# `set_`), a new tensor in the dict, a state dict loaded
STEP_EDITS = ["data", "set_", "dict", "load_state_dict"]
STEP_EDITED = {1: 1.0, 4: 10.0}  # param index -> the count it is given (torch's is then 3)


def _step_edit(how, opt, states, edited):
    """Give each param i of `edited` the step count edited[i]; `states[i]`: its state dict
    (for load_state_dict: its index in the optimizer's state dict)."""
    if how == "load_state_dict":
        sd = copy.deepcopy(opt.state_dict())  # (the state's own dicts are not edited)
        for i, v in edited.items():
            sd["state"][i]["step"] = torch.tensor(v)
        opt.load_state_dict(sd)
        return
    for i, v in edited.items():
        st = states[i]
        if how == "data":
            st["step"].data = torch.tensor(v)
        elif how == "set_":
            st["step"].set_(torch.tensor(v))
        else:
            st["step"] = torch.tensor(v)


@pytest.mark.parametrize("path", STEP_PATHS)
@pytest.mark.parametrize("how", STEP_EDITS)
def test_step_count_replaced_between_steps_is_followed_like_torch(path, how):
    """A script replaces some params' step counts after step 3 (``st["step"].data = t``,
    ``st["step"].set_(t)``, ``st["step"] = t`` or a loaded state dict) and the same in
    torch.optim.AdamW: the bias corrections then follow the new counts, as torch's do. The
    engine keeps every count as a view into one buffer (engine.py, _StepPack): a count cut off
    from it by `.data =` / `set_` is the same tensor in the same dict, so the state dicts'
    identity check does not see it; the compiled plan's storage check and the Python path's
    pack check must. A count left behind moves the params by ~5e-3 here (lr 1e-2); fp32
    atol 1e-6, rtol 1e-5 after each of 5 steps after the edit, and the counts themselves
    equal torch's."""
    device = "cuda" if path == "fused-cuda" else "cpu"
    if path.startswith("zero"):
        _need_native("cpu")
    g = torch.Generator().manual_seed(7)
    shapes = [(33, 7), (4097,), (5,), (16, 3), (129,), (1,)]
    pa = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]
    if path == "fused-python-path":  # (complex: real views taken per step, no compiled plan)
        pa.append(torch.nn.Parameter(torch.randn(6, 2, generator=g, dtype=torch.complex64)))
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]

    def groups(ps):
        return [dict(params=ps[:3], **GROUPS[0]), dict(params=ps[3:], **GROUPS[3])]

    ref = torch.optim.AdamW(groups(pb), foreach=False)
    if path.startswith("fused"):
        opt = FusedAdamW(groups(pa))
        engine = lambda: opt._engine  # noqa: E731
        states = lambda: [opt.state[p] for p in pa]  # noqa: E731
    else:
        from zero_ext import ZeroRedundancyOptimizer

        offload = {"zero-param-offload": True, "zero-flat-offload": True,
                   "zero-offload-0.5": 0.5, "zero-FusedAdamW-offload": True}.get(path, False)
        cls = FusedAdamW if "FusedAdamW" in path else torch.optim.AdamW
        opt = ZeroRedundancyOptimizer(groups(pa), cls, offload_optimizer=offload,
                                      sharding="flat" if "flat" in path else "param")
        engine = lambda: (opt.optim._engine if cls is FusedAdamW  # noqa: E731
                          else opt._fused_step().engine)

        def states():
            key = {lp.param_id: lp.key for lp in opt.plan.local}
            return [opt.optim.state[key[i]] for i in range(len(pa))]
    for it in range(8):
        gen = torch.Generator().manual_seed(300 + it)
        for a, b in zip(pa, pb):
            gr = torch.randn(a.shape, generator=gen, dtype=a.dtype).to(device)
            a.grad, b.grad = gr.clone(), gr.clone()
        opt.step()
        ref.step()
        for i, (a, b) in enumerate(zip(pa, pb)):
            torch.testing.assert_close(a.detach(), b.detach(), **FP32_TOL,
                                       msg=lambda m: f"{path}, {how}: param {i} after step "
                                                     f"{it + 1}: {m}")
        if it == 2:
            _step_edit(how, opt, states(), STEP_EDITED)
            _step_edit(how, ref, [ref.state[p] for p in pb], STEP_EDITED)
    counts = [float(st["step"]) for st in states()]
    assert counts == [float(ref.state[p]["step"]) for p in pb]
    assert counts[1] == STEP_EDITED[1] + 5 and counts[0] == 8
    # the path named served the steps: a compiled plan, or the Python path
    assert engine()._plan.native == (path != "fused-python-path")
