"""Where two features meet: a pending clip and a layout change, state tensors replaced by the
user, unusual norm types, GradScaler on a rank without grads.

Each scenario runs the ZeRO optimizer next to a plain single-process torch optimizer fed the
same grads (clipped with torch.nn.utils.clip_grad_norm_ over the params the optimizer held
at the time of the clip), on gloo worlds of 1-3 ranks, and compares the params after every
step (fp32: atol = rtol = 1e-6) and across ranks (bitwise).
"""
from __future__ import annotations

import math

import pytest
import torch

from _dist import (WORLD_SIZES, Scenarios, assert_params_close, assert_same_on_every_rank,
                   assert_raised, detached, gloo_available, make_params)

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with gloo")

SC = Scenarios(__name__)
AdamW, SGD = torch.optim.AdamW, torch.optim.SGD
SHAPES = [(16, 8), (16,), (8, 16), (8,), (33,), (4, 4, 3), (1,), (64,), (7, 5), (2,)]
TOL = dict(atol=1e-6, rtol=1e-6)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def world(request):
    return SC.run(request.param)


def _zero(params, cls, pg, **kw):
    from zero_ext import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer(params, cls, process_group=pg, **kw)


def _grads(params, step, seed=0, only=None):
    """Seeded grads (the same on every rank) for the params that require grad."""
    for i, p in enumerate(params):
        if not p.requires_grad or (only is not None and i not in only):
            continue
        g = torch.Generator().manual_seed(seed * 7919 + step * 1009 + i)
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _twins(seed):
    pz = make_params(SHAPES, seed=seed)
    pr = [p.detach().clone().requires_grad_() for p in pz]
    return pz, pr


def _copy_grads(pr, pz):
    for r, z in zip(pr, pz):
        r.grad = None if z.grad is None else z.grad.clone()


def _out(pz, pr, **extra):
    return {"zero": detached(pz), "ref": detached(pr), **extra}


def _check(vals):
    for r, v in enumerate(vals):
        assert_params_close(v["zero"], v["ref"], what=f"rank {r} param", **TOL)
    assert_same_on_every_rank([v["zero"] for v in vals])


MODES = {"param_bv": dict(sharding="param", parameters_as_bucket_view=True),
         "param": dict(sharding="param"),
         "flat": dict(sharding="flat"),
         "flat_bv": dict(sharding="flat", parameters_as_bucket_view=True)}
CLASSES = {"sgd": (SGD, dict(lr=0.05, momentum=0.9)),
           "adamw": (AdamW, dict(lr=1e-2, weight_decay=0.1))}


def _register(name, fn, *args):
    """A scenario named `name` running fn(ctx, *args), at module level (the workers find
    it by name)."""
    def scenario(ctx):
        return fn(ctx, *args)
    scenario.__name__ = scenario.__qualname__ = name
    globals()[name] = SC.scenario()(scenario)


# ------------------------------------------------------------------ a clip, then a new layout

def _unfreeze_between_clip_and_step(ctx, cls_name, mode, stale):
    """Fine-tuning: the backbone (every other param) is frozen; clip, then unfreeze it, then
    step. With bucket views in "param" mode the unfreeze rebuilds the buckets in the step, so
    this rank's list of owned grads changes order between the clip and the step."""
    cls, hp = CLASSES[cls_name]
    pz, pr = _twins(seed=21)
    backbone = list(range(0, len(SHAPES), 2))
    for ps in (pz, pr):
        for i in backbone:
            ps[i].requires_grad_(False)
    opt = _zero(pz, cls, ctx.pg, **MODES[mode], **hp)
    ref = cls(pr, **hp)
    for s in range(4):
        opt.zero_grad()
        ref.zero_grad()
        _grads(pz, s)
        if stale and s == 1:  # frozen params holding grads from before they were frozen
            for i in backbone:
                pz[i].grad = torch.full_like(pz[i], 0.5)
        _copy_grads(pr, pz)
        norm = float(opt.clip_grad_norm_(0.5))
        ref_norm = float(torch.nn.utils.clip_grad_norm_(pr, 0.5))
        assert math.isclose(norm, ref_norm, rel_tol=1e-6), (norm, ref_norm)
        if s == 1:  # the "unfreeze the backbone" moment, between the clip and the step
            for ps in (pz, pr):
                for i in backbone:
                    ps[i].requires_grad_(True)
        opt.step()
        ref.step()
    return _out(pz, pr)


for _cls in CLASSES:
    for _mode in MODES:
        for _stale in (False, True):
            _register(f"unfreeze_after_clip_{_cls}_{_mode}" + ("_stale" if _stale else ""),
                      _unfreeze_between_clip_and_step, _cls, _mode, _stale)


@pytest.mark.parametrize("stale", [False, True], ids=["no_grad", "stale_grad"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("cls_name", list(CLASSES))
def test_unfreezing_between_clip_and_step_keeps_the_clip(world, cls_name, mode, stale):
    name = f"unfreeze_after_clip_{cls_name}_{mode}" + ("_stale" if stale else "")
    _check(world.values(name))


def _clipped_twins(ctx, cls, ref_cls, mode, hp, seed):
    """Twin params, a ZeRO optimizer of `cls` and a torch `ref_cls` over them, grads clipped
    by each (zero_ext's pending clip; torch's in place)."""
    pz, pr = _twins(seed=seed)
    opt, ref = _zero(pz, cls, ctx.pg, **MODES[mode], **hp), ref_cls(pr, **hp)
    _grads(pz, 0, seed=5)  # (norm ~20: the clip scales)
    _copy_grads(pr, pz)
    opt.clip_grad_norm_(0.5)
    torch.nn.utils.clip_grad_norm_(pr, 0.5)
    return pz, pr, opt, ref


def _rebuilt_over_clipped_grads(ctx, cls_name, mode, frozen):
    """A training phase that ends with a clipped step and rebuilds the optimizer (new
    hyperparameters) without zeroing the grads: the new one steps those grads clipped, as
    a torch optimizer finds them after torch's clip. With `frozen`, one param is frozen
    and keeps its stale clipped grad for the new optimizer; the others get new grads."""
    from zero_ext import FusedAdamW

    cls, hp = CLASSES[cls_name]
    pz, pr, opt, ref = _clipped_twins(ctx, cls, cls, mode, hp, seed=31)
    opt.step()
    ref.step()
    if frozen:
        for ps in (pz, pr):
            ps[0].requires_grad_(False)
        stale = pr[0].grad  # (the reference's: clipped in place by torch)
        _grads(pz, 1, seed=5)  # new grads for the trainable params
        _copy_grads(pr, pz)
        pr[0].grad = stale
    hp2 = dict(hp, lr=hp["lr"] * 0.5)
    opt, ref = _zero(pz, cls, ctx.pg, **MODES[mode], **hp2), cls(pr, **hp2)
    opt.step()
    ref.step()
    single = None
    if ctx.world_size == 1 and cls_name == "adamw":  # FusedAdamW rebuilt the same way
        pf = [p.detach().clone().requires_grad_() for p in pr]
        q = [p.detach().clone().requires_grad_() for p in pr]
        for a, b in ((pf, FusedAdamW), (q, AdamW)):
            _grads(a, 0, seed=5)
            o = b(a, **hp)
            if b is FusedAdamW:
                o.clip_grad_norm_(0.5)
            else:
                torch.nn.utils.clip_grad_norm_(a, 0.5)
            o.step()
            b(a, **hp2).step()
        single = (detached(pf), detached(q))
    return _out(pz, pr, single=single)


for _cls in CLASSES:
    for _mode in ("param", "flat"):
        for _frozen in (False, True):
            _register(f"rebuilt_over_clipped_{_cls}_{_mode}" + ("_frozen" if _frozen else ""),
                      _rebuilt_over_clipped_grads, _cls, _mode, _frozen)


@pytest.mark.parametrize("frozen", [False, True], ids=["all_stale", "frozen_stale"])
@pytest.mark.parametrize("mode", ["param", "flat"])
@pytest.mark.parametrize("cls_name", list(CLASSES))
def test_optimizer_rebuilt_over_clipped_grads_steps_them_clipped(world, cls_name, mode,
                                                                 frozen):
    vals = world.values(f"rebuilt_over_clipped_{cls_name}_{mode}"
                        + ("_frozen" if frozen else ""))
    _check(vals)
    for v in vals:
        if v["single"] is not None:
            assert_params_close(v["single"][0], v["single"][1], what="FusedAdamW", **TOL)


def _fused_local_over_stale_clipped_grads(ctx, mode):
    """FusedAdamW as the local optimizer, grads clipped once and never zeroed: three steps
    over the same grads, then an optimizer rebuilt over them. Each step applies the clip
    once (the local optimizer is handed the factor; it must not find it on the grads too)."""
    from zero_ext import FusedAdamW

    hp = dict(lr=1e-2, weight_decay=0.1)
    pz, pr, opt, ref = _clipped_twins(ctx, FusedAdamW, AdamW, mode, hp, seed=51)
    for _ in range(3):
        opt.step()
        ref.step()
    hp2 = dict(hp, lr=5e-3)
    opt, ref = _zero(pz, FusedAdamW, ctx.pg, **MODES[mode], **hp2), AdamW(pr, **hp2)
    for _ in range(2):
        opt.step()
        ref.step()
    return _out(pz, pr)


for _mode in MODES:
    _register(f"fused_local_stale_clipped_{_mode}", _fused_local_over_stale_clipped_grads,
              _mode)


@pytest.mark.parametrize("mode", list(MODES))
def test_fused_local_optimizer_applies_a_carried_clip_once(world, mode):
    _check(world.values(f"fused_local_stale_clipped_{mode}"))


def _unfrozen_then_group_added(ctx, mode):
    """Fine-tuning in phases: a param frozen for a step (param mode with bucket views then
    keeps it out of the views), unfrozen, then a new param group added before the next
    step: the unfrozen param's update must reach every rank."""
    pz, pr = _twins(seed=41)
    first, later = list(range(0, len(SHAPES) - 2)), [len(SHAPES) - 2, len(SHAPES) - 1]
    opt = _zero([pz[i] for i in first], AdamW, ctx.pg, **MODES[mode], lr=1e-2)
    ref = AdamW([pr[i] for i in first], lr=1e-2)
    for ps in (pz, pr):
        ps[0].requires_grad_(False)
    _grads(pz, 0, only=first)
    _copy_grads(pr, pz)
    opt.step()
    ref.step()
    for ps in (pz, pr):
        ps[0].requires_grad_(True)
    opt.add_param_group({"params": [pz[i] for i in later], "weight_decay": 0.0})
    ref.add_param_group({"params": [pr[i] for i in later], "weight_decay": 0.0})
    for s in (1, 2):
        _grads(pz, s)
        _copy_grads(pr, pz)
        opt.step()
        ref.step()
    return _out(pz, pr)


for _mode in MODES:
    _register(f"unfrozen_then_group_added_{_mode}", _unfrozen_then_group_added, _mode)


@pytest.mark.parametrize("mode", list(MODES))
def test_param_unfrozen_then_group_added_is_exchanged(world, mode):
    _check(world.values(f"unfrozen_then_group_added_{mode}"))


def _add_group_between_clip_and_step(ctx, cls_name, mode, first_step):
    """clip over the params the optimizer has, add_param_group (params that hold grads of
    their own, never clipped), step: the clip applies to exactly the clipped grads. With
    `first_step` the group is added before any state exists (a fresh partition of all
    params); else after a step (the new params are placed on top)."""
    cls, hp = CLASSES[cls_name]
    pz, pr = _twins(seed=22)
    head = list(range(7))  # then a group of params 7 and 8, later one of param 9
    opt = _zero([pz[i] for i in head], cls, ctx.pg, **MODES[mode], **hp)
    ref = cls([pr[i] for i in head], **hp)
    s = 0
    if not first_step:
        _grads(pz, s, only=head)
        _copy_grads(pr, pz)
        opt.step()
        ref.step()
        s += 1
    _grads(pz, s)  # every param has a grad, also those not in the optimizer yet
    _copy_grads(pr, pz)
    norm = float(opt.clip_grad_norm_(0.5))
    ref_norm = float(torch.nn.utils.clip_grad_norm_([pr[i] for i in head], 0.5))
    assert math.isclose(norm, ref_norm, rel_tol=1e-6), (norm, ref_norm)
    opt.add_param_group({"params": pz[7:9], "lr": hp["lr"] / 2})
    ref.add_param_group({"params": pr[7:9], "lr": hp["lr"] / 2})
    opt.step()
    ref.step()
    # a second clip covering every group, with a pending one over the earlier groups only:
    # torch's norm is of (clipped old grads, unclipped new ones)
    _grads(pz, s + 1)
    _copy_grads(pr, pz)
    opt.clip_grad_norm_(0.8)
    torch.nn.utils.clip_grad_norm_(pr[:9], 0.8)
    opt.add_param_group({"params": pz[9:], "lr": 1e-3})
    ref.add_param_group({"params": pr[9:], "lr": 1e-3})
    norm = float(opt.clip_grad_norm_(0.3))
    ref_norm = float(torch.nn.utils.clip_grad_norm_(pr, 0.3))
    assert math.isclose(norm, ref_norm, rel_tol=1e-6), (norm, ref_norm)
    opt.step()
    ref.step()
    return _out(pz, pr)


for _cls in CLASSES:
    for _mode in ("param", "param_bv", "flat"):
        for _first in (False, True):
            _register(f"add_group_after_clip_{_cls}_{_mode}" + ("_first" if _first else ""),
                      _add_group_between_clip_and_step, _cls, _mode, _first)


@pytest.mark.parametrize("first", [False, True], ids=["after_a_step", "before_any_state"])
@pytest.mark.parametrize("mode", ["param", "param_bv", "flat"])
@pytest.mark.parametrize("cls_name", list(CLASSES))
def test_add_param_group_between_clip_and_step(world, cls_name, mode, first):
    name = f"add_group_after_clip_{cls_name}_{mode}" + ("_first" if first else "")
    _check(world.values(name))


@SC.scenario()
def clip_then_accumulate_then_clip(ctx):
    """A clip that scaled the grads, a backward accumulating into them, a second clip: torch
    would take the norm of (clipped old part + new part), which cannot be rebuilt: every rank
    raises. A clip that did not scale (max_norm above the norm: logging the norm) leaves
    nothing pending, so the same sequence is fine."""
    pz, pr = _twins(seed=23)
    opt = _zero(pz, SGD, ctx.pg, sharding="flat", lr=0.05)
    ref = SGD(pr, lr=0.05)
    _grads(pz, 0)
    _copy_grads(pr, pz)
    opt.clip_grad_norm_(1e9)  # no clip: logs the norm
    torch.nn.utils.clip_grad_norm_(pr, 1e9)
    for i, p in enumerate(pz):  # a second backward accumulates into both
        g = torch.Generator().manual_seed(100 + i)
        extra = torch.randn(p.shape, generator=g)
        p.grad.add_(extra)
        pr[i].grad.add_(extra)
    norm = float(opt.clip_grad_norm_(0.4))
    ref_norm = float(torch.nn.utils.clip_grad_norm_(pr, 0.4))
    opt.step()
    ref.step()
    opt.zero_grad()
    _grads(pz, 2)
    opt.clip_grad_norm_(0.01)
    for p in pz:
        p.grad.add_(p.grad)
    try:
        opt.clip_grad_norm_(0.5)
        raised = None
    except RuntimeError as exc:
        raised = str(exc)
    return _out(pz, pr, norms=(norm, ref_norm), raised=raised)


def test_a_second_clip_after_accumulating_into_clipped_grads_raises(world):
    vals = world.values("clip_then_accumulate_then_clip")
    _check(vals)
    for v in vals:
        assert math.isclose(*v["norms"], rel_tol=1e-6), v["norms"]
        assert v["raised"] is not None and "in place" in v["raised"], v["raised"]


# ------------------------------------------------------------------ state replaced by the user

def _replace_state(st_of, params, how):
    """What a script does after a loss spike: new moment tensors (or a new step)."""
    for p in params:
        st = st_of(p)
        if not st:
            continue
        if how == "zeros":
            st["exp_avg"] = torch.zeros_like(st["exp_avg"])
        elif how == "scaled":
            st["exp_avg_sq"] = st["exp_avg_sq"] * 0.25
            if "max_exp_avg_sq" in st:
                st["max_exp_avg_sq"] = st["max_exp_avg_sq"] * 0.25
        elif how == "step":
            st["step"] = torch.tensor(float(st["step"]) - 1.0)


def _local_state(opt):
    """opt.optim.state keyed by the local optimizer's keys (views in "flat" mode)."""
    keys = [k for g in opt.optim.param_groups for k in g["params"]]
    return keys, opt.optim.state.get


def _replaced_state_run(ctx, mode, how, amsgrad):
    pz, pr = _twins(seed=24)
    hp = dict(lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    opt = _zero(pz, AdamW, ctx.pg, **MODES[mode], **hp)
    ref = AdamW(pr, **hp)
    for s in range(5):
        _grads(pz, s)
        _copy_grads(pr, pz)
        if s in (2, 3):
            keys, get = _local_state(opt)
            _replace_state(get, keys, how)
            _replace_state(ref.state.get, pr, how)
        opt.step()
        ref.step()
    return _out(pz, pr)


for _mode in ("param", "flat", "param_bv"):
    for _how in ("zeros", "scaled", "step"):
        _register(f"replaced_state_{_mode}_{_how}", _replaced_state_run, _mode, _how,
                  _how == "scaled")


@pytest.mark.parametrize("how", ["zeros", "scaled", "step"])
@pytest.mark.parametrize("mode", ["param", "flat", "param_bv"])
def test_state_tensors_replaced_by_the_user_are_stepped(world, mode, how):
    _check(world.values(f"replaced_state_{mode}_{how}"))


@pytest.mark.parametrize("how", ["zeros", "scaled", "step"])
def test_fused_adamw_steps_state_tensors_replaced_by_the_user(how):
    from zero_ext import FusedAdamW
    pz, pr = _twins(seed=25)
    hp = dict(lr=1e-2, weight_decay=0.1, amsgrad=(how == "scaled"))
    opt, ref = FusedAdamW(pz, **hp), AdamW(pr, **hp)
    for s in range(5):
        _grads(pz, s)
        _copy_grads(pr, pz)
        if s in (2, 3):
            _replace_state(opt.state.get, pz, how)
            _replace_state(ref.state.get, pr, how)
        opt.step()
        ref.step()
    assert_params_close(detached(pz), detached(pr), **TOL)
    # the state dict holds what the step used
    sd, rsd = opt.state_dict(), ref.state_dict()
    for i in rsd["state"]:
        for k, v in rsd["state"][i].items():
            torch.testing.assert_close(sd["state"][i][k], v, **TOL)


# ------------------------------------------------------------------ norm types

@SC.scenario()
def clip_negative_norm_types(ctx):
    out = {}
    for mode in ("param", "flat"):
        pz, pr = _twins(seed=26)
        opt = _zero(pz, SGD, ctx.pg, sharding=mode, lr=0.1)
        ref = SGD(pr, lr=0.1)
        for k, nt in enumerate((-math.inf, -1.0, -2.0, "-inf", "inf")):
            _grads(pz, k)
            _copy_grads(pr, pz)
            norm = float(opt.clip_grad_norm_(0.05, norm_type=nt))
            ref_norm = float(torch.nn.utils.clip_grad_norm_(pr, 0.05, norm_type=nt))
            out[(mode, str(nt))] = (norm, ref_norm)
            opt.step()
            ref.step()
        out[mode] = _out(pz, pr)
    return out


def test_negative_norm_types_match_torch(world):
    vals = world.values("clip_negative_norm_types")
    for mode in ("param", "flat"):
        _check([v[mode] for v in vals])
    for v in vals:
        for key, (ours, theirs) in v.items():
            if isinstance(key, tuple):
                assert math.isclose(ours, theirs, rel_tol=1e-6), (key, ours, theirs)


@pytest.mark.parametrize("norm_type", ["fro", "nuc", None, object()])
def test_norm_type_errors_match_torch(norm_type):
    from zero_ext import FusedAdamW
    ps = make_params([(3,)])
    ps[0].grad = torch.ones(3)
    with pytest.raises(Exception) as theirs:
        torch.nn.utils.clip_grad_norm_(ps, 1.0, norm_type=norm_type)
    with pytest.raises(type(theirs.value)) as ours:
        FusedAdamW(ps).clip_grad_norm_(1.0, norm_type=norm_type)
    assert "norm_type" in str(ours.value)


@pytest.mark.parametrize("norm_type", [-2.0, -math.inf, 3.0])
def test_norms_of_infinite_grads_match_torch(norm_type):
    from zero_ext import FusedAdamW
    ps, qs = make_params([(3,), (2, 2)]), make_params([(3,), (2, 2)])
    for p in ps + qs:
        p.grad = torch.full(p.shape, math.inf)
    theirs = float(torch.nn.utils.clip_grad_norm_(qs, 1.0, norm_type=norm_type))
    ours = float(FusedAdamW(ps).clip_grad_norm_(1.0, norm_type=norm_type))
    assert ours == theirs, (ours, theirs)


def test_norm_type_zero_is_refused_clearly():
    from zero_ext import FusedAdamW
    ps = make_params([(3,)])
    ps[0].grad = torch.ones(3)
    with pytest.raises(ValueError, match="norm_type=0"):
        FusedAdamW(ps).clip_grad_norm_(1.0, norm_type=0)


# ------------------------------------------------------------------ GradScaler, no grads here

@SC.scenario(min_world=2)
def scaler_with_no_grads_on_one_rank(ctx):
    """Without DDP a rank can reach scaler.step with no grads at all: torch's GradScaler
    then hands the optimizer found_inf as the int 0. Every rank must step (no hang, no
    AttributeError on one rank), and the params stay identical on every rank."""
    out = {}
    for mode in ("param", "flat_bv"):
        pz = make_params(SHAPES, seed=27)
        opt = _zero(pz, AdamW, ctx.pg, **MODES[mode], lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        scaler.scale(torch.ones(()))
        # one step: on the rank without grads torch's update() asserts (nothing checked),
        # and a second scaler.step without it raises
        if ctx.rank == ctx.world_size - 1:
            for p in pz:
                p.grad = None
        else:
            _grads(pz, 0)
        scaler.step(opt)
        out[mode] = detached(pz)
    return out


def test_grad_scaler_with_no_grads_on_one_rank(world):
    if world.world_size < 2:
        pytest.skip("needs 2+ ranks")
    vals = world.values("scaler_with_no_grads_on_one_rank")
    for mode in vals[0]:
        assert_same_on_every_rank([v[mode] for v in vals])


def test_fused_adamw_grad_scaler_with_no_grads():
    from zero_ext import FusedAdamW
    pz = make_params(SHAPES[:3], seed=28)
    opt = FusedAdamW(pz, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    scaler.scale(torch.ones(()))
    before = detached(pz)
    scaler.step(opt)  # no grads anywhere: found_inf arrives as the int 0
    assert_params_close(detached(pz), before, atol=0, rtol=0)


@SC.scenario(min_world=2)
def bad_found_inf_raises_everywhere(ctx):
    """A found_inf that cannot be read (not a number or tensor) on one rank is an error on
    every rank, not a hang."""
    pz = make_params(SHAPES, seed=29)
    opt = _zero(pz, AdamW, ctx.pg, lr=1e-2)
    _grads(pz, 0)
    opt.found_inf = object() if ctx.rank == 0 else torch.zeros(1)
    try:
        opt.step()
    finally:
        del opt.found_inf


def test_unreadable_found_inf_raises_on_every_rank(world):
    if world.world_size < 2:
        pytest.skip("needs 2+ ranks")
    outs = world.outcomes("bad_found_inf_raises_everywhere")
    assert_raised(outs[0], TypeError, "found_inf")
    for o in outs[1:]:
        assert_raised(o, RuntimeError, "rank 0")


# ------------------------------------------------------------------ clipped grads that survive

def _surviving_clip_run(opt, ref, pz, pr):
    """clip, step, step again on the same grads (nothing zeroed them: torch's in-place clip
    left them clipped), then zero them in place and accumulate new ones (a new grad)."""
    _grads(pz, 0)
    _copy_grads(pr, pz)
    opt.clip_grad_norm_(0.3)
    torch.nn.utils.clip_grad_norm_(pr, 0.3)
    for _ in range(2):
        opt.step()
        ref.step()
    for k, (z, r) in enumerate(zip(pz, pr)):
        g = torch.Generator().manual_seed(500 + k)
        new = torch.randn(z.shape, generator=g)
        for p in (z, r):
            p.grad.zero_()
            p.grad.add_(new)
    opt.step()
    ref.step()


@SC.scenario()
def clipped_grads_surviving_a_step(ctx):
    out = {}
    for mode in ("param", "flat_bv"):
        pz, pr = _twins(seed=30)
        hp = dict(lr=0.05, momentum=0.9)
        opt, ref = _zero(pz, SGD, ctx.pg, **MODES[mode], **hp), SGD(pr, **hp)
        _surviving_clip_run(opt, ref, pz, pr)
        out[mode] = _out(pz, pr)
    return out


def test_a_clipped_grad_that_survives_a_step_stays_clipped(world):
    vals = world.values("clipped_grads_surviving_a_step")
    for mode in vals[0]:
        _check([v[mode] for v in vals])


def test_fused_adamw_clipped_grad_that_survives_a_step_stays_clipped():
    from zero_ext import FusedAdamW
    pz, pr = _twins(seed=31)
    opt, ref = FusedAdamW(pz, lr=1e-2), AdamW(pr, lr=1e-2)
    _surviving_clip_run(opt, ref, pz, pr)
    assert_params_close(detached(pz), detached(pr), **TOL)


# ------------------------------------------------------------------ grads changed after a clip

@SC.scenario()
def grads_transformed_after_the_clip(ctx):
    """clip, then p.grad = p.grad + noise (a new tensor computed from the grad, as a DP
    noise step or a cast does): torch's new grad would be built from clipped values, which
    zero_ext cannot rebuild (it clips inside the step): every rank raises at the step and
    nothing is stepped. After opt.zero_grad() the optimizer works on."""
    out = {}
    for mode in ("param", "flat"):
        pz, pr = _twins(seed=32)
        opt = _zero(pz, SGD, ctx.pg, **MODES[mode], lr=0.05)
        before = detached(pz)
        _grads(pz, 0)
        opt.clip_grad_norm_(0.3)
        for p in pz:
            p.grad = p.grad + 0.01
        try:
            opt.step()
            err = None
        except RuntimeError as exc:
            err = str(exc)
        unchanged = all(torch.equal(a, b) for a, b in zip(before, detached(pz)))
        opt.zero_grad()
        _grads(pz, 1)
        opt.step()
        out[mode] = {"err": err, "unchanged": unchanged, "zero": detached(pz)}
    return out


def test_grads_transformed_after_the_clip_raise_on_every_rank(world):
    vals = world.values("grads_transformed_after_the_clip")
    for mode in vals[0]:
        for v in vals:
            assert v[mode]["err"] is not None and "replaced" in v[mode]["err"], v[mode]["err"]
            assert v[mode]["unchanged"]
        assert_same_on_every_rank([v[mode]["zero"] for v in vals])
