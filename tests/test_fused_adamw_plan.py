"""The fused AdamW step plan (zero_ext.kernels.adamw.make_plan, csrc/fused_adamw_plan.cpp):
one kernel call kept in the compiled library from step to step, and the AdamW engine's use
of it (zero_ext/engine.py).

What is checked, on the CPU (the same plan code serves CUDA; only the launch differs):
- a plan's steps equal the op's, bit for bit, and the reference's within the fp32 tolerance
  of test_fused_adamw.py, with new grad tensors at every step, an lr and betas changed
  every step, steps that differ within a group, and grads taken from runs of a larger
  source's grad (as the ZeRO optimizer's flat segments are);
- ready() says False for every change that would make the kept pointers wrong, and a run
  without a successful ready() raises;
- make_plan declines what the kernels do not take as it is (the op path stages it or
  runs the reference) and what the op would reject;
- FusedAdamW against torch.optim.AdamW when params, grads and state change between steps
  (a param's storage, a state tensor or dict replaced, grads dropped and back): the engine
  rebuilds its plan, and keeps using one when nothing changed.
"""
from __future__ import annotations

import copy

import pytest
import torch

from zero_ext import FusedAdamW
from zero_ext.kernels import adamw as K
from zero_ext.kernels import native_available

CUDA = torch.cuda.is_available()
DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda",
                        marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU"))]
FP32_TOL = dict(atol=1e-6, rtol=1e-5)
GROUPS = [dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
          dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0, amsgrad=True,
               maximize=True),
          dict(lr=1e-3, betas=(0.3, 0.9), eps=1e-8, weight_decay=0.5)]


def _need_plan(device):
    if not native_available("fused_adamw_", device) or K._plan_class(torch.device(device)) is None:
        pytest.skip(f"no compiled fused AdamW plan on {device}")


class _Lists:
    """Segments over sources: sources[0] is a flat 'model' param whose grad feeds segments
    0-2 by runs (as ZeRO's flat segments), sources 1-3 are whole params of segments 3-5."""

    SIZES = (5, 40, 3, 4097, 16, 33)

    def __init__(self, device, seed=0, ams_group=1):
        g = torch.Generator().manual_seed(seed)
        flat_n = sum(self.SIZES[:3]) + 7
        self.sources = [torch.nn.Parameter(torch.randn(flat_n, generator=g).to(device))]
        self.sources += [torch.nn.Parameter(torch.randn(n, generator=g).to(device))
                         for n in self.SIZES[3:]]
        offs = [0, 5, 45]  # runs of the flat source (element 48.. unused)
        base = self.sources[0].detach()
        self.params = [base[o:o + n] for o, n in zip(offs, self.SIZES[:3])]
        self.params += self.sources[1:]  # whole params: the params themselves (as the engine)
        self.seg_source = [0, 0, 0, 1, 2, 3]
        self.seg_off = offs + [0, 0, 0]
        self.groups = torch.tensor([0, 1, 2, 1, 0, 2])
        self.exp_avgs = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sqs = [torch.zeros_like(p) for p in self.params]
        self.maxs = [torch.zeros_like(p) if int(gi) == ams_group else
                     torch.empty(0, device=device) for p, gi in zip(self.params, self.groups)]
        self.device = device

    def new_grads(self, seed):
        g = torch.Generator().manual_seed(seed)
        for s in self.sources:
            s.grad = torch.randn(s.shape, generator=g).to(self.device)

    def seg_grads(self):
        return [self.sources[j].grad.view(-1)[o:o + p.numel()]
                for j, o, p in zip(self.seg_source, self.seg_off, self.params)]

    def plan(self, table, no_grad=()):
        return K.make_plan(self.params, self.exp_avgs, self.exp_avg_sqs, self.maxs, [],
                           self.sources, self.seg_source, self.seg_off, list(no_grad),
                           self.groups, table)

    def state(self):
        return [t.clone() for ts in (self.params, self.exp_avgs, self.exp_avg_sqs, self.maxs)
                for t in ts]


def _table(step):
    rows = []
    for i, g in enumerate(GROUPS):  # hyperparameters that change every step
        row = dict(g, lr=g["lr"] * (1 + 0.1 * step), betas=(g["betas"][0] - 0.01 * step,
                                                             g["betas"][1]))
        rows.append(row)
    return K.group_hparams_table(rows)


@pytest.mark.parametrize("device", DEVICES)
def test_plan_steps_equal_the_op_and_the_reference(device):
    _need_plan(device)
    a, b, r = _Lists(device), _Lists(device), _Lists(device)
    a.new_grads(0)
    plan = a.plan(_table(0))
    assert plan is not None and plan.num_segments == 6
    steps = torch.zeros(6)
    for it in range(6):
        for x in (a, b, r):
            x.new_grads(100 + it)  # new grad tensors: new pointers every step
        steps += 1
        if it == 3:
            steps[4] -= 1  # segment 4 skipped a step: its group's steps differ now
        table = _table(it)
        assert plan.ready()
        plan.run(steps.to(device), table)
        K.fused_adamw_(b.params, b.seg_grads(), b.exp_avgs, b.exp_avg_sqs, b.maxs,
                       steps.to(device), b.groups, table)
        K.fused_adamw_reference_(r.params, r.seg_grads(), r.exp_avgs, r.exp_avg_sqs, r.maxs,
                                 steps.to(device), r.groups, table)
    for x, y, z in zip(a.state(), b.state(), r.state()):
        assert torch.equal(x, y)  # the same kernel on the same values
        torch.testing.assert_close(x, z, **FP32_TOL)
    # the flat source's element that no segment covers is untouched
    assert torch.equal(a.sources[0].detach()[48:], b.sources[0].detach()[48:])


def _change(x: _Lists, what: str):
    """One change between steps; returns True when the plan may still run (ready)."""
    if what == "new grads":
        x.new_grads(7)
        return True
    if what == "param storage replaced":
        x.sources[1].data = x.sources[1].data.clone()
    elif what == "param resized":
        x.sources[2].data = torch.zeros(x.sources[2].numel() + 1, device=x.device)
    elif what == "grad dropped":
        x.sources[3].grad = None
    elif what == "grad non-contiguous":
        x.sources[3].grad = torch.zeros(2 * x.sources[3].numel(), device=x.device)[::2]
    elif what == "grad of another dtype":
        if not hasattr(x.sources[1], "grad_dtype"):
            pytest.skip("this torch refuses a grad of another dtype than its param's "
                        "(no Tensor.grad_dtype): the change cannot happen")
        x.sources[1].grad_dtype = None  # (torch >= 2.10 refuses it otherwise)
        x.sources[1].grad = x.sources[1].grad.double()
    elif what == "grad misaligned":  # the kernel's vector accesses were chosen at build
        x.sources[1].grad = torch.zeros(x.sources[1].numel() + 1, device=x.device)[1:]
    elif what == "grad sparse":
        x.sources[2].grad = torch.zeros_like(x.sources[2]).to_sparse()
    elif what == "exp_avg storage replaced":
        x.exp_avgs[4].data = x.exp_avgs[4].data.clone()
    elif what == "max_exp_avg_sq storage replaced":
        x.maxs[1].data = x.maxs[1].data.clone()
    elif what == "a no-grad source got a grad":
        x.extra.grad = torch.zeros_like(x.extra)
    else:
        raise ValueError(what)
    return False


CHANGES = ["new grads", "param storage replaced", "param resized", "grad dropped",
           "grad non-contiguous", "grad of another dtype", "grad misaligned", "grad sparse",
           "exp_avg storage replaced", "max_exp_avg_sq storage replaced",
           "a no-grad source got a grad"]


@pytest.mark.parametrize("what", CHANGES)
def test_plan_ready_sees_every_change(what):
    _need_plan("cpu")
    x = _Lists("cpu")
    x.new_grads(0)
    x.extra = torch.nn.Parameter(torch.zeros(3))  # a param without a grad, watched
    plan = x.plan(_table(0), no_grad=[x.extra])
    assert plan is not None
    plan.run(torch.ones(6), _table(0))  # (make_plan's own ready())
    expected = _change(x, what)
    assert plan.ready() is expected
    if not expected:
        with pytest.raises(RuntimeError, match="ready\\(\\) must return True"):
            plan.run(torch.full((6,), 2.0), _table(1))


def test_plan_run_needs_a_ready_before_each_run():
    _need_plan("cpu")
    x = _Lists("cpu")
    x.new_grads(0)
    plan = x.plan(_table(0))
    plan.run(torch.ones(6), _table(0))
    with pytest.raises(RuntimeError, match="ready\\(\\) must return True"):
        plan.run(torch.full((6,), 2.0), _table(0))
    assert plan.ready()
    with pytest.raises(RuntimeError, match="amsgrad of group 1 changed"):
        plan.run(torch.full((6,), 2.0), K.group_hparams_table(
            [GROUPS[0], dict(GROUPS[1], amsgrad=False), GROUPS[2]]))


@pytest.mark.parametrize("case", ["non-contiguous param", "float64", "group out of range",
                                  "missing grad", "offsets length"])
def test_make_plan_declines_what_the_op_path_must_serve(case):
    _need_plan("cpu")
    x = _Lists("cpu")
    x.new_grads(0)
    table = _table(0)
    if case == "non-contiguous param":
        x.params[3] = x.sources[1].detach().view(1, -1).t()[::2, 0]
    elif case == "float64":
        x.params[5] = x.params[5].double()
    elif case == "group out of range":
        x.groups = torch.tensor([0, 1, 2, 1, 0, 3])
    elif case == "missing grad":
        x.sources[2].grad = None
    elif case == "offsets length":
        x.seg_off = x.seg_off[:-1]
    assert x.plan(table) is None


# ------------------------------------------------------------------ the engine's use of it

def _pair(device):
    g = torch.Generator().manual_seed(3)
    shapes = [(3, 4), (4097,), (1,), (5, 7), (16,), (33,)]
    pa = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]

    def groups(ps):
        return [dict(params=ps[0:2], **GROUPS[0]), dict(params=ps[2:4], **GROUPS[1]),
                dict(params=ps[4:], **GROUPS[2])]

    return pa, pb, FusedAdamW(groups(pa)), torch.optim.AdamW(groups(pb), foreach=False)


def _between_steps(opt, ps, what, it):
    """The same change made to FusedAdamW's and torch's side at step `it`."""
    if what in ("lr scheduled", "grads dropped and back") or it != 3:
        for g in opt.param_groups:
            g["lr"] = g["lr"] * 0.9
        return
    st = opt.state[ps[1]]
    if what == "param storage replaced":
        ps[1].data = ps[1].data.clone()
    elif what == "state tensor replaced":
        st["exp_avg"] = st["exp_avg"] * 0.5
    elif what == "state storage replaced":
        st["exp_avg_sq"].data = st["exp_avg_sq"].data * 0.25
    elif what == "step replaced":
        st["step"] = torch.tensor(float(st["step"]) + 5.0)
    elif what == "state dict reset":
        opt.state[ps[1]] = {}
    elif what == "max_exp_avg_sq replaced":
        s3 = opt.state[ps[3]]
        s3["max_exp_avg_sq"] = s3["max_exp_avg_sq"] * 0.5
    else:
        raise ValueError(what)


ENGINE_CHANGES = ["lr scheduled", "param storage replaced", "state tensor replaced",
                  "state storage replaced", "step replaced", "state dict reset",
                  "max_exp_avg_sq replaced", "grads dropped and back"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("what", ENGINE_CHANGES)
def test_fused_adamw_with_its_plan_follows_changes_between_steps(device, what, monkeypatch):
    _need_plan(device)
    runs = []
    real_run = K.FusedAdamWPlan.run
    monkeypatch.setattr(K.FusedAdamWPlan, "run",
                        lambda self, *a, **k: (runs.append(1), real_run(self, *a, **k))[1])
    pa, pb, oa, ob = _pair(device)
    for it in range(7):
        gen = torch.Generator().manual_seed(50 + it)
        for i, (a, b) in enumerate(zip(pa, pb)):
            if what == "grads dropped and back" and i == 2 and it in (2, 3):
                a.grad = b.grad = None  # set_to_none for one param, then a grad again
                continue
            g = torch.randn(a.shape, generator=gen).to(device)
            a.grad, b.grad = g.clone(), g.clone()  # new grad tensors every step
        oa.step()
        ob.step()
        for a, b in zip(pa, pb):
            torch.testing.assert_close(a, b, **FP32_TOL, msg=lambda m: f"step {it}: {m}")
        _between_steps(oa, pa, what, it)
        _between_steps(ob, pb, what, it)
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    for k in sb:
        for name in sb[k]:
            torch.testing.assert_close(sa[k][name].cpu(), sb[k][name].cpu(), **FP32_TOL)
    assert oa._engine._plan.native and len(runs) >= 5  # the plan served the quiet steps


def test_engine_with_plans_deep_copies_and_pickles():
    _need_plan("cpu")
    pa, pb, oa, ob = _pair("cpu")
    for p in pa:
        p.grad = torch.ones_like(p)
    oa.step()
    assert oa._engine._plan.native
    engine = copy.deepcopy(oa._engine)  # the plan is not copied: rebuilt at the next step
    assert engine._plan is None
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.deepcopy(oa._engine._plan.chunks[0][0].native)
