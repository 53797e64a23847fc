"""Seams of the state side (issue 19, items 2, 3, 4, 7 and the structure notes).

- A state dict whose param changed shape but kept its numel ((4, 6) saved, (6, 4) now) is
  a ValueError on every rank, nothing loaded, in both sharding modes; plain torch's AdamW
  loads it and fails at the next step with a RuntimeError.
- Two different optimizers saving to one checkpoint path (halves of the job with equal
  shapes, or ranks calling save on different optimizers of one group) are a ValueError on
  every rank before anything is written.
- An optimizer class that creates its state in __init__ (torch's Adagrad) keeps it through
  accelerate's prepare() round trip before the first step.
- A rendezvous that times out on one rank while another arrives: both ranks return or both
  raise (no rank goes on into the collective alone).
- Every rank computes any rank's local piece order alike (ShardPlan.local_order).

Correctness is checked against a plain torch optimizer fed the same grads (atol = rtol =
1e-6) on every rank.
"""
from __future__ import annotations

import copy
import os
import time

import pytest
import torch

from _dist import (WORLD_SIZES, Scenarios, error_of, assert_params_close, assert_same_on_every_rank, detached, gloo_available, make_params, sd_diff)

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with gloo")

SC = Scenarios(__name__)
AdamW = torch.optim.AdamW
HP = dict(lr=1e-2, weight_decay=0.1)
TOL = dict(atol=1e-6, rtol=1e-6)
MODES = {"param": dict(sharding="param"), "flat": dict(sharding="flat"),
         "flat_bv": dict(sharding="flat", parameters_as_bucket_view=True)}


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def world(request):
    return SC.run(request.param)


def _grads(params, step, seed=0):
    for i, p in enumerate(params):
        g = torch.Generator().manual_seed(seed * 7919 + step * 1009 + i)
        p.grad = torch.randn(p.shape, generator=g)


def _train(opt, params, first, n, seed=0):
    for s in range(first, first + n):
        _grads(params, s, seed)
        opt.step()


# ------------------------------------------------------------------ item 2: shapes


SAVED_SHAPES = [(4, 6), (5,), (3, 8)]
NOW_SHAPES = [(6, 4), (5,), (3, 8)]  # param 0 changed shape, kept its numel


@SC.scenario()
def shape_changed_state(ctx):
    from zero_ext import ZeroRedundancyOptimizer

    src = make_params(SAVED_SHAPES, seed=3)
    ref = AdamW(src, **HP)
    _train(ref, src, 0, 2)
    saved = ref.state_dict()
    out = {}
    for mode, kw in MODES.items():
        ps = make_params(NOW_SHAPES, seed=4)
        opt = ZeroRedundancyOptimizer(ps, AdamW, process_group=ctx.pg, **kw, **HP)
        rec = out[mode] = {}
        rec["every_rank"] = error_of(lambda: opt.load_state_dict(copy.deepcopy(saved)))
        rec["rank0_only"] = error_of(lambda: opt.load_state_dict(
            copy.deepcopy(saved) if ctx.rank == 0 else None))
        rec["untouched"] = not any(opt.optim.state.values())
        # the same dict into params of the saved shapes loads and trains as torch
        ok_p = make_params(SAVED_SHAPES, seed=3)
        ok = ZeroRedundancyOptimizer(ok_p, AdamW, process_group=ctx.pg, **kw, **HP)
        _train(ok, ok_p, 0, 2)  # the same params as `src` now
        twin_p = [p.detach().clone().requires_grad_() for p in ok_p]
        twin = AdamW(twin_p, **HP)
        twin.load_state_dict(copy.deepcopy(saved))
        fresh_p = [p.detach().clone().requires_grad_() for p in ok_p]
        fresh = ZeroRedundancyOptimizer(fresh_p, AdamW, process_group=ctx.pg, **kw, **HP)
        fresh.load_state_dict(copy.deepcopy(saved) if ctx.rank == 0 else None)
        _train(fresh, fresh_p, 2, 2)
        _train(twin, twin_p, 2, 2)
        rec["zero"], rec["ref"] = detached(fresh_p), detached(twin_p)
    return out


def test_shape_changed_state_is_a_value_error_on_every_rank(world):
    vals = world.values("shape_changed_state")
    for mode in MODES:
        for v in vals:
            rec = v[mode]
            for how in ("every_rank", "rank0_only"):
                err = rec[how]
                assert err is not None, f"{mode}/{how}: the (4, 6) state loaded into (6, 4)"
                assert err[0] == "ValueError", err
                assert "shape" in err[1] and "(6, 4)" in err[1] or "rank" in err[1], err
            assert rec["untouched"], f"{mode}: state was installed before the error"
            assert_params_close(rec["zero"], rec["ref"], **TOL)
        # the rank that validated names the shapes; the others name that rank
        assert "(4, 6)" in vals[0][mode]["every_rank"][1]
        assert_same_on_every_rank([v[mode]["zero"] for v in vals])


def test_plain_adamw_only_fails_at_the_step():
    """What torch does with the same dict (the reason to refuse it at load)."""
    src = make_params(SAVED_SHAPES, seed=3)
    ref = AdamW(src, **HP)
    _train(ref, src, 0, 1)
    ps = make_params(NOW_SHAPES, seed=4)
    opt = AdamW(ps, **HP)
    opt.load_state_dict(ref.state_dict())
    _grads(ps, 1)
    with pytest.raises(RuntimeError):
        opt.step()


# ------------------------------------------------------------------ item 7b: eager state


class WarmMomentumSGD(torch.optim.SGD):
    """A custom optimizer that creates its state when it is built (a warm start of the
    momentum buffer), never lazily."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p]["momentum_buffer"] = torch.full_like(p, 0.25)


EAGER = {"adagrad": (torch.optim.Adagrad, dict(lr=0.1, initial_accumulator_value=0.5),
                     ("param", "flat")),
         "warm_sgd": (WarmMomentumSGD, dict(lr=0.1, momentum=0.9), ("param",))}


@SC.scenario()
def eager_state_survives_prepare(ctx):
    from zero_ext import ZeroRedundancyOptimizer

    shapes = [(6, 4), (5,), (3, 8), (7,)]
    out = {}
    for name, (cls, hp, modes) in EAGER.items():
        for mode in modes:
            ps = make_params(shapes, seed=5)
            rp = [p.detach().clone().requires_grad_() for p in ps]
            opt = ZeroRedundancyOptimizer(ps, cls, process_group=ctx.pg, sharding=mode, **hp)
            ref = cls(rp, **hp)
            rec = out[(name, mode)] = {}
            sd = opt.state_dict()  # accelerate's prepare(): on every rank, then loaded back
            if "state" in sd:
                rec["diff"] = sd_diff(sd, ref.state_dict(), **TOL)
            opt.load_state_dict(copy.deepcopy(sd))
            rec["err"] = error_of(lambda: _train(opt, ps, 0, 3))
            _train(ref, rp, 0, 3)
            rec["zero"], rec["ref"] = detached(ps), detached(rp)
    return out


def test_eager_state_survives_prepare_round_trip(world):
    vals = world.values("eager_state_survives_prepare")
    for key in vals[0]:
        for r, v in enumerate(vals):
            rec = v[key]
            assert rec["err"] is None, (key, r, rec["err"])
            assert rec.get("diff", []) == [], (key, rec["diff"])
            assert_params_close(rec["zero"], rec["ref"], **TOL)
        assert "diff" in vals[0][key], f"{key}: rank 0 got no state dict"
        assert_same_on_every_rank([v[key]["zero"] for v in vals])


# ------------------------------------------------------------------ item 3: one path


@SC.scenario(min_world=2)
def two_optimizers_of_one_group_save_to_one_path(ctx):
    """Every rank saves, but rank 0 saves optimizer A and the others optimizer B (same
    shapes, other params, both over the whole group): one checkpoint cannot hold both."""
    import tempfile

    from zero_ext import ZeroRedundancyOptimizer, checkpoint

    shapes = [(6, 4), (5,), (3, 8)]
    pa, pb = make_params(shapes, seed=6), make_params(shapes, seed=7)
    a = ZeroRedundancyOptimizer(pa, AdamW, process_group=ctx.pg, **HP)
    b = ZeroRedundancyOptimizer(pb, AdamW, process_group=ctx.pg, **HP)
    _train(a, pa, 0, 1)
    _train(b, pb, 0, 1, seed=1)
    root = [tempfile.mkdtemp(prefix="zero_ext_seams_") if ctx.rank == 0 else None]
    torch.distributed.broadcast_object_list(
        root, src=torch.distributed.get_global_rank(ctx.pg, 0), group=ctx.pg)
    path = os.path.join(root[0], "optim")
    err = error_of(lambda: checkpoint.save(a if ctx.rank == 0 else b, path))
    torch.distributed.barrier(group=ctx.pg)
    written = os.path.exists(path) or os.path.exists(path + ".zero_ext-tmp")
    # the same save of one optimizer still works
    ok = error_of(lambda: checkpoint.save(a, path))
    return {"err": err, "written": written, "ok": ok}


def test_two_optimizers_one_path_is_an_error_on_every_rank(world):
    if world.world_size < 2:
        pytest.skip("needs 2+ ranks")
    for v in world.values("two_optimizers_of_one_group_save_to_one_path"):
        assert v["err"] is not None and v["err"][0] == "ValueError", v["err"]
        assert "different optimizers" in v["err"][1] or "rank" in v["err"][1], v["err"]
        assert not v["written"]
        assert v["ok"] is None, v["ok"]


# ------------------------------------------------------------------ item 7a: rendezvous


class _LateArrivalStore:
    """Rank 0's store during a rendezvous that times out: the first store write it makes
    after its timeout (its withdrawal) waits until rank 1 has arrived and finished its own
    rendezvous call: the widest window of the race between a withdrawal and a late rank."""

    def __init__(self, store, side, timeout_s):
        self.store, self.side = store, side
        self.deadline = time.monotonic() + timeout_s
        self.held = False

    def _hold(self):
        if not self.held and time.monotonic() >= self.deadline:
            self.held = True
            self.side.set("late/go", "1")
            try:
                self.side.wait(["late/done"], __import__("datetime").timedelta(seconds=10))
            except RuntimeError:
                pass

    def __getattr__(self, name):
        attr = getattr(self.store, name)
        if name in ("set", "add", "delete_key", "compare_set"):
            def write(*args, **kwargs):
                self._hold()
                return attr(*args, **kwargs)
            return write
        return attr


@SC.scenario(min_world=2, max_world=2)
def rendezvous_timeout_races_a_late_rank(ctx):
    import datetime

    import torch.distributed as dist

    from zero_ext import agree

    saved = (agree.RENDEZVOUS_TIMEOUT_S, agree.RENDEZVOUS_WARN_S,
             dist.distributed_c10d._get_default_store)
    real = saved[2]()
    try:
        if ctx.rank == 0:
            agree.RENDEZVOUS_TIMEOUT_S, agree.RENDEZVOUS_WARN_S = 0.5, 0.2
            wrapped = _LateArrivalStore(real, ctx.store, 0.5)
            dist.distributed_c10d._get_default_store = lambda: wrapped
        else:
            agree.RENDEZVOUS_TIMEOUT_S, agree.RENDEZVOUS_WARN_S = 3.0, 1.0
            ctx.store.wait(["late/go"], datetime.timedelta(seconds=30))
        err = error_of(lambda: agree.rendezvous(ctx.pg, 2, ctx.rank, "seams.test", "hint"))
        if ctx.rank == 1:
            ctx.store.set("late/done", "1")
        if ctx.rank == 0:
            ctx.store.set("late/go", "1")  # (in case rank 0 never wrote after its timeout)
        dist.distributed_c10d._get_default_store = saved[2]
        agree.RENDEZVOUS_TIMEOUT_S, agree.RENDEZVOUS_WARN_S = 3.0, 1.0
        # the next call of both ranks pairs up when the first one agreed
        again = error_of(lambda: agree.rendezvous(ctx.pg, 2, ctx.rank, "seams.test", "hint"))
    finally:
        (agree.RENDEZVOUS_TIMEOUT_S, agree.RENDEZVOUS_WARN_S,
         dist.distributed_c10d._get_default_store) = saved
    return {"err": err, "again": again}


def test_rendezvous_timeout_and_a_late_rank_agree(world):
    if world.world_size != 2:
        pytest.skip("needs exactly 2 ranks")
    vals = world.values("rendezvous_timeout_races_a_late_rank")
    outcomes = [v["err"] is None for v in vals]
    assert outcomes[0] == outcomes[1], f"one rank returned, the other raised: {vals}"
    assert all(v["again"] is None for v in vals), vals


# ------------------------------------------------------------------ structure


@SC.scenario()
def local_order_is_the_same_everywhere(ctx):
    from zero_ext import ZeroRedundancyOptimizer

    shapes = [(6, 4), (5,), (3, 8), (1,), (40,), (2, 2)]
    out = {}
    for mode, kw in MODES.items():
        ps = make_params(shapes, seed=8)
        groups = [{"params": ps[0::2]}, {"params": ps[1::2], "weight_decay": 0.0}]
        opt = ZeroRedundancyOptimizer(groups, AdamW, process_group=ctx.pg, **kw, **HP)
        mine = [(lp.param_id, lp.start, lp.length)
                for gi in range(2) for lp in opt.plan.local_pieces(gi)]
        out[mode] = {"mine": mine,
                     "all": [[(pc[1], pc[2], pc[3]) for pc in opt.plan.local_order(r)]
                             for r in range(ctx.world_size)]}
    return out


def test_every_rank_computes_every_ranks_local_order(world):
    vals = world.values("local_order_is_the_same_everywhere")
    for mode in MODES:
        for r, v in enumerate(vals):
            for other in vals:
                assert other[mode]["all"][r] == v[mode]["mine"], (mode, r)


# ------------------------------------------------------------------ world 4: 2 x 2


def _mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch(step, r):
    g = torch.Generator().manual_seed(step * 101 + r)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _ddp_steps(ddp, opt, rank, first, n):
    for s in range(first, first + n):
        x, y = _batch(s, rank)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()


def _ref_steps(model, opt, world, first, n):
    """The single-process reference: the mean of every rank's loss (what DDP averages)."""
    for s in range(first, first + n):
        loss = sum(torch.nn.functional.mse_loss(model(x), y)
                   for x, y in (_batch(s, r) for r in range(world))) / world
        loss.backward()
        opt.step()
        opt.zero_grad()


def _four_ranks(rank, world, root):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer, checkpoint, hybrid_groups

    shard, _ = hybrid_groups(shard_size=2)
    single, _ = hybrid_groups(shard_size=1)
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out = {}
    for mode in ("param", "flat"):
        for unused in (False, True):
            tag = f"{mode}_{'unused' if unused else 'default'}"
            rec = out[tag] = {}
            model, ref_model = _mlp(0), _mlp(0)
            opt = ZeroRedundancyOptimizer(model.parameters(), AdamW, process_group=shard,
                                          sharding=mode, **HP)
            ref = AdamW(ref_model.parameters(), **HP)
            ddp = DDP(model, find_unused_parameters=unused)
            _ddp_steps(ddp, opt, rank, 0, 2)
            _ref_steps(ref_model, ref, world, 0, 2)
            # the README's idioms: state_dict() on every rank, saved from global rank 0 ...
            sd = opt.state_dict()
            f = os.path.join(root, f"{tag}.pt")
            if rank == 0:
                torch.save(sd, f)
                rec["sd_diff"] = sd_diff(sd, ref.state_dict(), **TOL)
            dist.barrier()
            # ... and resumed with the file read on global rank 0 only
            model2 = _mlp(1)
            model2.load_state_dict(model.state_dict())
            opt2 = ZeroRedundancyOptimizer(model2.parameters(), AdamW, process_group=shard,
                                           sharding=mode, **HP)
            ddp2 = DDP(model2, find_unused_parameters=unused)
            rec["resume"] = error_of(lambda: opt2.load_state_dict(
                torch.load(f, weights_only=True) if rank == 0 else None))
            if rec["resume"] is None:
                _ddp_steps(ddp2, opt2, rank, 2, 2)
                _ref_steps(ref_model, ref, world, 2, 2)
                rec["zero"] = detached(model2.parameters())
                rec["ref"] = detached(ref_model.parameters())
            # mismatches: every rank raises, none returns
            fresh = ZeroRedundancyOptimizer(_mlp(2).parameters(), AdamW, process_group=shard,
                                            sharding=mode, **HP)
            other = fresh.state_dict()  # a real dict with empty state
            rec["err_two_dicts"] = error_of(lambda: fresh.load_state_dict(
                torch.load(f, weights_only=True) if rank == 0 else other if rank == 2
                else None))
            rec["err_none"] = error_of(lambda: fresh.load_state_dict(None))
            bad = torch.load(f, weights_only=True)
            bad["param_groups"] = bad["param_groups"] + bad["param_groups"]
            rec["err_bad_on_0"] = error_of(lambda: fresh.load_state_dict(
                bad if rank == 0 else None))
            rec["fresh_untouched"] = not any(fresh.optim.state.values())
    # item 3: two independent optimizers over halves of the job, equal shapes, one path
    path = os.path.join(root, "one_path")
    half = halves[rank // 2]
    hm = _mlp(10 + rank // 2)  # other values in each half
    hopt = ZeroRedundancyOptimizer(hm.parameters(), AdamW, process_group=half, **HP)
    hopt.zero_grad()
    for p in hm.parameters():
        p.grad = torch.ones_like(p)
    hopt.step()
    out["halves"] = error_of(lambda: checkpoint.save(hopt, path))
    out["halves_written"] = os.path.exists(path) or os.path.exists(path + ".zero_ext-tmp")
    out["halves_own_paths"] = error_of(
        lambda: checkpoint.save(hopt, os.path.join(root, f"half{rank // 2}")))
    # an ensemble: every rank its own optimizer (world 1 each) over other values
    em = _mlp(20 + rank)
    eopt = ZeroRedundancyOptimizer(em.parameters(), AdamW, process_group=single, **HP)
    out["ensemble"] = error_of(lambda: checkpoint.save(eopt, os.path.join(root, "ens")))
    # replicas of one optimizer (2 x 2) still write one checkpoint together
    rm = _mlp(30)
    ropt = ZeroRedundancyOptimizer(rm.parameters(), AdamW, process_group=shard, **HP)
    for p in rm.parameters():
        p.grad = torch.ones_like(p)
    ropt.step()
    out["replicas"] = error_of(lambda: checkpoint.save(ropt, os.path.join(root, "rep")))
    if rank == 0 and out["replicas"] is None:
        out["replicas_meta"] = checkpoint.read_meta(os.path.join(root, "rep"))["replicas"]
    return out


@pytest.fixture(scope="module")
def four():
    import shutil
    import tempfile

    from _dist import run_world

    root = tempfile.mkdtemp(prefix="zero_ext_seams4_")
    try:
        yield run_world(_four_ranks, 4, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_hybrid_rank0_idioms_resume_every_replica(four):
    for tag in four[0]:
        if "_" not in tag or tag.startswith(("halves", "replicas", "ensemble")):
            continue
        assert four[0][tag]["sd_diff"] == [], (tag, four[0][tag]["sd_diff"])
        for r, v in enumerate(four):
            assert v[tag]["resume"] is None, (tag, r, v[tag]["resume"])
            assert_params_close(v[tag]["zero"], v[tag]["ref"], atol=1e-5, rtol=1e-5)
        assert_same_on_every_rank([v[tag]["zero"] for v in four])


def test_hybrid_load_mismatch_raises_on_every_rank(four):
    for tag in ("param_default", "flat_unused"):
        for r, v in enumerate(four):
            rec = v[tag]
            assert rec["err_two_dicts"] is not None, (tag, r)
            assert "different state dicts" in rec["err_two_dicts"][1], rec["err_two_dicts"]
            assert rec["err_none"] is not None and "no rank" in rec["err_none"][1]
            assert rec["err_bad_on_0"] is not None, (tag, r)
            assert rec["fresh_untouched"]


def test_two_optimizers_over_halves_cannot_share_a_path(four):
    from zero_ext.checkpoint import _dcp

    for r, v in enumerate(four):
        assert v["halves"] is not None and v["halves"][0] == "ValueError", (r, v["halves"])
        assert not v["halves_written"]
        if _dcp._maps_its_coordinator() or r < 2:
            assert v["halves_own_paths"] is None, v["halves_own_paths"]
        else:  # (torch 2.6's DCP over ranks {2, 3}: a clear error on both, not a ValueError
            #      from inside DCP)
            assert v["halves_own_paths"][0] == "RuntimeError", v["halves_own_paths"]
            assert "first rank is not global rank 0 (this one's is rank 2)" in \
                v["halves_own_paths"][1], v["halves_own_paths"]
        assert v["ensemble"] is not None and v["ensemble"][0] == "ValueError", v["ensemble"]
        assert v["replicas"] is None, v["replicas"]
    assert four[0]["replicas_meta"] == 2
