"""Hyperparameters a script changes between steps, through FusedAdamW and through
ZeroRedundancyOptimizer's fused step, against torch.optim.AdamW given the same changes.

A script may set any key of a param group between two steps (a scheduler for lr or betas,
a weight-decay ramp, a warm-up of eps, a phase that maximizes, amsgrad switched off and on
again, a group flag such as ``differentiable``). The fused step keeps its kernel call as a
compiled plan from step to step (csrc/fused_adamw_plan.cpp) and must read every group's
hyperparameters afresh at each step: here each key is changed on its own, then all of them at
once with different values per group, on three groups of params of uneven sizes, and the
params must equal torch's after every step. Each case also checks that a plan built before a
change served the step after it (else a plan that keeps stale values would go unseen).

Cases: lr (floats, then tensors), betas (both), eps, weight_decay (0.1 -> 0.8 over the run),
maximize (on, then off), amsgrad (a group that started with it: off, then on again: torch
keeps its max_exp_avg_sq meanwhile), differentiable (a group flag torch accepts between
steps; ZeRO then steps that group through torch's own AdamW), and all together.
``capturable`` set between steps is refused by torch.optim.AdamW itself on CPU params (and on
CUDA params whose step counts live on the CPU): there are no values to compare, and the
tests at the end of the file compare the refusal instead (with ``decoupled_weight_decay``
turned off, which the fused step cannot honour).

Tolerances: fp32 atol 1e-6, rtol 1e-5 after every one of 8 steps on the CPU (the kernel and
torch's for-loop differ in the last ulp; docs/design.md, "AdamW arithmetic"); a stale eps,
weight decay or maximize moves params by 1e-4 to 1e-2 here. The CUDA variants
(tests/test_zero_cuda.py) use atol/rtol 1e-5, as that file does.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from _dist import clones, detached, fake_grads, gloo_available, make_params, run_specs
from zero_ext import FusedAdamW
from zero_ext.kernels import adamw as K
from zero_ext.kernels import native_available

CPU_TOL = dict(atol=1e-6, rtol=1e-5)
CUDA_TOL = dict(atol=1e-5, rtol=1e-5)
STEPS = 8
# uneven sizes: flat sharding splits some params between ranks (segments that are runs of a
# larger grad), and a 4097-element param takes the kernel's vector path and its tail
SHAPES = [(33, 7), (4097,), (5,), (16, 3), (129,), (1,)]
GROUPS = [dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
          dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0, amsgrad=True),
          dict(lr=5e-3, betas=(0.5, 0.9), eps=1e-8, weight_decay=0.5)]
CASES = ["lr", "lr-tensor", "betas", "eps", "weight_decay", "maximize", "amsgrad",
         "differentiable", "all"]
# where the fused plan is not expected to serve the steps after a change: an amsgrad flip
# changes which state tensors the kernel reads (a new plan), and ZeRO hands a differentiable
# group to torch's own AdamW
NO_REUSE = {"amsgrad": ("fused", "zero"), "differentiable": ("zero",)}


def groups_of(params):
    return [dict(GROUPS[0], params=params[0:2]), dict(GROUPS[1], params=params[2:4]),
            dict(GROUPS[2], params=params[4:6])]


def change(case: str, groups: list, it: int) -> None:
    """What the script does to `groups` after step `it` (the same to both optimizers)."""
    for gi, g in enumerate(groups):
        if case in ("lr", "all"):
            g["lr"] = float(g["lr"]) * (0.7 if (it + gi) % 2 else 1.3)
        if case == "lr-tensor":  # (a scheduler on a tensor lr)
            g["lr"] = torch.tensor(float(g["lr"]) * (0.7 if (it + gi) % 2 else 1.3))
        if case in ("betas", "all"):
            b1, b2 = g["betas"]
            g["betas"] = (b1 - 0.04 * (gi + 1), b2 - 0.01 * (gi + 1) * (it % 2))
        if case in ("eps", "all") and it in (2, 5):
            g["eps"] = (1e-1, 1e-3, 3e-2)[gi] if it == 2 else 1e-8
        if case in ("weight_decay", "all"):  # a ramp from 0.1 to 0.8 (every group)
            g["weight_decay"] = 0.1 + 0.7 * (it + 1) / (STEPS - 1) + 0.05 * gi
        if case in ("maximize", "all") and it in (2, 5):  # on after step 2, off after 5
            g["maximize"] = it == 2 and not (case == "all" and gi == 1)
        if case in ("amsgrad", "all") and it in (2, 5) and gi == 1:
            g["amsgrad"] = it == 5  # (torch has no max_exp_avg_sq for a group without it)
        if case == "differentiable" and it == 2 and gi == 0:
            g["differentiable"] = True


def change_steps(case: str) -> list:
    """The steps after which `change` changes something in `case`."""
    if case in ("eps", "maximize", "amsgrad"):
        return [2, 5]
    if case == "differentiable":
        return [2]
    return list(range(STEPS - 1))


class PlanRuns:
    """Which compiled plans ran at each step (FusedAdamWPlan.run wrapped, in this process)."""

    def __init__(self):
        self.by_step: list = []

    @contextlib.contextmanager
    def watching(self):
        real = K.FusedAdamWPlan.run
        runs = self

        def run(plan, *args, **kwargs):
            runs.by_step[-1].append(plan)
            return real(plan, *args, **kwargs)

        K.FusedAdamWPlan.run = run
        try:
            yield self
        finally:
            K.FusedAdamWPlan.run = real

    def reused_after(self, steps) -> list:
        """The change steps after which the next step ran a plan that had run before."""
        return [c for c in steps if c + 1 < len(self.by_step) and any(
            any(p is q for q in self.by_step[c]) for p in self.by_step[c + 1])]


def _grads(params, it, device):
    cpu = [torch.empty(p.shape, requires_grad=True) for p in params]
    fake_grads(cpu, it, seed=44)
    for p, c in zip(params, cpu):
        p.grad = c.grad.to(device)


def train_with_changes(case: str, device: str, tol: dict, sharding=None, pg=None) -> dict:
    """8 steps of the candidate (FusedAdamW when `sharding` is None, else
    ZeroRedundancyOptimizer(AdamW, sharding=...) on `pg`) and of torch.optim.AdamW (for-loop)
    on clones, `change` applied to both between steps. Raises AssertionError at the first
    step whose params differ beyond `tol`; returns the largest difference seen and which
    change steps a kept plan served."""
    params = [p.detach().to(device).requires_grad_() for p in make_params(SHAPES, seed=4)]
    ref = clones(params)
    if sharding is None:
        opt = FusedAdamW(groups_of(params))
    else:
        from zero_ext import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(groups_of(params), torch.optim.AdamW, process_group=pg,
                                      sharding=sharding)
    ropt = torch.optim.AdamW(groups_of(ref), foreach=False)
    worst = 0.0
    runs = PlanRuns()
    with runs.watching():
        for it in range(STEPS):
            _grads(params, it, device)
            _grads(ref, it, device)
            runs.by_step.append([])
            opt.step()
            ropt.step()
            for k, (a, b) in enumerate(zip(params, ref)):
                worst = max(worst, float((a.detach() - b.detach()).abs().max()))
                torch.testing.assert_close(
                    a.detach(), b.detach(), **tol,
                    msg=lambda m, k=k, it=it: f"{case}: param {k} after step {it}: {m}")
            change(case, opt.param_groups, it)
            change(case, ropt.param_groups, it)
    return {"worst": worst, "reused": runs.reused_after(change_steps(case))}


def check_reuse(case, res, who):
    if who in NO_REUSE.get(case, ()):
        return
    # the test means something only where a plan built before a change ran after it
    assert res["reused"], f"{case}: no plan built before a change served the next step"


def need_plan(device: str) -> None:
    if not native_available("fused_adamw_", device) or K._plan_class(torch.device(device)) is None:
        pytest.skip(f"no compiled fused AdamW plan on {device}")


# ------------------------------------------------------------------ FusedAdamW

@pytest.mark.parametrize("case", CASES)
def test_fused_adamw_follows_group_changes_between_steps(case):
    need_plan("cpu")
    res = train_with_changes(case, "cpu", CPU_TOL)
    check_reuse(case, res, "fused")


# ------------------------------------------------------------------ ZeRO's fused step

def zero_case(spec, ctx):
    """One rank's run of (case, sharding, device) under ZeroRedundancyOptimizer."""
    case, sharding, device = spec
    if device == "cuda":
        torch.cuda.set_device(0)
    tol = CUDA_TOL if device == "cuda" else CPU_TOL
    return train_with_changes(case, device, tol, sharding=sharding, pg=ctx.pg)


ZERO_SPECS = [(case, sharding) for sharding in ("param", "flat") for case in CASES]


@pytest.fixture(scope="module")
def zero_world():
    if not gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    need_plan("cpu")
    return run_specs(2, zero_case, [(c, s, "cpu") for c, s in ZERO_SPECS])


@pytest.mark.parametrize("case,sharding", ZERO_SPECS, ids=[f"{s}-{c}" for c, s in ZERO_SPECS])
def test_zero_fused_step_follows_group_changes_between_steps(zero_world, case, sharding):
    values = zero_world.values(f"spec{ZERO_SPECS.index((case, sharding))}")
    for res in values:  # (each rank compared its params with torch's after every step)
        check_reuse(case, res, "zero")


# ------------------------------------------------------------------ keys the fused step cannot honour
# A group key set between steps that the fused step cannot honour is refused as torch refuses
# it where torch does (same exception type), else as FusedAdamW refuses it at construction or
# in add_param_group; the message names the key and the group, and nothing is stepped: params
# and every state entry (step counts too) unchanged, no state made for params stepping for the
# first time. (torch.optim.AdamW steps group after group, so when the refused group is not the
# first it has stepped the ones before it: it is compared with on its exception only, and the
# run that goes on after the key is set back is compared with a torch run that never took the
# refused step.)

def _state_of(opt, params) -> list:
    return [{k: v.detach().clone() if isinstance(v, torch.Tensor) else v
             for k, v in opt.state[p].items()} if p in opt.state else None for p in params]


def _assert_nothing_stepped(opt, params, before_params, before_state, what):
    for k, (p, b) in enumerate(zip(params, before_params)):
        assert torch.equal(p.detach(), b), f"{what}: param {k} changed"
    after = _state_of(opt, params)
    for k, (a, b) in enumerate(zip(after, before_state)):
        if b is None:  # (a param that has never stepped: still no state)
            assert not a, f"{what}: state made for param {k}: {sorted(a)}"
            continue
        assert a is not None and sorted(a) == sorted(b), f"{what}: param {k}'s state entries"
        for name in b:
            assert torch.equal(torch.as_tensor(a[name]), torch.as_tensor(b[name])), \
                f"{what}: param {k}'s state {name!r} changed"


def _refused_run(key: str, value, gi: int, torch_raises: bool):
    """Two steps of FusedAdamW and of torch.optim.AdamW (plus a group of fresh params added
    after the first), then `key` = `value` on group `gi` of both: FusedAdamW's third step must
    raise with nothing stepped. Returns (FusedAdamW's exception, torch's or None, and a
    function that sets the key back and checks that the run goes on equal to torch's)."""
    ours = [p.detach().requires_grad_() for p in make_params(SHAPES + [(6,), (3, 3)], seed=4)]
    theirs, theirs_refused = clones(ours), clones(ours)
    opt = FusedAdamW(groups_of(ours[:6]))
    ref = torch.optim.AdamW(groups_of(theirs[:6]), foreach=False)
    ref_refused = torch.optim.AdamW(groups_of(theirs_refused[:6]), foreach=False)
    for it in range(2):
        for ps in (ours, theirs, theirs_refused):
            _grads(ps[:6], it, "cpu")
        for o in (opt, ref, ref_refused):
            o.step()
    for o, ps in ((opt, ours), (ref, theirs), (ref_refused, theirs_refused)):
        o.add_param_group(dict(lr=2e-3, params=ps[6:]))  # state made at their first step
    for o in (opt, ref_refused):  # (ref: the torch run that never takes the refused step)
        o.param_groups[gi][key] = value
    for ps in (ours, theirs, theirs_refused):
        _grads(ps, 2, "cpu")
    want = None
    if torch_raises:
        with pytest.raises(Exception) as caught:
            ref_refused.step()
        want = caught.value
    else:
        ref_refused.step()  # (torch honours it: no error to compare with)
    before_params, before_state = detached(ours), _state_of(opt, ours)
    with pytest.raises(Exception) as caught:
        opt.step()
    got = caught.value
    _assert_nothing_stepped(opt, ours, before_params, before_state, f"{key} on group {gi}")

    def goes_on(default):
        opt.param_groups[gi][key] = default
        for it in range(2, 5):  # (step 2's grads again first: the refused step's)
            if it > 2:
                _grads(ours, it, "cpu")
                _grads(theirs, it, "cpu")
            opt.step()
            ref.step()
            for k, (a, b) in enumerate(zip(ours, theirs)):
                torch.testing.assert_close(a.detach(), b.detach(), **CPU_TOL,
                                           msg=lambda m, k=k, it=it: f"param {k}, step {it}: {m}")

    return got, want, goes_on


@pytest.mark.parametrize("gi", [0, 2])
def test_capturable_set_between_steps_raises_as_torch_does(gi):
    """capturable=True set on a CPU group between steps: torch.optim.AdamW raises an
    AssertionError (its params and step counts must be on a capturable device); FusedAdamW
    raises the same type, names the key and the group, and steps nothing. A capturable group
    whose params have no grad this step is not stepped, so neither raises; set back, the run
    goes on equal to torch's."""
    got, want, goes_on = _refused_run("capturable", True, gi, torch_raises=True)
    assert isinstance(want, AssertionError), want  # (torch's own behaviour, as documented)
    assert type(got) is type(want), f"FusedAdamW raised {type(got).__name__}: {got}"
    assert "capturable" in str(got) and f"param group {gi}" in str(got), str(got)
    goes_on(False)


def test_capturable_group_without_grads_steps_as_torch_does():
    """torch checks capturable on the params it steps only: a capturable group whose params
    have no grad does not stop the step of the others, in torch and in FusedAdamW alike."""
    ours = [p.detach().requires_grad_() for p in make_params(SHAPES, seed=4)]
    theirs = clones(ours)
    opt = FusedAdamW(groups_of(ours))
    ref = torch.optim.AdamW(groups_of(theirs), foreach=False)
    for it in range(4):
        for ps in (ours, theirs):
            _grads(ps, it, "cpu")
            if it >= 2:
                ps[2].grad = ps[3].grad = None  # group 1's params
        for o in (opt, ref):
            o.param_groups[1]["capturable"] = it >= 2
            o.step()
        for k, (a, b) in enumerate(zip(ours, theirs)):
            torch.testing.assert_close(a.detach(), b.detach(), **CPU_TOL)


@pytest.mark.parametrize("gi", [0, 2])
def test_decoupled_weight_decay_off_between_steps_is_refused(gi):
    """decoupled_weight_decay=False set between steps: torch (>= 2.7, where AdamW keeps the
    key) honours it with L2 weight decay; the fused step is decoupled only, so FusedAdamW
    refuses it as its add_param_group does (ValueError naming the key), nothing stepped,
    instead of stepping decoupled weight decay silently. Set back, the run goes on equal to
    torch's."""
    if "decoupled_weight_decay" not in torch.optim.AdamW([torch.zeros(1)]).defaults:
        pytest.skip("this torch's AdamW has no decoupled_weight_decay key")
    got, _, goes_on = _refused_run("decoupled_weight_decay", False, gi, torch_raises=False)
    with pytest.raises(Exception) as at_add:
        FusedAdamW([torch.zeros(1, requires_grad=True)]).add_param_group(
            dict(params=[torch.zeros(1, requires_grad=True)], decoupled_weight_decay=False))
    assert type(got) is type(at_add.value) is ValueError, f"{type(got).__name__}: {got}"
    assert "decoupled_weight_decay" in str(got) and f"param group {gi}" in str(got), str(got)
    goes_on(True)


def test_differentiable_group_added_steps_as_torch_does():
    """differentiable=True in a group added with add_param_group: torch.optim.AdamW accepts it
    and steps that group as the others (its step runs under no_grad unless the optimizer was
    built differentiable), as FusedAdamW steps a group given the flag between steps (the
    "differentiable" case above); FusedAdamW accepts it there too. capturable=True stays
    refused there, naming the key."""
    ours = [p.detach().requires_grad_() for p in make_params(SHAPES, seed=4)]
    theirs = clones(ours)
    opt = FusedAdamW(groups_of(ours)[:2])
    ref = torch.optim.AdamW(groups_of(theirs)[:2], foreach=False)
    opt.add_param_group(dict(GROUPS[2], params=ours[4:], differentiable=True))
    ref.add_param_group(dict(GROUPS[2], params=theirs[4:], differentiable=True))
    for it in range(3):
        for ps in (ours, theirs):
            _grads(ps, it, "cpu")
        opt.step()
        ref.step()
        for k, (a, b) in enumerate(zip(ours, theirs)):
            torch.testing.assert_close(a.detach(), b.detach(), **CPU_TOL)
    with pytest.raises(ValueError, match="capturable=True"):
        opt.add_param_group(dict(params=[torch.zeros(2, requires_grad=True)], capturable=True))


# ------------------------------------------------------------- the same refusals under ZeRO
# Under ZeroRedundancyOptimizer a refused key must stop every rank before any rank steps: a
# rank stepping its share of the groups before the refused one (torch's order), or a rank
# owning no param of that group stepping all of its share, would leave the replicas apart
# (each rank's params are then a mix of stepped and unstepped shares, and the exchange that
# would have made them whole never ran).

def zero_refusal_case(spec, ctx):
    """Two steps, then `key` = `value` on group `gi`: the third step must raise on every rank
    (torch's exception type where torch raises) with nothing stepped anywhere, params and
    this rank's state alike; the key set back, the run goes on equal to torch's run that
    never took the refused step. "no-grads": the group's params have no grad from the third
    step on, so nothing is refused, as in torch."""
    from zero_ext import ZeroRedundancyOptimizer

    cls_name, sharding, key, value, gi, no_grads = spec
    cls = FusedAdamW if cls_name == "FusedAdamW" else torch.optim.AdamW
    ours = [p.detach().requires_grad_() for p in make_params(SHAPES, seed=4)]
    theirs = clones(ours)
    opt = ZeroRedundancyOptimizer(groups_of(ours), cls, process_group=ctx.pg, sharding=sharding)
    ref = torch.optim.AdamW(groups_of(theirs), foreach=False)
    members = set(range(2 * gi, 2 * gi + 2))

    def grads(it):
        for ps in (ours, theirs):
            _grads(ps, it, "cpu")
            if no_grads and it >= 2:
                for k in members:
                    ps[k].grad = None

    def compare(it):
        for k, (a, b) in enumerate(zip(ours, theirs)):
            torch.testing.assert_close(a.detach(), b.detach(), **CPU_TOL,
                                       msg=lambda m, k=k: f"param {k}, step {it}: {m}")

    for it in range(2):
        grads(it)
        opt.step()
        ref.step()
    opt.param_groups[gi][key] = value
    grads(2)
    raised = None
    if no_grads:
        ref.param_groups[gi][key] = value
        opt.step()
        ref.step()
        compare(2)
    else:
        local = [lp.key for lp in opt.plan.local]
        before_params, before_state = detached(ours), _state_of(opt.optim, local)
        before_local = detached(local)
        with pytest.raises(Exception) as caught:
            opt.step()
        raised = (type(caught.value).__name__, str(caught.value))
        _assert_nothing_stepped(opt.optim, local, before_local, before_state,
                                f"{key} on group {gi}, rank {ctx.rank}")
        for k, (p, b) in enumerate(zip(ours, before_params)):
            assert torch.equal(p.detach(), b), f"rank {ctx.rank}: param {k} changed"
        opt.param_groups[gi][key] = not value
        opt.step()  # (step 2's grads again: the refused step's)
        ref.step()
        compare(2)
    for it in range(3, 5):
        grads(it)
        opt.step()
        ref.step()
        compare(it)
    return raised


ZERO_REFUSALS = [
    ("AdamW", "param", "capturable", True, 1, False),
    ("AdamW", "flat", "capturable", True, 2, False),
    ("AdamW", "even", "capturable", True, 0, False),
    ("FusedAdamW", "param", "capturable", True, 1, False),
    ("FusedAdamW", "flat", "decoupled_weight_decay", False, 2, False),
    ("AdamW", "param", "capturable", True, 1, True),
]


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def zero_refusal_world(request):
    if not gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    return run_specs(request.param, zero_refusal_case, ZERO_REFUSALS, prefix="refusal")


@pytest.mark.parametrize("spec", ZERO_REFUSALS, ids=["-".join(map(str, s[:5])) + (
    "-no-grads" if s[5] else "") for s in ZERO_REFUSALS])
def test_zero_refuses_a_group_key_on_every_rank_before_any_rank_steps(zero_refusal_world, spec):
    cls_name, _, key, value, gi, no_grads = spec
    if key == "decoupled_weight_decay" and \
            "decoupled_weight_decay" not in torch.optim.AdamW([torch.zeros(1)]).defaults:
        pytest.skip("this torch's AdamW has no decoupled_weight_decay key")
    raised = zero_refusal_world.values(f"refusal{ZERO_REFUSALS.index(spec)}")
    if no_grads:
        assert raised == [None] * len(raised)
        return
    want = "AssertionError" if key == "capturable" else "ValueError"
    for rank, (kind, text) in enumerate(raised):
        assert kind == want, f"rank {rank} raised {kind}: {text}"
        assert key in text and f"param group {gi}" in text, f"rank {rank}: {text}"
