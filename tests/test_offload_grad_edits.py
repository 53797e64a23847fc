"""offload_optimizer with reduce_scatter_hook: grads edited between the hook's early copy
and the step, in ways that move no version counter, are the grads the step uses.

The hook sends each bucket's owned grads to the host as soon as its reduce-scatter is
done. A script may then change the grads in place through ``.data`` (fairseq's
``multiply_grads``: ``p.grad.data.mul_(c)``; a ``.data.zero_()``; a clip applied through
``.data``; ``.data.clamp_``) or through kernels that move no version on the CPU
(GradScaler's ``unscale_``): the host copies are then stale, and the step must notice
(offload.py: the windows' fingerprints). Each scenario runs, on every rank, DDP + torch.optim.AdamW
(the reference) and DDP + reduce_scatter_hook + zero_ext with offload_optimizer, fed the
same per-rank batches and edited alike; after every step the params must agree (float32,
atol = rtol = 1e-6, as tests/test_offload.py) and be bitwise equal on every rank. Before the
fingerprints each edit scenario drifted (data_mul: 3.4e-2 after 5 steps, world 2, flat).
The control without edits checks the other side: the hook's copies are used (no window sent
again: the fingerprint of unchanged grads is exact).
"""
from __future__ import annotations

import pytest
import torch

from _dist import gloo_available, run_specs
from test_offload import _Net  # (the model test_offload compares with DDP + AdamW)

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with gloo")

TOL = dict(atol=1e-6, rtol=1e-6)
HP = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99))
MAX_NORM = 0.05


def _edit(model, opt, edit: str, is_ref: bool, scaler) -> None:
    """The script's change of the grads after backward, the same on both sides."""
    params = [p for p in model.parameters() if p.grad is not None]
    if edit == "data_mul":  # fairseq's multiply_grads
        for p in params:
            p.grad.data.mul_(0.25)
    elif edit == "data_zero_one":
        model.module.mid.weight.grad.data.zero_()
    elif edit == "data_clamp":
        for p in params:
            p.grad.data.clamp_(-2e-3, 2e-3)
    elif edit == "data_clip":  # the true global norm, the clip applied through .data
        if is_ref:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        else:
            norm = opt.clip_grad_norm_(float("inf"))  # (factor 1: nothing clipped)
        coef = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
        for p in params:
            p.grad.data.mul_(coef)
    elif edit == "scaler_unscale":  # GradScaler.unscale_, then the optimizer's own step
        scaler.unscale_(opt)
    elif edit != "none":
        raise ValueError(edit)


def scenario(cfg, ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    rank, pg, edit = ctx.rank, ctx.pg, cfg["edit"]
    kw = dict(process_group=pg, bucket_cap_mb=0.002)
    ref, cand = DDP(_Net(), **kw), DDP(_Net(), **kw)
    o_ref = torch.optim.AdamW(ref.parameters(), **HP)
    opt = ZeroRedundancyOptimizer(list(cand.parameters()), torch.optim.AdamW, process_group=pg,
                                  sharding=cfg["sharding"], offload_optimizer=cfg["offload"],
                                  **HP)
    cand.register_comm_hook(opt, reduce_scatter_hook)
    scaled = edit == "scaler_unscale"
    for it in range(5):
        g = torch.Generator().manual_seed(1000 * it + 10 * rank)
        x = torch.randn(6 + rank, 12, generator=g)
        for model, o, is_ref in ((ref, o_ref, True), (cand, opt, False)):
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaled else None
            loss = model(x).square().mean()
            (scaler.scale(loss) if scaled else loss).backward()
            _edit(model, o, edit, is_ref, scaler)
            o.step()
            if scaled:
                scaler.update()
            o.zero_grad()
        opt.wait_for_params()
        for (name, a), b in zip(ref.module.named_parameters(), cand.module.parameters()):
            torch.testing.assert_close(b.detach(), a.detach(), **TOL,
                                       msg=lambda m, name=name: f"iter {it} {name}: {m}")
    host = opt._offload
    return {"params": [p.detach().clone() for p in cand.module.parameters()],
            "early": host.pulled_early, "sent_again": host.sent_again,
            "host": host.numel}


CASES = {}
for _mode in ("flat", "even", "param"):
    for _frac in (True, 0.5):
        CASES[f"data_mul-{_mode}-{_frac}"] = dict(edit="data_mul", sharding=_mode, offload=_frac)
    CASES[f"none-{_mode}"] = dict(edit="none", sharding=_mode, offload=True)
for _name, _mode, _frac in (("data_zero_one", "flat", True), ("data_zero_one", "even", 0.5),
                            ("data_zero_one", "param", True), ("data_clip", "flat", 0.5),
                            ("data_clip", "even", True), ("data_clip", "param", 0.5),
                            ("scaler_unscale", "flat", True), ("scaler_unscale", "even", 0.5),
                            ("scaler_unscale", "param", True), ("data_clamp", "flat", True)):
    CASES[f"{_name}-{_mode}-{_frac}"] = dict(edit=_name, sharding=_mode, offload=_frac)
_NAMES = sorted(CASES)


@pytest.fixture(scope="module")
def world2():
    return run_specs(2, scenario, [CASES[n] for n in _NAMES], prefix="edits")


@pytest.mark.parametrize("case", _NAMES)
def test_edits_after_the_hooks_copies_reach_the_step(world2, case):
    vals = world2.values(f"edits{_NAMES.index(case)}")
    for r in range(1, len(vals)):
        for a, b in zip(vals[0]["params"], vals[r]["params"]):
            assert torch.equal(a, b), f"rank {r} differs from rank 0"
    assert all(v["host"] > 0 for v in vals), "a rank with no host part"
    if CASES[case]["edit"] == "none":  # the hook's copies were used, none sent again
        assert all(v["early"] > 0 and v["sent_again"] == 0 for v in vals), vals
    else:  # the edit reached host pieces the hook had sent: sent again at the step
        assert any(v["sent_again"] > 0 for v in vals), vals


# --------------------------------------------------------------------------- the fingerprint


def _buffers(dtype, n, stage_bytes=None):
    from zero_ext import offload

    itemsize = torch.empty((), dtype=dtype).element_size()
    n = -(-n * itemsize // 16) * 16 // itemsize  # (aligned, as HostShard.place lays it out)
    b = offload._Buffers(torch.device("cpu"), dtype, itemsize, n, torch.empty(n, dtype=dtype),
                         torch.empty(n, dtype=dtype))
    if stage_bytes is not None:  # (a small staging: a direct window in several chunks)
        b.hook_stage = torch.empty(stage_bytes // itemsize, dtype=dtype)
    return b


def _fp(x, stage_bytes=None):
    """The fingerprint of tensor x as the hook takes it of a direct window."""
    from zero_ext import offload

    b = _buffers(x.dtype, x.numel(), stage_bytes)
    slot = offload._Slot(0, 0, 0, x.numel(), 0, 0, x, x)
    out = torch.zeros(2, dtype=torch.int64)
    offload._fingerprint_window(b, offload._Window(0, [slot], True), [x], out)
    return out.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fingerprint_sees_every_usual_edit(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4099, generator=g) * 1e-3).to(dtype)
    base = _fp(x)
    assert _fp(x.clone()) == base
    edits = {
        "scaled": lambda t: t.mul_(0.25),
        "scaled by 3": lambda t: t.mul_(3.0),
        "zeroed": lambda t: t.zero_(),
        "one element zeroed": lambda t: t[17].zero_(),
        "clamped": lambda t: t.clamp_(-1e-3, 1e-3),
        "added to": lambda t: t.add_(torch.randn(t.shape, generator=g).to(dtype) * 1e-5),
        "one element nudged by an ulp": lambda t: t[4000:4001].copy_(torch.nextafter(
            t[4000:4001], torch.ones(1, dtype=dtype))),
        "overwritten": lambda t: t.copy_(torch.randn(t.shape, generator=g).to(dtype)),
        "negated": lambda t: t.neg_(),
    }
    for name, fn in edits.items():
        y = x.clone()
        fn(y)
        assert not torch.equal(y, x)
        assert _fp(y) != base, name


def test_fingerprint_second_sum_sees_a_balanced_sign_flip():
    """A sign flip moves a float32's bits by +-2^31 in the low half of a 64-bit word, by
    2^63 in the high half: with as many positive as negative elements in the low halves, and
    an even number in the high ones, the words' sum keeps its value modulo 2^64; the
    squares' sum does not."""
    x = torch.tensor([0.5, 3.0, -0.25, -7.0] * 256)
    a, b = _fp(x), _fp(-x)
    assert a[0] == b[0] and a[1] != b[1]


def test_fingerprint_is_exact_whatever_the_chunks_and_threads():
    """Integer sums: the same bytes give the same fingerprint in one piece or in chunks of
    the staging (a direct window bigger than it), read where they lie or through the
    staging (a grad that does not start on 8 bytes), on one thread or several."""
    x = torch.randn((1 << 20) + 5, generator=torch.Generator().manual_seed(1))
    whole = _fp(x)
    assert _fp(x, stage_bytes=4096) == whole
    assert _fp(x, stage_bytes=48) == whole
    shifted = torch.empty(x.numel() + 1)[1:]
    shifted.copy_(x)
    assert shifted.data_ptr() % 8 and _fp(shifted) == whole
    assert _fp(shifted, stage_bytes=4096) == whole
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert _fp(x) == whole
    finally:
        torch.set_num_threads(threads)
