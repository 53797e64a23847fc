"""overlap_param_gather=True: the params' exchange left in flight after the step, each
module's next forward waiting for its own params, against DDP + torch.optim.AdamW.

Every path that reads (or writes) params between a step and the next forward must see the
stepped values on every rank: a forward (train, eval, under DDP's no_sync), model.state_dict,
model.load_state_dict (its values must not be overwritten by the exchange afterwards),
opt.state_dict, consolidate_state_dict, checkpoint.save / load, load_state_dict,
add_param_group, clip_grad_norm_, the next step, Join, zero_grad then forward, and the
user's own reads after opt.wait_for_params(). Each is checked by reading the params (or the
forward's output) against the reference's stepped values, in every sharding mode, with and
without reduce_scatter_hook, at worlds 2 and 3 and in a hybrid 2 x 2 layout; the exchange
runs in gloo's form (a worker thread, on one lane of its own or two) and, forced, in NCCL's (every
collective issued at the step, waited for by the forward's thread).
"""
from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch

from _dist import error_of, gloo_available, run_world

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with gloo")

# (1e-5: Adam turns last-ulp differences between zero_ext's fused kernel and torch's loop
# into up to 3e-6 on an element with a tiny grad after a few steps; a stale read is off by
# about lr = 1e-2 in every element it covers)
TOL = dict(atol=1e-5, rtol=1e-5)
HP = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99), eps=1e-4)


class _Net(torch.nn.Module):
    """Layers of different sizes, a buffer (DDP broadcasts buffers at every forward), and a
    layer only some iterations use."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(12, 32)
        self.b = torch.nn.Linear(32, 48)
        self.norm = torch.nn.LayerNorm(48)
        self.c = torch.nn.Linear(48, 5)
        self.side = torch.nn.Linear(48, 5)
        self.register_buffer("shift", torch.zeros(5))

    def forward(self, x, side=False):
        h = self.norm(torch.tanh(self.b(torch.tanh(self.a(x)))))
        out = self.c(h) + self.shift
        return out + self.side(h) if side else out


def _groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


def _batch(rank, it):
    g = torch.Generator().manual_seed(100 * it + rank)
    return torch.randn(4 + rank, 12, generator=g)


def _setup(rank, world, cfg):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer, hybrid_groups, param_gather
    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    param_gather.FORM = cfg.get("form", "auto")  # (a fresh process per world)
    if cfg.get("even_exchange"):  # (all-gathers at world 2 too)
        from zero_ext import sync
        sync.EVEN_EXCHANGE = cfg["even_exchange"]
    # a read that did not wait would read the old values every time, not by chance
    param_gather.WORKER_DELAY_S = 0.05
    group = hybrid_groups(shard_size=2)[0] if cfg.get("hybrid") else None
    kw = dict(bucket_cap_mb=0.002, find_unused_parameters=True)  # (`side`: some iterations)
    ref, cand = DDP(_Net(), **kw), DDP(_Net(), **kw)
    o_ref = torch.optim.AdamW(_groups(ref.module), **HP)
    opt = ZeroRedundancyOptimizer(_groups(cand.module), torch.optim.AdamW, process_group=group,
                                  sharding=cfg["sharding"], overlap_param_gather=True, **HP)
    if cfg.get("hook"):
        cand.register_comm_hook(opt, reduce_scatter_hook)
    if cfg.get("lane_vote_rank") == rank:  # this rank alone asks for a second lane
        opt._param_gather.wants_more_lanes = lambda: True
    return (ref, o_ref), (cand, opt)


def _train(rank, pair, it, side=False):
    ddp, opt = pair
    ddp(_batch(rank, it), side).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _saved_close(saved, ref):
    """A state_dict saved from the model against the reference model's, entry by entry."""
    for (name, a), b in zip(ref.state_dict().items(), saved.values()):
        torch.testing.assert_close(b, a, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def _close(model, ref, what):
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), **TOL,
                                   msg=lambda m, name=name: f"{what}, {name}: {m}")


# every path, after a step, reading through itself: returns what it read (for comparison)
def _read_forward(rank, ref, cand, opt, tmp):
    x = _batch(rank, 99)
    with torch.no_grad():
        return cand(x), ref(x)


def _read_eval_forward(rank, ref, cand, opt, tmp):
    cand.eval()
    ref.eval()
    try:
        with torch.no_grad():
            return cand.module(_batch(rank, 98)), ref.module(_batch(rank, 98))
    finally:
        cand.train()
        ref.train()


def _read_no_sync_forward(rank, ref, cand, opt, tmp):
    with cand.no_sync(), ref.no_sync():
        return cand(_batch(rank, 97)).detach(), ref(_batch(rank, 97)).detach()


def _read_model_state_dict(rank, ref, cand, opt, tmp):
    a, b = cand.module.state_dict(), ref.module.state_dict()
    return [a[k] for k in sorted(a)], [b[k] for k in sorted(b)]


def _write_model_state_dict(rank, ref, cand, opt, tmp):
    """Weights loaded between step and forward stay loaded (the exchange does not land on
    them afterwards): both load the reference's stepped weights scaled by 0.5."""
    sd = {k: v * 0.5 for k, v in ref.module.state_dict().items()}
    cand.module.load_state_dict(sd)
    ref.module.load_state_dict(sd)
    return _read_forward(rank, ref, cand, opt, tmp)


def _read_opt_state_dict(rank, ref, cand, opt, tmp):
    opt.state_dict()  # (collective: rank 0 gets the state)
    return list(cand.parameters()), list(ref.parameters())


def _read_consolidate(rank, ref, cand, opt, tmp):
    opt.consolidate_state_dict(0)
    return list(cand.parameters()), list(ref.parameters())


def _read_checkpoint(rank, ref, cand, opt, tmp):
    from zero_ext import checkpoint

    checkpoint.save(opt, os.path.join(tmp, "ckpt"))
    checkpoint.load(opt, os.path.join(tmp, "ckpt"))
    return list(cand.parameters()), list(ref.parameters())


def _read_load_state_dict(rank, ref, cand, opt, tmp):
    opt.consolidate_state_dict(0)
    opt.load_state_dict(opt.state_dict() if rank == 0 else None)
    return list(cand.parameters()), list(ref.parameters())


def _read_user_after_wait(rank, ref, cand, opt, tmp):
    opt.wait_for_params()  # (an EMA over the params, a logged weight)
    return [p.detach().clone() for p in cand.parameters()], list(ref.parameters())


def _read_zero_grad_then_forward(rank, ref, cand, opt, tmp):
    opt.zero_grad()  # does not wait: the forward after it does
    return _read_forward(rank, ref, cand, opt, tmp)


def _read_join(rank, ref, cand, opt, tmp):
    from torch.distributed.algorithms.join import Join

    with Join([opt]):
        pass
    return list(cand.parameters()), list(ref.parameters())


# (in this order; Join last: its context leaves the joinables' join config enabled, and
# the hook refuses Join)
PATHS = {f.__name__[1:]: f for f in (
    _read_forward, _read_eval_forward, _read_no_sync_forward, _read_model_state_dict,
    _write_model_state_dict, _read_opt_state_dict, _read_consolidate, _read_checkpoint,
    _read_load_state_dict, _read_user_after_wait, _read_zero_grad_then_forward, _read_join)}


def _every_path(rank, world, cfg):
    """Train a few iterations; after every step from the third (the order is agreed after
    the first forward), read through one path and compare with the reference; a final
    parity check of every param and a step that must follow from it."""
    (ref, o_ref), (cand, opt) = _setup(rank, world, cfg)
    tmp = cfg["tmp"]
    names = [n for n in PATHS if not (cfg.get("hook") and n == "read_join")]
    in_flight = 0
    for it in range(len(names) + 2):
        _train(rank, (ref, o_ref), it, side=it % 3 == 1)
        _train(rank, (cand, opt), it, side=it % 3 == 1)
        if it < 2:
            continue
        gather = opt._param_gather
        in_flight += gather.queue is not None
        name = names[it - 2]
        got, want = PATHS[name](rank, ref, cand, opt, tmp)
        for a, b in zip(got if isinstance(got, (list, tuple)) else [got],
                        want if isinstance(want, (list, tuple)) else [want]):
            torch.testing.assert_close(a.detach(), b.detach(), **TOL,
                                       msg=lambda m, name=name: f"after {name}: {m}")
    opt.wait_for_params()
    _close(cand.module, ref.module, "at the end")
    gather = opt._param_gather
    return {"in_flight": in_flight, "param_wait": "param_wait" in opt.last_step_timings,
            "params": [p.detach().clone() for p in cand.parameters()],
            "lanes": (gather.lane_count, len(gather.lanes or []))}


def _same_everywhere(vals):
    for r in range(1, len(vals)):
        for a, b in zip(vals[0]["params"], vals[r]["params"]):
            assert torch.equal(a, b), f"rank {r} differs from rank 0"


@pytest.mark.parametrize("hook", [False, True])
@pytest.mark.parametrize("sharding", ["param", "flat", "even"])
@pytest.mark.parametrize("world", [2, 3])
def test_every_path_reads_the_stepped_params(world, sharding, hook):
    if world == 3 and sharding == "param":
        pytest.skip("world 3: flat and even (2 cores)")
    with tempfile.TemporaryDirectory() as tmp:
        vals = run_world(_every_path, world, dict(sharding=sharding, hook=hook, tmp=tmp))
    _same_everywhere(vals)
    for v in vals:  # (the exchange was left in flight after the steps: the option acts)
        assert v["in_flight"] > 0 and v["param_wait"], v


@pytest.mark.parametrize("form", ["auto", "nccl"])
def test_hybrid_and_nccl_form(form):
    """Hybrid 2 x 2 (the exchange over the shard group) with the hook; and NCCL's form forced
    on gloo: every collective issued at the step, completed by the forward's thread."""
    with tempfile.TemporaryDirectory() as tmp:
        vals = run_world(_every_path, 4, dict(sharding="even", hook=True, hybrid=True, tmp=tmp,
                                             form=form))
    for v in vals:
        assert v["in_flight"] > 0, v


@pytest.mark.parametrize("sharding", ["flat", "even"])
def test_nccl_form_on_gloo(sharding):
    with tempfile.TemporaryDirectory() as tmp:
        vals = run_world(_every_path, 2, dict(sharding=sharding, hook=False, form="nccl",
                                             tmp=tmp))
    _same_everywhere(vals)


def test_a_second_lane_is_taken_on_every_rank_when_one_rank_asks():
    """Even mode at world 3 (all-gathers on the worker's lanes): one rank's forward fell
    behind the exchange (its vote forced), so every rank takes a second lane at the same
    step (agreed): a lane taken on one rank only would pair collectives that differ. Every
    path then reads the stepped params, on every rank."""
    with tempfile.TemporaryDirectory() as tmp:
        vals = run_world(_every_path, 3, dict(sharding="even", hook=True, tmp=tmp,
                                             lane_vote_rank=2))
    _same_everywhere(vals)
    assert [v["lanes"] for v in vals] == [(2, 2)] * 3, vals


def _one_shard_group_widens(rank, world, cfg):
    import torch.distributed as dist

    out = _every_path(rank, world, cfg)
    # a group over the whole job, made after one shard group took a second lane and the
    # other did not: its ranks must name it alike (torch counts the groups each rank made)
    job = dist.new_group(list(range(world)))
    t = torch.ones(1)
    dist.all_reduce(t, group=job)
    return {**out, "job_sum": t.item()}


def test_a_lane_taken_by_one_shard_group_only_leaves_later_groups_working():
    """Hybrid 2 x 2, the exchange by all-gathers (forced at a shard group of 2): rank 0's
    vote widens its shard group {0, 1}, not {2, 3}. Both made their lanes at the same
    step, so a group over the whole job made afterwards works."""
    with tempfile.TemporaryDirectory() as tmp:
        vals = run_world(_one_shard_group_widens, 4, dict(sharding="even", hook=True,
                                                          hybrid=True, tmp=tmp,
                                                          lane_vote_rank=0,
                                                          even_exchange="gather"))
    assert [v["lanes"] for v in vals] == [(2, 2), (2, 2), (1, 2), (1, 2)], vals
    assert [v["job_sum"] for v in vals] == [4.0] * 4, vals


def test_lanes_follow_the_forward():
    """The vote: one lane until the forward, after its first wait, still waited more than
    2 ms and more than half the first wait, in BEHIND_STEPS exchanges in a row that a
    forward consumed (one completed at once by wait_for_params does not count); never with
    ZERO_EXT_GATHER_LANES set, nor for broadcasts (they take two lanes from the start)."""
    from zero_ext import param_gather as pg

    class _Zero:
        last_step_timings: dict = {}

    zero = _Zero()
    g = pg.ParamGather(zero)
    g.gathers = True

    def exchange(first, later, by_forward=True):
        g.first_wait, g.waited, g.first_by_forward = first, first + later, by_forward
        g._finished()

    assert g.lane_count == 1 and not g.wants_more_lanes()
    exchange(0.015, 0.001)        # kept up: later waits below 2 ms
    exchange(0.015, 0.005)        # 5 ms late, but not half the first wait
    assert g.behind_steps == 0
    exchange(0.015, 0.020)
    assert g.behind_steps == 1 and not g.wants_more_lanes()
    exchange(0.015, 0.001)        # one exchange that kept up starts the count again
    exchange(0.015, 0.020)
    assert not g.wants_more_lanes()
    exchange(0.030, 0.0, by_forward=False)  # completed by wait_for_params: not counted
    assert g.behind_steps == 1
    exchange(0.001, 0.004)        # behind twice in a row
    assert g.wants_more_lanes()
    g.gathers = False
    assert not g.wants_more_lanes()
    g.gathers = True
    saved, pg.GATHER_LANES = pg.GATHER_LANES, 1
    try:
        assert not g.wants_more_lanes()
    finally:
        pg.GATHER_LANES = saved
    g.add_lane()
    assert g.lane_count == 2 and g.behind_steps == 0
    exchange(0.001, 0.5)
    exchange(0.001, 0.5)
    assert not g.wants_more_lanes() and g.lane_count == pg.MAX_LANES


def _rank0_saves(rank, world, cfg):
    """After every step rank 0 alone saves model.state_dict() (waiting for the exchange)
    while the other ranks go on to the next forward, whose DDP first broadcasts buffers:
    must neither hang nor save stale weights."""
    (ref, o_ref), (cand, opt) = _setup(rank, world, cfg)
    saved = None
    for it in range(5):
        _train(rank, (ref, o_ref), it)
        _train(rank, (cand, opt), it)
        if rank == 0:
            saved = {k: v.clone() for k, v in cand.module.state_dict().items()}
            want = ref.module.state_dict()
            for k in want:
                torch.testing.assert_close(saved[k], want[k], **TOL)
    opt.wait_for_params()
    _close(cand.module, ref.module, "at the end")
    return True


@pytest.mark.parametrize("sharding", ["flat", "even"])
def test_rank0_saving_model_state_dict_after_step(sharding):
    run_world(_rank0_saves, 3, dict(sharding=sharding, hook=True), timeout=240)


def _bad_options(rank, world, kw):
    from zero_ext import ZeroRedundancyOptimizer

    return error_of(lambda: ZeroRedundancyOptimizer(
        list(_Net().parameters()), torch.optim.AdamW, lr=1e-3, **kw))


@pytest.mark.parametrize("kw,cls,match", [
    (dict(overlap_param_gather=True, parameters_as_bucket_view=True, sharding="flat"),
     "ValueError", "bucket"),
    (dict(overlap_param_gather="yes"), "TypeError", "overlap_param_gather")])
def test_bad_options_raise_on_every_rank(kw, cls, match):
    for err in run_world(_bad_options, 2, kw):
        assert err is not None and err[0] == cls and match in err[1], err


def _auto_sharding(rank, world, kw, local_world):
    from zero_ext import ZeroRedundancyOptimizer

    os.environ["LOCAL_WORLD_SIZE"] = str(local_world)  # torchrun's ranks per node
    return ZeroRedundancyOptimizer(list(_Net().parameters()), torch.optim.AdamW, lr=1e-3,
                                   sharding="auto", **kw).sharding


def test_auto_sharding_is_even_with_the_overlap_across_nodes():
    """sharding="auto" with overlap_param_gather=True over ranks of several nodes: even (the
    exchange left in flight is then a ring all-gather of equal chunks); on one node, or
    without the option, auto keeps its old rule (one host is CPU bound: performance.md)."""
    on = dict(overlap_param_gather=True)
    assert run_world(_auto_sharding, 2, on, 1) == ["even"] * 2
    assert "even" not in run_world(_auto_sharding, 2, on, 2)
    assert "even" not in run_world(_auto_sharding, 2, {}, 1)


class _ReadsChildWeight(torch.nn.Module):
    """A layer applied as `F.linear(x, self.pre.weight, self.pre.bias)` in the parent's own
    forward, before any module is called: no module whose forward runs holds pre's params
    directly (as some GPT code applies a tied embedding or head)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pre = torch.nn.Linear(12, 12)
        self.emb = torch.nn.Linear(12, 24)
        self.mid = torch.nn.Linear(24, 24)

    def forward(self, x):
        x = torch.tanh(torch.nn.functional.linear(x, self.pre.weight, self.pre.bias))
        return torch.tanh(self.mid(torch.tanh(self.emb(x))))


def _child_weight(rank, world, sharding):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer, param_gather

    param_gather.WORKER_DELAY_S = 0.05
    ref, cand = DDP(_ReadsChildWeight()), DDP(_ReadsChildWeight())
    o_ref = torch.optim.AdamW(ref.parameters(), **HP)
    opt = ZeroRedundancyOptimizer(cand.parameters(), torch.optim.AdamW, sharding=sharding,
                                  overlap_param_gather=True, **HP)
    outs = []
    for it in range(5):
        x = _batch(rank, it)
        for ddp, o in ((ref, o_ref), (cand, opt)):
            out = ddp(x)
            out.square().mean().backward()
            o.step()
            o.zero_grad()
            outs.append(out.detach())
        torch.testing.assert_close(outs[-1], outs[-2], **TOL,
                                   msg=lambda m, it=it: f"iteration {it}: {m}")
    return True


@pytest.mark.parametrize("sharding", ["flat", "even"])
def test_a_param_read_outside_its_module(sharding):
    """The parent's forward reads a child's weight without calling the child: the forward's
    first module waits for it (it held a grad, and no module hook claimed it)."""
    run_world(_child_weight, 2, sharding)


class _ReadsAround(torch.nn.Module):
    """Forwards that read params where no module hook of their own waits (found by review):
    - "peek": the parent reads a child's weight before calling that child;
    - "late": a param read only functionally, and only from iteration 2 on (after the
      order was recorded without it);
    - "functional-head": a head only ever read functionally by a parent that holds no
      params (its module never runs: model.load_state_dict must still wait for it)."""

    def __init__(self, variant, width):
        super().__init__()
        torch.manual_seed(0)
        self.variant = variant
        self.head = torch.nn.Linear(width, 5)  # (first in the state dict)
        self.a = torch.nn.Linear(12, width)
        self.b = torch.nn.Linear(width, width)
        self.extra = torch.nn.Linear(width, 5)

    def forward(self, x, it):
        if self.variant == "peek":
            s = self.b.weight.sum() * 1e-2
            return self.head(torch.tanh(self.b(torch.tanh(self.a(x))))) + s
        h = torch.tanh(self.a(x))
        late = 0.0
        if self.variant == "late" and it >= 2:
            late = torch.nn.functional.linear(h, self.extra.weight) * 0.1
        h = torch.tanh(self.b(h))
        return torch.nn.functional.linear(h, self.head.weight, self.head.bias) + late


def _reads_around(rank, world, cfg):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer, param_gather

    param_gather.FORM = cfg["form"]
    param_gather.WORKER_DELAY_S = 0.0 if cfg["variant"] == "functional-head" else 0.05
    ref, cand = (DDP(_ReadsAround(cfg["variant"], cfg["width"]), find_unused_parameters=True)
                 for _ in range(2))
    o_ref = torch.optim.AdamW(ref.parameters(), **HP)
    opt = ZeroRedundancyOptimizer(cand.parameters(), torch.optim.AdamW, sharding=cfg["sharding"],
                                  overlap_param_gather=True, **HP)
    target = {k: v + 1.0 for k, v in ref.module.state_dict().items()}
    for it in range(5):
        for ddp, o in ((ref, o_ref), (cand, opt)):  # (the candidate's step last)
            ddp(_batch(rank, it), it).square().mean().backward()
            o.step()
            o.zero_grad()
        if cfg["variant"] == "functional-head" and it == 3:
            # right after the step, with the exchange in flight: the load must stay
            cand.module.load_state_dict(target)
            ref.module.load_state_dict(target)
    opt.wait_for_params()
    _close(cand.module, ref.module, cfg["variant"])
    return True


@pytest.mark.parametrize("form", ["auto", "nccl"])
@pytest.mark.parametrize("variant,world", [("peek", 2), ("late", 3), ("functional-head", 2)])
def test_params_read_where_no_module_hook_of_theirs_waits(variant, world, form):
    # (width 640: b's weight, 1.6 MB, travels in a collective of its own)
    run_world(_reads_around, world, dict(variant=variant, width=640, form=form,
                                        sharding="even"))


def _freed_soon(refs, ok, limit_s=10.0):
    """ok([alive, ...]) within limit_s. gloo's worker thread drops its reference to a
    finished work (and so to the work's tensors) just after wait() has returned, so a
    buffer is freed a moment after its collective finished, not at once."""
    import gc

    end = time.monotonic() + limit_s
    while True:
        gc.collect()
        if ok([r() is not None for r in refs]):
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.01)


def _staging_lifetimes(rank, world, cfg):
    """The NCCL form (every collective issued at the step, each with its own staging):
    after the forward needed the first items, their staging is gone while the rest of the
    exchange is still in flight (held to the end, it added up to a third or more of the
    params' bytes in even mode at world 4)."""
    import gc
    import weakref

    from zero_ext import replicas, sync

    replicas.DEFERRED_PACK_BYTES = 64  # (a fresh process: several collectives in flight)
    made = []
    real = sync._staging

    def spy(kept, key, n, dtype, device):
        buf = real(kept, key, n, dtype, device)
        if kept is None:
            made.append(weakref.ref(buf))
        return buf

    sync._staging = spy
    (ref, o_ref), (cand, opt) = _setup(rank, world, cfg)
    checked = 0
    for it in range(4):
        _train(rank, (ref, o_ref), it)
        made.clear()
        _train(rank, (cand, opt), it)
        queue = opt._param_gather.queue
        if queue is None:  # (the first steps record the forward's order of use)
            continue
        checked += 1
        assert not queue.done and len(made) >= 2, (len(made), queue.size)
        queue.complete_through(0)  # (as the first module's forward does)
        gc.collect()
        # (the queue holds every unfinished item's staging: no race here)
        assert any(r() is not None for r in made), \
            "the staging of collectives still in flight was freed"
        assert _freed_soon(made, lambda alive: not all(alive)), \
            "no staging was freed once its collective finished"
        opt.wait_for_params()
        assert _freed_soon(made, lambda alive: not any(alive)), "staging outlived its exchange"
        _close(cand.module, ref.module, f"iteration {it}")
    assert checked >= 2, checked
    return True


def test_nccl_form_frees_each_staging_once_finished():
    run_world(_staging_lifetimes, 3, dict(sharding="even", form="nccl"))


def _ends_like_a_script(rank, world, cfg):
    """The end of a training script: after the last step rank 0 alone saves the model
    (its state_dict waits for the exchange in flight) while the other ranks call
    destroy_process_group at once and leave. Their destroy must let the exchange finish
    first (the worker thread is held back 50 ms: without that wait, rank 0 got
    "Connection closed by peer" and no params)."""
    import torch.distributed as dist
    # nanoGPT's style: the function imported at the top, before any exchange
    from torch.distributed import destroy_process_group

    (ref, o_ref), (cand, opt) = _setup(rank, world, cfg)
    for it in range(3):
        _train(rank, (ref, o_ref), it)
        _train(rank, (cand, opt), it)
    if rank != 0:
        if cfg["imported_early"]:
            destroy_process_group()
        else:
            dist.destroy_process_group()
        return True
    time.sleep(0.2)  # (the others are destroying their groups now)
    _saved_close(cand.module.state_dict(), ref.module)
    dist.destroy_process_group()
    return True


@pytest.mark.parametrize("imported_early", [False, True], ids=["attribute", "imported_early"])
@pytest.mark.parametrize("world", [2, 3])
def test_others_leaving_while_rank_0_saves(world, imported_early):
    run_world(_ends_like_a_script, world, dict(sharding="even" if world == 3 else "flat",
                                               imported_early=imported_early))


def _one_shard_group_idle(rank, world, cfg):
    """Two shard groups, {0, 1} and {2, 3}, each its own job: the second trains (its first
    exchange left in flight comes at its second step), the first never steps (it raised,
    say). A group over all four ranks made afterwards must still form: the exchange's own
    groups are made at construction, where both shard groups are, not at a step."""
    import datetime

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer

    mine = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    kw = dict(process_group=mine, find_unused_parameters=True)
    ref, cand = DDP(_Net(), **kw), DDP(_Net(), **kw)
    o_ref = torch.optim.AdamW(_groups(ref.module), **HP)
    opt = ZeroRedundancyOptimizer(_groups(cand.module), torch.optim.AdamW, process_group=mine,
                                  sharding=cfg["sharding"], overlap_param_gather=True, **HP)
    if rank >= 2:
        for it in range(3):
            _train(rank, (ref, o_ref), it)
            _train(rank, (cand, opt), it)
        opt.wait_for_params()
        _close(cand.module, ref.module, "the training shard group")
    everyone = dist.new_group([0, 1, 2, 3], timeout=datetime.timedelta(seconds=30))
    t = torch.ones(1)
    dist.all_reduce(t, group=everyone)
    assert t.item() == 4.0
    return t  # (kept alive through the harness's destroy: see _optimizer_on_some_ranks)


def test_a_group_over_all_ranks_forms_after_one_shard_group_idled():
    run_world(_one_shard_group_idle, 4, dict(sharding="flat"))


def _optimizer_on_some_ranks(rank, world, cfg):
    """A job whose ranks 0 and 1 train a model with their own optimizer (over their group)
    while rank 2 builds none (a separate stage, an evaluator): a group over all ranks made
    afterwards must still form. The exchange's own groups, made by ranks 0 and 1 alone,
    must not change how torch names the groups made after them."""
    import datetime

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer

    pair = dist.new_group([0, 1])
    if rank < 2:
        kw = dict(process_group=pair, find_unused_parameters=True)
        ref, cand = DDP(_Net(), **kw), DDP(_Net(), **kw)
        o_ref = torch.optim.AdamW(_groups(ref.module), **HP)
        opt = ZeroRedundancyOptimizer(_groups(cand.module), torch.optim.AdamW,
                                      process_group=pair, sharding=cfg["sharding"],
                                      overlap_param_gather=True, **HP)
        for it in range(cfg["steps"]):
            _train(rank, (ref, o_ref), it)
            _train(rank, (cand, opt), it)
        opt.wait_for_params()
        _close(cand.module, ref.module, "the training pair")
    everyone = dist.new_group([0, 1, 2], timeout=datetime.timedelta(seconds=30))
    t = torch.ones(1)
    dist.all_reduce(t, group=everyone)
    assert t.item() == 3.0
    # Returned, so the harness holds it through its destroy_process_group: torch < 2.8
    # destroys a gloo group with the GIL held, and a worker dropping the last reference to a
    # tensor whose Python object died first needs the GIL (rank 2 builds no optimizer, so
    # zero_ext's release at shutdown is not installed there). That is torch's own hang,
    # without zero_ext too (4 runs in 10 of this test hung on 2.6.0, rank 2 in destroy).
    return t


@pytest.mark.parametrize("steps", [0, 3], ids=["built_only", "trained"])
def test_a_group_over_all_ranks_forms_after_an_optimizer_on_some_ranks(steps):
    run_world(_optimizer_on_some_ranks, 3, dict(sharding="even", steps=steps))


class _Work:
    """A collective's handle whose first wait fails (a peer lost, a timeout)."""

    def __init__(self, fails: bool):
        self.fails = fails

    def wait(self):
        if self.fails:
            self.fails = False
            raise RuntimeError("collective failed")


@pytest.mark.parametrize("bounded", [False, True], ids=["issued_at_once", "one_per_lane"])
def test_a_failed_collective_fails_every_later_wait(bounded):
    """The exchange's queue, driven from the waiting thread (NCCL's form): once a collective
    failed, every later wait (the next forward, a state_dict, destroy_process_group) raises
    that failure, nothing after it is finished into the params, and the failed item's
    staging stays held (on CUDA its kernel may not have ended)."""
    from zero_ext.sync import LaneQueue

    finished, staging = [], {}

    def issue(item, lane, slot):
        staging[item] = torch.empty(4)
        return _Work(item == 1), staging[item]

    queue = LaneQueue([None, None], [0, 1, 2], issue,
                      lambda item, buf: finished.append(item), bounded=bounded)
    queue.pump()
    with pytest.raises(RuntimeError, match="collective failed"):
        queue.complete_through(2)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="the params' exchange failed: collective failed"):
            queue.complete_through(2)
        with pytest.raises(RuntimeError, match="the params' exchange failed"):
            queue.wait_finished(2)
    assert finished == [0] and queue.finished == 1
    assert queue.inflight[1][1] is staging[1]


def test_a_failure_recorded_before_the_worker_runs_is_the_one_raised():
    """A failure recorded on the queue before the worker thread got to it (a peer lost, an
    error from the waiting thread): the worker issues nothing more, and every wait raises
    that first failure, not one from a collective issued afterwards on a group already torn
    down (it once overwrote the first with "Group ... is not registered")."""
    from zero_ext.sync import LaneQueue

    issued = []

    def issue(item, lane, slot):
        issued.append(item)
        raise ValueError("Group is not registered")

    queue = LaneQueue([None, None], [0, 1, 2], issue, lambda item, buf: None, bounded=False)
    queue.error = RuntimeError("peer lost")
    queue.run_to_end()
    assert issued == [], issued
    with pytest.raises(RuntimeError, match="the params' exchange failed: peer lost"):
        queue.wait_finished(2)


def _exchange_failed_before_destroy(rank, world, cfg):
    """The last step's exchange failed (a peer lost, say) and the script ends with
    destroy_process_group: it destroys the groups, then raises the failure (the params that
    exchange carried are not all there), on every rank; a read through zero_ext raises it too."""
    import torch.distributed as dist

    (ref, o_ref), (cand, opt) = _setup(rank, world, cfg)
    for it in range(3):
        _train(rank, (cand, opt), it)
    queue = opt._param_gather.queue
    with queue.cond:  # (as the worker thread records a failure)
        queue.error = RuntimeError("peer lost")
        queue.cond.notify_all()
    try:
        dist.destroy_process_group()
    except RuntimeError as exc:
        assert "the params' exchange failed: peer lost" in str(exc), exc
    else:
        raise AssertionError("destroy_process_group returned")
    assert not dist.is_initialized()
    try:
        cand.module.state_dict()
    except RuntimeError as exc:
        assert "peer lost" in str(exc), exc
    else:
        raise AssertionError("state_dict read the params")
    return True


def test_a_failed_exchange_is_raised_by_destroy_process_group():
    run_world(_exchange_failed_before_destroy, 2, dict(sharding="flat"))


def _groups_freed_with_the_world(rank, world, cfg):
    """destroy_process_group() frees the extra gloo groups zero_ext made (its optimizers
    still alive, as in a script's last lines): held past it, they were freed at the
    interpreter's teardown, where gloo's threads abort the process ("terminate called
    without an active exception")."""
    import gc
    import weakref

    import torch.distributed as dist

    from zero_ext import ZeroRedundancyOptimizer

    (ref, o_ref), (cand, opt) = _setup(rank, world, cfg)
    for it in range(2):
        _train(rank, (cand, opt), it)
    plain_model = torch.nn.Linear(8, 8)
    plain = ZeroRedundancyOptimizer(plain_model.parameters(), torch.optim.AdamW, lr=1e-2)
    plain_model(torch.ones(2, 8)).sum().backward()
    plain.step()
    extra = list(opt._param_gather.lanes) + plain._replicas.ex.lanes[1:]
    assert extra, "no extra groups: nothing to check"
    refs = [weakref.ref(g) for g in extra]
    del extra
    dist.destroy_process_group()
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} of {len(refs)} groups outlived destroy_process_group"
    return opt is not None and plain is not None  # (both alive to here)


def test_extra_groups_are_freed_with_the_world():
    run_world(_groups_freed_with_the_world, 2, dict(sharding="flat"))


def _dropped_optimizer_scenario(rank, world, cfg):
    """train() returns the model only: its optimizer is freed while the last step's
    exchange is still in flight. The model's state_dict (the checkpoint a script saves
    next) must still wait for the params, on every rank."""
    import gc

    def train():
        (ref, o_ref), (cand, opt) = _setup(rank, world, cfg)
        for it in range(3):
            _train(rank, (ref, o_ref), it)
            _train(rank, (cand, opt), it)
        return ref, cand

    ref, cand = train()
    gc.collect()
    _saved_close(cand.module.state_dict(), ref.module)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_a_dropped_optimizer_still_delivers_its_last_exchange(world):
    run_world(_dropped_optimizer_scenario, world,
              dict(sharding="even" if world == 3 else "flat"))
