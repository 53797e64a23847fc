"""The params' exchange after a step, left in flight until the next forward needs it
(``ZeroRedundancyOptimizer(..., overlap_param_gather=True)``).

Without it, ``step()`` returns once every owner's update has reached every rank. With it,
the step issues the exchange's collectives in the order the next forward first uses the
params and returns; each module's forward then waits only for the collectives carrying its
own params (``module._parameters``), as Megatron's distributed optimizer does
(``overlap_param_gather``). Where the model computes (a GPU), the exchange hides behind
the next forward instead of adding to the step.

- The order: the first forward after the first step records, per rank, the order in which
  modules' params are first used; the next step agrees on rank 0's order (one object
  broadcast, once) and plans the exchange by it from then on. Until then steps exchange as
  without the option.
- Transport: on NCCL every collective is issued at the step (a communicator runs its ops in
  issue order, on its own stream) and a waiting forward's stream waits on the collective's
  event, not the host. On gloo at most one collective per lane may be in flight (several
  async ops on one gloo group can start in a different order on each rank), so a worker
  thread issues them one after the other on lanes (groups) of the optimizer's ranks made for
  this only (a rank whose main thread waits in another collective, such as DDP's buffer
  broadcast at the start of its forward, still completes the exchange that another rank
  waits for: rank 0 saving ``model.state_dict()`` after the step, say).
- Nothing stale is read through a module: while the exchange is in flight, every module
  holding its params has a `_PendingParams` in place of its ``_parameters``, and any read or
  write of a value there waits for that module's collectives first (a module's forward,
  state_dict, load_state_dict, parameters(), Module._apply's casts, pickling, deepcopy,
  DDP's constructor and its final sync after a Join); the module gets its own dict back
  then, and nothing of zero_ext's stays on it. Every method of the optimizer that reads or
  writes params or state waits first (step, clip_grad_norm_, state_dict, load_state_dict,
  consolidate_state_dict, add_param_group, checkpoint.save/load, Join), as do the DDP comm
  hooks before their first collective. ``zero_grad()`` (the optimizer's, and torch's
  Module.zero_grad) does not wait: it touches no param value, and it runs between step and
  forward in nearly every training loop.
- What no module sees, the script's reads or writes of params it holds itself (a list
  taken before the step, another optimizer's param_groups), must follow
  ``opt.wait_for_params()``, on every rank. A write there while the collectives carrying the
  param are in flight moves its version counter: the next step raises on every rank.
"""
from __future__ import annotations

import atexit
import copy
import logging
import os
import sys
import threading
import time
import types
import weakref

import torch
import torch.distributed as dist

from . import sync
from .sync import LaneQueue, backend_device

# How the exchange left in flight travels: "auto" is NCCL's form on NCCL (every collective
# issued at the step on the optimizer's group, waited for by the forward's stream) and a
# worker thread on lanes of its own elsewhere; "nccl" forces NCCL's form on gloo, with
# one lane of its own per collective (one op in flight per gloo group), for tests
# (ZERO_EXT_GATHER_FORM). Every rank must use the same.
FORMS = ("auto", "nccl")
FORM = os.environ.get("ZERO_EXT_GATHER_FORM", "auto")
# Groups the worker thread's exchange travels on, one collective in flight on each.
# Broadcasts (param and flat modes, even at world 2) take two, so that two owners send at
# once. All-gathers (even mode) load every link: on one lane the collective the forward
# needs next gets the links' full rate; a second lane hides a ring's per-hop latency behind
# another collective, at half the rate each. Behind netlab's links, world 4 with 16 ms of
# compute per layer: one lane 1.03x DDP (the forward waited for its first module only), two
# 1.07x (two collectives sharing the links, the second module waited 20 ms); world 8, 44 ms
# per layer: one lane 1.11x (seven hops per collective: the gathers fell behind the
# forward), two 1.02x. So all-gathers start on one lane and take a second, on every rank
# alike (agreed at the step), once one lane fell behind the forward in BEHIND_STEPS
# exchanges in a row that a forward consumed. ZERO_EXT_GATHER_LANES=n fixes n lanes
# (benchmarks; every rank alike).
_LANES_SET = os.environ.get("ZERO_EXT_GATHER_LANES")
GATHER_LANES: int | None = int(_LANES_SET) if _LANES_SET else None
MAX_LANES = 2
BEHIND_STEPS = 2
# Seconds the worker thread waits before each exchange it drives (tests: a read that did
# not wait for the exchange then reads the old values, every time, not by chance)
WORKER_DELAY_S = 0.0

# ParamGathers with collectives in flight or an order being recorded, and the one global
# forward pre-hook that serves them (installed only while some are)
_ACTIVE: "weakref.WeakSet[ParamGather]" = weakref.WeakSet()
# ...and those whose exchange is in flight, held here until it is finished: a script may
# drop its optimizer while the params are still arriving (a train() that returns only the
# model), and the model's next forward or state_dict must still wait for them
_IN_FLIGHT: set = set()
_HOOK = None
_HOOK_LOCK = threading.Lock()


def _activate(gather: "ParamGather") -> None:
    global _HOOK
    with _HOOK_LOCK:
        _ACTIVE.add(gather)
        if _HOOK is None:
            _HOOK = torch.nn.modules.module.register_module_forward_pre_hook(_before_forward)


def _deactivate(gather: "ParamGather") -> None:
    global _HOOK
    with _HOOK_LOCK:
        _ACTIVE.discard(gather)
        if not _ACTIVE and _HOOK is not None:
            _HOOK.remove()
            _HOOK = None


@torch._disable_dynamo
def _before_forward(module: torch.nn.Module, args) -> None:
    if _RECORDING and _READS.outermost is None:
        _READS.watch(module)
    for gather in list(_ACTIVE):
        gather.before_forward(module)


# ParamGathers recording the forward's order of first use
_RECORDING: "weakref.WeakSet[ParamGather]" = weakref.WeakSet()


class _AttributeReads:
    """While a recorded forward runs (one forward after the first step, on the main
    thread): every read of a param as a module attribute (`self.c.weight`), so that a param
    that a parent's forward reads before calling the module holding it (`s =
    self.c.weight.norm()`, then `self.c(x)`) is known; its module's own wait would come
    too late. Module.__getattr__ is wrapped for that forward only; a forward hook that runs
    even when the forward raises puts it back."""

    def __init__(self):
        self.outermost: torch.nn.Module | None = None
        self.original = None
        self.done_hook = None

    def watch(self, module: torch.nn.Module) -> None:
        self.outermost = module
        self.original = original = torch.nn.Module.__getattr__

        def getattr_watched(mod, name):
            value = original(mod, name)
            if isinstance(value, torch.nn.Parameter):
                for gather in list(_RECORDING):
                    gather.attribute_read(value)
            return value

        torch.nn.Module.__getattr__ = getattr_watched
        self.done_hook = torch.nn.modules.module.register_module_forward_hook(
            self._after_forward, always_call=True)

    @torch._disable_dynamo
    def _after_forward(self, module, args, output) -> None:
        if module is self.outermost:
            torch.nn.Module.__getattr__ = self.original
            self.done_hook.remove()
            self.outermost = self.original = self.done_hook = None


_READS = _AttributeReads()


class _PendingParams(dict):
    """A module's ``_parameters`` while an exchange in flight carries some of its params.

    Whatever torch or a script does with a module's params outside its forward goes
    through this dict: ``state_dict`` and ``load_state_dict``, ``parameters()`` and
    ``named_parameters()`` (DDP's constructor and its final sync after a Join, a script's
    EMA), ``Module._apply`` (``to``, ``half``, ``cpu``, ...), pickling (``torch.save(model)``)
    and ``copy.deepcopy`` (through ``Module.__getstate__``), an attribute read
    (``model.head.weight``) and a param assigned or deleted. So every read or write of a
    value here first waits for the collectives carrying this module's params, then puts the
    module's own dict back: from then on the module holds nothing of zero_ext's, and nothing
    stays on it once the exchange has finished. It pickles and copies as a plain dict.
    Names (``in``, ``len``, iteration over keys) need no wait.

    ``items()`` and ``values()`` called by torch's ``Module.zero_grad`` do not wait: it reads
    the grads only, and HF's Trainer calls it between the step and the next forward, where a
    wait would remove the overlap. That caller is known by its code object on the stack (a
    torch internal: if it changes, zero_grad waits, which is correct, only slower)."""

    __slots__ = ("plain", "owner", "needs")

    def __init__(self, plain: dict, module: torch.nn.Module):
        super().__init__(plain)
        self.plain = plain                 # the module's own dict, put back once waited
        self.owner = weakref.ref(module)
        self.needs: dict = {}              # ParamGather -> last item carrying these params

    def settle(self, by_forward: bool = False) -> dict:
        """Wait for this module's params (raising an exchange's failure, now and at every
        later read); the module gets its own dict back, which is returned."""
        while self.needs:
            gather, k = next(iter(self.needs.items()))
            if gather.queue is not None:
                gather._wait_through(k, by_forward)
            self.needs.pop(gather, None)
        self._put_back()
        return self.plain

    def release(self, gather: "ParamGather") -> None:
        """(gather's exchange has finished)"""
        self.needs.pop(gather, None)
        if not self.needs:
            self._put_back()

    def _put_back(self) -> None:
        module = self.owner()
        if module is not None and module.__dict__.get("_parameters") is self:
            module.__dict__["_parameters"] = self.plain

    # reads of values
    def __getitem__(self, key):
        return self.settle()[key]

    def get(self, key, default=None):
        return self.settle().get(key, default)

    def items(self):
        return (self.plain if self.needs and _grads_only() else self.settle()).items()

    def values(self):
        return (self.plain if self.needs and _grads_only() else self.settle()).values()

    def copy(self):
        return self.settle().copy()

    __copy__ = copy

    def __deepcopy__(self, memo):
        out: dict = {}
        memo[id(self)] = out
        for key, value in self.settle().items():
            out[copy.deepcopy(key, memo)] = copy.deepcopy(value, memo)
        return out

    def __reduce_ex__(self, protocol):
        return dict, (), None, None, iter(self.settle().items())

    def __reduce__(self):
        return self.__reduce_ex__(2)

    def __repr__(self):
        return repr(self.settle())

    def __eq__(self, other):
        return self.settle() == other

    def __ne__(self, other):
        return self.settle() != other

    __hash__ = None  # type: ignore[assignment]

    def __or__(self, other):
        return self.settle() | other

    def __ror__(self, other):
        return other | self.settle()

    # writes: into the module's own dict (and this one, for whoever still holds it)
    def __setitem__(self, key, value):
        self.settle()[key] = value
        dict.__setitem__(self, key, value)

    def __delitem__(self, key):
        del self.settle()[key]
        dict.__delitem__(self, key)

    def pop(self, key, *default):
        out = self.settle().pop(key, *default)
        dict.pop(self, key, None)
        return out

    def popitem(self):
        key, value = self.settle().popitem()
        dict.pop(self, key, None)
        return key, value

    def setdefault(self, key, default=None):
        out = self.settle().setdefault(key, default)
        dict.setdefault(self, key, out)
        return out

    def update(self, *args, **kwargs):
        self.settle().update(*args, **kwargs)
        dict.clear(self)
        dict.update(self, self.plain)

    def __ior__(self, other):
        self.update(other)
        return self

    def clear(self):
        self.settle().clear()
        dict.clear(self)


_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))


def _kept_params(module: torch.nn.Module):
    """The params a module refers to from plain tuples, lists and dicts of its own
    attributes (not its _parameters, buffers or submodules): one level deep."""
    for name, value in vars(module).items():
        if name in _MODULE_INTERNALS:
            continue
        if isinstance(value, dict):
            value = value.values()
        elif not isinstance(value, (tuple, list)):
            continue
        for q in value:
            if isinstance(q, torch.nn.Parameter):
                yield q


def _plain(module: torch.nn.Module) -> dict:
    """A module's own `_parameters` (zero_ext's reads: no wait)."""
    held = module.__dict__.get("_parameters", {})
    return held.plain if type(held) is _PendingParams else held


_ZERO_GRAD = torch.nn.Module.zero_grad.__code__
_ZERO_GRAD_DEPTH = 8  # frames from items() up to zero_grad: _named_members' lambda, ...


def _grads_only() -> bool:
    """Whether torch's Module.zero_grad (grads only) asked for the params."""
    try:
        frame = sys._getframe(2)
    except ValueError:  # (called with no Python caller: from C)
        return False
    for _ in range(_ZERO_GRAD_DEPTH):
        if frame is None:
            return False
        if frame.f_code is _ZERO_GRAD:
            return True
        frame = frame.f_back
    return False


_OWN_SALTS = 1 << 48  # far above any count torch's own group names reach


def _members_only_gloo_group(ranks: list[int]):
    """A gloo group over `ranks`, made by its members alone (the optimizer's ranks; the
    others may build nothing). torch names such a group by its ranks and its group
    counter, and advances that counter on the members only, so the ranks outside would
    name every later group (any new_group over all ranks) differently and hang. This
    names ours by its ranks and its number among our groups over those same ranks, which
    the members agree on, and leaves torch's counter as it was."""
    c10d = dist.distributed_c10d
    world_state = getattr(c10d, "_world", None)
    if world_state is None or not hasattr(type(world_state), "group_count"):
        return dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    made = sync.this_world("member_groups", dict)  # how many over each set of ranks
    key = tuple(sorted(ranks))
    serial = made.get(key, 0)
    saved = world_state.group_count
    world_state.group_count = _OWN_SALTS + serial
    try:
        group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    finally:
        world_state.group_count = saved
    made[key] = serial + 1
    return group


class _Worker:
    """One thread per process that drives the gloo exchanges left in flight, job after job
    in the order the steps issued them (the same on every rank)."""

    def __init__(self):
        self.cond = threading.Condition()
        self.jobs: list = []
        self.thread: threading.Thread | None = None

    def submit(self, queue: LaneQueue) -> None:
        with self.cond:
            self.jobs.append(queue)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="zero_ext-param-gather",
                                               daemon=True)
                self.thread.start()
            self.cond.notify_all()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.jobs:
                    self.cond.wait()
                queue = self.jobs[0]
            if WORKER_DELAY_S:
                time.sleep(WORKER_DELAY_S)
            queue.run_to_end()  # (its own errors are kept for the waiting thread)
            with self.cond:
                self.jobs.pop(0)
                queue = None  # (not held while idle, nor once the job is off the list)


_WORKER = _Worker()


def wait_for_all_in_flight() -> None:
    """Every exchange left in flight by any optimizer of this process, completed into its
    params."""
    error = None
    for gather in list(_ACTIVE):
        try:
            gather.wait_all()
        except Exception as exc:  # noqa: BLE001 - the others are waited for first
            error = error or exc
    if error is not None:
        raise error


_SHUTDOWN_GUARDED = False


def guard_shutdown() -> None:
    """(an optimizer holding gloo groups of its own, or the first exchange left in flight)
    Two things must happen when the script ends.
    - The last step's exchange finishes before this process leaves its process groups:
      its peers' collectives need it to the end. A script that ends with rank 0 alone
      saving `model.state_dict()` (which waits) while the other ranks call
      destroy_process_group and exit gave rank 0 "Connection closed by peer" instead of
      the params. So torch's destroy_process_group, and the interpreter's exit (atexit),
      wait for every exchange in flight first.
    - zero_ext's extra groups are released with the world (_release_groups).

    Why torch's function object itself is changed (its `__code__`), a torch internal: torch
    offers no hook that runs before a process group is destroyed (ProcessGroup's
    on-completion hooks, which destroy_process_group waits for, are NCCL's only and cover
    works already issued on the group being destroyed; an atexit handler runs after the
    script's own destroy_process_group), and a changed module attribute misses a script
    that imported the function before zero_ext was (nanoGPT: `from torch.distributed import
    destroy_process_group` at the top), which holds that same object. Its code becomes a
    call of the waiting version, which runs a copy of torch's own function afterwards. If
    torch's function is not a plain function (a decorator's closure, another library's
    wrapper), the module attributes are wrapped instead, and a reference taken earlier does
    not wait. tests/test_shutdown_and_amp_internals.py checks, on the installed torch, that
    the plain form holds and that both forms wait."""
    global _SHUTDOWN_GUARDED
    if _SHUTDOWN_GUARDED:
        return
    _SHUTDOWN_GUARDED = True
    atexit.register(_wait_at_exit)
    c10d = dist.distributed_c10d
    fn = c10d.destroy_process_group
    if getattr(fn, "zero_ext_waits_first", False):
        return
    if (not isinstance(fn, types.FunctionType) or fn.__closure__
            or _WAITING_DESTROY in fn.__globals__):
        _wrap_destroy_attributes(fn)
        return
    original = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__)
    original.__kwdefaults__ = fn.__kwdefaults__
    original.__qualname__, original.__doc__ = fn.__qualname__, fn.__doc__
    original.__annotations__ = dict(fn.__annotations__)
    fn.__globals__[_WAITING_DESTROY] = _waiting(original)
    fn.__code__ = _calls_waiting_destroy.__code__
    fn.__defaults__ = fn.__kwdefaults__ = None
    fn.__wrapped__ = original  # (inspect.signature shows torch's)
    fn.zero_ext_waits_first = True


def _waiting(destroy):
    """`destroy` (torch's destroy_process_group), after every exchange in flight. On torch
    < 2.8 the groups it drops are released without the GIL (group_release)."""
    from . import group_release

    def waits_first(*args, **kwargs):
        error = None
        try:
            wait_for_all_in_flight()
        except Exception as exc:  # noqa: BLE001 - raised once the groups are destroyed
            error = exc
        group = kwargs["group"] if "group" in kwargs else (args[0] if args else None)
        release = group_release.hold_for_destroy(group)
        try:
            out = destroy(*args, **kwargs)
            if not dist.is_initialized():  # the whole world went: its groups with it
                _release_groups()
        finally:
            release()
        if error is not None:  # the params it carried are not all there: say so
            raise error
        return out

    return waits_first


def _wrap_destroy_attributes(fn) -> None:
    """(torch's destroy_process_group is not a plain function) The module attributes
    through which scripts call it wait first."""
    import functools

    waiting = functools.wraps(fn)(_waiting(fn))
    waiting.zero_ext_waits_first = True
    for module in (dist, dist.distributed_c10d):
        if getattr(module, "destroy_process_group", None) is fn:
            module.destroy_process_group = waiting
    logging.getLogger("zero_ext").info(
        "zero_ext: torch.distributed.destroy_process_group is not a plain function here; "
        "its module attributes wait for the params' exchange in flight, a reference taken "
        "before does not (call opt.wait_for_params() before it)")


_WAITING_DESTROY = "_zero_ext_destroy_process_group_waiting_first"
_ALL: "weakref.WeakSet[ParamGather]" = weakref.WeakSet()


def _release_groups() -> None:
    """zero_ext's references to the gloo groups it made, dropped once torch destroyed them:
    freed then, not at the interpreter's teardown, where gloo's threads abort the process
    ("terminate called without an active exception": in 3 of 3 launches of a script at
    world 3 holding its optimizer to the end; 0 of 5 with the references dropped)."""
    sync.release_lanes()
    with _WORKER.cond:  # (finished, or failed with its error kept: never pumped again)
        queues = list(_WORKER.jobs)
    for gather in list(_ALL):
        gather.lanes = None
        queues.append(gather.queue)
    for queue in queues:
        if queue is not None:
            queue.lanes = []


def _calls_waiting_destroy(*args, **kwargs):
    # (the code torch's destroy_process_group runs once guarded: a global of torch's module)
    return _zero_ext_destroy_process_group_waiting_first(*args, **kwargs)  # noqa: F821


def _wait_at_exit() -> None:
    if not (_ACTIVE and dist.is_initialized()):
        return
    try:
        wait_for_all_in_flight()
    except Exception as exc:  # noqa: BLE001 - the process is ending: say it, go on
        logging.getLogger("zero_ext").warning(
            "zero_ext: the last step's params exchange failed at exit: %s", exc)
    # (torch < 2.8: the teardown would destroy them with the GIL held, right after the
    # exchange's last collectives: kept alive to the end instead)
    from . import group_release

    group_release.keep_to_the_end(group_release.groups_destroyed_by(None))


class ParamGather:
    """One optimizer's exchange in flight, and the order it is issued in."""

    def __init__(self, zero):
        _ALL.add(self)
        self._zero = weakref.ref(zero)
        self.queue: LaneQueue | None = None
        self.threaded = False         # the worker thread drives `queue` (gloo)
        self.order_end = -1           # the item of the last param the forward uses
        self.positions: dict[int, int] | None = None  # param index -> first use (agreed)
        self.unclaimed: set = set()   # params the forward reads outside module hooks
        self.first_end = -1           # the last item carrying such params held by no module
        self.recorded: list | None = None  # id(param) in first-use order, while recording
        self._seen: set = set()
        self._read_early: set = set()  # read before its module's forward: as an
        #                                 attribute, or kept by a module (_kept_params)
        self.ids: set = set()         # id of every param of the optimizer
        self.modules: "weakref.WeakSet" = weakref.WeakSet()  # modules holding the params
        self._scanned: "weakref.WeakSet" = weakref.WeakSet()  # their trees searched
        self.held: list = []          # their _PendingParams while the exchange is in flight
        self.written: int | None = None  # a param written by another hand meanwhile
        self._plan: tuple | None = None  # the waits of the current exchange plan
        self.lanes: list | None = None  # gloo: the exchange's own groups
        self.lane_count = 1           # lanes for all-gathers (agreed: alike on every rank)
        self.gathers = False          # (gloo) the last exchange was of all-gathers
        self.waited = 0.0             # seconds this rank blocked for the last step's gathers
        self.first_wait: float | None = None  # of those, the first wait
        self.first_by_forward = False  # (and whether a forward waited it)
        self.behind_steps = 0         # exchanges in a row that fell behind the forward

    # ------------------------------------------------------------------ the order
    @property
    def ready(self) -> bool:
        """The order is agreed: the exchange can be left in flight (alike on every rank)."""
        return self.positions is not None

    def begin_recording(self) -> None:
        if self.positions is None and self.recorded is None:
            self.recorded, self._seen, self._read_early = [], set(), set()
            self.ids = {id(p) for p in self._zero().hook_seam.params}
            # (searched again: add_param_group may have brought params of modules that
            # held none of the optimizer's before)
            self._scanned = weakref.WeakSet()
            self._plan = None
            _RECORDING.add(self)
            _activate(self)

    def attribute_read(self, p: torch.Tensor) -> None:
        """(recording) A param read as a module attribute: before its own module's
        forward began, it is waited for at the forward's first module."""
        if self.recorded is not None and id(p) in self.ids and id(p) not in self._seen:
            self._read_early.add(id(p))

    def forget_order(self) -> None:
        """(add_param_group, on every rank) The next step exchanges as without the option
        and the forward after it records the order again, the new params included."""
        self.positions, self.unclaimed, self.recorded = None, set(), None
        self._plan = None
        _RECORDING.discard(self)
        if self.queue is None:  # (a recording under way stops too)
            _deactivate(self)

    def agree_order(self) -> None:
        """(Collective, at a step, alike on every rank: recording began at the same step
        everywhere.) Rank 0's recorded order, as param indices, becomes every rank's.

        Params that no module called in the recorded forward holds directly (read by a
        parent's own forward, `x @ self.child.weight`, by functional code, or not read in
        that forward at all but perhaps in a later one) come first, and the forward's first
        module waits for them: no module hook would."""
        if self.positions is not None or self.recorded is None:
            return
        zero = self._zero()
        index = zero.hook_seam.param_index()
        claimed = [index[i] for i in self.recorded if i in index and i not in self._read_early]
        seen = set(claimed)
        unclaimed = [pid for pid in range(len(zero.hook_seam.params)) if pid not in seen]
        mine = (unclaimed, claimed)
        self.recorded = None
        _RECORDING.discard(self)
        if self.queue is None:
            _deactivate(self)
        group = zero.process_group
        if zero.world_size > 1:
            box = [mine if zero.rank == 0 else None]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group or
                                                                     dist.group.WORLD, 0),
                                       group=group, device=backend_device(group))
            mine = box[0]
        unclaimed, claimed = mine
        self.unclaimed = set(unclaimed)
        self.positions = {pid: k for k, pid in enumerate(unclaimed + claimed)}
        self._plan = None

    def transport(self, exchanger, items: int, gathers: bool) -> tuple[list, bool]:
        """(the groups the exchange travels on, whether at most one op per group may be in
        flight). On gloo they are groups of the optimizer's ranks made for it only (made at
        the first such step: collective over those ranks), so that nothing else ever issues
        on them, the main thread's collectives included; on NCCL the optimizer's own group
        (a communicator runs its ops in issue order). All-gathers (`gathers`: every link
        busy in each) take `lane_count` lanes; broadcasts (one owner's links busy in each)
        MAX_LANES, so that two owners send at once."""
        if FORM not in FORMS:
            raise ValueError(f"ZERO_EXT_GATHER_FORM must be one of {FORMS}, got {FORM!r}")
        if exchanger.backend != "gloo":
            return [exchanger.group], False
        self.gathers = gathers
        if FORM == "nccl":
            want = items
        elif GATHER_LANES:
            want = GATHER_LANES
        else:
            want = self.lane_count if gathers else MAX_LANES
        if self.lanes is None:
            self.lanes = []
        # (made at construction: make_lanes; here only "nccl" form's, one per collective)
        build = want if FORM == "nccl" else max(want, MAX_LANES)
        while len(self.lanes) < build:
            self.lanes.append(_members_only_gloo_group(exchanger.global_ranks))
        return self.lanes[:max(1, want)], FORM != "nccl"

    def make_lanes(self, exchanger) -> None:
        """(construction, collective over the optimizer's ranks) The gloo groups the
        exchange travels on, all of them, though the second may be used only later. Made
        here, not at the first exchange: torch names a group by a counter that each
        new_group call advances on the ranks that make it, so two shard groups whose first
        exchanges come at different steps (one of them raised, say) would make theirs at
        different points, and a later new_group over both would hang. (The "nccl" form
        forced on gloo, for tests, still makes one lane per collective as it needs them.)"""
        if exchanger.backend != "gloo" or exchanger.world == 1 or FORM == "nccl":
            return
        self.lanes = [_members_only_gloo_group(exchanger.global_ranks)
                      for _ in range(max(GATHER_LANES or 0, MAX_LANES))]

    # ------------------------------------------------------------------ in flight
    def start(self, queue: LaneQueue, params_of_items: list) -> None:
        """The step's exchange, issued (NCCL) or handed to the worker thread (gloo)."""
        zero = self._zero()
        self.queue, self.waited, self.first_wait = queue, 0.0, None
        if queue.size == 0:  # (nothing to exchange: no param stepped)
            self._finished()
            return
        params = zero.hook_seam.params
        plan = self._plan
        # (one per exchange plan: the plan's items are the same list while it holds; the
        # order and the modules change only at a recording, which drops it)
        if plan is None or plan[0] is not queue.items or plan[1] != len(params):
            plan = self._plan = (queue.items, len(params),
                                 *self._plan_waits(params, params_of_items))
        _, _, self.order_end, self.first_end, needs = plan
        self.threaded = queue.bounded
        self._watch_writes(queue, params, params_of_items)
        self._hold_modules(needs)
        guard_shutdown()
        _IN_FLIGHT.add(self)
        if self.threaded:
            _WORKER.submit(queue)
        else:
            queue.pump()
        _activate(self)

    def before_forward(self, module: torch.nn.Module) -> None:
        if self.recorded is not None:
            for p in _plain(module).values():
                if p is not None and id(p) in self.ids:
                    self.modules.add(module)  # (it claims its params: it waits for them)
                    if id(p) not in self._seen:
                        self._seen.add(id(p))
                        self.recorded.append(id(p))
            # every module below the outermost one called that holds the params waits from
            # then on, also one whose forward never runs (read by its parent: F.linear(x,
            # self.head.weight)), for whatever reads its params (_PendingParams)
            if module not in self._scanned:
                for sub in module.modules():
                    self._scanned.add(sub)
                    if any(q is not None and id(q) in self.ids
                           for q in _plain(sub).values()):
                        self.modules.add(sub)
                    # params a module keeps references to outside its own _parameters
                    # (`self._post = (self.post.weight, self.post.bias)`, then
                    # `F.linear(x, *self._post)`) may be read before the module holding
                    # them runs, even if it runs later in the same forward: read early
                    self._read_early.update(id(q) for q in _kept_params(sub)
                                            if id(q) in self.ids)
        queue = self.queue
        if queue is None:
            return
        if queue.finished <= self.first_end:
            # the forward's first module, whichever: params no module it knows holds
            self._wait_through(self.first_end, by_forward=True)
        held = module.__dict__.get("_parameters")
        if type(held) is _PendingParams and self in held.needs:
            held.settle(by_forward=True)

    def _plan_waits(self, params: list, params_of_items: list) -> tuple:
        """(order_end: the item of the last param the forward uses, first_end: the last
        item carrying params no module hook claims, [(module, the last item carrying its
        params)] for every module known to hold them)."""
        last_item: dict[int, int] = {}  # id(param) -> the last item carrying it
        for k, pids in enumerate(params_of_items):
            for pid in pids:
                last_item[id(params[pid])] = k
        used = [last_item[id(params[pid])] for pid in self.positions
                if pid < len(params) and id(params[pid]) in last_item]
        order_end = max(used) if used else len(params_of_items) - 1
        # the forward's first module waits for every param no module hook claims, also
        # those a known module holds: a forward may read them without going through that
        # module at all (a reference kept in a tuple, `F.linear(x, *self._pre)`). They come
        # first in the order, so this wait is for the head of the exchange.
        loose = {pid for pid in self.unclaimed if pid < len(params)}
        first_end = max((k for k, pids in enumerate(params_of_items)
                         if loose.intersection(pids)), default=-1)
        needs = []
        for module in list(self.modules):
            need = max((last_item.get(id(p), -1) for p in _plain(module).values()
                        if p is not None), default=-1)
            if need >= 0:
                # past its last param in the recorded order, the forward completes the
                # rest too (params it does not use): no rank's exchange outlives its forward
                needs.append([weakref.ref(module),
                              len(params_of_items) - 1 if need >= order_end else need,
                              None])  # (its _PendingParams, made once, filled at each step)
        return order_end, first_end, needs

    def _hold_modules(self, needs: list) -> None:
        """Every module known to hold the params gets a _PendingParams in place of its
        `_parameters` until the collectives carrying them have finished: whatever reads or
        writes them through the module waits for them first."""
        for entry in needs:
            module = entry[0]()
            if module is None:
                continue
            held = module.__dict__["_parameters"]
            if type(held) is not _PendingParams:  # (else another optimizer's: joined)
                mine = entry[2]
                if mine is None or mine.plain is not held:
                    mine = entry[2] = _PendingParams(held, module)
                else:  # (the same dict as last time: its names as they are now)
                    dict.clear(mine)
                    dict.update(mine, held)
                module.__dict__["_parameters"] = held = mine
            held.needs[self] = entry[1]
            self.held.append(held)

    def _watch_writes(self, queue: LaneQueue, params: list, params_of_items: list) -> None:
        """A write into a param while the collectives carrying it are in flight (a script
        that writes params it holds, between step and forward, without wait_for_params)
        moves its version counter, which the exchange's own writes leave alone (they go
        through `.data`: Replicas.sync): checked once each item has finished."""
        versions = [p._version for p in params]

        def watch(k: int) -> None:
            if self.written is None:
                for pid in params_of_items[k]:
                    if params[pid]._version != versions[pid]:
                        self.written = pid
                        return

        queue.watch = watch

    def write_error(self) -> RuntimeError | None:
        """(at a step, before its agreement: raised on every rank) A param written while
        its exchange was in flight, on this rank; then forgotten."""
        pid, self.written = self.written, None
        if pid is None:
            return None
        zero = self._zero()
        p = zero.hook_seam.params[pid] if zero is not None else None
        shape = tuple(p.shape) if p is not None else "?"
        return RuntimeError(
            f"zero_ext: param {pid} of the optimizer (shape {shape}) was written while the "
            "last step's exchange of it was in flight (overlap_param_gather=True): the "
            "exchange landed on part of the write, so the params differ between ranks. Call "
            "opt.wait_for_params() on every rank before writing params held outside the "
            "module between step() and the next forward (a write through the module, "
            "`model.layer.weight`, waits by itself)")

    def _wait_through(self, k: int, by_forward: bool = False) -> None:
        queue = self.queue
        if queue.finished > k and not queue.done:  # (arrived: no wait, no lock)
            if self.first_wait is None:
                self.first_wait, self.first_by_forward = 0.0, by_forward
            return
        t = time.perf_counter()
        if self.threaded:
            queue.wait_finished(k)
        else:
            queue.complete_through(k)
        dt = time.perf_counter() - t
        self.waited += dt
        if self.first_wait is None:
            self.first_wait, self.first_by_forward = dt, by_forward
        if queue.done:
            self._finished()

    def wait_all(self) -> None:
        """Every collective of the last step's exchange completed into the params."""
        if self.queue is not None:
            self._wait_through(self.queue.size - 1)

    # ------------------------------------------------------------------ lanes
    def fell_behind(self) -> bool:
        """Whether the forward, after its first wait (the first collective can only start
        at the step), still waited for later collectives: more than 2 ms and more than half
        the first wait. Then they arrive later than the forward needs them."""
        first = self.first_wait or 0.0
        late = self.waited - first
        return late > 0.002 and late > 0.5 * first

    def wants_more_lanes(self) -> bool:
        """(this rank's vote at the step) One more lane would help: lanes not fixed by
        ZERO_EXT_GATHER_LANES, fewer than MAX_LANES, and the last BEHIND_STEPS exchanges
        that a forward consumed fell behind it on this rank."""
        return (GATHER_LANES is None and FORM != "nccl" and self.gathers
                and self.lane_count < MAX_LANES and self.behind_steps >= BEHIND_STEPS)

    def add_lane(self) -> None:
        """(at a step, on every rank: the votes are agreed) The next exchanges use one lane
        more (made, collectively, by transport())."""
        self.lane_count = min(MAX_LANES, self.lane_count + 1)
        self.behind_steps = 0

    def _finished(self) -> None:
        zero = self._zero()
        # Only exchanges a forward consumed count (one completed at once by a state_dict,
        # wait_for_params or the next step says nothing about the forward), in a row.
        if self.first_wait is not None and self.first_by_forward:
            self.behind_steps = self.behind_steps + 1 if self.fell_behind() else 0
        if zero is not None:
            zero.last_step_timings["param_wait"] = self.waited
        self.queue = None
        for held in self.held:
            held.release(self)
        self.held = []
        _IN_FLIGHT.discard(self)
        if self.recorded is None:
            _deactivate(self)
