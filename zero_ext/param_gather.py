"""The params' exchange after a step, left in flight until the next forward needs it
(``ZeroRedundancyOptimizer(..., overlap_param_gather=True)``).

Without it, ``step()`` returns once every owner's update has reached every rank. With it,
the step issues the exchange's collectives in the order the next forward first uses the
params and returns; each module's forward then waits only for the collectives carrying its
own params (``module._parameters``), as Megatron's distributed optimizer does
(``overlap_param_gather``). Where the model computes (a GPU), the exchange hides behind
the next forward instead of adding to the step.

- The order (speed only, never what waits): the first forward after the first step
  records, per rank, the order in which modules' params are first used; the next step
  agrees on rank 0's order (one object broadcast, once) and plans the exchange by it from
  then on. Until then steps exchange as without the option.
- Transport: on NCCL every collective is issued at the step (a communicator runs its ops in
  issue order, on its own stream) and a waiting forward's stream waits on the collective's
  event, not the host. On gloo at most one collective per lane may be in flight (several
  async ops on one gloo group can start in a different order on each rank), so a worker
  thread issues them one after the other on lanes (groups) of the optimizer's ranks made for
  this only (a rank whose main thread waits in another collective, such as DDP's buffer
  broadcast at the start of its forward, still completes the exchange that another rank
  waits for: rank 0 saving ``model.state_dict()`` after the step, say).
- What waits (_WaitPlan), keyed on the params: every collective carries known params, and
  an alias (`b.data = a.data`) travels as the param whose memory it shares. Any module's
  forward, whether zero_ext has seen the module before or not, first waits through the last
  collective carrying a param it holds (its ``_parameters``: by identity, or by memory for
  a Parameter over a param's memory that the optimizer does not hold) or keeps for its
  forward in its own tuples, lists or dicts (a wrapper's list of every param it wraps, as
  DDP keeps, is bookkeeping, not a read: `_kept_reads`). So a module waits for its own
  collectives and no more, and DDP's forward, the first one called, for none.
- Nothing stale is read through a module: while the exchange is in flight, every module
  found holding its params (the tree of every module whose forward ran while recording or
  in flight) has a `_PendingParams` in place of its ``_parameters``, and any read or write
  of a value there waits for that module's collectives first (a parent's read of a child's
  weight, state_dict, load_state_dict, parameters(), Module._apply's casts, pickling,
  deepcopy, DDP's constructor and its final sync after a Join); the module gets its own
  dict back then, and nothing of zero_ext's stays on it. Params no module was found holding,
  or no module's forward read when the order was recorded, travel first, and the first
  forward after the step waits for them. Every method of the
  optimizer that reads or writes params or state waits first (step, clip_grad_norm_,
  state_dict, load_state_dict, consolidate_state_dict, add_param_group,
  checkpoint.save/load, Join), as do the DDP comm hooks before their first collective.
  ``zero_grad()`` (the optimizer's, and torch's Module.zero_grad) does not wait: it touches
  no param value, and it runs between step and forward in nearly every training loop.
- What no module sees, the script's reads or writes of params it holds itself (a list
  taken before the step, another optimizer's param_groups), must follow
  ``opt.wait_for_params()``, on every rank. A write there while the collectives carrying the
  param are in flight moves its version counter: the next step raises on every rank.
"""
from __future__ import annotations

import atexit
import bisect
import copy
import itertools
import logging
import os
import sys
import threading
import time
import types
import weakref

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

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
    for gather in list(_ACTIVE):
        gather.before_forward(module)


_REGISTRATION_HOOKS: list = []


def _watch_registrations() -> None:
    """(once per process) What a module found before is given later is found too: a
    submodule attached to it (`model.aux = head`) has its tree searched, and a Parameter
    registered on it (`module.weight = p`, `register_parameter`,
    `load_state_dict(assign=True)`) is waited for at once if in flight; either way the
    waits are planned again at the next step."""
    if not _REGISTRATION_HOOKS:
        hooks = torch.nn.modules.module
        _REGISTRATION_HOOKS.append(hooks.register_module_parameter_registration_hook(
            _param_registered))
        _REGISTRATION_HOOKS.append(hooks.register_module_module_registration_hook(
            _module_registered))


def _param_registered(module: torch.nn.Module, name: str, param) -> None:
    for gather in list(_ALL):
        if module in gather._scanned:
            gather.registered(module, param)


def _module_registered(module: torch.nn.Module, name: str, submodule) -> None:
    if submodule is None:
        return
    for gather in list(_ALL):
        if module in gather._scanned:
            gather._discover(submodule)


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
_WARNED_KEPT: set = set()


def _opaque(module: torch.nn.Module) -> str | None:
    """How a module runs its submodules where no forward hook is seen: "wrapper" (a
    ScriptModule, torch.compile's OptimizedModule: its own forward hooks run eagerly
    first) or "in place" (`module.compile()`: its hooks run inside the compiled code)."""
    if module.__dict__.get("_compiled_call_impl") is not None:
        return "in place"
    if isinstance(module, torch.jit.ScriptModule):
        return "wrapper"
    compiled = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(compiled, "OptimizedModule", None)
    return "wrapper" if optimized is not None and isinstance(module, optimized) else None


def _kept_reads(module: torch.nn.Module) -> dict:
    """{attribute: [params]}: the params a module refers to from plain tuples, lists and
    dicts among its own attributes (nested up to _KEPT_DEPTH levels: `self._wb = [(l.weight,
    l.bias) for l in self.layers]`; not its _parameters, buffers or submodules), which its
    forward may read before, or without, calling the module that holds them
    (`self._pre = (self.pre.weight, self.pre.bias)`, then `F.linear(x, *self._pre)`).

    Less a wrapper's bookkeeping, which its forward never reads: DDP's lists
    (`_module_parameters`, `_delay_all_reduce_params`: its forward hands the wrapped
    module's outputs to its reducer and reads grads only; counted as reads they made DDP's
    forward, the first one called, wait for the whole exchange), and the attributes a class
    names in `zero_ext_bookkeeping` (a wrapper of its own with such a list). No other list
    can be told from one the forward reads (a list of every param, read functionally, looks
    the same), so every other one counts as read: correct, at the cost of overlap, which
    `_warn_if_kept_most` reports."""
    if isinstance(module, DistributedDataParallel):
        return {}
    skip = getattr(type(module), "zero_ext_bookkeeping", ())
    kept = {}
    for name, value in vars(module).items():
        if name in _MODULE_INTERNALS or name in skip or not isinstance(value, (tuple, list,
                                                                              dict)):
            continue
        found = list(_params_in(value, _KEPT_DEPTH))
        if found:
            kept[name] = found
    return kept


_KEPT_DEPTH = 3


def _params_in(value, depth: int):
    """Parameters in a plain tuple, list or dict, and in those nested in it."""
    for item in (value.values() if isinstance(value, dict) else value):
        if isinstance(item, torch.nn.Parameter):
            yield item
        elif depth > 1 and isinstance(item, (tuple, list, dict)):
            yield from _params_in(item, depth - 1)


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


class _WaitPlan:
    """Which collectives of an exchange each module's forward waits for.

    A param is carried by the items (collectives) whose pieces hold it; an alias (a param
    over another's memory, `b.data = a.data`) by its first param's. A module waits through
    the last item carrying any param it holds or keeps for its forward (_kept_reads);
    found by identity, and for a param the optimizer does not hold, by memory: one that
    overlaps a param in flight waits for that param's items. A module whose params reach
    the last param of the recorded order waits for the whole exchange, so that no
    exchange outlives its forward. Params no module was found holding, or no module's
    forward read when the order was recorded (`loose`), are waited for by the first forward
    after the step, whichever module it is."""

    def __init__(self, key: tuple, gather: "ParamGather", params: list, params_of_items: list,
                 alias_of: dict):
        self.key = key
        self._kept_of = gather._kept_of
        self.size = len(params_of_items)
        item_of: dict[int, int] = {}  # id(param) -> the last item carrying it
        for k, pids in enumerate(params_of_items):
            for pid in pids:
                item_of[id(params[pid])] = k
        self._spans: dict | None = None  # device -> sorted (start, end, item): by memory
        self._exchanged = [(params[pid], k) for k, pids in enumerate(params_of_items)
                           for pid in pids]
        for pid, tied in alias_of.items():
            if id(params[tied]) in item_of:
                item_of[id(params[pid])] = item_of[id(params[tied])]
        self.item_of = item_of
        used = [item_of[id(params[pid])] for pid in (gather.positions or ())
                if pid < len(params) and id(params[pid]) in item_of]
        self.order_end = max(used) if used else self.size - 1
        modules = list(gather.modules)
        self.held = self.holds(modules)
        reached = {id(p) for m in modules for p in itertools.chain(
            _plain(m).values(), self._kept_of.get(m, ()))}
        # Loose: params no module found holds, and params no module's forward read in the
        # recorded forward (a head read through a functools.partial or a namespace made at
        # construction, before any module runs): they travel first, and the first forward
        # after the step waits for them.
        unread = gather.unrecorded
        self.loose_end = max((k for k, pids in enumerate(params_of_items)
                              if any(pid in unread or id(params[pid]) not in reached
                                     for pid in pids)), default=-1)
        if gather.opaque:  # (compiled code: the first forward waits for everything)
            self.loose_end = self.size - 1

    def made_for(self, key: tuple) -> bool:
        """(items, number of params, the params' recorded memory, modules' generation)"""
        mine = self.key
        return (mine[0] is key[0] and mine[1] == key[1] and mine[2] is key[2]
                and mine[3] == key[3])

    def holds(self, modules: list) -> list:
        """[weakref(module), the last item its forward waits for, its _PendingParams (made
        at the first hold)] for every one of `modules` that reads params in flight."""
        out = []
        for module in modules:
            k = self.need(module)
            if k >= 0:
                out.append([weakref.ref(module), k, None])
        return out

    def need(self, module: torch.nn.Module) -> int:
        k = -1
        for p in itertools.chain(_plain(module).values(), self._kept_of.get(module, ())):
            if p is not None:
                k = max(k, self.item(p))
        if k >= self.order_end:  # past the recorded order: the rest too
            k = self.size - 1
        return k

    def item(self, p: torch.Tensor) -> int:
        """The last item carrying `p` (-1: none)."""
        k = self.item_of.get(id(p))
        if k is not None:
            return k
        if p.device.type == "meta" or p.numel() == 0:
            return -1
        if self._spans is None:
            spans: dict = {}
            for q, k in self._exchanged:
                if q.numel():
                    spans.setdefault(q.device, []).append((q.data_ptr(), _end(q), k))
            self._spans = {d: sorted(v) for d, v in spans.items()}
        spans = self._spans.get(p.device, ())
        lo, hi = p.data_ptr(), _end(p)
        i = max(bisect.bisect_right(spans, (lo, float("inf"))) - 1, 0)
        k = -1
        while i < len(spans) and spans[i][0] < hi:
            if spans[i][1] > lo:
                k = max(k, spans[i][2])
            i += 1
        return k


def _end(t: torch.Tensor) -> int:
    """The address past the last byte `t` reaches."""
    reach = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return t.data_ptr() + reach * t.element_size()


class ParamGather:
    """One optimizer's exchange in flight, and the order it is issued in."""

    def __init__(self, zero):
        _ALL.add(self)
        _watch_registrations()
        self._zero = weakref.ref(zero)
        self.queue: LaneQueue | None = None
        self.threaded = False         # the worker thread drives `queue` (gloo)
        self.positions: dict[int, int] | None = None  # param index -> first use (agreed)
        self.unrecorded: frozenset = frozenset()  # params no module's forward read then
        self.recorded: list | None = None  # param indices in first-use order, while recording
        self._seen: set = set()
        self._pid_of: dict = {}       # (recording) id(param) -> the param carrying it
        self.modules: "weakref.WeakSet" = weakref.WeakSet()  # modules found holding params
        self._scanned: "weakref.WeakSet" = weakref.WeakSet()  # modules found (any)
        self._kept_of: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._generation = 0          # moves when modules are found or given params
        self.opaque = False           # compiled or scripted code found: wait for all at once
        self.wait_at_step = False     # (code compiled in place: at the step itself)
        self._recording_done = False  # (recording stopped early: opaque code found)
        self._lock = threading.RLock()  # (forwards on several threads wait alike)
        self.waits: _WaitPlan | None = None  # the current exchange plan's waits
        self.held: list = []          # _PendingParams of modules while in flight
        self.written: int | None = None  # a param written by another hand meanwhile
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
            zero = self._zero()
            alias_of = zero.plan.alias_of
            self.recorded, self._seen, self._recording_done = [], set(), False
            self._pid_of = {id(p): alias_of.get(i, i)
                            for i, p in enumerate(zero.hook_seam.params)}
            # (modules searched again: their kept references may have changed)
            self._scanned = weakref.WeakSet()
            self.waits = None
            _activate(self)

    def forget_order(self) -> None:
        """(add_param_group, on every rank) The next step exchanges as without the option
        and the forward after it records the order again, the new params included."""
        self.positions, self.recorded, self.waits = None, None, None
        self.unrecorded = frozenset()
        if self.queue is None:  # (a recording under way stops too)
            _deactivate(self)

    def _record(self, module: torch.nn.Module) -> None:
        """(recording) The params this module's forward may read, in first-use order."""
        if self._recording_done:
            return
        for p in itertools.chain(_plain(module).values(), self._kept_of.get(module, ())):
            pid = self._pid_of.get(id(p))
            if pid is not None and pid not in self._seen:
                self._seen.add(pid)
                self.recorded.append(pid)

    def agree_order(self) -> None:
        """(Collective, at a step, alike on every rank: recording began at the same step
        everywhere.) Rank 0's recorded order, as param indices, becomes every rank's.
        Params that no forward read through a module (read by functional code, or not at
        all that time) go first: where they are read is not known. An alias travels as the
        param whose memory it shares."""
        if self.positions is not None or self.recorded is None:
            return
        zero = self._zero()
        recorded, self.recorded = self.recorded, None
        if self.queue is None:
            _deactivate(self)
        group = zero.process_group
        if zero.world_size > 1:
            box = [recorded if zero.rank == 0 else None]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group or
                                                                     dist.group.WORLD, 0),
                                       group=group, device=backend_device(group))
            recorded = box[0]
        alias_of = zero.plan.alias_of
        seen = set(recorded)
        first = [pid for pid in range(len(zero.hook_seam.params))
                 if pid not in seen and pid not in alias_of]
        self.unrecorded = frozenset(first)
        self.positions = {pid: k for k, pid in enumerate(first + recorded)}
        for pid, tied in alias_of.items():
            if tied in self.positions:
                self.positions[pid] = self.positions[tied]
        self.waits = None

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
        # (one per exchange plan: the same items while the layout, the params' memory, the
        # order and the modules found stay as they are)
        key = (queue.items, len(params), zero._replicas._ptrs, self._generation)
        waits = self.waits
        if waits is None or not waits.made_for(key):
            waits = self.waits = _WaitPlan(key, self, params, params_of_items,
                                           zero.plan.alias_of)
        self.threaded = queue.bounded
        self._watch_writes(queue, params, params_of_items)
        self._hold_modules(waits.held)
        guard_shutdown()
        _IN_FLIGHT.add(self)
        if self.threaded:
            _WORKER.submit(queue)
        else:
            queue.pump()
        _activate(self)
        if self.wait_at_step:
            self.wait_all()

    def before_forward(self, module: torch.nn.Module) -> None:
        """(every module's forward, while recording or in flight) A module seen for the
        first time gets its tree searched; then the module waits for the collectives
        carrying the params it holds (its _PendingParams), and the first forward after the
        step for those carrying params no module was found holding."""
        if module not in self._scanned:
            self._discover(module)
        if self.recorded is not None:
            self._record(module)
        queue, waits = self.queue, self.waits
        if queue is None or waits is None:
            return
        if queue.finished <= waits.loose_end:
            self._wait_through(waits.loose_end, by_forward=True)
            if self.queue is None:
                return
        held = module.__dict__.get("_parameters")
        if type(held) is _PendingParams and self in held.needs:
            held.settle(by_forward=True)

    def _discover(self, module: torch.nn.Module) -> None:
        """Every module of `module`'s tree not searched before: those holding params, or
        keeping references to params (_kept_reads), are known from now on. While an
        exchange is in flight they are held at once (a module called for the first time
        after the step: an eval head sharing the model's embedding)."""
        found = []
        for sub in module.modules():
            if sub in self._scanned:
                continue
            self._scanned.add(sub)
            kind = _opaque(sub)
            if kind is not None and not (self.opaque and (self.wait_at_step
                                                          or kind == "wrapper")):
                self._found_opaque(sub, kind)
            kept = _kept_reads(sub)
            if kept:
                self._kept_of[sub] = [q for reads in kept.values() for q in reads]
                self._warn_if_kept_most(sub, kept)
            if kept or any(p is not None for p in _plain(sub).values()):
                self.modules.add(sub)
                found.append(sub)
        if found:
            self._generation += 1
            if self.queue is not None:
                self._hold_modules(self.waits.holds(found))

    def _found_opaque(self, module: torch.nn.Module, kind: str) -> None:
        """Compiled or scripted code (torch.compile's OptimizedModule, a ScriptModule, a
        module compiled in place) runs its submodules where no forward hook of zero_ext's
        is seen, and a dict swapped into a submodule fails torch.compile's guards (a
        recompile at every step). From now on the order is not recorded, and the first
        forward after each step waits for the whole exchange before the compiled code is
        entered; where that forward's own hooks run inside compiled code (compiled in
        place), the step itself waits for it (a local choice: the collectives are the same
        on every rank either way)."""
        self.opaque = True
        self.wait_at_step = self.wait_at_step or kind == "in place"
        self._generation += 1
        if self.recorded is not None:
            self._recording_done = True
            if self.queue is None:
                _deactivate(self)  # (no global hook seen by the compiled code from now on)
        logging.getLogger("zero_ext").warning(
            "zero_ext: overlap_param_gather=True with %s (%s) in the model: its code runs "
            "where zero_ext cannot see which params each module reads, so %s waits for the "
            "whole params' exchange (correct, but nothing overlaps; without compiling or "
            "scripting, each module waits for its own params only)", type(module).__name__,
            "compiled in place" if kind == "in place" else "compiled or scripted",
            "each step" if self.wait_at_step else "the first forward after each step")

    def _warn_if_kept_most(self, module: torch.nn.Module, kept: dict) -> None:
        """A module that keeps references to most of the exchanged params (a list of the
        decayed params, say) waits for them at its forward: the overlap is then mostly
        gone. Said once per attribute."""
        zero = self._zero()
        if zero is None:
            return
        mine = {id(p): p.numel() for p in zero.hook_seam.params}
        total = sum(mine.values())
        for name, reads in kept.items():
            share = sum(mine.get(i, 0) for i in {id(q) for q in reads})
            key = (type(module).__qualname__, name)
            if total and share > total // 2 and key not in _WARNED_KEPT:
                _WARNED_KEPT.add(key)
                logging.getLogger("zero_ext").warning(
                    "zero_ext: overlap_param_gather=True: %s.%s keeps references to %.0f%% "
                    "of the optimizer's param elements; its forward waits for them (it may "
                    "read them), so little of the exchange overlaps. If its forward does not "
                    "read them, keep that list outside the module, or name the attribute in "
                    "the class attribute `zero_ext_bookkeeping` (a tuple of names)",
                    type(module).__name__, name, 100.0 * share / total)

    def registered(self, module: torch.nn.Module, param) -> None:
        """A Parameter registered on a module found before (an eval head tied to the
        embedding after it ran on its own weight): the waits are planned again at the next
        step, and one whose exchange is in flight now is waited for at once (the waits in
        flight were planned without it)."""
        self.modules.add(module)
        self._generation += 1
        if self.queue is not None and isinstance(param, torch.Tensor):
            k = self.waits.item(param)
            if k >= 0:
                self._wait_through(k)

    def _hold_modules(self, entries: list) -> None:
        """Every module whose forward reads params in flight gets a _PendingParams in
        place of its `_parameters` until the collectives carrying them have finished:
        whatever reads or writes them through the module waits for them first."""
        for entry in entries:
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
        if queue is None:
            return
        if queue.finished > k and not queue.done:  # (arrived: no wait, no lock)
            if self.first_wait is None:
                self.first_wait, self.first_by_forward = 0.0, by_forward
            return
        with self._lock:  # (forwards on two threads: one completes, the other waits)
            queue = self.queue
            if queue is None:
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
        queue = self.queue
        if queue is not None:
            self._wait_through(queue.size - 1)

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
