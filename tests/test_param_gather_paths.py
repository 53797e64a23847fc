"""overlap_param_gather=True meets torch's other readers and writers of params: every path
that reads, writes or replaces params outside a forward, run right after a step (the
exchange of its updates still in flight, held back 50 ms by the worker), must see the
stepped values or raise on every rank, against DDP + torch.optim.AdamW fed the same
batches (torch's ZeroRedundancyOptimizer for Join, whose joined ranks step as zero_ext's).

The paths: pickling the model (``pickle.dumps``, ``torch.save``, also after
``wait_for_params`` and with the optimizer dropped), ``copy.deepcopy``, ``Module._apply``
(``to``, ``double``, ``half``, ``bfloat16``, ``float``, ``cpu``), a new DDP over the model,
Join with uneven inputs (DDP's final sync), ``model.parameters()`` read by the script, and a
write into params that bypasses the module while the exchange is in flight (raises at the
next step on every rank, nothing stepped). ``model.zero_grad()`` reads no param: it must not
wait (the overlap stays).
"""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from _dist import gloo_available, run_world
from test_param_gather import HP, TOL, _batch, _close, _groups, _Net, _setup, _train

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with gloo")


def _steps(rank, ref_pair, cand_pair, first, n):
    for it in range(first, first + n):
        _train(rank, ref_pair, it, side=it % 3 == 1)
        _train(rank, cand_pair, it, side=it % 3 == 1)


def _in_flight(opt) -> bool:
    """The last step's exchange was left in flight and not yet waited for: the modules hold
    their _PendingParams. (Whether the worker thread has already finished its collectives
    is up to the scheduler, so it is not asked: the queue is cleared on this thread only.)"""
    return opt._param_gather.queue is not None


def _params_close(got, want, what, **tol):
    for (name, a), b in zip(want, got):
        torch.testing.assert_close(b.detach(), a.detach(), **(tol or TOL),
                                   msg=lambda m, name=name: f"{what}, {name}: {m}")


# ------------------------------------------------------------------ pickling, copies
def _pickled(rank, world, cfg):
    """The model pickled right after a step (exchange in flight), after wait_for_params, and
    after the optimizer was dropped: each time the stepped values, and nothing of zero_ext
    in the bytes (a checkpoint of the model must load without it)."""
    import gc

    (ref, o_ref), (cand, opt) = _setup(rank, world, cfg)
    _steps(rank, (ref, o_ref), (cand, opt), 0, 3)
    assert _in_flight(opt)

    def dump(module):
        if cfg["how"] == "torch.save":
            buf = io.BytesIO()
            torch.save(module, buf)
            blob = buf.getvalue()
            return blob, torch.load(io.BytesIO(blob), weights_only=False)
        blob = pickle.dumps(module)
        return blob, pickle.loads(blob)

    for when in ("in flight", "after wait_for_params", "optimizer dropped"):
        if when == "after wait_for_params":
            _steps(rank, (ref, o_ref), (cand, opt), 3, 1)
            opt.wait_for_params()
        if when == "optimizer dropped":
            _steps(rank, (ref, o_ref), (cand, opt), 4, 1)
            del opt
            gc.collect()
        blob, loaded = dump(cand.module)
        assert b"zero_ext" not in blob, f"{when}: the pickled model refers to zero_ext"
        _params_close(loaded.parameters(), ref.module.named_parameters(), when)
    return True


@pytest.mark.parametrize("how,sharding", [("pickle", "flat"), ("torch.save", "even"),
                                          ("pickle", "param")])
def test_pickling_the_model(how, sharding):
    run_world(_pickled, 2, dict(sharding=sharding, how=how))


def _deepcopied(rank, world, cfg):
    (ref, o_ref), (cand, opt) = _setup(rank, world, cfg)
    _steps(rank, (ref, o_ref), (cand, opt), 0, 3)
    assert _in_flight(opt)
    twin = copy.deepcopy(cand.module)  # (an EMA model, a snapshot)
    _params_close(twin.parameters(), ref.module.named_parameters(), "the copy")
    _steps(rank, (ref, o_ref), (cand, opt), 3, 2)
    opt.wait_for_params()
    _close(cand.module, ref.module, "after the copy")
    return True


@pytest.mark.parametrize("sharding,form", [("flat", "auto"), ("even", "nccl")])
def test_deepcopy_of_the_model(sharding, form):
    run_world(_deepcopied, 2, dict(sharding=sharding, form=form))


# ------------------------------------------------------------------ Module._apply
_CASTS = {
    "to(float64)": (lambda m: m.to(torch.float64), torch.float64),
    "double": (lambda m: m.double(), torch.float64),
    "half": (lambda m: m.half(), torch.float16),
    "bfloat16": (lambda m: m.bfloat16(), torch.bfloat16),
    "float": (lambda m: m.float(), torch.float32),
    "cpu": (lambda m: m.cpu(), torch.float32),
}
# one unit in the last place of the cast: the two sides cast fp32 values 1e-5 apart (a
# stale read is off by about lr = 1e-2, many units)
_CAST_TOL = {torch.float64: TOL, torch.float32: TOL,
             torch.float16: dict(atol=1e-4, rtol=2.0 ** -10),
             torch.bfloat16: dict(atol=1e-4, rtol=2.0 ** -7)}


def _cast(rank, world, cfg):
    (ref, o_ref), (cand, opt) = _setup(rank, world, cfg)
    _steps(rank, (ref, o_ref), (cand, opt), 0, 3)
    assert _in_flight(opt)
    cast, dtype = _CASTS[cfg["cast"]]
    cast(cand.module)
    cast(ref.module)
    want, got = ref.module.state_dict(), cand.module.state_dict()
    for name in want:
        assert got[name].dtype == want[name].dtype, (name, got[name].dtype)
        torch.testing.assert_close(got[name], want[name], **_CAST_TOL[dtype],
                                   msg=lambda m, name=name: f"after {cfg['cast']}, {name}: {m}")
    if dtype in (torch.float64, torch.float32):  # (exact both ways: train on in fp32)
        from torch.nn.parallel import DistributedDataParallel as DDP

        # (DDP's reducer does not follow a change of its params' memory: DDP + AdamW then
        # ends different on each rank; a new DDP over the cast model trains on)
        kw = dict(bucket_cap_mb=0.002, find_unused_parameters=True)
        ref, cand = DDP(ref.module.float(), **kw), DDP(cand.module.float(), **kw)
        _steps(rank, (ref, o_ref), (cand, opt), 3, 2)
        opt.wait_for_params()
        _close(cand.module, ref.module, f"training on after {cfg['cast']}")
    return True


@pytest.mark.parametrize("cast,sharding", [
    ("to(float64)", "flat"), ("double", "even"), ("double", "param"), ("half", "flat"),
    ("bfloat16", "even"), ("float", "flat"), ("cpu", "even")])
def test_casts_of_the_model(cast, sharding):
    run_world(_cast, 2, dict(sharding=sharding, cast=cast))


# ------------------------------------------------------------------ a new DDP over the model
def _rewrapped(rank, world, cfg):
    """A new phase wraps the model in a new DDP (without find_unused_parameters) right after
    a step: DDP's constructor broadcasts rank 0's params, which must be the stepped ones."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    (ref, o_ref), (cand, opt) = _setup(rank, world, cfg)
    _steps(rank, (ref, o_ref), (cand, opt), 0, 3)
    assert _in_flight(opt)
    cand2 = DDP(cand.module, bucket_cap_mb=0.002)
    ref2 = DDP(ref.module, bucket_cap_mb=0.002)
    if cfg["rewrap_hook"]:
        cand2.register_comm_hook(opt, reduce_scatter_hook)
    for it in range(3, 6):
        _train(rank, (ref2, o_ref), it, side=True)  # (every param used: no unused ones)
        _train(rank, (cand2, opt), it, side=True)
    opt.wait_for_params()
    _close(cand.module, ref.module, "after the new DDP")
    return True


@pytest.mark.parametrize("sharding,hook", [("flat", False), ("even", True)])
def test_a_new_ddp_over_the_model(sharding, hook):
    run_world(_rewrapped, 2, dict(sharding=sharding, hook=False, rewrap_hook=hook))


# ------------------------------------------------------------------ Join
N_REAL = 3


def _joined(rank, world, cfg):
    """Rank r runs N_REAL + 2 r real batches inside Join([ddp, opt]) (torch's documented
    pattern, zero_grad(set_to_none=False)); the reference is the same script with torch's
    ZeroRedundancyOptimizer (its joined ranks step their shards from their last grads as
    zero_ext's do; zero_ext's partition differs, so the extra batches have a zero loss, and
    every param takes one step with zero grads per extra iteration, whoever owns it). When
    the Join exits, DDP broadcasts the last joiner's params: the last step's exchange must
    have landed there."""
    from torch.distributed.algorithms.join import Join
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer, param_gather

    param_gather.WORKER_DELAY_S = 0.05
    param_gather.FORM = cfg.get("form", "auto")
    ref, cand = DDP(_Net()), DDP(_Net())
    o_ref = TorchZero(_groups(ref.module), torch.optim.AdamW, **HP)
    opt = ZeroRedundancyOptimizer(_groups(cand.module), torch.optim.AdamW,
                                  sharding=cfg["sharding"], overlap_param_gather=True, **HP)
    for ddp, o in ((ref, o_ref), (cand, opt)):
        with Join([ddp, o]):
            for it in range(N_REAL + 2 * rank):
                out = ddp(_batch(rank, it), True)  # (every param used)
                loss = out.square().mean() if it < N_REAL else (out * 0).sum()
                loss.backward()
                o.step()
                o.zero_grad(set_to_none=False)
    _close(cand.module, ref.module, "after Join")
    return [p.detach().clone() for p in cand.module.parameters()]


@pytest.mark.parametrize("sharding,form", [("flat", "auto"), ("even", "auto"),
                                           ("flat", "nccl")])
def test_join_with_uneven_inputs(sharding, form):
    vals = run_world(_joined, 2, dict(sharding=sharding, form=form))
    for a, b in zip(*vals):
        assert torch.equal(a, b), "ranks differ after Join"


# ------------------------------------------------------------------ the script's own code
def _parameters_read(rank, world, cfg):
    """The script reads model.parameters() right after the step (an EMA, a weight norm
    logged): the stepped values."""
    (ref, o_ref), (cand, opt) = _setup(rank, world, cfg)
    ema = None
    for it in range(5):
        _steps(rank, (ref, o_ref), (cand, opt), it, 1)
        got = [p.detach().clone() for p in cand.module.parameters()]
        if it >= 2:
            _params_close(got, ref.module.named_parameters(), f"iteration {it}")
        ema = got if ema is None else [0.9 * e + 0.1 * g for e, g in zip(ema, got)]
    return True


def test_model_parameters_read_after_the_step():
    run_world(_parameters_read, 2, dict(sharding="even"))


def _zero_grad_does_not_wait(rank, world, cfg):
    """model.zero_grad() (HF Trainer calls it after every optimizer step) reads only grads:
    the exchange stays in flight, and the next forward still reads the stepped params."""
    (ref, o_ref), (cand, opt) = _setup(rank, world, cfg)
    gather = opt._param_gather
    waits = []
    real = gather._wait_through
    gather._wait_through = lambda k, by_forward=False: (waits.append(k),
                                                         real(k, by_forward))[1]
    for it in range(5):
        for ddp, o in ((ref, o_ref), (cand, opt)):
            ddp(_batch(rank, it)).square().mean().backward()
            o.step()
            waits.clear()
            ddp.module.zero_grad(set_to_none=it % 2 == 0)
        if it >= 2:
            assert _in_flight(opt) and waits == [], \
                f"iteration {it}: model.zero_grad() waited for {waits}"
        with torch.no_grad():
            x = _batch(rank, 50 + it)
            torch.testing.assert_close(cand(x), ref(x), **TOL)
    return True


def test_model_zero_grad_keeps_the_overlap():
    run_world(_zero_grad_does_not_wait, 2, dict(sharding="flat"))


def _write_in_flight(rank, world, cfg):
    """The script writes into params it holds (a list taken before the step) right after
    the step, without wait_for_params: the exchange lands on part of it, so the next step
    raises on every rank (with reduce_scatter_hook, whose step agrees before its local
    update, stepping nothing; without, at the agreement after it, before the exchange). A
    write through the module's attribute (`model.a.weight`) waits for its own params first,
    and trains on as the reference."""
    (ref, o_ref), (cand, opt) = _setup(rank, world, cfg)
    held = list(cand.module.parameters())
    _steps(rank, (ref, o_ref), (cand, opt), 0, 3)
    assert _in_flight(opt)
    if cfg["how"] == "attribute":
        with torch.no_grad():
            cand.module.b.weight.mul_(0.5)
            ref.module.b.weight.mul_(0.5)
        _steps(rank, (ref, o_ref), (cand, opt), 3, 2)
        opt.wait_for_params()
        _close(cand.module, ref.module, "after the write")
        return None
    with torch.no_grad():
        held[2].mul_(0.5)  # (b.weight: several owners' pieces)
    cand(_batch(rank, 3)).square().mean().backward()
    opt.wait_for_params()
    before = [p.detach().clone() for p in held]
    try:
        opt.step()
    except RuntimeError as exc:
        if cfg["hook"]:
            for a, b in zip(before, held):
                assert torch.equal(a, b), "the step that raised changed params"
        return str(exc)
    return None


@pytest.mark.parametrize("sharding,form,hook", [("flat", "auto", False),
                                                ("even", "nccl", True),
                                                ("param", "auto", True)])
def test_a_write_while_in_flight_raises_on_every_rank(sharding, form, hook):
    errors = run_world(_write_in_flight, 2, dict(sharding=sharding, form=form, hook=hook,
                                                 how="held"))
    for err in errors:
        assert err is not None and "written" in err and "wait_for_params" in err, errors


def test_a_write_through_the_module_waits_first():
    assert run_world(_write_in_flight, 2, dict(sharding="even", how="attribute")) == [None] * 2


def _added_group(rank, world, cfg):
    """add_param_group brings the params of a layer that held none of the optimizer's when
    the forward's order was first recorded (found by the script harness with the exchange
    held back): once the order is recorded again, that layer's forward and everything that
    reads it through the model wait for its params too."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer, param_gather

    param_gather.WORKER_DELAY_S = 0.05
    param_gather.FORM = cfg["form"]
    ref, cand = DDP(_Net()), DDP(_Net())

    def main(model):
        return [p for n, p in model.named_parameters() if not n.startswith("side.")]

    o_ref = torch.optim.AdamW(main(ref.module), **HP)
    opt = ZeroRedundancyOptimizer(main(cand.module), torch.optim.AdamW,
                                  sharding=cfg["sharding"], overlap_param_gather=True, **HP)
    for it in range(8):
        if it == 3:
            o_ref.add_param_group({"params": list(ref.module.side.parameters())})
            opt.add_param_group({"params": list(cand.module.side.parameters())})
        for ddp, o in ((ref, o_ref), (cand, opt)):
            ddp(_batch(rank, it), True).square().mean().backward()
            o.step()
            o.zero_grad()
        got = copy.deepcopy(cand.module.side).weight
        torch.testing.assert_close(got, ref.module.side.weight, **TOL,
                                   msg=lambda m, it=it: f"iteration {it}: {m}")
    opt.wait_for_params()
    _close(cand.module, ref.module, "at the end")
    return True


@pytest.mark.parametrize("sharding,form", [("flat", "auto"), ("even", "nccl")])
def test_params_of_a_group_added_later_are_waited_for(sharding, form):
    run_world(_added_group, 2, dict(sharding=sharding, form=form))


def _own_writes(rank, world, cfg):
    """The exchange's own writes into the params (all-gathers in place, whose wait moves the
    version counter; staged copies; broadcasts) are not taken for another hand's: training
    with reads through the model only never raises."""
    from zero_ext import sync

    sync.DIRECT_GATHER_BYTES = 64  # (every param whose chunks are in rank order: in place)
    sync.EVEN_EXCHANGE = "gather"
    (ref, o_ref), (cand, opt) = _setup(rank, world, cfg)
    _steps(rank, (ref, o_ref), (cand, opt), 0, 6)
    opt.wait_for_params()
    _close(cand.module, ref.module, "at the end")
    return True


@pytest.mark.parametrize("world,form", [(2, "auto"), (3, "nccl")])
def test_the_exchange_own_writes_raise_nothing(world, form):
    run_world(_own_writes, world, dict(sharding="even", form=form))


# ------------------------------------------------------------------ a kept reference
class _Captured(torch.nn.Module):
    """A forward that reads a submodule's params through references kept at construction
    (`F.linear(x, *self._pre)`): neither the submodule's forward nor an attribute read of
    it runs, so only the forward's first wait can cover them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (torch.nn.Linear(12, 32), torch.nn.Linear(32, 48),
                                  torch.nn.Linear(48, 5))
        self.pre = torch.nn.Linear(12, 12)
        self._pre = (self.pre.weight, self.pre.bias)

    def forward(self, x):
        x = x + torch.nn.functional.linear(x, *self._pre)
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class _CapturedThenCalled(_Captured):
    """The same early read through the kept references, and the submodule holding them
    called later in the same forward: its own forward claims the params in the recorded
    order, after the read."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.b = torch.nn.Linear(32, 12)
        self.c = torch.nn.Linear(12, 5)

    def forward(self, x):
        x = x + torch.nn.functional.linear(x, *self._pre)
        h = self.b(torch.tanh(self.a(x)))
        return self.c(self.pre(torch.tanh(h)))


def _captured(rank, world, sharding, called_later=False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer, param_gather

    param_gather.WORKER_DELAY_S = 0.05
    model = _CapturedThenCalled if called_later else _Captured
    ref, cand = DDP(model(), bucket_cap_mb=0.002), DDP(model(), bucket_cap_mb=0.002)
    o_ref = torch.optim.AdamW(ref.module.parameters(), **HP)
    opt = ZeroRedundancyOptimizer(cand.module.parameters(), torch.optim.AdamW,
                                  sharding=sharding, overlap_param_gather=True, **HP)
    for it in range(6):
        for d, o in ((ref, o_ref), (cand, opt)):
            d(_batch(rank, it)).square().mean().backward()
            o.step()
            o.zero_grad()
        with torch.no_grad():  # the first forward after the step, exchange in flight
            x = _batch(rank, 50 + it)
            torch.testing.assert_close(cand(x), ref(x), **TOL,
                                       msg=lambda m, it=it: f"forward after step {it}: {m}")
    opt.wait_for_params()
    _params_close(cand.module.parameters(), ref.module.named_parameters(), "end")
    return True


@pytest.mark.parametrize("sharding", ["param", "flat"])
def test_params_read_through_a_kept_reference(sharding):
    assert all(run_world(_captured, 2, sharding))


@pytest.mark.parametrize("sharding", ["param", "flat"])
def test_params_read_through_a_kept_reference_before_their_module_runs(sharding):
    assert all(run_world(_captured, 2, sharding, True))
