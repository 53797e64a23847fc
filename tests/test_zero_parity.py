"""Numerical parity of zero_ext.ZeroRedundancyOptimizer with a single-process torch.optim
optimizer fed identical gradients, on gloo worlds of 1, 2 and 3 ranks.

Every rank sets the same seeded gradients on its (replicated) params, steps the ZeRO optimizer,
and steps a plain torch optimizer over clones of the same params with the same groups.  The
tests check, per rank, that the params match the plain optimizer and that every rank holds
bitwise-identical params.

Tolerances (fp32): atol=1e-6, rtol=1e-6 after 12-15 steps.  The fused AdamW path may round
differently from torch's for-loop in the last ulp per step (docs/design.md, "AdamW
arithmetic"), so the comparison is not bitwise; anything wrong in the update (a group's lr or
weight_decay not applied, a step count off by one, a missed bias correction) is orders of
magnitude above it.
bf16 params: atol=2e-2, rtol=1.6e-2 after 10 steps of lr 1e-2 (each step moves a param by about
lr, i.e. several bf16 ulps at |p|~0.5; torch's reference rounds every intermediate to bf16).
"""
from __future__ import annotations

import pytest
import torch

from _dist import (AGAINST_TORCH, WORLD_SIZES, Scenarios, assert_params_close,
                   assert_same_on_every_rank, clones, detached, fake_grads, gloo_available,
                   make_params, make_zero)

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with gloo")

SC = Scenarios(__name__)
AdamW, Adam, SGD = torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD

ATOL, RTOL = 1e-6, 1e-6
BF16_ATOL, BF16_RTOL = 2e-2, 1.6e-2
STEPS = 15

# Matrices, vectors and odd sizes, so that ranks own different mixes at every world size.
SHAPES = [(16, 8), (16,), (8, 16), (8,), (33,), (4, 4, 3), (1,), (64,), (7, 5), (2,)]
W_IDX, B_IDX, E_IDX = (0, 2, 5, 8), (1, 3, 6, 9), (4, 7)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def world(request):
    return SC.run(request.param)


def three_groups(ps, gen=False, w_extra=None, b_extra=None, e_extra=None):
    """decay / no-decay / defaults: the usual AdamW recipe, with a different lr per group."""
    def pick(idx):
        sel = [ps[i] for i in idx]
        return (p for p in sel) if gen else sel

    groups = [{"params": pick(W_IDX), "lr": 1e-2, "weight_decay": 0.1},
              {"params": pick(B_IDX), "lr": 3e-3, "weight_decay": 0.0},
              {"params": pick(E_IDX)}]
    for g, extra in zip(groups, (w_extra, b_extra, e_extra)):
        g.update(extra or {})
    return groups


ADAMW_DEFAULTS = dict(lr=2e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


def _parity(ctx, cls, defaults, *, groups=three_groups, gen=False, steps=STEPS, skip=None,
            zero_kwargs=None, shapes=SHAPES, dtypes=None, sched=None, hook=None):
    """Train ZeRO and a plain ``cls`` side by side; return both sets of params."""
    pz = make_params(shapes, seed=11, dtypes=dtypes)
    pr = clones(pz)
    opt = make_zero(groups(pz, gen=gen), cls, ctx.pg, **(zero_kwargs or {}), **defaults)
    ref = cls(groups(pr), **defaults)
    scheds = (sched(opt), sched(ref)) if sched else None
    lrs = []
    for s in range(steps):
        if hook is not None:
            hook(s, opt, ref)
        fake_grads(pz, s, skip=skip)
        fake_grads(pr, s, skip=skip)
        opt.step()
        ref.step()
        if scheds:
            scheds[0].step()
            scheds[1].step()
        lrs.append([g["lr"] for g in opt.param_groups])
    return {"zero": detached(pz), "ref": detached(pr), "lrs": lrs,
            "ref_lrs": [g["lr"] for g in ref.param_groups],
            "ref_betas": [g.get("betas") for g in ref.param_groups],
            "zero_betas": [g.get("betas") for g in opt.param_groups]}


def _check(vals, atol=ATOL, rtol=RTOL):
    for r, v in enumerate(vals):
        assert_params_close(v["zero"], v["ref"], atol, rtol, what=f"rank {r} param")
    assert_same_on_every_rank([v["zero"] for v in vals])


# --------------------------------------------------------------------------------------------
# AdamW with dict groups (different lr and weight_decay per group)


@SC.scenario()
def adamw_dict_groups(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS)


@SC.scenario()
def adamw_dict_groups_sharding_param(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, zero_kwargs={"sharding": "param"})


@SC.scenario()
def adamw_bucket_view(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, zero_kwargs={"parameters_as_bucket_view": True})


@SC.scenario()
def adamw_bucket_view_sharding_param(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS,
                   zero_kwargs={"parameters_as_bucket_view": True, "sharding": "param"})


@SC.scenario()
def adamw_dict_groups_sharding_flat(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, zero_kwargs={"sharding": "flat"})


@SC.scenario()
def adamw_bucket_view_sharding_flat(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS,
                   zero_kwargs={"parameters_as_bucket_view": True, "sharding": "flat"})


@SC.scenario()
def adamw_grads_none_sharding_flat(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, skip=_sparse, zero_kwargs={"sharding": "flat"})


@SC.scenario()
def adamw_generators_in_groups(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, gen=True)


@SC.scenario()
def adamw_plain_tensor_list(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, groups=lambda ps, gen=False: list(ps))


@SC.scenario()
def adamw_amsgrad_maximize_per_group(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS,
                   groups=lambda ps, gen=False: three_groups(
                       ps, gen, w_extra={"amsgrad": True}, b_extra={"maximize": True},
                       e_extra={"betas": (0.8, 0.9), "eps": 1e-6}))


@SC.scenario()
def adamw_fused_kwarg(ctx):
    # a drop-in must accept torch's own AdamW flags; compared with torch's fused AdamW
    return _parity(ctx, AdamW, dict(ADAMW_DEFAULTS, fused=True))


def _sparse(i, s):
    return (i + s) % 3 == 0  # grad None for this param on this step


@SC.scenario()
def adamw_grads_none_on_some_steps(ctx):
    # torch skips params whose grad is None (their step count does not advance)
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, skip=_sparse)


@SC.scenario()
def adamw_grads_none_bucket_view(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, skip=_sparse,
                   zero_kwargs={"parameters_as_bucket_view": True})


def _frozen_groups(ps, gen=False):
    ps[4].requires_grad_(False)  # frozen inside a group: never gets a grad, never moves
    return three_groups(ps, gen)


@SC.scenario()
def adamw_frozen_param(ctx):
    out = _parity(ctx, AdamW, ADAMW_DEFAULTS, groups=_frozen_groups,
                  zero_kwargs={"parameters_as_bucket_view": True})
    out["frozen_init"] = make_params(SHAPES, seed=11)[4].detach()
    return out


@pytest.mark.parametrize("name", [
    "adamw_dict_groups", "adamw_dict_groups_sharding_param", "adamw_bucket_view",
    "adamw_bucket_view_sharding_param", "adamw_dict_groups_sharding_flat",
    "adamw_bucket_view_sharding_flat", "adamw_grads_none_sharding_flat",
    "adamw_generators_in_groups", "adamw_plain_tensor_list",
    "adamw_amsgrad_maximize_per_group", "adamw_fused_kwarg", "adamw_grads_none_on_some_steps",
    "adamw_grads_none_bucket_view", "adamw_frozen_param"])
def test_adamw_parity(world, name):
    if AGAINST_TORCH and "sharding" in name:
        pytest.skip("torch has no sharding argument")
    vals = world.values(name)
    _check(vals)
    if name == "adamw_frozen_param":
        for v in vals:
            assert torch.equal(v["zero"][4], v["frozen_init"]), "a frozen param moved"


# --------------------------------------------------------------------------------------------
# LR schedulers and manual changes of param_groups act on the next step


@SC.scenario()
def adamw_steplr(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS,
                   sched=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5))


@SC.scenario()
def adamw_onecycle_changes_betas(ctx):
    # OneCycleLR also cycles betas[0]: every key of ZeRO's groups must reach .optim
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, steps=12,
                   sched=lambda o: torch.optim.lr_scheduler.OneCycleLR(
                       o, max_lr=[2e-2, 5e-3, 4e-3], total_steps=12, pct_start=0.3,
                       base_momentum=0.8, max_momentum=0.95))


def _manual_change(s, opt, ref):
    if s == 5:
        for o in (opt, ref):
            o.param_groups[0]["lr"] = 0.0
            o.param_groups[1]["weight_decay"] = 0.2
            o.param_groups[2]["betas"] = (0.5, 0.9)
    if s == 10:
        for o in (opt, ref):
            o.param_groups[0]["lr"] = 4e-3


@SC.scenario()
def adamw_manual_param_group_changes(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, hook=_manual_change)


@SC.scenario()
def adamw_lr_zero_freezes_group(ctx):
    pz = make_params(SHAPES, seed=11)
    opt = make_zero(three_groups(pz), AdamW, ctx.pg, **ADAMW_DEFAULTS)
    for s in range(3):
        fake_grads(pz, s)
        opt.step()
    opt.param_groups[0]["lr"] = 0.0
    before = detached(pz)
    for s in range(3, 6):
        fake_grads(pz, s)
        opt.step()
    return {"before": before, "after": detached(pz),
            "local_lr0": opt.optim.param_groups[0]["lr"]}


@pytest.mark.parametrize("name", ["adamw_steplr", "adamw_onecycle_changes_betas",
                                  "adamw_manual_param_group_changes"])
def test_schedulers_and_param_group_changes(world, name):
    vals = world.values(name)
    _check(vals)
    for v in vals:
        # (that .optim received them is what the parity above proves)
        assert v["lrs"][-1] == v["ref_lrs"], "ZeRO's param_groups lr differs from torch's"
        assert v["zero_betas"] == v["ref_betas"], "ZeRO's param_groups betas differ from torch's"
    if name == "adamw_steplr":
        assert [round(x, 12) for x in vals[0]["lrs"][-1]] == [1.25e-3, 3.75e-4, 2.5e-4]


def test_lr_zero_leaves_group_unchanged(world):
    for r, v in enumerate(world.values("adamw_lr_zero_freezes_group")):
        assert v["local_lr0"] == 0.0
        for i in range(len(SHAPES)):
            moved = not torch.equal(v["before"][i], v["after"][i])
            assert moved == (i not in W_IDX), (
                f"rank {r} param {i}: {'moved' if moved else 'did not move'} with group lr "
                f"{0.0 if i in W_IDX else 'nonzero'}")


# --------------------------------------------------------------------------------------------
# other optimizers through the generic path


@SC.scenario()
def sgd_momentum_groups(ctx):
    return _parity(ctx, SGD, dict(lr=0.03, momentum=0.9),
                   groups=lambda ps, gen=False: three_groups(
                       ps, gen, w_extra={"lr": 0.05, "nesterov": True, "weight_decay": 0.01},
                       b_extra={"lr": 0.02, "momentum": 0.5, "dampening": 0.1}))


@SC.scenario()
def adam_groups(ctx):
    return _parity(ctx, Adam, dict(lr=3e-3, betas=(0.8, 0.95)),
                   groups=lambda ps, gen=False: three_groups(
                       ps, gen, w_extra={"amsgrad": True}, b_extra={"weight_decay": 0.01}))


class SignDescent(torch.optim.Optimizer):
    """A user-defined optimizer with per-param state: must take the generic path."""

    def __init__(self, params, lr=0.01, decay=0.0):
        super().__init__(params, {"lr": lr, "decay": decay})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["n"] = st.get("n", 0) + 1
                p.mul_(1 - g["decay"]).add_(p.grad.sign(), alpha=-g["lr"] / st["n"])


@SC.scenario()
def custom_optimizer_groups(ctx):
    return _parity(ctx, SignDescent, dict(lr=0.05),
                   groups=lambda ps, gen=False: three_groups(
                       ps, gen, w_extra={"lr": 0.02, "decay": 0.01},
                       b_extra={"lr": 0.01, "name": "biases"}))  # extra keys are legal


def _sgd_flat_groups(ps, gen=False):
    return three_groups(ps, gen, w_extra={"lr": 0.05, "weight_decay": 0.01},
                        b_extra={"lr": 0.02, "momentum": 0.5})


@SC.scenario()
def sgd_momentum_sharding_flat(ctx):
    return _parity(ctx, SGD, dict(lr=0.03, momentum=0.9), groups=_sgd_flat_groups,
                   zero_kwargs={"sharding": "flat"})


@SC.scenario()
def adam_sharding_flat(ctx):
    return _parity(ctx, Adam, dict(lr=3e-3, betas=(0.8, 0.95)),
                   groups=lambda ps, gen=False: three_groups(ps, gen, w_extra={"amsgrad": True}),
                   zero_kwargs={"sharding": "flat", "parameters_as_bucket_view": True})


@pytest.mark.parametrize("name", ["sgd_momentum_groups", "adam_groups",
                                  "custom_optimizer_groups", "sgd_momentum_sharding_flat",
                                  "adam_sharding_flat"])
def test_generic_optimizer_parity(world, name):
    if AGAINST_TORCH and "sharding" in name:
        pytest.skip("torch has no sharding argument")
    _check(world.values(name))


# --------------------------------------------------------------------------------------------
# step(closure, **kwargs)


@SC.scenario()
def step_with_closure(ctx):
    pz = make_params(SHAPES, seed=11)
    pr = clones(pz)
    opt = make_zero(three_groups(pz), AdamW, ctx.pg, **ADAMW_DEFAULTS)
    ref = AdamW(three_groups(pr), **ADAMW_DEFAULTS)
    calls = [0]

    def closure_for(params, o, count):
        def closure():
            if count:
                calls[0] += 1
            o.zero_grad()
            loss = sum((p.float() ** 2).sum() * (i + 1) for i, p in enumerate(params))
            loss.backward()
            return loss
        return closure

    losses = []
    for _ in range(5):
        lz = opt.step(closure_for(pz, opt, True))
        lr_ = ref.step(closure_for(pr, ref, False))
        losses.append((float(lz), float(lr_)))
    return {"zero": detached(pz), "ref": detached(pr), "calls": calls[0], "losses": losses}


def test_step_with_closure(world):
    vals = world.values("step_with_closure")
    _check(vals)
    for r, v in enumerate(vals):
        assert v["calls"] == 5, f"rank {r}: closure called {v['calls']} times in 5 steps"
        for lz, lr_ in v["losses"]:
            assert lz == pytest.approx(lr_, rel=1e-6), "step must return the closure's loss"


class KwargSGD(torch.optim.SGD):
    """step() without a closure parameter and with an extra keyword."""

    seen: list = []

    def step(self, *, scale=1.0):  # noqa: D401 - mimics optimizers with custom step kwargs
        KwargSGD.seen.append(scale)
        with torch.no_grad():
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-g["lr"] * scale)
        return scale


@SC.scenario()
def step_kwargs_forwarded(ctx):
    KwargSGD.seen.clear()
    pz = make_params(SHAPES, seed=11)
    pr = clones(pz)
    opt = make_zero(three_groups(pz), KwargSGD, ctx.pg, lr=0.05)
    ref = KwargSGD(three_groups(pr), lr=0.05)
    for s, scale in enumerate((1.0, 0.5, 2.0)):
        fake_grads(pz, s)
        fake_grads(pr, s)
        if scale == 1.0:
            opt.step()  # a None closure must not be passed on
            ref.step()
        else:
            opt.step(scale=scale)
            ref.step(scale=scale)
    return {"zero": detached(pz), "ref": detached(pr), "seen": list(KwargSGD.seen)}


class ScaledAdamW(torch.optim.AdamW):
    """A subclass of AdamW with its own step: must not be replaced by a fused AdamW path."""

    def step(self, closure=None, *, scale=1.0):
        for g in self.param_groups:
            g["lr"] *= scale
        loss = super().step(closure)
        for g in self.param_groups:
            g["lr"] /= scale
        return loss


@SC.scenario()
def adamw_subclass_custom_step(ctx):
    pz = make_params(SHAPES, seed=11)
    pr = clones(pz)
    opt = make_zero(three_groups(pz), ScaledAdamW, ctx.pg, **ADAMW_DEFAULTS)
    ref = ScaledAdamW(three_groups(pr), **ADAMW_DEFAULTS)
    for s in range(8):
        fake_grads(pz, s)
        fake_grads(pr, s)
        opt.step(scale=0.5 if s % 2 else 3.0)
        ref.step(scale=0.5 if s % 2 else 3.0)
    return {"zero": detached(pz), "ref": detached(pr)}


@pytest.mark.parametrize("name", ["step_kwargs_forwarded", "adamw_subclass_custom_step"])
def test_step_kwargs_forwarded_and_none_closure_omitted(world, name):
    vals = world.values(name)
    _check(vals)
    if name == "step_kwargs_forwarded":
        for v in vals:  # ZeRO's local step and the reference's interleave
            assert v["seen"] == [1.0, 1.0, 0.5, 0.5, 2.0, 2.0], v["seen"]


# --------------------------------------------------------------------------------------------
# add_param_group mid-training


def _add_group_run(ctx, zero_kwargs):
    pz = make_params(SHAPES, seed=11)
    pr = clones(pz)
    first = [0, 1, 2, 3, 4, 5]
    later = [6, 7, 8, 9]
    opt = make_zero([{"params": [pz[i] for i in first], "lr": 1e-2}], AdamW, ctx.pg,
                    **zero_kwargs, **ADAMW_DEFAULTS)
    ref = AdamW([{"params": [pr[i] for i in first], "lr": 1e-2}], **ADAMW_DEFAULTS)
    for s in range(5):
        fake_grads(pz, s, skip=lambda i, _: i in later)
        fake_grads(pr, s, skip=lambda i, _: i in later)
        opt.step()
        ref.step()
    new_z = {"params": [pz[i] for i in later], "lr": 5e-3, "weight_decay": 0.0}
    new_r = {"params": [pr[i] for i in later], "lr": 5e-3, "weight_decay": 0.0}
    opt.add_param_group(new_z)
    ref.add_param_group(new_r)
    for s in range(5, 12):
        fake_grads(pz, s)
        fake_grads(pr, s)
        opt.step()
        ref.step()
    return {"zero": detached(pz), "ref": detached(pr), "n_groups": len(opt.param_groups),
            "n_local_groups": len(opt.optim.param_groups),
            "local_numel": getattr(opt, "local_numel", None),
            "group1_lr": opt.param_groups[1]["lr"], "group1_wd": opt.param_groups[1]["weight_decay"],
            "group1_betas": opt.param_groups[1]["betas"]}


@SC.scenario()
def add_param_group_mid_training(ctx):
    return _add_group_run(ctx, {})


@SC.scenario()
def add_param_group_bucket_view(ctx):
    return _add_group_run(ctx, {"parameters_as_bucket_view": True})


@SC.scenario()
def add_param_group_sharding_flat(ctx):
    return _add_group_run(ctx, {"sharding": "flat", "parameters_as_bucket_view": True})


@pytest.mark.parametrize("name", ["add_param_group_mid_training", "add_param_group_bucket_view",
                                  "add_param_group_sharding_flat"])
def test_add_param_group_mid_training(world, name):
    if AGAINST_TORCH and "sharding" in name:
        pytest.skip("torch has no sharding argument")
    vals = world.values(name)
    _check(vals)
    total = sum(torch.Size(s).numel() for s in SHAPES)
    for r, v in enumerate(vals):
        assert v["n_groups"] == 2 and v["n_local_groups"] == 2, f"rank {r}: {v}"
        assert (v["group1_lr"], v["group1_wd"]) == (5e-3, 0.0)
        assert v["group1_betas"] == ADAMW_DEFAULTS["betas"], "defaults must fill the new group"
    if not AGAINST_TORCH:
        assert sum(v["local_numel"] for v in vals) == total


# --------------------------------------------------------------------------------------------
# mixed fp32 + bf16 params, in separate groups or in one group


MIXED_SHAPES = [(16, 8), (16,), (8, 16), (8,), (33,), (4, 4, 3)]
MIXED_DTYPES = [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16, torch.float32,
                torch.bfloat16]


def _mixed_separate(ps, gen=False):
    f32 = [p for p in ps if p.dtype == torch.float32]
    b16 = [p for p in ps if p.dtype == torch.bfloat16]
    return [{"params": f32, "lr": 5e-3}, {"params": b16, "lr": 1e-2, "weight_decay": 0.0}]


def _mixed_one_group(ps, gen=False):
    return [{"params": list(ps), "lr": 1e-2}]


def _mixed(ctx, groups, zero_kwargs=None):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, groups=groups, shapes=MIXED_SHAPES,
                   dtypes=MIXED_DTYPES, steps=10, zero_kwargs=zero_kwargs)


@SC.scenario()
def mixed_fp32_bf16_separate_groups(ctx):
    return _mixed(ctx, _mixed_separate)


@SC.scenario()
def mixed_fp32_bf16_one_group(ctx):
    return _mixed(ctx, _mixed_one_group)


@SC.scenario()
def mixed_fp32_bf16_bucket_view(ctx):
    return _mixed(ctx, _mixed_separate, {"parameters_as_bucket_view": True})


@SC.scenario()
def mixed_fp32_bf16_sharding_flat(ctx):
    return _mixed(ctx, _mixed_one_group, {"sharding": "flat"})


@pytest.mark.parametrize("name", ["mixed_fp32_bf16_separate_groups", "mixed_fp32_bf16_one_group",
                                  "mixed_fp32_bf16_bucket_view", "mixed_fp32_bf16_sharding_flat"])
def test_mixed_fp32_bf16(world, name):
    vals = world.values(name)
    f32 = [i for i, d in enumerate(MIXED_DTYPES) if d == torch.float32]
    b16 = [i for i, d in enumerate(MIXED_DTYPES) if d == torch.bfloat16]
    for r, v in enumerate(vals):
        assert [t.dtype for t in v["zero"]] == MIXED_DTYPES, f"rank {r}: a param changed dtype"
        assert_params_close([v["zero"][i] for i in f32], [v["ref"][i] for i in f32],
                            ATOL, RTOL, what=f"rank {r} fp32 param")
        assert_params_close([v["zero"][i] for i in b16], [v["ref"][i] for i in b16],
                            BF16_ATOL, BF16_RTOL, what=f"rank {r} bf16 param")
    assert_same_on_every_rank([v["zero"] for v in vals])
    # the bf16 params really trained (10 steps of ~lr 1e-2 each): not a vacuous tolerance
    init = make_params(MIXED_SHAPES, seed=11, dtypes=MIXED_DTYPES)
    for i in b16:
        moved = (vals[0]["zero"][i].float() - init[i].detach().float()).abs().max().item()
        assert moved > 0.04, f"bf16 param {i} moved only {moved}"


# --------------------------------------------------------------------------------------------
# last: the default process group (process_group=None)


@SC.scenario(default_group=True)
def adamw_default_process_group(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, zero_kwargs={"parameters_as_bucket_view": True})


def test_default_process_group(world):
    _check(world.values("adamw_default_process_group"))
