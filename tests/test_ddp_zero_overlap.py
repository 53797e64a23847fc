"""torch's overlap_with_ddp API (issue 20, item 1): the ZeRO step inside DDP's backward,
through zero_ext.ddp_zero_hook.hook_with_zero_step[_interleaved], on gloo.

Shaped like torch's own test_ddp_zero_overlap: one DDP model trains with our optimizer built
with overlap_with_ddp=True and the hook registered, after 2 warm-up iterations (3 with
static_graph) in which nothing is updated; a second DDP model (real DDP backward too, same
inputs) trains with a plain torch optimizer. After every iteration the params agree within
fp32 tolerances (atol = rtol = 1e-6: the hook divides before the all-reduce, DDP's own
reduction after, and the fused AdamW may differ in the last ulp) and are bitwise equal
across ranks. Cases: SGD / Adam / AdamW, both hooks, shard_buckets, gradient_as_bucket_view,
static_graph, every sharding mode with and without bucket views, param-group dicts; then the
clear errors, raised on every rank. Worlds 1, 2, 3, one spawned world each.
"""
from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import Scenarios, assert_raised, assert_same_on_every_rank, gloo_available

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with gloo")

SC = Scenarios(__name__)
ATOL = RTOL = 1e-6
ITERS = 4  # stepping iterations after the warm-up
KW = {"SGD": dict(lr=0.01, momentum=0.9, weight_decay=0.001),
      "Adam": dict(lr=0.01, betas=(0.9, 0.99)),
      "AdamW": dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.05)}
MODES = [("param", False), ("flat", False), ("param", True), ("flat", True)]


def _model(strided=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(),
                                torch.nn.Linear(40, 30), torch.nn.Tanh(),
                                torch.nn.Linear(30, 20), torch.nn.Tanh(), torch.nn.Linear(20, 3))
    if strided:  # dense but not row-major (as channels_last): DDP's bucket keeps that order
        for i in (0, 4):
            w = model[i].weight.detach()
            model[i].weight = torch.nn.Parameter(w.t().contiguous().t())
    return model


def _ddp(model, ctx, gabv, static, **kw):
    # small buckets: several per iteration, so per-bucket steps and their order matter
    return DDP(copy.deepcopy(model), process_group=ctx.pg, gradient_as_bucket_view=gabv,
               bucket_cap_mb=0.002, static_graph=static, **kw)


def _groups(params, grouped):
    if not grouped:
        return params
    return [{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0, "lr": 0.02}]


def _hook_ctor(interleaved):
    from zero_ext.ddp_zero_hook import hook_with_zero_step, hook_with_zero_step_interleaved

    return hook_with_zero_step_interleaved if interleaved else hook_with_zero_step


def _parity(ctx, opt_name, interleaved, gabv, static, shard_buckets, sharding, bv,
            grouped=False, strided=False):
    from zero_ext import ZeroRedundancyOptimizer

    cls, kw = getattr(torch.optim, opt_name), KW[opt_name]
    model = _model(strided)
    ddp_overlap, ddp_local = _ddp(model, ctx, gabv, static), _ddp(model, ctx, gabv, static)
    zero = ZeroRedundancyOptimizer(_groups(list(ddp_overlap.parameters()), grouped), cls,
                                   process_group=ctx.pg, overlap_with_ddp=True,
                                   sharding=sharding, parameters_as_bucket_view=bv, **kw)
    buckets = []

    def counting_allreduce(state, bucket):
        buckets.append(bucket.index())
        return allreduce_hook(state, bucket)

    ddp_overlap.register_comm_hook(ctx.pg, _hook_ctor(interleaved)(
        counting_allreduce, ddp_overlap, zero, shard_buckets=shard_buckets))
    local = cls(_groups(list(ddp_local.parameters()), grouped), **kw)
    gen = torch.Generator().manual_seed(1000 + ctx.rank)  # each rank its own batch
    warmup = 3 if static else 2
    inputs = [torch.randn(5, 12, generator=gen) for _ in range(warmup + ITERS)]
    before = [p.detach().clone() for p in ddp_overlap.parameters()]
    for x in inputs[:warmup]:  # torch's warm-up: DDP finalises its buckets, no update
        ddp_overlap(x).square().sum().backward()
    unchanged = all(torch.equal(p, q) for p, q in zip(ddp_overlap.parameters(), before))
    errors, step_returns = [], []
    for x in inputs[warmup:]:
        zero.zero_grad()
        ddp_overlap(x).square().sum().backward()  # steps inside
        snap = [p.detach().clone() for p in ddp_overlap.parameters()]
        step_returns.append(zero.step())  # a no-op, as torch's
        step_returns.append(all(torch.equal(p, q) for p, q in zip(ddp_overlap.parameters(), snap)))
        local.zero_grad()
        ddp_local(x).square().sum().backward()
        local.step()
        errors.append(max(((p - q).abs() - RTOL * q.abs()).max().item()
                          for p, q in zip(ddp_overlap.parameters(), ddp_local.parameters())))
    moved = not all(torch.equal(p, q) for p, q in zip(ddp_overlap.parameters(), before))
    sd = zero.state_dict()  # collective: the state of every param, on rank 0
    n_state = len(sd.get("state", {})) if ctx.rank == 0 else None
    return {"unchanged_in_warmup": unchanged, "errors": errors, "moved": moved,
            "step_returns": step_returns, "buckets": max(buckets) + 1, "n_state": n_state,
            "n_params": len(list(ddp_overlap.parameters())),
            "params": [p.detach().clone() for p in ddp_overlap.parameters()]}


PARITY = []


def _register(name, **kw):
    def fn(ctx):
        return _parity(ctx, **kw)
    fn.__name__ = fn.__qualname__ = name
    globals()[name] = fn  # picklable by name
    SC.scenario()(fn)
    PARITY.append(name)


# torch's 16 cases (SGD), then Adam and AdamW over the same grid; the sharding mode and
# bucket views cycle through the cases
for _i, (_opt, _il, _gabv, _static, _shard) in enumerate(itertools.product(
        ("SGD", "Adam", "AdamW"), (False, True), (False, True), (False, True), (False, True))):
    if _opt != "SGD" and _shard != (_i % 2 == 0):
        continue  # shard_buckets changes nothing here: half the grid for Adam/AdamW
    _mode, _bv = MODES[_i % len(MODES)]
    _register(f"{_opt}_{'interleaved' if _il else 'hook'}_gabv{int(_gabv)}_static{int(_static)}"
              f"_shard{int(_shard)}_{_mode}{'_bv' if _bv else ''}",
              opt_name=_opt, interleaved=_il, gabv=_gabv, static=_static,
              shard_buckets=_shard, sharding=_mode, bv=_bv)
for _opt, _il, (_mode, _bv) in itertools.product(("AdamW", "SGD"), (False, True), MODES[:2]):
    _register(f"groups_{_opt}_{'interleaved' if _il else 'hook'}_{_mode}", opt_name=_opt,
              interleaved=_il, gabv=False, static=False, shard_buckets=False, sharding=_mode,
              bv=_bv, grouped=True)


for _opt, _il, _gabv in (("SGD", False, False), ("AdamW", True, True)):
    _register(f"strided_{_opt}_{'interleaved' if _il else 'hook'}_gabv{int(_gabv)}",
              opt_name=_opt, interleaved=_il, gabv=_gabv, static=False, shard_buckets=False,
              sharding="param", bv=False, strided=True)


# ------------------------------------------------------------------ clear errors


def _zero(params, ctx, cls=torch.optim.SGD, **kw):
    from zero_ext import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, cls, process_group=ctx.pg, lr=0.01, **kw)


@SC.scenario()
def err_zero_without_overlap(ctx):
    ddp = _ddp(_model(), ctx, False, False)
    zero = _zero(ddp.parameters(), ctx)
    _hook_ctor(False)(allreduce_hook, ddp, zero)


@SC.scenario()
def err_torch_zero(ctx):
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    ddp = _ddp(_model(), ctx, False, False)
    zero = TorchZero(ddp.parameters(), torch.optim.SGD, process_group=ctx.pg, lr=0.01)
    _hook_ctor(True)(allreduce_hook, ddp, zero)


@SC.scenario()
def err_not_a_ddp(ctx):
    model = _model()
    zero = _zero(model.parameters(), ctx, overlap_with_ddp=True)
    _hook_ctor(False)(allreduce_hook, model, zero)


@SC.scenario()
def err_other_params_on_rank0(ctx):
    """Rank 0 pairs the hook with an optimizer over a copy of the model (same shapes, so
    construction agrees): a ValueError there, an error naming rank 0 everywhere else."""
    ddp = _ddp(_model(), ctx, False, False)
    params = ([p.detach().clone().requires_grad_() for p in ddp.parameters()] if ctx.rank == 0
              else list(ddp.parameters()))
    zero = _zero(params, ctx, overlap_with_ddp=True)
    _hook_ctor(False)(allreduce_hook, ddp, zero)


@SC.scenario()
def err_find_unused_parameters(ctx):
    ddp = _ddp(_model(), ctx, False, False, find_unused_parameters=True)
    zero = _zero(ddp.parameters(), ctx, overlap_with_ddp=True)
    _hook_ctor(False)(allreduce_hook, ddp, zero)


@SC.scenario()
def err_unsupported_optimizer(ctx):
    _zero(_model().parameters(), ctx, cls=torch.optim.LBFGS, overlap_with_ddp=True)


@SC.scenario()
def err_master_weights(ctx):
    _zero(_model().parameters(), ctx, cls=torch.optim.AdamW, overlap_with_ddp=True,
          master_weights=True)


@SC.scenario()
def err_overlap_flag_differs(ctx):
    _zero(_model().parameters(), ctx, overlap_with_ddp=ctx.rank == 0)


@SC.scenario()
def err_clip_grad_norm(ctx):
    ddp = _ddp(_model(), ctx, False, False)
    zero = _zero(ddp.parameters(), ctx, overlap_with_ddp=True)
    ddp.register_comm_hook(None, _hook_ctor(False)(allreduce_hook, ddp, zero))
    ddp(torch.randn(2, 12)).sum().backward()
    zero.clip_grad_norm_(1.0)


@SC.scenario()
def err_local_step_raises_on_last_rank(ctx):
    """A failure inside one rank's step in backward: every rank's backward raises, no hang."""
    ddp = _ddp(_model(), ctx, False, False)
    zero = _zero(ddp.parameters(), ctx, overlap_with_ddp=True)
    ddp.register_comm_hook(None, _hook_ctor(True)(allreduce_hook, ddp, zero))
    if ctx.rank == ctx.world_size - 1:
        def broken_step(*a, **k):
            raise RuntimeError("broken local step")
        zero.optim.step = broken_step
    for _ in range(3):
        zero.zero_grad()
        ddp(torch.randn(2, 12)).sum().backward()


# ------------------------------------------------------------------ tests


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"world{w}")
def world(request):
    return SC.run(request.param)


@pytest.mark.parametrize("name", PARITY)
def test_ddp_zero_overlap(world, name):
    """Parity with DDP + a local torch optimizer after torch's warm-up, on every rank."""
    vals = world.values(name)
    for r, v in enumerate(vals):
        assert v["unchanged_in_warmup"], f"rank {r}: params changed during the warm-up"
        assert v["moved"], f"rank {r}: the params were never updated"
        assert max(v["errors"]) <= ATOL, f"rank {r}: off by {v['errors']}"
        assert v["step_returns"] == [None, True] * ITERS, f"rank {r}: step() is not a no-op"
        assert v["buckets"] >= 3, "the model should span several DDP buckets"
    assert vals[0]["n_state"] == vals[0]["n_params"]
    assert_same_on_every_rank([v["params"] for v in vals])


def _all_raise(world, name, exc_type, match):
    for o in world.outcomes(name):
        assert_raised(o, exc_type, match)


def test_zero_without_overlap_flag(world):
    _all_raise(world, "err_zero_without_overlap", ValueError, "overlap_with_ddp=True")


def test_torch_zero_is_refused(world):
    _all_raise(world, "err_torch_zero", TypeError, "zero_ext.ZeroRedundancyOptimizer")


def test_not_a_ddp(world):
    _all_raise(world, "err_not_a_ddp", TypeError, "DistributedDataParallel")


def test_params_not_in_ddp_on_one_rank(world):
    outs = world.outcomes("err_other_params_on_rank0")
    assert_raised(outs[0], ValueError, "not params of this DDP model")
    for o in outs[1:]:
        assert_raised(o, RuntimeError, "rank 0 failed")


def test_find_unused_parameters(world):
    _all_raise(world, "err_find_unused_parameters", ValueError, "find_unused_parameters")


def test_unsupported_optimizer(world):
    _all_raise(world, "err_unsupported_optimizer", ValueError, "LBFGS")


def test_master_weights(world):
    _all_raise(world, "err_master_weights", ValueError, "master_weights")


def test_overlap_flag_differs_between_ranks(world):
    if world.world_size == 1:
        pytest.skip("needs two ranks")
    _all_raise(world, "err_overlap_flag_differs", RuntimeError, "overlap_with_ddp")


def test_clip_grad_norm_has_no_place(world):
    _all_raise(world, "err_clip_grad_norm", RuntimeError, "reduce_scatter_hook")


def test_local_step_failure_reaches_every_rank(world):
    outs = world.outcomes("err_local_step_raises_on_last_rank")
    last = world.world_size - 1
    assert_raised(outs[last], RuntimeError, "broken local step")
    for o in outs[:last]:
        assert_raised(o, RuntimeError, f"rank {last} failed")
