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
MODES = [("param", False), ("flat", False), ("param", True), ("flat", True), ("even", False)]


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


class _DoneOnSecondLook(torch.futures.Future):
    """A hook's future whose done() answers False the first time it is asked: as one whose
    all-reduce completes (on gloo's thread) between two looks of the interleaved hook."""

    def __init__(self):
        super().__init__()
        self.looked = False

    def done(self):
        if not self.looked:
            self.looked = True
            return False
        return super().done()


def _done_on_second_look(state, bucket):
    inner, out = allreduce_hook(state, bucket), _DoneOnSecondLook()
    inner.add_done_callback(lambda f: out.set_result(f.value()))
    return out


def _parity(ctx, opt_name, interleaved, gabv, static, shard_buckets, sharding, bv,
            grouped=False, strided=False, hook=allreduce_hook):
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
        return hook(state, bucket)

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


# every bucket stepped once, whenever its future says it is done
_register("AdamW_interleaved_done_on_second_look", opt_name="AdamW", interleaved=True,
          gabv=False, static=False, shard_buckets=False, sharding="flat", bv=False,
          hook=_done_on_second_look)


# ------------------------------------------------------------------ issue 23: seams


def _named(name, body, min_world=1, **kw):
    """Scenario `name`: body(ctx, **kw), picklable by name (as _register's)."""
    def fn(ctx):
        return body(ctx, **kw)
    fn.__name__ = fn.__qualname__ = name
    globals()[name] = fn
    SC.scenario(min_world=min_world)(fn)
    return name


def _error(a, b):
    return max(((p - q).abs() - RTOL * q.abs()).max().item()
               for p, q in zip(a.parameters(), b.parameters()))


def _lockstep(ctx, ddp_overlap, zero, ddp_local, local, warmup, before=None, after=None,
              set_to_none=True):
    """The warm-up on the overlap model alone (nothing is updated), then ITERS iterations of
    both models on the same inputs; the error after each (the file's atol/rtol measure).
    `before(i)` / `after(i)` run around iteration i on both sides alike."""
    gen = torch.Generator().manual_seed(1000 + ctx.rank)
    inputs = [torch.randn(5, 12, generator=gen) for _ in range(warmup + ITERS)]
    for x in inputs[:warmup]:
        ddp_overlap(x).square().sum().backward()
    errors = []
    for i, x in enumerate(inputs[warmup:]):
        if before is not None:
            before(i)
        # the module's zero_grad: params outside the optimizer too (DDP reduces them all)
        ddp_overlap.zero_grad(set_to_none)
        ddp_overlap(x).square().sum().backward()
        zero.step()
        ddp_local.zero_grad(set_to_none)
        ddp_local(x).square().sum().backward()
        local.step()
        if after is not None:
            after(i)
        errors.append(_error(ddp_overlap, ddp_local))
    return errors


class _Branches(torch.nn.Module):
    """The trunk, a branch no rank uses (DDP leaves its grads None: torch never steps it)
    and one only rank 0 uses (DDP averages its grads into every rank: all step it)."""

    def __init__(self):
        super().__init__()
        self.trunk = _model()
        self.never = torch.nn.Linear(12, 3)
        self.rank0 = torch.nn.Linear(12, 3)
        self.use_rank0 = True

    def forward(self, x):
        y = self.trunk(x)
        return y + self.rank0(x) if self.use_rank0 else y


def _unused_parity(ctx, opt_name, interleaved, sharding, find_unused, zeroed=False):
    """`zeroed`: after the warm-up (DDP recorded the branch as used by no rank), the
    never-used branch is given zero-filled grads, and the loop zeroes grads in place
    (zero_grad(set_to_none=False)): torch's optimizer steps a param that holds a grad
    (weight decay moves it), so zero_ext must too."""
    from zero_ext import ZeroRedundancyOptimizer

    cls, kw = getattr(torch.optim, opt_name), KW[opt_name]
    model = _Branches()
    model.use_rank0 = ctx.rank == 0
    ddp_overlap, ddp_local = (_ddp(model, ctx, False, True, find_unused_parameters=find_unused)
                              for _ in range(2))
    zero = ZeroRedundancyOptimizer(list(ddp_overlap.parameters()), cls, process_group=ctx.pg,
                                   overlap_with_ddp=True, sharding=sharding, **kw)
    ddp_overlap.register_comm_hook(ctx.pg, _hook_ctor(interleaved)(allreduce_hook, ddp_overlap,
                                                                   zero))
    local = cls(list(ddp_local.parameters()), **kw)
    never = [p.detach().clone() for p in ddp_overlap.module.never.parameters()]
    def materialise(i):  # (as scripts that keep every grad allocated do)
        if i == 0:
            for p in list(ddp_overlap.module.never.parameters()) + list(
                    ddp_local.module.never.parameters()):
                p.grad = torch.zeros_like(p)

    errors = _lockstep(ctx, ddp_overlap, zero, ddp_local, local, warmup=3,
                       before=materialise if zeroed else None, set_to_none=not zeroed)
    sd = zero.state_dict()  # collective: the full state on rank 0

    def steps(state):  # which params have state, and their step counters
        return {k: float(v.get("step", -1)) for k, v in state.items()}

    return {"errors": errors, "params": [p.detach().clone() for p in ddp_overlap.parameters()],
            "never_moved": not all(torch.equal(p, q) for p, q in
                                   zip(ddp_overlap.module.never.parameters(), never)),
            "state": steps(sd["state"]) if ctx.rank == 0 else None,
            "torch_state": steps(local.state_dict()["state"])}


UNUSED = []
for _i, (_opt, _il, _fu) in enumerate(itertools.product(("AdamW", "SGD"), (False, True),
                                                        (True, False))):
    _name = f"unused_{_opt}_{'interleaved' if _il else 'hook'}_find{int(_fu)}"
    UNUSED.append(_named(_name, _unused_parity, opt_name=_opt, interleaved=_il,
                         sharding=("param", "flat")[_i % 2], find_unused=_fu))
ZEROED = [_named(f"zeroed_never_{_opt}_{_mode}", _unused_parity, opt_name=_opt,
                 interleaved=False, sharding=_mode, find_unused=False, zeroed=True)
          for _opt, _mode in (("AdamW", "even"), ("SGD", "param"))]


def _added_group_parity(ctx, opt_name, interleaved, sharding, add_at):
    """The optimizer starts with the first two layers of the DDP model and gets the rest by
    add_param_group at stepping iteration `add_at` (0: before any state; 1: with state)."""
    from zero_ext import ZeroRedundancyOptimizer

    cls, kw = getattr(torch.optim, opt_name), KW[opt_name]
    model = _model()
    ddp_overlap, ddp_local = _ddp(model, ctx, False, False), _ddp(model, ctx, False, False)
    zero = ZeroRedundancyOptimizer(list(ddp_overlap.parameters())[:4], cls, process_group=ctx.pg,
                                   overlap_with_ddp=True, sharding=sharding, **kw)
    ddp_overlap.register_comm_hook(ctx.pg, _hook_ctor(interleaved)(allreduce_hook, ddp_overlap,
                                                                   zero))
    local = cls(list(ddp_local.parameters())[:4], **kw)

    def before(i):
        if i == add_at:
            for opt, ddp in ((zero, ddp_overlap), (local, ddp_local)):
                opt.add_param_group({"params": list(ddp.parameters())[4:], "lr": 0.02})

    errors = _lockstep(ctx, ddp_overlap, zero, ddp_local, local, warmup=2, before=before)
    return {"errors": errors, "params": [p.detach().clone() for p in ddp_overlap.parameters()]}


ADDED = []
for _opt, _il, _mode, _at in (("AdamW", False, "param", 0), ("AdamW", True, "flat", 1),
                              ("SGD", False, "flat", 1), ("SGD", True, "param", 0)):
    _name = f"added_group_{_opt}_{'interleaved' if _il else 'hook'}_{_mode}_at{_at}"
    ADDED.append(_named(_name, _added_group_parity, opt_name=_opt, interleaved=_il,
                        sharding=_mode, add_at=_at))


def _scheduled_parity(ctx, opt_name, interleaved, sharding):
    """An lr scheduler on the zero_ext optimizer, stepped after every iteration as in a
    training loop: each new lr must reach the local optimizer's next step."""
    from zero_ext import ZeroRedundancyOptimizer

    cls, kw = getattr(torch.optim, opt_name), KW[opt_name]
    model = _model()
    ddp_overlap, ddp_local = _ddp(model, ctx, False, False), _ddp(model, ctx, False, False)
    zero = ZeroRedundancyOptimizer(_groups(list(ddp_overlap.parameters()), True), cls,
                                   process_group=ctx.pg, overlap_with_ddp=True,
                                   sharding=sharding, **kw)
    ddp_overlap.register_comm_hook(ctx.pg, _hook_ctor(interleaved)(allreduce_hook, ddp_overlap,
                                                                   zero))
    local = cls(_groups(list(ddp_local.parameters()), True), **kw)
    lambdas = [lambda i: 0.5 ** i, lambda i: 1.0 + i]  # one per group, both move every step
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambdas) for o in (zero, local)]
    lrs = []

    def after(i):
        for s in scheds:
            s.step()
        lrs.append(([g["lr"] for g in zero.param_groups], [g["lr"] for g in local.param_groups]))

    errors = _lockstep(ctx, ddp_overlap, zero, ddp_local, local, warmup=2, after=after)
    return {"errors": errors, "lrs": lrs,
            "params": [p.detach().clone() for p in ddp_overlap.parameters()]}


SCHEDULED = []
for _opt, _il, _mode in (("AdamW", False, "flat"), ("SGD", True, "param")):
    _name = f"scheduled_{_opt}_{'interleaved' if _il else 'hook'}_{_mode}"
    SCHEDULED.append(_named(_name, _scheduled_parity, opt_name=_opt, interleaved=_il,
                            sharding=_mode))


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


def _buckets_reset_after_recording(ctx, interleaved):
    """DDP's buckets reset after the hook recorded them (_update_process_group, made to
    shrink or grow DDP's world): the next backward raises on every rank, instead of
    skipping steps and then stepping params with other params' grads once DDP rebuilt its
    buckets in another order."""
    ddp = _ddp(_model(), ctx, False, False)
    zero = _zero(ddp.parameters(), ctx, overlap_with_ddp=True)
    ddp.register_comm_hook(None, _hook_ctor(interleaved)(allreduce_hook, ddp, zero))
    for i in range(5):  # 0: warm-up, 1: recording, 2: the first step
        if i == 3:
            ddp._update_process_group(ctx.pg)
        zero.zero_grad()
        ddp(torch.randn(2, 12)).sum().backward()


@SC.scenario()
def err_buckets_reset_plain(ctx):
    _buckets_reset_after_recording(ctx, False)


@SC.scenario()
def err_buckets_reset_interleaved(ctx):
    _buckets_reset_after_recording(ctx, True)


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


def _lr_differs_on_last_rank(ctx, interleaved):
    """After the warm-up, the last rank alone changes its lr: every rank's backward raises."""
    ddp = _ddp(_model(), ctx, False, False)
    zero = _zero(ddp.parameters(), ctx, overlap_with_ddp=True)
    ddp.register_comm_hook(ctx.pg, _hook_ctor(interleaved)(allreduce_hook, ddp, zero))
    for i in range(4):  # 0: warm-up, 1: recording, 2: the first step
        if i == 2 and ctx.rank == ctx.world_size - 1:
            zero.param_groups[0]["lr"] = 0.02
        zero.zero_grad()
        ddp(torch.randn(2, 12)).sum().backward()


for _il in (False, True):
    _named(f"err_lr_differs_{'interleaved' if _il else 'hook'}", _lr_differs_on_last_rank,
           min_world=2, interleaved=_il)


@SC.scenario()
def err_added_params_not_in_ddp(ctx):
    """add_param_group after the warm-up with a param DDP does not reduce: never a grad."""
    ddp = _ddp(_model(), ctx, False, False)
    zero = _zero(ddp.parameters(), ctx, overlap_with_ddp=True)
    ddp.register_comm_hook(ctx.pg, _hook_ctor(False)(allreduce_hook, ddp, zero))
    for i in range(3):  # 0: warm-up, 1: recording, 2: the first step
        if i == 2:
            zero.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
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


@pytest.mark.parametrize("hook", ["plain", "interleaved"])
def test_buckets_reset_after_recording_raise(world, hook):
    _all_raise(world, f"err_buckets_reset_{hook}", RuntimeError, "buckets were reset")


def test_local_step_failure_reaches_every_rank(world):
    outs = world.outcomes("err_local_step_raises_on_last_rank")
    last = world.world_size - 1
    assert_raised(outs[last], RuntimeError, "broken local step")
    for o in outs[:last]:
        assert_raised(o, RuntimeError, f"rank {last} failed")


def _check_parity(vals):
    for r, v in enumerate(vals):
        assert max(v["errors"]) <= ATOL, f"rank {r}: off by {v['errors']}"
    assert_same_on_every_rank([v["params"] for v in vals])


@pytest.mark.parametrize("name", UNUSED)
def test_unused_params_are_not_stepped(world, name):
    """static_graph (+ find_unused_parameters): a param no rank uses keeps its values and
    gets no state, as with torch's optimizer; one only rank 0 uses steps everywhere."""
    vals = world.values(name)
    _check_parity(vals)
    for r, v in enumerate(vals):
        assert not v["never_moved"], f"rank {r}: the unused branch was stepped"
    assert vals[0]["state"] == vals[0]["torch_state"]


@pytest.mark.parametrize("name", ZEROED)
def test_unused_params_holding_zeroed_grads_are_stepped(world, name):
    """static_graph, a branch no rank uses whose grads are zero tensors (zeroed in place,
    not set to None): torch's optimizer steps it (weight decay, SGD's momentum), and
    zero_ext the same, on every rank."""
    vals = world.values(name)
    _check_parity(vals)
    for r, v in enumerate(vals):  # (weight decay moves it: both classes have some)
        assert v["never_moved"], f"rank {r}: the branch holding grads was not stepped"
    assert vals[0]["state"] == vals[0]["torch_state"]


@pytest.mark.parametrize("name", ADDED)
def test_add_param_group_after_warmup(world, name):
    _check_parity(world.values(name))


def test_added_params_not_in_ddp(world):
    _all_raise(world, "err_added_params_not_in_ddp", ValueError, "none of this DDP model's")


@pytest.mark.parametrize("name", SCHEDULED)
def test_scheduler_reaches_the_step(world, name):
    vals = world.values(name)
    _check_parity(vals)
    for v in vals:
        assert all(a == b for a, b in v["lrs"]) and v["lrs"][0] != v["lrs"][-1]


@pytest.mark.parametrize("interleaved", [False, True], ids=["hook", "interleaved"])
def test_lr_differing_on_one_rank_raises_everywhere(world, interleaved):
    if world.world_size == 1:
        pytest.skip("needs two ranks")
    _all_raise(world, f"err_lr_differs_{'interleaved' if interleaved else 'hook'}",
               RuntimeError, "different hyperparameters")
