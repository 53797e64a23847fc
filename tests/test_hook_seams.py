"""reduce_scatter_hook at its seams with the rest of a training script: the partition
changed between backward and step, DDP and the optimizer on one subgroup (pipeline x data
parallel), an optimizer replaced mid-run while the hook keeps the old one as its state, and
a second (plain) optimizer over params that share a DDP bucket with the hook's.

Each flow runs a REAL DDP backward and is checked against plain DDP + torch optimizers fed
the same per-rank batches (atol/rtol 1e-6), or must raise a clear error on every rank before
anything is stepped.
"""
from __future__ import annotations

import pytest
import torch

from _dist import error_of, gloo_available, run_world
from test_grad_reduce import HP, TOL, _batch, _groups, _Net, _same_everywhere

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with gloo")

SMALL = 0.002  # bucket_cap_mb: several DDP buckets even for this small model


def _step_loss(ddp, rank, it):
    return ddp(_batch(rank, it)).square().mean()


def _train_alongside(rank, candidate, reference, iters):
    """Train (DDP, optimizer) pairs on the same batches; after every step the candidate's
    params must match the reference's. Returns the candidate's final params."""
    for it in range(iters):
        for ddp, opt in (candidate, reference):
            _step_loss(ddp, rank, it).backward()
            opt.step()
            opt.zero_grad()
        for a, b in zip(reference[0].module.parameters(), candidate[0].module.parameters()):
            torch.testing.assert_close(b.detach(), a.detach(), **TOL,
                                       msg=lambda m, it=it: f"iteration {it}: {m}")
    return [p.detach().clone() for p in candidate[0].module.parameters()]


# ------------------------------------------------------------------ the plan changes

def _plan_changes(rank, world, sharding, state="opt"):
    """add_param_group between backward and step, before any state (SGD without momentum
    keeps none): the fresh partition would give elements reduced to one rank to another,
    which holds only its local grad. The added params (the embedding, first in the model)
    are in DDP's last bucket, all-reduced as no optimizer holds them yet; with the hook's
    state None that bucket never reaches the optimizer's reducer."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    def body(net):
        return [p for n, p in net.named_parameters() if not n.startswith("emb")]

    net = _Net()
    ddp, ref = DDP(net, bucket_cap_mb=SMALL), DDP(_Net(), bucket_cap_mb=SMALL)
    opt = ZeroRedundancyOptimizer(body(net), torch.optim.SGD, sharding=sharding, lr=0.1)
    o_ref = torch.optim.SGD(body(ref.module), lr=0.1)
    ddp.register_comm_hook(opt if state == "opt" else None, reduce_scatter_hook)
    err, untouched = None, None
    for it in range(4):
        if it == 1:  # (DDP's buckets are rebuilt: small ones, reduce-scattered, from here)
            _step_loss(ddp, rank, it).backward()
            opt.add_param_group({"params": list(net.emb.parameters())})
            o_ref.add_param_group({"params": list(ref.module.emb.parameters())})
            before = [p.detach().clone() for p in net.parameters()]
            err = error_of(opt.step)
            untouched = all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
            net.zero_grad()  # the script goes on with a fresh backward
            if err is not None:
                continue
            # no reduced element changed owner (the same on every rank): a normal step
            _step_loss(ref, rank, it).backward()
            o_ref.step()
            ref.module.zero_grad()
            continue
        for d, o in ((ddp, opt), (ref, o_ref)):
            _step_loss(d, rank, it).backward()
            o.step()
            d.module.zero_grad()  # (the params not in the optimizer yet too)
        for a, b in zip(ref.module.parameters(), net.parameters()):
            torch.testing.assert_close(b.detach(), a.detach(), **TOL,
                                       msg=lambda m, it=it: f"iteration {it}: {m}")
    return err, untouched


@pytest.mark.parametrize("state", ["opt", "none"])
@pytest.mark.parametrize("world", [2, 3])
def test_partition_changed_after_the_hook_raises_on_every_rank(world, state):
    """Flat mode: the new group enlarges every rank's range, so reduced elements move.
    (With state None the step read the moved grads silently, 5e-3 from DDP + SGD.)"""
    for err, untouched in run_world(_plan_changes, world, "flat", state):
        assert err is not None and err[0] == "RuntimeError", err
        assert "add_param_group" in err[1] and "partition" in err[1], err
        assert untouched


def test_partition_kept_for_the_reduced_params_is_a_normal_step():
    """Param mode here keeps every reduced param on its owner: no error, exact steps."""
    for err, _ in run_world(_plan_changes, 2, "param"):
        assert err is None, err


# ------------------------------------------------------------------ subgroups

def _subgroup(rank, world, how):
    """World 4 as two independent data-parallel groups {0,1} and {2,3} (the data-parallel
    dimension of a pipeline layout): DDP and the optimizer on the same subgroup."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = halves[rank // 2]
    ddp_group = mine if how == "same" else None  # "world": DDP over the whole job
    net = _Net()
    ddp = DDP(net, bucket_cap_mb=SMALL, process_group=ddp_group)
    opt = ZeroRedundancyOptimizer(_groups(net), torch.optim.AdamW, process_group=mine,
                                  sharding="flat", **HP)
    ddp.register_comm_hook(opt, reduce_scatter_hook)
    if how != "same":
        return error_of(lambda: _step_loss(ddp, rank, 0).backward())
    ref = DDP(_Net(), bucket_cap_mb=SMALL, process_group=mine)
    o_ref = torch.optim.AdamW(_groups(ref.module), **HP)
    return _train_alongside(rank, (ddp, opt), (ref, o_ref), iters=3)


def test_ddp_and_optimizer_on_one_subgroup():
    out = run_world(_subgroup, 4, "same")
    _same_everywhere(out[:2])
    _same_everywhere(out[2:])


def _hybrid_shard_group_as_ddp_group(rank, world):
    """A group that hybrid_groups() made, used as DDP's own group too: no replicas to
    average over (DDP averages over the same ranks as the optimizer shards)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer, hybrid_groups
    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    shard, _ = hybrid_groups(shard_size=2)
    net = _Net()
    ddp = DDP(net, bucket_cap_mb=SMALL, process_group=shard)
    opt = ZeroRedundancyOptimizer(_groups(net), torch.optim.AdamW, process_group=shard,
                                  sharding="param", **HP)
    ddp.register_comm_hook(opt, reduce_scatter_hook)
    ref = DDP(_Net(), bucket_cap_mb=SMALL, process_group=shard)
    o_ref = torch.optim.AdamW(_groups(ref.module), **HP)
    return _train_alongside(rank, (ddp, opt), (ref, o_ref), iters=3)


def test_ddp_on_a_hybrid_shard_group_itself():
    out = run_world(_hybrid_shard_group_as_ddp_group, 4)
    _same_everywhere(out[:2])
    _same_everywhere(out[2:])


def test_optimizer_subgroup_under_a_whole_job_ddp_is_an_error():
    """Not a hybrid_groups() layout: DDP averages over the job, the optimizer knows only
    its subgroup, so the ranks holding the same shard elsewhere are unknown."""
    for err in run_world(_subgroup, 4, "world"):
        assert err is not None and err[0] == "ValueError", err
        assert "hybrid_groups()" in err[1] and "[0, 1, 2, 3]" in err[1], err


# ------------------------------------------------------------------ a replaced optimizer

def _replaced(rank, world, state_none):
    """The hook was registered with one optimizer; mid-run the script builds another (other
    sharding mode) and loads the first one's state into it. DDP takes no second hook."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    net = _Net()
    ddp = DDP(net, bucket_cap_mb=SMALL)
    old = ZeroRedundancyOptimizer(_groups(net), torch.optim.AdamW, sharding="param", **HP)
    ddp.register_comm_hook(None if state_none else old, reduce_scatter_hook)
    ref = DDP(_Net(), bucket_cap_mb=SMALL)
    o_ref = torch.optim.AdamW(_groups(ref.module), **HP)
    opt = old
    for it in range(4):
        if it == 2:
            opt = ZeroRedundancyOptimizer(_groups(net), torch.optim.AdamW, sharding="flat",
                                          **HP)
            opt.load_state_dict(old.state_dict())
        _step_loss(ddp, rank, it).backward()
        before = [p.detach().clone() for p in net.parameters()]
        err = error_of(opt.step)
        if err is not None:
            return err, all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
        opt.zero_grad()
        _step_loss(ref, rank, it).backward()
        o_ref.step()
        o_ref.zero_grad()
        for a, b in zip(ref.module.parameters(), net.parameters()):
            torch.testing.assert_close(b.detach(), a.detach(), **TOL)
    return None, True


@pytest.mark.parametrize("world", [2, 3])
def test_replaced_optimizer_is_an_error_on_every_rank(world):
    for err, untouched in run_world(_replaced, world, False):
        assert err is not None and err[0] == "RuntimeError", err
        assert "another ZeroRedundancyOptimizer" in err[1] and "None" in err[1], err
        assert untouched


def test_replaced_optimizer_with_state_none_follows_the_new_one():
    for err, _ in run_world(_replaced, 2, True):
        assert err is None, err


def _replaced_between(rank, world):
    """state None, the optimizer replaced between backward and step, the old one dropped:
    that backward's grads were cut by the old plan, whatever has become of it."""
    import gc

    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    net = _Net()
    ddp = DDP(net, bucket_cap_mb=SMALL)
    opt = ZeroRedundancyOptimizer(_groups(net), torch.optim.AdamW, sharding="param", **HP)
    ddp.register_comm_hook(None, reduce_scatter_hook)
    for it in range(2):
        _step_loss(ddp, rank, it).backward()
        opt.step()
        opt.zero_grad()
    _step_loss(ddp, rank, 2).backward()
    new = ZeroRedundancyOptimizer(_groups(net), torch.optim.AdamW, sharding="flat", **HP)
    new.load_state_dict(opt.state_dict())
    del opt
    gc.collect()
    before = [p.detach().clone() for p in net.parameters()]
    err = error_of(new.step)
    return err, all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_optimizer_replaced_between_backward_and_step_is_an_error():
    for err, untouched in run_world(_replaced_between, 2):
        assert err is not None and "another ZeroRedundancyOptimizer" in err[1], err
        assert untouched


# ------------------------------------------------------------------ a model wrapped again

def _gloo_carries_complex():
    """Whether this torch's gloo takes complex tensors (2.6's raises 'Invalid scalar type'
    in DDP's first broadcast). Every rank asks, so the probe is itself a collective."""
    try:
        torch.distributed.broadcast(torch.zeros(1, dtype=torch.complex64), 0)
    except RuntimeError:
        return False
    return True


class _ComplexNet(torch.nn.Module):
    """A complex param beside real ones: DDP's first iteration buckets them apart (by
    dtype), so a static_graph DDP's first backward hands the hook two buckets. Where gloo
    cannot carry complex tensors, a float64 param splits the buckets the same way."""

    def __init__(self, complex_param=True):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Linear(12, 24)
        if complex_param:
            self.c = torch.nn.Parameter(torch.complex(torch.randn(24), torch.randn(24)) * 0.5)
        else:
            self.c = torch.nn.Parameter(torch.randn(24, dtype=torch.float64) * 0.5)
        self.head = torch.nn.Linear(24, 5)

    def forward(self, x):
        h = torch.tanh(self.emb(x))
        if not self.c.is_complex():
            z = h.double() * self.c
            return self.head(h + 0.5 * z.float())
        z = h.to(torch.complex64) * self.c
        return self.head(h + 0.5 * z.real + 0.25 * z.imag)


def _wrapped_again(rank, world, sharding, old, reader):
    """A new static_graph DDP over the same module mid-run (a new phase of the script, as
    after a cast), the old DDP dropped or still referenced. In the new DDP's first backward
    DDP hands every bucket to the hook as bucket 0 and none as the last: the grads must be
    DDP's there (all-reduced, as in any DDP's first iteration), read by `reader`: torch's
    clip (right where the grads are whole), or gather_grads and a look at every grad. Then
    training goes on against DDP + AdamW, and the hook's savings come back (partial grads)
    once the new DDP has rebuilt its buckets. (The hook took the new DDP for the gone or
    the old one and reduce-scattered those buckets, unrecorded: gather_grads gathered
    nothing and the step read partial grads unchecked.)"""
    import gc

    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.ddp_zero_hook import gather_grads, reduce_scatter_hook

    kw = dict(bucket_cap_mb=SMALL, static_graph=True)
    complex_param = _gloo_carries_complex()
    net, ref_net = _ComplexNet(complex_param), _ComplexNet(complex_param)
    opt = ZeroRedundancyOptimizer(_groups(net), torch.optim.AdamW, sharding=sharding, **HP)
    o_ref = torch.optim.AdamW(_groups(ref_net), **HP)
    ddp, ref = DDP(net, **kw), DDP(ref_net, **kw)
    ddp.register_comm_hook(opt, reduce_scatter_hook)
    kept = []
    partial = None
    for it in range(7):
        if it == 3:  # a new phase: new DDP models, the hook registered again
            if old == "kept":
                kept.append(ddp)
            ddp, ref = DDP(net, **kw), DDP(ref_net, **kw)
            ddp.register_comm_hook(opt, reduce_scatter_hook)
            gc.collect()
        _step_loss(ddp, rank, it).backward()
        _step_loss(ref, rank, it).backward()
        if it == 3 and reader == "torch-clip":
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
            torch.nn.utils.clip_grad_norm_(ref_net.parameters(), 0.05)
        elif it in (3, 6):
            if it == 6:  # (the new DDP's buckets are rebuilt: reduce-scattered again)
                partial = any(not torch.allclose(a.grad, b.grad, **TOL)
                              for a, b in zip(ref_net.parameters(), net.parameters()))
            gather_grads(opt)
            for (name, a), b in zip(ref_net.named_parameters(), net.parameters()):
                torch.testing.assert_close(b.grad, a.grad, **TOL,
                                           msg=lambda m, it=it, name=name: f"{it} {name}: {m}")
        opt.step()
        o_ref.step()
        opt.zero_grad()
        o_ref.zero_grad()
        for (name, a), b in zip(ref_net.named_parameters(), net.parameters()):
            torch.testing.assert_close(b.detach(), a.detach(), **TOL,
                                       msg=lambda m, it=it, name=name: f"{it} {name}: {m}")
    return partial


@pytest.mark.parametrize("sharding,old,reader", [
    ("param", "dropped", "gather"), ("even", "kept", "gather"),
    ("flat", "dropped", "torch-clip"), ("param", "kept", "torch-clip")])
def test_a_static_graph_ddp_made_anew_reduces_its_first_backward_as_ddp(sharding, old,
                                                                         reader):
    for partial in run_world(_wrapped_again, 2, sharding, old, reader):
        assert partial is True  # (and not all-reduced from then on)


def _wrapped_again_over_a_subgroup(rank, world):
    """World 4, the optimizer over the job: the model wrapped again in a DDP over {0,1} /
    {2,3}, the first DDP dropped. The new DDP's pairing with the optimizer's group is checked
    like the first one's: an error on every rank at its first backward. (The hook took the
    new DDP for the one gone, and averaged its grads over the job, not DDP's group.)"""
    import gc

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    net = _Net()
    ddp = DDP(net, bucket_cap_mb=SMALL)
    opt = ZeroRedundancyOptimizer(_groups(net), torch.optim.AdamW, sharding="flat", **HP)
    ddp.register_comm_hook(opt, reduce_scatter_hook)
    for it in range(3):
        _step_loss(ddp, rank, it).backward()
        opt.step()
        opt.zero_grad()
    ddp = DDP(net, bucket_cap_mb=SMALL, process_group=halves[rank // 2])
    ddp.register_comm_hook(opt, reduce_scatter_hook)
    gc.collect()
    return error_of(lambda: _step_loss(ddp, rank, 3).backward())


def test_ddp_made_anew_over_another_group_is_checked_again():
    for rank, err in enumerate(run_world(_wrapped_again_over_a_subgroup, 4)):
        assert err is not None and err[0] == "ValueError", err
        assert f"{[0, 1] if rank < 2 else [2, 3]}" in err[1] and "[0, 1, 2, 3]" in err[1], err


# ------------------------------------------------------------------ a second optimizer

def _second_optimizer(rank, world):
    """A plain SGD over the head (sharing a DDP bucket, so a version counter under
    gradient_as_bucket_view, with other params) and zero_ext over the rest; the SGD steps
    and zeroes its grads in place first. That bucket was all-reduced: nothing to flag."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    def split(net):
        head = list(net.head.parameters()) + list(net.norm.parameters())
        ids = {id(p) for p in head}
        return head, [p for p in net.parameters() if id(p) not in ids]

    net, ref_net = _Net(), _Net()
    ddp = DDP(net, bucket_cap_mb=SMALL, gradient_as_bucket_view=True)
    ref = DDP(ref_net, bucket_cap_mb=SMALL, gradient_as_bucket_view=True)
    head, body = split(net)
    r_head, r_body = split(ref_net)
    sgd, zero = torch.optim.SGD(head, lr=0.1), ZeroRedundancyOptimizer(
        body, torch.optim.AdamW, sharding="flat", **HP)
    ddp.register_comm_hook(zero, reduce_scatter_hook)
    r_sgd, r_adamw = torch.optim.SGD(r_head, lr=0.1), torch.optim.AdamW(r_body, **HP)
    for it in range(3):
        for d, opts in ((ddp, (sgd, zero)), (ref, (r_sgd, r_adamw))):
            _step_loss(d, rank, it).backward()
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=False)
        for a, b in zip(ref_net.parameters(), net.parameters()):
            torch.testing.assert_close(b.detach(), a.detach(), **TOL)
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("world", [2, 3])
def test_second_optimizer_over_a_shared_bucket(world):
    _same_everywhere(run_world(_second_optimizer, world))


def _clip_with_a_foreign_last_bucket(rank, world):
    """The embedding (first in the model: DDP's last bucket) under a plain SGD, the rest
    under zero_ext with the hook's state None, and torch's clip_grad_norm_ over the body's
    partial grads after backward: the step must raise on every rank, with nothing stepped.
    (The record of what the hook reduced was queued only at a last bucket that reached the
    optimizer: here the clip went unseen and the step read clipped partial grads.)"""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    net = _Net()
    ddp = DDP(net, bucket_cap_mb=SMALL)
    emb = list(net.emb.parameters())
    body = [p for n, p in net.named_parameters() if not n.startswith("emb")]
    sgd = torch.optim.SGD(emb, lr=0.1)
    zero = ZeroRedundancyOptimizer(body, torch.optim.AdamW, sharding="flat", **HP)
    ddp.register_comm_hook(None, reduce_scatter_hook)
    for it in range(2):  # (DDP's first iteration all-reduces everything)
        _step_loss(ddp, rank, it).backward()
        if it == 1:
            torch.nn.utils.clip_grad_norm_(body, 1e-3)
        sgd.step()
        before = [p.detach().clone() for p in body]
        err = error_of(zero.step)
        zero.zero_grad()
        sgd.zero_grad()
    return err, all(torch.equal(a, b) for a, b in zip(before, body))


@pytest.mark.parametrize("world", [2, 3])
def test_torch_clip_with_the_last_bucket_under_another_optimizer_raises(world):
    for err, untouched in run_world(_clip_with_a_foreign_last_bucket, world):
        assert err is not None and "clip_grad_norm_" in err[1], err
        assert untouched


# ------------------------------------------------------------------ odd params

class _WithEmpty(torch.nn.Module):
    """_Net plus a trainable param of no element (a zero-width adapter, a pruned bias)."""

    def __init__(self):
        super().__init__()
        self.net = _Net()
        self.empty = torch.nn.Parameter(torch.zeros(0, 4))

    def forward(self, x):
        return self.net(x) + self.empty.sum()


def _empty_param(rank, world, sharding):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    net, ref_net = _WithEmpty(), _WithEmpty()
    ddp, ref = DDP(net, bucket_cap_mb=SMALL), DDP(ref_net, bucket_cap_mb=SMALL)
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, sharding=sharding,
                                  **HP)
    ddp.register_comm_hook(opt, reduce_scatter_hook)
    return _train_alongside(rank, (ddp, opt), (ref, torch.optim.AdamW(ref_net.parameters(),
                                                                      **HP)), iters=3)


@pytest.mark.parametrize("sharding", ["flat", "even"])
def test_a_param_without_elements(sharding):
    _same_everywhere(run_world(_empty_param, 2, sharding))


# ------------------------------------------------------------------ two DDP models

CLIP_AT = 2  # (DDP's first iteration all-reduces: its grads are whole, torch's clip is right)


def _two_models(rank, world, sharding, when):
    """An encoder and a head, each in its own DDP with the hook, under one optimizer; each
    iteration runs the encoder's backward, then the head's (on the encoder's output,
    detached). At iteration CLIP_AT the script clips the encoder's grads with torch's
    clip_grad_norm_(..., 0.05), `when` = "between" the two backwards or "after" both: those
    grads are partial (reduced to their owners) and were recorded by an earlier backward
    than the last one. The step must raise on every rank with nothing stepped; the script
    then zeroes the grads and goes on, equal to DDP + torch.optim.AdamW (which skips that
    iteration too) after every step. Returns (error, untouched, how far a step that did
    not raise landed from DDP + AdamW given the same clip, the reference's encoder norm)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    def models():
        enc = _Net()
        torch.manual_seed(1)
        return enc, torch.nn.Linear(5, 3)

    def params(enc, head):
        return list(enc.parameters()) + list(head.parameters())

    def groups(enc, head):  # the decay / no-decay dicts of a real script, over both models
        ps = params(enc, head)
        return [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
                {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]

    cand, ref = models(), models()
    c_ddp = [DDP(m, bucket_cap_mb=SMALL) for m in cand]
    r_ddp = [DDP(m, bucket_cap_mb=SMALL) for m in ref]
    opt = ZeroRedundancyOptimizer(groups(*cand), torch.optim.AdamW, sharding=sharding, **HP)
    for d in c_ddp:
        d.register_comm_hook(opt, reduce_scatter_hook)
    o_ref = torch.optim.AdamW(groups(*ref), **HP)

    def backward(ddps, mods, it, clip):
        enc, head = ddps
        h = enc(_batch(rank, it))
        (h.square().mean() * 0.1).backward()
        norm = None
        if clip and when == "between":
            norm = torch.nn.utils.clip_grad_norm_(mods[0].parameters(), 0.05)
        head(h.detach()).square().mean().backward()
        if clip and when == "after":
            norm = torch.nn.utils.clip_grad_norm_(mods[0].parameters(), 0.05)
        return norm

    err, untouched, silent, ref_norm = None, None, None, None
    for it in range(CLIP_AT + 3):
        clip = it == CLIP_AT
        backward(c_ddp, cand, it, clip)
        before = [p.detach().clone() for p in params(*cand)]
        e = error_of(opt.step)
        if clip:
            err = e
            untouched = all(torch.equal(a, b) for a, b in zip(before, params(*cand)))
            ref_norm = float(backward(r_ddp, ref, it, clip))  # (DDP's whole grads)
            if e is None:  # what the step read: compare with the same clip of whole grads
                o_ref.step()
                silent = max(float((a - b).abs().max())
                             for a, b in zip(params(*ref), params(*cand)))
        else:
            assert e is None, f"iteration {it}: {e}"
            backward(r_ddp, ref, it, clip)
            o_ref.step()
            for a, b in zip(params(*ref), params(*cand)):
                torch.testing.assert_close(b.detach(), a.detach(), **TOL,
                                           msg=lambda m, it=it: f"iteration {it}: {m}")
        opt.zero_grad()
        o_ref.zero_grad()
        if clip and e is None:
            break  # (the two sides part ways here)
    return err, untouched, silent, ref_norm


@pytest.mark.parametrize("sharding,when", [("flat", "between"), ("flat", "after"),
                                           ("param", "between"), ("even", "after")])
def test_torch_clip_of_an_earlier_models_grads_raises(sharding, when):
    """Two DDP models under one optimizer: torch's clip of the first model's partial grads,
    between the two backwards or after both, is caught at the step on every rank, however
    many backwards recorded grads after it. (A record that kept only the last backward's
    grads stepped the clipped partial grads silently: 5.6e-4 from DDP + AdamW.)"""
    for err, untouched, silent, ref_norm in run_world(_two_models, 2, sharding, when):
        assert ref_norm > 0.05, ref_norm  # (the clip changes the grads)
        assert err is not None, (
            f"the step read clipped partial grads without an error: {silent:.1e} from DDP + "
            "AdamW given the same clip")
        assert err[0] == "RuntimeError" and "clip_grad_norm_" in err[1], err
        assert untouched


# ------------------------------------------------------------------ the one seam

_HOOK_MODULES = ("reduce_scatter/__init__.py", "reduce_scatter/hook.py",
                 "reduce_scatter/plan.py", "reduce_scatter/transport.py",
                 "reduce_scatter/record.py", "reduce_scatter/checks.py", "overlap.py")


def _private_names_of_the_optimizer() -> set[str]:
    """Private attributes zero.py gives ZeroRedundancyOptimizer: its `self._x = ...` and its
    `def _x` (read from the source, so a new one is covered without listing it here)."""
    import ast
    import pathlib

    import zero_ext

    tree = ast.parse((pathlib.Path(zero_ext.__file__).parent / "zero.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("_"):
            names.add(node.name)
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id == "self"):
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_hooks_reach_the_optimizer_only_through_its_seam():
    """reduce_scatter/ and overlap.py read no private attribute of the optimizer (its
    `hook_seam` is what they may use); their own objects (`self.`) do not count."""
    import ast
    import pathlib

    import zero_ext

    private = _private_names_of_the_optimizer()
    assert {"_all_params", "_replicas", "_stepper", "_fused_step_supported"} <= private
    found = []
    for name in _HOOK_MODULES:
        path = pathlib.Path(zero_ext.__file__).parent / name
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in private
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                found.append(f"{name}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.Constant) and node.value in private:
                found.append(f"{name}:{node.lineno} {node.value!r}")  # getattr / __dict__
    assert not found, found


def test_the_optimizer_imports_no_hook():
    """Building and stepping an optimizer (and its state dict) loads neither hook module:
    the check before a step is the hooks' own step pre-hook."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from zero_ext import ZeroRedundancyOptimizer\n"
        "m = torch.nn.Linear(4, 3)\n"
        "opt = ZeroRedundancyOptimizer(m.parameters(), torch.optim.SGD, lr=0.1)\n"
        "m(torch.ones(2, 4)).sum().backward(); opt.step(); opt.state_dict()\n"
        "print([n for n in ('zero_ext.reduce_scatter', 'zero_ext.overlap', "
        "'zero_ext.ddp_zero_hook') if n in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
