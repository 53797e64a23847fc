"""reduce_scatter_hook, the DDP comm hook: which optimizer and which DDP model a bucket
belongs to, and what happens to it (reduce-scattered to its owners, or all-reduced as DDP
does). The cut is in plan.py, the collectives in transport.py, the record of what was
reduced in record.py, the checks before a step in checks.py.
"""
# (no `from __future__ import annotations`: DDP checks the hook's annotations as objects)
import logging
import weakref
from typing import Any

import torch
import torch.distributed as dist

from ..seam import HookSeam, newest_holding
from . import plan
from .record import Record
from .transport import Transfers

logger = logging.getLogger("zero_ext")


class GradReducer:
    """The hook's state for one optimizer: its buckets' plans, the transfers in flight and
    the record of what was reduced since the last step."""

    def __init__(self, opt):
        self.seam: HookSeam = opt.hook_seam  # all this reads of the optimizer, or asks
        self.buckets: dict = {}  # plan.cut's cache: (first param's id, bucket index) -> plan
        self.transfers = Transfers(self.seam, opt.world_size, opt.rank)
        self.record = Record(self.seam)
        self.checked_ddps: "weakref.WeakSet" = weakref.WeakSet()  # layouts checked

    @property
    def replica_group(self):
        return self.transfers.replica_group

    @replica_group.setter
    def replica_group(self, group) -> None:
        self.transfers.replica_group = group

    def bucket_plan(self, bucket, params=None) -> "plan.BucketPlan | None":
        return plan.cut(bucket, self.seam.ownership(), self.seam.param_index(),
                        self.transfers.world, self.buckets, params,
                        self.transfers.scatters)

    def start_step(self) -> None:
        """The step reads the grads: the record is consumed, the transfers start afresh.
        Plans no backward used since the last step let go of their views (of a DDP model's
        bucket buffers: one replaced or gone keeps no memory alive past one step)."""
        self.record.start_step()
        self.transfers.restart()
        for bp in self.buckets.values():
            if not bp.used:
                for seg in bp.segments:
                    seg.views.clear()
            bp.used = False

    def reduce(self, bucket, bp: "plan.BucketPlan") -> torch.futures.Future:
        bp.used = True
        self.record.reduced(bp.param_ids, self.seam.ownership())
        # (offload_optimizer: the owned grads leave for the host as the bucket finishes)
        return self.seam.bucket_reduced(bp.param_ids, bucket,
                                        self.transfers.reduce(bucket.buffer(), bp.segments))


# The hook's state per optimizer (the optimizer knows nothing of it)
_REDUCERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def reducer_of(opt) -> GradReducer:
    r = _REDUCERS.get(opt)
    if r is None:
        r = _REDUCERS[opt] = GradReducer(opt)
        r.replica_group = _replica_group(opt.process_group)
    return r


def _replica_group(group):
    """The replica group when `group` is a shard group made by hybrid_groups() (the owned
    sums are then all-reduced across the replicas), else None: a layout is hybrid because
    of how its groups were made, not because the job is larger than the group (DDP may
    well average over the same subgroup: the data-parallel groups of a pipeline layout)."""
    from ..hybrid import replica_group_of

    if group is None:
        return None
    try:
        return replica_group_of(group)
    except ValueError:
        return None


# What _ddp_of found for a DDP bucket, kept on the bucket's buffer tensor itself (GradBucket
# does not say which DDP runs the hook, nor over which process group): DDP allocates a
# bucket's buffer once per bucket layout (its first iteration's, the rebuilt one) and hands
# the same tensor to the hook at every backward. So a new DDP model over the same params (a
# model wrapped again) comes with buffers never seen and is scanned for, and a buffer freed
# with its model takes the note along: a new buffer at a reused address starts without it,
# where a note kept by the first param's id or the buffer's address went on naming the
# model gone (its first iterations then went unseen; see _before_rebuild).
_SEEN = "_zero_ext_ddps"
_SEVERAL = object()


def _ddp_of(bucket, p: torch.Tensor) -> tuple:
    """(the live DDP models that may be running this hook: those holding the bucket's first
    param `p`, with the hook registered if any are; their process group, or _SEVERAL when
    their groups differ, or None when none was found). One scan of the live objects per
    bucket layout of each DDP model, and again when one of the models found is gone."""
    buf = bucket.buffer()
    seen = getattr(buf, _SEEN, None)
    if seen is not None:
        ddps = tuple(r() for r in seen[0])
        if all(d is not None for d in ddps):
            return ddps, seen[1]
    found = _ddp_holding(p)
    groups = {tuple(sorted(dist.get_process_group_ranks(d.process_group))) for d in found}
    group = None if not found else (found[0].process_group if len(groups) == 1
                                    else _SEVERAL)
    setattr(buf, _SEEN, (tuple(weakref.ref(d) for d in found), group))
    return tuple(found), group


def _before_rebuild(ddps: tuple) -> bool:
    """Whether the DDP model running the hook has not rebuilt its buckets yet (its first
    iteration, the first two with static_graph; never with find_unused_parameters=True
    without static_graph, which never rebuilds): then its buckets are all-reduced, as DDP
    does. Its first iteration has one bucket of every grad (per dtype), rebuilt into
    buckets of bucket_cap_mb afterwards, and reduce-scattering it would need scratch of the
    model's size for the whole run; and a static_graph DDP's first backward hands every
    bucket to the hook as bucket 0, none as the last (DDP's delayed all-reduce), so the
    record of what the hook reduced would never be queued and the step would read partial
    grads unchecked. Where several DDP models hold the params (a model wrapped again while
    the old wrap is still referenced), which one runs is unknown: any of them that has run
    a forward (so not one built and never used) and not rebuilt yet."""
    def warming(d) -> bool:
        return not d._has_rebuilt_buckets and (not d.find_unused_parameters or d.static_graph)

    if len(ddps) == 1:
        return warming(ddps[0])
    return any(warming(d) and getattr(d, "_lazy_init_ran", True) for d in ddps)


def _ddp_holding(param) -> list:
    """The DDP models holding `param` that may run this hook (those with it registered, if
    any)."""
    import gc

    from torch.nn.parallel import DistributedDataParallel

    gc.collect()  # a dead DDP of an earlier wrap in a cycle: gone alike on every rank
    # (issubclass of the type: isinstance would ask a dead weakref.proxy, which raises)
    found = [o for o in gc.get_objects() if issubclass(type(o), DistributedDataParallel)
             and any(q is param for q in o.module.parameters())]
    hooked = [o for o in found if any(h is reduce_scatter_hook
                                      for h, _ in getattr(o, "_comm_hooks", ()))]
    return hooked or found


def check_layout(reducer, ddp, group) -> None:
    """Once per DDP model, before its first reduction: DDP must average over the
    optimizer's own group (then no replicas, whoever made the group), or over the whole job
    when that is a hybrid_groups() shard group (then the owned sums are all-reduced across
    its replica group); else which ranks hold the same elements is unknown and the averages
    would be wrong. The same on every rank."""
    if ddp is not None and ddp in reducer.checked_ddps:
        return
    opt = reducer.seam.optimizer
    if ddp is not None:
        reducer.checked_ddps.add(ddp)
    if group is None or group is _SEVERAL:
        return  # (unknown: the groups cannot be compared)
    theirs = sorted(dist.get_process_group_ranks(group))
    ours = sorted(dist.get_process_group_ranks(opt.process_group or dist.group.WORLD))
    if theirs == ours:
        reducer.replica_group = None
    elif reducer.replica_group is None or theirs != list(range(dist.get_world_size())):
        raise ValueError(
            f"reduce_scatter_hook: DDP averages the grads over ranks {theirs}, "
            f"but the optimizer shards over ranks {ours}"
            + (" of a hybrid_groups() layout, which needs DDP over the whole job or "
               "over the shard group itself"
               if reducer.replica_group is not None else
               ", a group that zero_ext.hybrid_groups() did not make, so the ranks "
               "holding the same shard elsewhere are unknown")
            + ". Build the optimizer over DDP's own process group, or the groups with "
            "zero_ext.hybrid_groups() (DDP over the whole job, the optimizer over the "
            "shard group)")


def _owner_of(first: torch.Tensor, state: Any):
    if state is not None:
        if not isinstance(getattr(state, "hook_seam", None), HookSeam):
            raise TypeError(
                "reduce_scatter_hook: the hook's state must be a "
                "zero_ext.ZeroRedundancyOptimizer or None, got "
                f"{type(state).__module__}.{type(state).__qualname__}")
        return state
    return newest_holding(first)


@torch._disable_dynamo  # a backward inside a compiled function: collective, data-dependent
def reduce_scatter_hook(state: Any, bucket: dist.GradBucket
                        ) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: each grad goes, summed and averaged, only to the rank that owns its
    elements in zero_ext's optimizer (`state`, or None to find the optimizer holding the
    bucket's params). Register with ``ddp.register_comm_hook(opt_or_None,
    reduce_scatter_hook)``; then call ``opt.clip_grad_norm_`` (not torch's) and
    ``opt.step()`` as usual. See the module docstring for what ``.grad`` holds."""
    params = bucket.parameters()  # (once: a list made anew by each call)
    opt = _owner_of(params[0], state)
    ddps, group = _ddp_of(bucket, params[0])
    ddp = ddps[0] if len(ddps) == 1 else None
    if opt is None:  # no zero_ext optimizer holds these params: DDP's own all-reduce
        _say_all_reduced_once(bucket)
        if bucket.is_last():
            # DDP's last bucket ends this backward: the record of the grads reduced for
            # any optimizer is queued here too, or their step would read them unchecked
            # (a partition changed since by add_param_group, a clip of partial grads)
            for reducer in list(_REDUCERS.values()):
                reducer.record.after_bucket(bucket)
        if group is _SEVERAL:
            raise ValueError(
                "reduce_scatter_hook: the params of DDP bucket "
                f"{bucket.index()} belong to DDP models over different process groups, and "
                "no zero_ext optimizer holds them: which group averages them is unknown. "
                "Register DDP's default all-reduce on the model whose params no zero_ext "
                "optimizer holds")
        return _all_reduce(bucket, group)
    opt.hook_seam.wait_for_params()  # (before any collective on the exchange's lanes)
    opt.hook_seam.reduce_scatter_begins()  # (sharding="auto": even, before any state)
    if opt.hook_seam.joined:
        raise NotImplementedError(
            "reduce_scatter_hook under a Join context (uneven inputs) is not supported: "
            "register DDP's default all-reduce for training with Join")
    reducer = reducer_of(opt)
    check_layout(reducer, ddp, group)
    if group is None or group is _SEVERAL:  # (unknown: the optimizer's layout decides)
        group = None if reducer.replica_group else opt.process_group
    try:
        if _before_rebuild(ddps):  # (DDP's first iterations: its bytes, once)
            return _all_reduce(bucket, group)
        bp = reducer.bucket_plan(bucket, params)
        if bp is None:  # (params of no or another optimizer: DDP's all-reduce)
            return _all_reduce(bucket, group)
        return reducer.reduce(bucket, bp)
    finally:
        reducer.record.after_bucket(bucket)


_SAID_ALL_REDUCED = False


def _say_all_reduced_once(bucket) -> None:
    """A bucket whose params no zero_ext optimizer holds is all-reduced, as DDP does: right
    for params a plain optimizer steps, but a model meant to go through the hook (an
    optimizer built over other params, or not yet) would lose its savings with no word."""
    global _SAID_ALL_REDUCED
    if not _SAID_ALL_REDUCED:
        _SAID_ALL_REDUCED = True
        logger.warning(
            "zero_ext: reduce_scatter_hook all-reduces DDP bucket %d as DDP does: no "
            "zero_ext ZeroRedundancyOptimizer holds its params (said once per process)",
            bucket.index())


def _all_reduce(bucket, group) -> torch.futures.Future:
    """What DDP does by default: the bucket summed over `group` (None: the job), averaged."""
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(group))
    work = dist.all_reduce(buf, group=group, async_op=True)
    return work.get_future().then(lambda fut: (fut.wait(), buf)[1])
