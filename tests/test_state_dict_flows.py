"""state_dict() / load_state_dict() as the training frameworks call them.

- accelerate's prepare() calls state_dict() on every rank, moves it and loads it back, before
  any step (or after a load); its save_state() calls state_dict() on every rank without
  consolidating; its load_state() loads the saved dict on every rank.
- Lightning and scripts written for torch's ZeRO call consolidate_state_dict() on every
  rank, then state_dict() on one rank.
- HF Trainer saves state_dict() from the main process only (it needs the integration
  callback, tests/test_integrations.py).

Each scenario checks the dicts against a plain torch.optim.AdamW fed the same grads (fp32:
atol = rtol = 1e-6), and that a round trip leaves training bitwise unchanged.
"""
from __future__ import annotations

import copy

import pytest
import torch

from _dist import (WORLD_SIZES, Scenarios, assert_params_close, assert_raised,
                   assert_same_on_every_rank, detached, gloo_available, make_params, sd_diff)

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with gloo")

SC = Scenarios(__name__)
AdamW = torch.optim.AdamW
SHAPES = [(16, 8), (16,), (8, 16), (8,), (33,), (4, 4, 3), (1,), (64,), (7, 5), (2,)]
HP = dict(lr=1e-2, weight_decay=0.1)
MODES = {"param": dict(sharding="param"), "flat_bv": dict(sharding="flat",
                                                          parameters_as_bucket_view=True)}


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def world(request):
    return SC.run(request.param)


def _groups(ps):
    return [{"params": ps[0::2], "weight_decay": 0.1}, {"params": ps[1::2], "weight_decay": 0.0}]


def _zero(params, pg, mode):
    from zero_ext import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer(_groups(params), AdamW, process_group=pg, **MODES[mode],
                                   **HP)


def _grads(params, step):
    for i, p in enumerate(params):
        g = torch.Generator().manual_seed(step * 1009 + i)
        p.grad = torch.randn(p.shape, generator=g)


def _train(opt, params, steps, first=0):
    for s in range(first, first + steps):
        _grads(params, s)
        opt.step()


def _is_placeholder(sd):
    from zero_ext.state import is_placeholder
    return is_placeholder(sd)


def _setup(ctx, mode):
    """ZeRO and the plain reference after 3 steps of the same grads."""
    pz = make_params(SHAPES, seed=40)
    pr = [p.detach().clone().requires_grad_() for p in pz]
    opt, ref = _zero(pz, ctx.pg, mode), AdamW(_groups(pr), **HP)
    _train(opt, pz, 3)
    _train(ref, pr, 3)
    return pz, pr, opt, ref


@SC.scenario()
def prepare_round_trip_before_any_step(ctx):
    """accelerate's prepare(): state_dict() on every rank, moved, loaded back, no step yet.
    Every rank gets a real dict with empty state, without any collective."""
    out = {}
    for mode in MODES:
        pz = make_params(SHAPES, seed=41)
        pr = [p.detach().clone().requires_grad_() for p in pz]
        opt, ref = _zero(pz, ctx.pg, mode), AdamW(_groups(pr), **HP)
        sd = opt.state_dict()
        out[mode] = {"diff": sd_diff(sd, ref.state_dict())}
        opt.load_state_dict(copy.deepcopy(sd))
        _train(opt, pz, 3)
        _train(ref, pr, 3)
        out[mode]["zero"], out[mode]["ref"] = detached(pz), detached(pr)
    return out


def test_prepare_round_trip_before_any_step(world):
    vals = world.values("prepare_round_trip_before_any_step")
    for mode in MODES:
        for v in vals:
            assert v[mode]["diff"] == [], v[mode]["diff"]
            assert_params_close(v[mode]["zero"], v[mode]["ref"], atol=1e-6, rtol=1e-6)
        assert_same_on_every_rank([v[mode]["zero"] for v in vals])


@SC.scenario()
def state_dict_on_every_rank_then_round_trip(ctx):
    """accelerate's save_state() (state_dict() on every rank, no consolidation), then a
    prepare()-style round trip with state (rank 0's real dict, placeholders elsewhere): the
    placeholder ranks receive their share from rank 0, and training goes on exactly as a
    twin that never round-tripped."""
    out = {}
    for mode in MODES:
        twin_p = make_params(SHAPES, seed=40)
        twin = _zero(twin_p, ctx.pg, mode)
        _train(twin, twin_p, 3)
        pz, pr, opt, ref = _setup(ctx, mode)
        sd = opt.state_dict()
        rec = {"placeholder": _is_placeholder(sd)}
        if ctx.rank == 0:
            rec["diff"] = sd_diff(sd, ref.state_dict(), atol=1e-6, rtol=1e-6)
        opt.load_state_dict(copy.deepcopy(sd))  # what prepare() does with it
        _train(opt, pz, 2, first=3)
        _train(twin, twin_p, 2, first=3)
        rec["zero"], rec["twin"] = detached(pz), detached(twin_p)
        out[mode] = rec
    return out


def test_state_dict_on_every_rank_then_round_trip(world):
    vals = world.values("state_dict_on_every_rank_then_round_trip")
    for mode in MODES:
        for r, v in enumerate(vals):
            rec = v[mode]
            assert rec["placeholder"] == (r != 0)
            if r == 0:
                assert rec["diff"] == [], rec["diff"]
            for a, b in zip(rec["zero"], rec["twin"]):
                assert torch.equal(a, b), "the round trip changed training"
        assert_same_on_every_rank([v[mode]["zero"] for v in vals])


@SC.scenario(min_world=2)
def consolidated_elsewhere_then_stale(ctx):
    """torch's protocol: consolidate_state_dict(to=1) on every rank, then state_dict() on
    each rank separately (no collective: rank 1 has the state, rank 0 a placeholder). After
    another step that consolidation is out of date: state_dict() gathers afresh, on every
    rank together, to rank 0."""
    pz, pr, opt, ref = _setup(ctx, "param")
    opt.consolidate_state_dict(to=1)
    first = opt.state_dict()  # no collective here: ranks may call it in any order
    rec = {"first_placeholder": _is_placeholder(first)}
    if ctx.rank == 1:
        rec["first_diff"] = sd_diff(first, ref.state_dict(), atol=1e-6, rtol=1e-6)
    _train(opt, pz, 1, first=3)
    _train(ref, pr, 1, first=3)
    second = opt.state_dict()
    rec["second_placeholder"] = _is_placeholder(second)
    if ctx.rank == 0:
        rec["second_diff"] = sd_diff(second, ref.state_dict(), atol=1e-6, rtol=1e-6)
    return rec


def test_consolidated_elsewhere_then_stale(world):
    if world.world_size < 2:
        pytest.skip("needs 2+ ranks")
    vals = world.values("consolidated_elsewhere_then_stale")
    for r, v in enumerate(vals):
        assert v["first_placeholder"] == (r != 1)
        assert v["second_placeholder"] == (r != 0)
    assert vals[1]["first_diff"] == [] and vals[0]["second_diff"] == []


@SC.scenario(min_world=2)
def load_from_one_holder(ctx):
    """Only the last rank holds the dict (read from a file there); the others pass the
    placeholder: every rank ends with the state of that dict."""
    pz, pr, opt, ref = _setup(ctx, "param")
    opt.consolidate_state_dict(to=0)
    sd = opt.state_dict()
    from zero_ext.state import placeholder
    full = [sd if ctx.rank == 0 else None]
    torch.distributed.broadcast_object_list(full, src=torch.distributed.get_global_rank(
        ctx.pg, 0), group=ctx.pg)
    last = ctx.world_size - 1
    pz2 = [p.detach().clone().requires_grad_() for p in pz]
    opt2 = _zero(pz2, ctx.pg, "flat_bv")  # another layout: the holder cuts the shares
    opt2.load_state_dict(full[0] if ctx.rank == last else placeholder(opt2, 0))
    _train(opt2, pz2, 2, first=3)
    _train(ref, pr, 2, first=3)
    return {"zero": detached(pz2), "ref": detached(pr)}


def test_load_from_one_holder(world):
    if world.world_size < 2:
        pytest.skip("needs 2+ ranks")
    vals = world.values("load_from_one_holder")
    for v in vals:
        assert_params_close(v["zero"], v["ref"], atol=1e-6, rtol=1e-6)
    assert_same_on_every_rank([v["zero"] for v in vals])


@SC.scenario()
def load_only_placeholders(ctx):
    pz, pr, opt, ref = _setup(ctx, "param")
    from zero_ext.state import placeholder
    opt.load_state_dict(placeholder(opt, 0))


def test_placeholders_everywhere_raise_on_every_rank(world):
    for o in world.outcomes("load_only_placeholders"):
        assert_raised(o, ValueError, "placeholder")


@SC.scenario(min_world=2)
def state_dict_called_on_one_rank_only(ctx):
    """A script that calls state_dict() on rank 0 only, without consolidate_state_dict()
    first: rank 0 gets a clear error naming the missing ranks (here after 2 s), not a hang;
    the other ranks are not involved. torch's ZeRO raises at once there."""
    from zero_ext import agree
    pz, pr, opt, ref = _setup(ctx, "param")
    saved = agree.RENDEZVOUS_TIMEOUT_S, agree.RENDEZVOUS_WARN_S
    agree.RENDEZVOUS_TIMEOUT_S, agree.RENDEZVOUS_WARN_S = 2.0, 0.5
    try:
        err = None
        if ctx.rank == 0:
            try:
                opt.state_dict()
            except RuntimeError as exc:
                err = str(exc)
    finally:
        agree.RENDEZVOUS_TIMEOUT_S, agree.RENDEZVOUS_WARN_S = saved
    # the other ranks call state_dict() only once rank 0's call has given up (store signal):
    # the timed-out call withdrew, so this next call on every rank pairs up and works
    key = f"{ctx.scenario}/first_call_over"
    if ctx.rank == 0:
        ctx.store.set(key, "1")
    else:
        ctx.store.wait([key])
    sd = opt.state_dict()
    return {"err": err, "placeholder": _is_placeholder(sd),
            "diff": sd_diff(sd, ref.state_dict(), atol=1e-6, rtol=1e-6) if ctx.rank == 0
            else []}


def test_state_dict_on_one_rank_only_is_a_clear_error(world):
    if world.world_size < 2:
        pytest.skip("needs 2+ ranks")
    vals = world.values("state_dict_called_on_one_rank_only")
    assert vals[0]["err"] is not None and "consolidate_state_dict" in vals[0]["err"]
    assert "ranks [1" in vals[0]["err"]
    assert all(v["err"] is None for v in vals[1:])
    for r, v in enumerate(vals):
        assert v["placeholder"] == (r != 0) and v["diff"] == [], (r, v)


@SC.scenario(min_world=2)
def load_on_rank0_only(ctx):
    """A resume where only rank 0 reads the file: rank 0 passes the dict, the others None;
    they receive their shares. The trap next to it: the others pass their fresh
    optimizer's state_dict() (a real dict with empty state, not None): the ranks were given
    different dicts, which is a ValueError on every rank with nothing loaded."""
    pz, pr, opt, ref = _setup(ctx, "param")
    opt.consolidate_state_dict(to=0)
    full = [opt.state_dict() if ctx.rank == 0 else None]
    torch.distributed.broadcast_object_list(full, src=torch.distributed.get_global_rank(
        ctx.pg, 0), group=ctx.pg)
    saved = full[0]

    def fresh():
        ps = [p.detach().clone().requires_grad_() for p in pz]
        return ps, _zero(ps, ctx.pg, "flat_bv")

    ps_trap, trap = fresh()
    err = None
    try:
        trap.load_state_dict(copy.deepcopy(saved) if ctx.rank == 0 else trap.state_dict())
    except ValueError as exc:
        err = str(exc)
    trap_empty = not any(trap.optim.state.values())
    ps_ok, ok = fresh()
    ok.load_state_dict(copy.deepcopy(saved) if ctx.rank == 0 else None)
    _train(ok, ps_ok, 2, first=3)
    _train(ref, pr, 2, first=3)
    return {"err": err, "trap_empty": trap_empty, "zero": detached(ps_ok), "ref": detached(pr)}


def test_load_on_rank0_only_and_the_fresh_state_dict_trap(world):
    if world.world_size < 2:
        pytest.skip("needs 2+ ranks")
    vals = world.values("load_on_rank0_only")
    for v in vals:
        assert v["err"] is not None and "different state dicts" in v["err"], v["err"]
        assert v["trap_empty"]
        assert_params_close(v["zero"], v["ref"], atol=1e-6, rtol=1e-6)
    assert_same_on_every_rank([v["zero"] for v in vals])
