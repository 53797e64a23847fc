"""Checkpoints of zero_ext.ZeroRedundancyOptimizer in the plain torch optimizer format, on gloo
worlds of 1, 2 and 3 ranks.

* ``consolidate_state_dict(to)`` on every rank, then ``state_dict()`` on rank ``to`` equals
  what a plain ``torch.optim.AdamW`` trained on the same grads returns (same keys, global
  indices in the user's group order, same hyperparameters, state within fp32 tolerance).
* Round trips, then training continues and params are compared with an uninterrupted plain
  AdamW: ours -> torch.optim.AdamW, torch.optim.AdamW -> ours, ours -> ours (other options),
  ours -> torch's ZeroRedundancyOptimizer, torch's ZeroRedundancyOptimizer -> ours.
* ``load_state_dict`` does not modify the caller's dict (deep-copy compare), neither at load
  time nor later while training.
Tolerance for fp32 state and params: atol=1e-6, rtol=1e-6.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from _dist import (AGAINST_TORCH, WORLD_SIZES, Scenarios, assert_params_close,
                   assert_same_on_every_rank, clones, detached, fake_grads, gloo_available,
                   make_params, make_zero, sd_diff)

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with gloo")

SC = Scenarios(__name__)
AdamW, SGD = torch.optim.AdamW, torch.optim.SGD
ATOL, RTOL = 1e-6, 1e-6

SHAPES = [(12, 6), (12,), (6, 12), (6,), (25,), (3, 3, 3), (1,), (40,), (5, 4), (2,)]
DEFAULTS = dict(lr=2e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
K = 6  # steps before the checkpoint, and again after it
NEVER = 9  # this param never gets a grad: it has no optimizer state in either format


def _skip(i, s):
    return i == NEVER or (i + s) % 4 == 0


def groups(ps):
    return [{"params": [ps[i] for i in (0, 2, 5, 8)], "lr": 1e-2, "weight_decay": 0.1},
            {"params": [ps[i] for i in (1, 3, 6, 9)], "lr": 3e-3, "weight_decay": 0.0},
            {"params": [ps[i] for i in (4, 7)], "amsgrad": True}]


# global index of a param in the state dict: its position in the user's group order
ORDER = [i for g in groups(list(range(len(SHAPES)))) for i in g["params"]]
NEVER_INDEX = ORDER.index(NEVER)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def world(request):
    return SC.run(request.param)


def _train(opt, ps, steps):
    for s in steps:
        fake_grads(ps, s, skip=_skip)
        opt.step()


def _bcast(ctx, obj, src):
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=ctx.pg)
    return box[0]


def _zero_and_ref(ctx, **zero_kwargs):
    pz = make_params(SHAPES, seed=21)
    pr = clones(pz)
    opt = make_zero(groups(pz), AdamW, ctx.pg, **zero_kwargs, **DEFAULTS)
    ref = AdamW(groups(pr), **DEFAULTS)
    _train(opt, pz, range(K))
    _train(ref, pr, range(K))
    return pz, opt, pr, ref


def _consolidated(ctx, opt, to):
    opt.consolidate_state_dict(to=to)
    sd = opt.state_dict() if ctx.rank == to else None
    return _bcast(ctx, sd, to)


# --------------------------------------------------------------------------------------------
# the consolidated format is exactly torch.optim.AdamW's


def _format_scenario(ctx, to):
    pz, opt, pr, ref = _zero_and_ref(ctx)
    opt.consolidate_state_dict(to=to)
    if ctx.rank != to:
        return None
    return {"sd": opt.state_dict(), "ref_sd": ref.state_dict()}


@SC.scenario()
def format_to_rank0(ctx):
    return _format_scenario(ctx, 0)


@SC.scenario()
def format_to_last_rank(ctx):
    return _format_scenario(ctx, ctx.world_size - 1)


@SC.scenario()
def format_sharding_flat(ctx):
    pz, opt, pr, ref = _zero_and_ref(ctx, sharding="flat", parameters_as_bucket_view=True)
    opt.consolidate_state_dict(to=0)
    return {"sd": opt.state_dict(), "ref_sd": ref.state_dict()} if ctx.rank == 0 else None


@pytest.mark.parametrize("name", ["format_to_rank0", "format_to_last_rank",
                                  "format_sharding_flat"])
def test_state_dict_is_plain_torch_format(world, name):
    if AGAINST_TORCH and "sharding" in name:
        pytest.skip("torch has no sharding argument")
    vals = world.values(name)
    to = world.world_size - 1 if name == "format_to_last_rank" else 0
    v = vals[to]
    assert v is not None
    sd, ref_sd = v["sd"], v["ref_sd"]
    assert set(sd) == {"state", "param_groups"}, f"top-level keys {sorted(sd)}"
    assert NEVER_INDEX not in sd["state"], "a param that never had a grad must have no state"
    assert sorted(sd["state"]) == sorted(ref_sd["state"])
    # structure, indices, hyperparameters exactly; state tensors within fp32 tolerance
    diffs = sd_diff(sd["param_groups"], ref_sd["param_groups"], "param_groups")
    diffs += sd_diff(sd["state"], ref_sd["state"], "state", atol=ATOL, rtol=RTOL)
    assert not diffs, "state_dict differs from torch.optim.AdamW's:\n" + "\n".join(diffs[:20])


# --------------------------------------------------------------------------------------------
# ours -> torch.optim.AdamW, and back


@SC.scenario()
def ours_to_plain_adamw(ctx):
    pz, opt, pr, ref = _zero_and_ref(ctx)
    sd = _consolidated(ctx, opt, 0)
    pp = clones(pz)
    plain = AdamW(groups(pp), **DEFAULTS)
    plain.load_state_dict(copy.deepcopy(sd))
    _train(plain, pp, range(K, 2 * K))
    _train(ref, pr, range(K, 2 * K))
    return {"zero": detached(pp), "ref": detached(pr)}


@SC.scenario()
def plain_adamw_to_ours(ctx):
    pr = make_params(SHAPES, seed=21)
    ref = AdamW(groups(pr), **DEFAULTS)
    _train(ref, pr, range(K))
    ref.param_groups[0]["lr"] = 7e-3  # a changed hyperparameter travels with the checkpoint
    sd = copy.deepcopy(ref.state_dict())  # not aliasing ref's live state, which trains on
    snapshot = copy.deepcopy(sd)
    pz = clones(pr)
    opt = make_zero(groups(pz), AdamW, ctx.pg, **DEFAULTS)
    opt.load_state_dict(sd)
    mutated_at_load = sd_diff(sd, snapshot)
    lr_after_load = opt.param_groups[0]["lr"]
    _train(opt, pz, range(K, 2 * K))
    _train(ref, pr, range(K, 2 * K))
    return {"zero": detached(pz), "ref": detached(pr), "mutated_at_load": mutated_at_load,
            "lr_after_load": lr_after_load}


@SC.scenario()
def ours_to_ours_other_options(ctx):
    pz, opt, pr, ref = _zero_and_ref(ctx)
    sd = _consolidated(ctx, opt, ctx.world_size - 1)
    snapshot = copy.deepcopy(sd)
    p2 = clones(pz)
    opt2 = make_zero(groups(p2), AdamW, ctx.pg, parameters_as_bucket_view=True,
                     sharding="param", **DEFAULTS)
    opt2.load_state_dict(sd)
    mutated_at_load = sd_diff(sd, snapshot)
    # load -> consolidate gives back the same dict
    opt2.consolidate_state_dict(to=0)
    again = opt2.state_dict() if ctx.rank == 0 else None
    _train(opt2, p2, range(K, 2 * K))
    _train(ref, pr, range(K, 2 * K))
    return {"zero": detached(p2), "ref": detached(pr), "mutated_at_load": mutated_at_load,
            "mutated_later": sd_diff(sd, snapshot), "again": again, "sd": sd}


def _check(vals):
    for r, v in enumerate(vals):
        assert_params_close(v["zero"], v["ref"], ATOL, RTOL, what=f"rank {r} param")
    assert_same_on_every_rank([v["zero"] for v in vals])


@SC.scenario()
def plain_adamw_to_ours_sharding_flat(ctx):
    pr = make_params(SHAPES, seed=21)
    ref = AdamW(groups(pr), **DEFAULTS)
    _train(ref, pr, range(K))
    sd = copy.deepcopy(ref.state_dict())
    pz = clones(pr)
    opt = make_zero(groups(pz), AdamW, ctx.pg, sharding="flat", **DEFAULTS)
    opt.load_state_dict(sd)
    _train(opt, pz, range(K, 2 * K))
    _train(ref, pr, range(K, 2 * K))
    # and back out of flat shards into the torch format
    opt.consolidate_state_dict(to=0)
    again = opt.state_dict() if ctx.rank == 0 else None
    return {"zero": detached(pz), "ref": detached(pr), "again": again,
            "ref_sd": ref.state_dict() if ctx.rank == 0 else None}


@pytest.mark.parametrize("name", ["ours_to_plain_adamw", "plain_adamw_to_ours",
                                  "ours_to_ours_other_options",
                                  "plain_adamw_to_ours_sharding_flat"])
def test_round_trip_then_continue(world, name):
    if AGAINST_TORCH and ("ours_to_ours" in name or "sharding" in name):
        pytest.skip("torch has no sharding argument")
    vals = world.values(name)
    _check(vals)
    if name == "plain_adamw_to_ours":
        for v in vals:
            assert v["lr_after_load"] == 7e-3, "param_groups hyperparameters must be loaded"
    if name == "plain_adamw_to_ours_sharding_flat":
        v0 = vals[0]
        diffs = sd_diff(v0["again"], v0["ref_sd"], atol=ATOL, rtol=RTOL)
        assert not diffs, "flat state_dict differs from AdamW's:\n" + "\n".join(diffs[:20])
    if name == "ours_to_ours_other_options":
        v0 = vals[0]
        diffs = sd_diff(v0["again"], v0["sd"])
        assert not diffs, "load_state_dict then state_dict changed the dict:\n" + "\n".join(diffs)


@pytest.mark.parametrize("name", ["plain_adamw_to_ours", "ours_to_ours_other_options"])
def test_load_state_dict_does_not_modify_input(world, name):
    if AGAINST_TORCH:
        pytest.skip("torch's load_state_dict mutates its input (a known upstream bug)")
    for r, v in enumerate(world.values(name)):
        assert not v["mutated_at_load"], (
            f"rank {r}: load_state_dict modified the caller's dict:\n"
            + "\n".join(v["mutated_at_load"][:10]))


def test_loaded_state_dict_not_aliased_by_training(world):
    """Training after load_state_dict must not write into the caller's tensors either."""
    if AGAINST_TORCH:
        pytest.skip("torch aliases the caller's tensors")
    for r, v in enumerate(world.values("ours_to_ours_other_options")):
        assert not v["mutated_later"], (
            f"rank {r}: training after load_state_dict changed the caller's dict:\n"
            + "\n".join(v["mutated_later"][:10]))


# --------------------------------------------------------------------------------------------
# interoperability with torch's own ZeroRedundancyOptimizer, both directions


def _torch_zero(params, pg, **kw):
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

    return TorchZeRO(params, AdamW, process_group=pg, **kw)


@SC.scenario()
def ours_to_torch_zero(ctx):
    pz, opt, pr, ref = _zero_and_ref(ctx)
    sd = _consolidated(ctx, opt, 0)
    pt = clones(pz)
    tz = _torch_zero(groups(pt), ctx.pg, **DEFAULTS)
    tz.load_state_dict(copy.deepcopy(sd))  # torch mutates what it loads
    _train(tz, pt, range(K, 2 * K))
    _train(ref, pr, range(K, 2 * K))
    return {"zero": detached(pt), "ref": detached(pr)}


@SC.scenario()
def torch_zero_to_ours(ctx):
    pt = make_params(SHAPES, seed=21)
    pr = clones(pt)
    tz = _torch_zero(groups(pt), ctx.pg, **DEFAULTS)
    ref = AdamW(groups(pr), **DEFAULTS)
    _train(tz, pt, range(K))
    _train(ref, pr, range(K))
    tz.consolidate_state_dict(to=0)
    sd = _bcast(ctx, tz.state_dict() if ctx.rank == 0 else None, 0)
    snapshot = copy.deepcopy(sd)
    pz = clones(pt)
    opt = make_zero(groups(pz), AdamW, ctx.pg, **DEFAULTS)
    opt.load_state_dict(sd)
    mutated_at_load = sd_diff(sd, snapshot)
    _train(opt, pz, range(K, 2 * K))
    _train(ref, pr, range(K, 2 * K))
    return {"zero": detached(pz), "ref": detached(pr), "mutated_at_load": mutated_at_load}


@pytest.mark.parametrize("name", ["ours_to_torch_zero", "torch_zero_to_ours"])
def test_torch_zero_interop(world, name):
    vals = world.values(name)
    _check(vals)
    if name == "torch_zero_to_ours" and not AGAINST_TORCH:
        for v in vals:
            assert not v["mutated_at_load"], "\n".join(v["mutated_at_load"][:10])


# --------------------------------------------------------------------------------------------
# the generic path: SGD with momentum


@SC.scenario()
def sgd_momentum_state_dict(ctx):
    pz = make_params(SHAPES, seed=21)
    pr = clones(pz)
    opt = make_zero(groups_sgd(pz), SGD, ctx.pg, lr=0.05, momentum=0.9)
    ref = SGD(groups_sgd(pr), lr=0.05, momentum=0.9)
    _train(opt, pz, range(K))
    _train(ref, pr, range(K))
    sd = _consolidated(ctx, opt, 0)
    ref_sd = copy.deepcopy(ref.state_dict())
    pp = clones(pz)
    plain = SGD(groups_sgd(pp), lr=0.05, momentum=0.9)
    plain.load_state_dict(copy.deepcopy(sd))
    _train(plain, pp, range(K, 2 * K))
    _train(ref, pr, range(K, 2 * K))
    return {"zero": detached(pp), "ref": detached(pr), "sd": sd, "ref_sd": ref_sd}


def groups_sgd(ps):
    return [{"params": ps[:5], "lr": 0.02, "nesterov": True}, {"params": ps[5:], "momentum": 0.5}]


def test_sgd_state_dict(world):
    vals = world.values("sgd_momentum_state_dict")
    _check(vals)
    v = vals[0]
    diffs = sd_diff(v["sd"], v["ref_sd"], atol=ATOL, rtol=RTOL)
    assert not diffs, "\n".join(diffs[:20])
