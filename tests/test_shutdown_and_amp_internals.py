"""The two places where zero_ext relies on torch internals (issue 39 item 3), checked on the
installed torch, so that a torch upgrade that moves them fails here, by name:

- the shutdown guard changes the code of torch's ``destroy_process_group`` function object
  (no hook of torch's runs before a process group is destroyed; a script may hold the
  function since before zero_ext was imported): torch's function must be a plain function,
  keep its face (signature, name, docstring) once guarded, still destroy; where it is not a
  plain function, the module attributes wait instead (a script that leaves while rank 0
  saves still gets the params to rank 0);
- ``zero_ext.amp.scaler_verdicts`` reads GradScaler.step's frame: the per-device found-inf
  tensors it finds there must be the very ones ``update()`` reads (an inf written into them
  backs the scale off).
"""
from __future__ import annotations

import inspect
import types

import pytest
import torch

from _dist import gloo_available, run_world

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with gloo")


# ------------------------------------------------------------------ GradScaler's frame
class _Probe(torch.optim.SGD):
    """An optimizer of the amp protocol that asks for its scaler's verdicts in its step, as
    ZeroRedundancyOptimizer does, and reports an inf the scaler did not see."""

    _step_supports_amp_scaling = True

    def step(self, closure=None):
        from zero_ext import amp

        self.found = amp.scaler_verdicts(self)
        if self.found and self.write_inf:
            self.found[0].fill_(1.0)
        return None


def test_gradscaler_step_frame_holds_the_verdicts_update_reads():
    w = torch.nn.Parameter(torch.ones(3))
    opt = _Probe([w], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
    for write_inf, want in ((False, 2.0 ** 9), (True, 2.0 ** 8)):
        opt.write_inf = write_inf
        scaler.scale(w.sum()).backward()
        scaler.step(opt)
        state = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
        assert opt.found is not None and len(opt.found) == len(state) == 1
        assert all(a is b for a, b in zip(opt.found, state.values()))
        scaler.update()  # finite grads: grows; the inf written in: backs off from 2^9
        assert scaler.get_scale() == want, (write_inf, scaler.get_scale())
        w.grad = None
    opt.write_inf = False
    opt.step()  # (no scaler on the stack)
    assert opt.found is None


# ------------------------------------------------------------------ destroy_process_group
def test_torchs_destroy_process_group_is_a_plain_function():
    fn = torch.distributed.distributed_c10d.destroy_process_group
    assert isinstance(fn, types.FunctionType) and fn.__closure__ is None, fn
    assert torch.distributed.destroy_process_group is fn


def _guarded_face(rank, world):
    import torch.distributed as dist

    from zero_ext import param_gather

    fn = dist.distributed_c10d.destroy_process_group
    before = (str(inspect.signature(fn)), fn.__name__, fn.__qualname__, fn.__doc__,
              fn.__module__)
    param_gather.guard_shutdown()
    assert dist.destroy_process_group is fn and fn.zero_ext_waits_first
    after = (str(inspect.signature(fn)), fn.__name__, fn.__qualname__, fn.__doc__,
             fn.__module__)
    assert after == before, (after, before)
    with pytest.raises(ValueError, match="Invalid process group"):
        fn(object())  # (torch's own check, still there)
    fn()
    assert not dist.is_initialized()
    return True


def test_the_guarded_destroy_process_group_keeps_torchs_face():
    run_world(_guarded_face, 1)


def _wrapped_destroy(rank, world, cfg):
    """torch's destroy_process_group as a wrapper (a decorator's closure): the guard
    falls back to the module attributes, and ranks leaving through them while rank 0
    saves the model after the last step still let the exchange finish."""
    import functools

    import torch.distributed as dist

    from test_param_gather import _ends_like_a_script

    torchs = dist.distributed_c10d.destroy_process_group

    @functools.wraps(torchs)
    def decorated(*args, **kwargs):
        return torchs(*args, **kwargs)

    dist.destroy_process_group = dist.distributed_c10d.destroy_process_group = decorated
    out = _ends_like_a_script(rank, world, cfg)
    assert dist.destroy_process_group is not decorated  # (wrapped by the guard)
    return out


def test_a_wrapped_destroy_process_group_still_waits():
    run_world(_wrapped_destroy, 2, dict(sharding="flat", imported_early=False))


# ------------------------------------------------------------------ destroy without the GIL
def _threads() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


def _destroy_with_a_collective_in_flight(rank, world, cfg):
    """torch before 2.8 destroys a process group holding the GIL; a gloo worker that frees a
    finished collective's tensors (their Python objects let go first) needs the GIL: both
    waited forever in zero_ext's destroy_process_group, which destroys right after the
    params' exchange finished. Made certain here: rank 0's broadcast is still in flight
    (rank 1 joins 1 s later) when it destroys the world, its tensor and work dropped. The
    groups must be destroyed all the same (their threads gone), or, where the native library
    is not loaded, kept alive to the end."""
    import time

    import torch.distributed as dist

    from zero_ext import group_release, param_gather

    if cfg["force"]:
        group_release.GIL_HELD_BY_GROUP_DESTRUCTOR = True
    if not cfg["native"]:
        group_release._native = lambda: False
    param_gather.guard_shutdown()
    store = dist.distributed_c10d._get_default_store()
    group = dist.new_group(backend="gloo")
    dist.barrier()
    with_groups = _threads()
    if rank == 1:
        time.sleep(1.0)
        dist.broadcast(torch.zeros(1000), src=0, group=group)
        store.set("in_flight_test/joined", "1")
    else:
        work = dist.broadcast(torch.ones(1000), src=0, group=group, async_op=True)
        del work  # (only gloo's worker holds the tensor and the work now)
    del group
    dist.destroy_process_group()
    store.wait(["in_flight_test/joined"])  # (a kept group's broadcast still needs rank 0)
    return with_groups - _threads()  # threads gone with the groups


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="needs /proc")
@pytest.mark.parametrize("native", [True, False], ids=["native", "no_native"])
@pytest.mark.parametrize("force", [False, True], ids=["this_torch", "release_path"])
def test_destroy_with_a_collective_in_flight(force, native):
    from zero_ext import group_release

    if not native and not (force or group_release.GIL_HELD_BY_GROUP_DESTRUCTOR):
        pytest.skip("torch >= 2.8 destroys groups without the GIL: nothing is kept")
    gone = run_world(_destroy_with_a_collective_in_flight, 2,
                     dict(force=force, native=native), timeout=90)
    destroyed = native or not (force or group_release.GIL_HELD_BY_GROUP_DESTRUCTOR)
    for rank, n in enumerate(gone):
        if destroyed:  # two groups of two gloo worker threads at least
            assert n >= 4, f"rank {rank}: {n} threads gone with the groups"
        else:
            assert n <= 0, f"rank {rank}: the kept groups' threads went ({n})"
