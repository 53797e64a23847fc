"""Join with uneven inputs (DDP + ZeRO as torch documents it), local_numel and partition
balance, and parameters_as_bucket_view storage, on gloo worlds of 1, 2 and 3 ranks."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from _dist import (AGAINST_TORCH, WORLD_SIZES, Scenarios, assert_params_close,
                   assert_same_on_every_rank, detached, fake_grads, gloo_available, make_params,
                   make_zero)

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with gloo")

SC = Scenarios(__name__)
AdamW = torch.optim.AdamW


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def world(request):
    return SC.run(request.param)


# --------------------------------------------------------------------------------------------
# Join: rank r runs N_REAL + r iterations inside Join([ddp, opt]).
#
# The first N_REAL iterations are real on every rank (DDP averages the grads).  The extra
# iterations of the longer ranks use a zero loss (out * 0), so the averaged grads are zero
# whichever ranks have joined, and a joined rank's grads are zero too (zero_grad with
# set_to_none=False after every step).  Every param therefore takes exactly one AdamW step per
# iteration of the longest rank, whoever owns it: the result is independent of the partition
# and equals a single-process AdamW run, while the joined ranks must still shadow every
# collective of DDP and of the optimizer step (or the others hang).

N_REAL = 3
JOIN_ATOL, JOIN_RTOL = 1e-5, 1e-5  # DDP's allreduce sums in another order than the reference


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def _batch(rank, i):
    g = torch.Generator().manual_seed(1000 * rank + i)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _loss(out, y):
    return (out - y).pow(2).mean()


def _decay_groups(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _join_run(ctx, zero_kwargs, scaler=False):
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    ref_model = copy.deepcopy(model)
    ddp = DDP(model, process_group=ctx.pg)
    opt = make_zero(_decay_groups(model), AdamW, ctx.pg, lr=1e-2, **zero_kwargs)
    n_mine = N_REAL + ctx.rank
    # GradScaler: a joined rank must still take part in the step's inf agreement
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4) if scaler else None
    with Join([ddp, opt]):
        for i in range(n_mine):
            x, y = _batch(ctx.rank, i)
            out = ddp(x)
            loss = _loss(out, y) if i < N_REAL else (out * 0).sum()
            if sc is None:
                loss.backward()
                opt.step()
            else:
                sc.scale(loss).backward()
                sc.step(opt)
                sc.update()
            opt.zero_grad(set_to_none=False)

    # the same run in one process: average the ranks' losses, then the zero-grad steps
    ref = AdamW(_decay_groups(ref_model), lr=1e-2)
    for i in range(N_REAL + ctx.world_size - 1):
        if i < N_REAL:
            loss = sum(_loss(ref_model(_batch(r, i)[0]), _batch(r, i)[1])
                       for r in range(ctx.world_size)) / ctx.world_size
            loss.backward()
        ref.step()
        ref.zero_grad(set_to_none=False)
    return {"zero": detached(model.parameters()), "ref": detached(ref_model.parameters()),
            "join_device": str(opt.join_device),
            "join_pg_is_pg": opt.join_process_group is (ctx.pg if ctx.pg is not None
                                                         else opt.join_process_group)}


@SC.scenario()
def join_uneven_inputs(ctx):
    return _join_run(ctx, {})


@SC.scenario()
def join_uneven_inputs_bucket_view(ctx):
    return _join_run(ctx, {"parameters_as_bucket_view": True})


@SC.scenario()
def join_uneven_inputs_sharding_flat(ctx):
    return _join_run(ctx, {"sharding": "flat", "parameters_as_bucket_view": True})


@SC.scenario()
def join_uneven_inputs_grad_scaler(ctx):
    if AGAINST_TORCH:
        return None
    return _join_run(ctx, {"sharding": "flat"}, scaler=True)


def _join_stale_grads(ctx, use_scaler):
    """Rank 0 trains 4 more batches than the others; the joined ranks step their shards
    from their last (stale, nonzero) grads, which a GradScaler left scaled."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    opt = make_zero(model.parameters(), AdamW, ctx.pg, lr=1e-2)
    ddp = DDP(model, process_group=ctx.pg)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=10 ** 6,
                              enabled=use_scaler)
    with Join([ddp, opt]):
        for i in range(5 if ctx.rank == 0 else 1):
            x, y = _batch(ctx.rank, i)
            opt.zero_grad()
            sc.scale(_loss(ddp(x), y)).backward()
            sc.step(opt)
            sc.update()
    return detached(model.parameters())


@SC.scenario()
def join_stale_grads_with_and_without_scaler(ctx):
    if AGAINST_TORCH:
        return None
    return {"scaler": _join_stale_grads(ctx, True), "plain": _join_stale_grads(ctx, False)}


def test_join_with_a_grad_scaler_unscales_the_joined_ranks_grads(world):
    """Loss scaling by 2^16 is exact in fp32: with and without the scaler must agree."""
    if AGAINST_TORCH:
        pytest.skip("zero_ext's GradScaler support")
    for v in world.values("join_stale_grads_with_and_without_scaler"):
        assert_params_close(v["scaler"], v["plain"], 0.0, 0.0, what="param")


@SC.scenario()
def clip_inside_join(ctx):
    if AGAINST_TORCH:
        return None
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    opt = make_zero(model.parameters(), AdamW, ctx.pg, lr=1e-2)
    ddp = DDP(model, process_group=ctx.pg)
    try:
        with Join([ddp, opt]):
            x, y = _batch(ctx.rank, 0)
            _loss(ddp(x), y).backward()
            opt.clip_grad_norm_(1.0)
    except NotImplementedError as exc:
        return str(exc)
    return None


def test_clip_grad_norm_inside_join_is_refused_on_every_rank(world):
    if AGAINST_TORCH:
        pytest.skip("zero_ext's clip_grad_norm_")
    for v in world.values("clip_inside_join"):
        assert v is not None and "Join" in v


@pytest.mark.parametrize("name", ["join_uneven_inputs", "join_uneven_inputs_bucket_view",
                                  "join_uneven_inputs_sharding_flat",
                                  "join_uneven_inputs_grad_scaler"])
def test_join_uneven_inputs(world, name):
    if AGAINST_TORCH and ("sharding" in name or "scaler" in name):
        pytest.skip("torch has no sharding argument (nor GradScaler support)")
    vals = world.values(name)
    for r, v in enumerate(vals):
        assert_params_close(v["zero"], v["ref"], JOIN_ATOL, JOIN_RTOL, what=f"rank {r} param")
        assert v["join_device"] == "cpu"
        assert v["join_pg_is_pg"], "join_process_group must be the process group given"
    assert_same_on_every_rank([v["zero"] for v in vals])


# --------------------------------------------------------------------------------------------
# local_numel and balance ("param" mode: whole params, never worse than torch's greedy)

# one big embedding-like param, a few mid-size and many small ones, over three groups
BAL_SHAPES = [(300, 8), (64, 8), (8, 64), (40, 8), (100,), (8,), (8,), (16,), (33,), (7, 7),
              (5,), (1,), (64,), (12, 12)]
BAL_GROUPS = [(0, 1, 2, 3, 9, 13), (4, 5, 6, 7), (8, 10, 11, 12)]


def torch_greedy_max_load(numels_per_group, world_size):
    """torch's rule: per group, params by numel descending, each to the least-loaded rank
    (ties to the lowest rank), loads carried across groups.  Returns the max rank load."""
    load = [0] * world_size
    for numels in numels_per_group:
        for n in sorted(numels, reverse=True):
            r = min(range(world_size), key=lambda k: (load[k], k))
            load[r] += n
    return max(load)


def _balance(ctx, sharding):
    ps = make_params(BAL_SHAPES, seed=31)
    groups = [{"params": [ps[i] for i in g]} for g in BAL_GROUPS]
    opt = make_zero(groups, AdamW, ctx.pg, sharding=sharding, lr=1e-3)
    local = [p for g in opt.optim.param_groups for p in g["params"]]
    index = {id(p): i for i, p in enumerate(ps)}
    fake_grads(ps, 0)
    opt.step()
    state_numel = sum(t.numel() for st in opt.optim.state.values() for k, t in st.items()
                      if torch.is_tensor(t) and k == "exp_avg")
    return {"local_numel": getattr(opt, "local_numel", None),
            "local_param_numel": sum(p.numel() for p in local),
            "local_ids": [index.get(id(p)) for p in local],
            "state_numel": state_numel}


@SC.scenario()
def balance_param(ctx):
    return _balance(ctx, "param")


@SC.scenario()
def balance_auto(ctx):
    return _balance(ctx, "auto")


@pytest.mark.parametrize("name", ["balance_param", "balance_auto"])
def test_local_numel_and_balance(world, name):
    if AGAINST_TORCH:
        pytest.skip("torch has no local_numel")
    vals = world.values(name)
    total = sum(torch.Size(s).numel() for s in BAL_SHAPES)
    loads = [v["local_numel"] for v in vals]
    assert all(isinstance(x, int) for x in loads), f"local_numel must be an int: {loads}"
    assert sum(loads) == total, f"local_numel over ranks {loads} does not sum to {total}"
    bound = torch_greedy_max_load(
        [[torch.Size(BAL_SHAPES[i]).numel() for i in g] for g in BAL_GROUPS], world.world_size)
    assert max(loads) <= bound, f"max load {max(loads)} worse than torch's greedy {bound}"
    if name == "balance_param":
        # whole params: .optim holds the user's own tensors, each on exactly one rank
        owned = sorted(i for v in vals for i in v["local_ids"])
        assert owned == list(range(len(BAL_SHAPES))), f"params owned across ranks: {owned}"
        for r, v in enumerate(vals):
            assert v["local_param_numel"] == v["local_numel"]
            # the AdamW state this rank holds covers exactly local_numel elements
            assert v["state_numel"] == v["local_numel"], (r, v["state_numel"], v["local_numel"])


# --------------------------------------------------------------------------------------------
# parameters_as_bucket_view=True: trainable params of one (device, dtype) are views sharing
# one storage; frozen params stay out; the views survive steps and add_param_group (whose
# params become views too, possibly into a bucket of their own)


def _storage_report(ps):
    return [{"ptr": p.untyped_storage().data_ptr(), "nbytes": p.untyped_storage().nbytes(),
             "dtype": p.dtype, "trainable": p.requires_grad} for p in ps]


@SC.scenario()
def bucket_view_storage(ctx):
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16,
              torch.float32, torch.float32]
    ps = make_params([(8, 4), (4,), (6, 6), (17,), (9,), (3, 3), (5,)], seed=41, dtypes=dtypes)
    ps[5].requires_grad_(False)  # frozen: stays out of the buckets
    extra = make_params([(4, 4), (2,)], seed=42)
    values_before = detached(ps)
    opt = make_zero([{"params": ps[:3]}, {"params": ps[3:], "lr": 1e-2}], AdamW, ctx.pg,
                    parameters_as_bucket_view=True, lr=1e-3)
    values_after_init = detached(ps)
    at_init = _storage_report(ps)
    for s in range(3):
        fake_grads(ps, s)
        opt.step()
    after_steps = _storage_report(ps)
    opt.add_param_group({"params": extra})
    for s in range(3, 5):
        fake_grads(ps + extra, s)
        opt.step()
    after_add = _storage_report(ps)
    added = _storage_report(extra)
    return {"at_init": at_init, "after_steps": after_steps, "after_add": after_add,
            "added": added,
            "values_kept": all(torch.equal(a, b) for a, b in zip(values_before,
                                                                    values_after_init))}


def _check_buckets(report, where):
    trainable = [x for x in report if x["trainable"]]
    by_dtype = {}
    for x in trainable:
        by_dtype.setdefault(x["dtype"], set()).add(x["ptr"])
    for dt, ptrs in by_dtype.items():
        assert len(ptrs) == 1, f"{where}: trainable {dt} params live in {len(ptrs)} storages"
    all_ptrs = [next(iter(p)) for p in by_dtype.values()]
    assert len(set(all_ptrs)) == len(all_ptrs), f"{where}: dtypes share a storage"
    for x in report:
        if not x["trainable"]:
            assert x["ptr"] not in all_ptrs, f"{where}: a frozen param was put in a bucket"


def test_bucket_view_shares_storage(world):
    for r, v in enumerate(world.values("bucket_view_storage")):
        assert v["values_kept"], f"rank {r}: building the buckets changed param values"
        _check_buckets(v["at_init"], f"rank {r} after construction")
        _check_buckets(v["after_steps"], f"rank {r} after steps")
        # add_param_group may put the new params in a bucket of their own, but the old
        # views must survive it and the new params must be bucket views too
        _check_buckets(v["after_add"], f"rank {r} after add_param_group")
        _check_buckets(v["added"], f"rank {r}, the added group")
        assert all(x["nbytes"] > 4 * 16 for x in v["added"]), (
            f"rank {r}: the added params are not views into a bucket")


# --------------------------------------------------------------------------------------------
# ranks that froze different params: every rank raises before the exchange (no hang, no
# mismatched broadcasts), with and without bucket views and overlapped sends


def _frozen_on_one_rank(ctx, zero_kwargs):
    ps = make_params([(64, 8), (8,), (32, 4), (4,)], seed=3)
    opt = make_zero(ps, AdamW, ctx.pg, lr=1e-2, **zero_kwargs)
    fake_grads(ps, 0)
    opt.step()
    if ctx.rank == 0:
        ps[2].requires_grad_(False)
    fake_grads(ps, 1)
    try:
        opt.step()
    except RuntimeError as exc:
        return str(exc)
    return None


@SC.scenario(min_world=2)
def frozen_on_one_rank_plain(ctx):
    return _frozen_on_one_rank(ctx, {"sharding": "param"})


@SC.scenario(min_world=2)
def frozen_on_one_rank_bucket_view(ctx):
    return _frozen_on_one_rank(ctx, {"sharding": "param", "parameters_as_bucket_view": True})


@SC.scenario(min_world=2)
def frozen_on_one_rank_flat_bucket_view(ctx):
    return _frozen_on_one_rank(ctx, {"sharding": "flat", "parameters_as_bucket_view": True})


@pytest.mark.parametrize("name", ["frozen_on_one_rank_plain", "frozen_on_one_rank_bucket_view",
                                  "frozen_on_one_rank_flat_bucket_view"])
def test_ranks_that_froze_different_params_all_raise(world, name):
    if world.world_size == 1 or AGAINST_TORCH:
        pytest.skip("needs 2+ ranks; zero_ext's agreement")
    for v in world.values(name):
        assert v is not None and "require grad" in v, v
