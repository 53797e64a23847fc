"""The ZeRO step inside DDP's backward (``overlap_with_ddp=True``): the machinery behind the
hooks of ``zero_ext.ddp_zero_hook``.

torch's semantics, kept: while DDP has not finalised its buckets (it rebuilds them in the
second forward, the third with ``static_graph``), iterations only all-reduce and nothing is
stepped; the first iteration after the rebuild records which params each DDP bucket holds
and which of them some rank used (one small all-reduce), still without a step; from the next
one on, each rank steps its share of every bucket with the bucket's averaged grads, inside
``loss.backward()``, and the user's ``step()`` does nothing. A param no rank used (with
``static_graph`` DDP fixes that set from its first iteration and leaves their ``.grad``
None) is not stepped unless it holds a grad, as torch's optimizer does. So a script gets 2
(3 with ``static_graph``) iterations without updates, exactly as with torch's hooks.

What differs from torch's: the partition is the optimizer's own (``sharding`` "param" or
"flat", balanced over all params, any number of param groups) instead of one re-cut along
DDP's buckets: a bucket's grads feed the pieces of it each rank owns, and which rank steps
an element does not change its update, so ``shard_buckets`` changes nothing in the result.
The state lives in ``zero.optim`` from construction on, so state dicts and checkpoints work
before, during and after the warm-up.

No collective of ours runs while one of DDP's all-reduces is in flight: gloo runs the ops
of one group on a small thread pool, and ops issued concurrently from several threads (a
future's callback, as in torch's interleaved hook) can pair up differently on each rank,
which is why torch refuses gloo here. The local steps run as the grads arrive (all at the
last bucket for ``hook_with_zero_step``; each bucket as soon as its all-reduce is done for
the interleaved hook), and the one agreement on errors and the exchange of every owner's
update follow from the last bucket's hook, after every all-reduce of the iteration has
completed, on the autograd thread, in the same order on every rank.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import groups as groups_mod
from .agree import agree
from .engine import AdamWEngine, Segment, StepLayout
from .seam import OVERLAP_FLAG as _FLAG
from .seam import HookSeam

# which BucketStepper steps each optimizer (one DDP model per optimizer)
_BOUND: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _GradSource:
    """Stands for a param in the engine's layout: its `.grad` is the averaged bucket grad."""

    __slots__ = ("grad", "shape")

    def __init__(self, shape: torch.Size):
        self.grad: torch.Tensor | None = None
        self.shape = shape


def _check_hook_args(hook, ddp, zero, shard_buckets) -> None:
    if not callable(hook):
        raise TypeError(f"hook must be a DDP comm hook (a callable), got {hook!r}")
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"ddp must be a DistributedDataParallel, got {type(ddp).__name__}")
    if not isinstance(getattr(zero, "hook_seam", None), HookSeam):
        raise TypeError(
            "zero must be a zero_ext.ZeroRedundancyOptimizer built with overlap_with_ddp=True, "
            f"got {type(zero).__module__}.{type(zero).__name__}")
    if not isinstance(shard_buckets, bool):
        raise TypeError(f"shard_buckets must be a bool, got {shard_buckets!r}")
    if not zero.hook_seam.overlap_with_ddp:
        raise ValueError(
            "ZeroRedundancyOptimizer must be constructed with overlap_with_ddp=True to use this "
            "hook")
    bound = _BOUND.get(zero)
    if bound is not None and bound.ddp() is not ddp:
        raise ValueError("this ZeroRedundancyOptimizer already steps inside the backward of "
                         "another DDP model; build one optimizer per model")
    if ddp.find_unused_parameters and not ddp.static_graph:
        raise ValueError(
            f"{_FLAG} needs DDP's final buckets, and with find_unused_parameters=True (without "
            "static_graph) DDP never rebuilds them: torch's hooks would never step. Use "
            "find_unused_parameters=False, or static_graph=True")
    if zero.world_size > 1:
        ours = set(dist.get_process_group_ranks(zero.process_group))
        theirs = set(dist.get_process_group_ranks(ddp.process_group))
        if not ours <= theirs:
            raise ValueError("the optimizer's process group has ranks outside DDP's process "
                             f"group ({sorted(ours - theirs)}): DDP averages no grads there")
    in_ddp = {id(p) for p in ddp.module.parameters()}
    missing = [i for i, p in enumerate(zero.hook_seam.params)
               if p.requires_grad and id(p) not in in_ddp]
    if missing:
        raise ValueError(f"params {missing[:8]} of the optimizer are not params of this DDP "
                         "model: its backward would never give them a grad to step")


def build_hook(hook, ddp, zero, shard_buckets: bool, interleaved: bool, what: str):
    """Validate on every rank (an error on one is an error on all), then the wrapped hook."""
    error = None
    try:
        _check_hook_args(hook, ddp, zero, shard_buckets)
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
        error = exc
    if isinstance(ddp, DistributedDataParallel):
        group = ddp.process_group
    elif isinstance(getattr(zero, "hook_seam", None), HookSeam):
        group = zero.process_group
    else:  # neither tells which ranks take part: nothing to agree over
        raise error
    agree(group, dist.get_world_size(group), error, what)
    stepper = _BOUND[zero] = BucketStepper(zero, ddp, interleaved)

    def hook_with_zero(state, bucket):
        stepper.check_join()  # before the all-reduce: every rank raises at the same point
        fut = hook(state, bucket)
        return stepper.on_bucket(bucket, fut)

    return hook_with_zero


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill its memory span without gaps or overlaps, in some order
    of its dims (DDP then lays its grad out in that order inside the bucket)."""
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class BucketStepper:
    """One optimizer's steps inside one DDP model's backward (see the module docstring)."""

    def __init__(self, zero, ddp, interleaved: bool):
        self.zero = zero
        self.seam: HookSeam = zero.hook_seam  # all this reads of the optimizer, or asks
        self.ddp = weakref.ref(ddp)
        self.interleaved = interleaved
        # Per DDP bucket, from the recording iteration: its params, and whether any rank gave
        # each a grad (with static_graph DDP fixes its unused set: it leaves their .grad None)
        self.recording: list | None = None
        self.bucket_params: list[list[torch.Tensor]] | None = None
        self.used: list[list[bool]] | None = None
        self.bucket_ids: list[list[int | None]] | None = None  # zero's index of each, per plan
        self.plan_key = None
        self.layout: StepLayout | None = None
        self.engine: AdamWEngine | None = None
        self.pending: list = []  # (bucket index, GradBucket, future) not stepped yet
        self.error: BaseException | None = None
        self.stepped: list[int] = []

    # ------------------------------------------------------------------ per bucket

    def check_join(self) -> None:
        if self.seam.joined or self.ddp()._join_config.enable:
            raise RuntimeError(
                f"{_FLAG} does not support Join (uneven inputs): a joined rank would not take "
                "part in the step's exchange")

    def on_bucket(self, bucket, fut):
        self.seam.wait_for_params()  # (overlap_param_gather: the last step's exchange)
        ddp = self.ddp()
        if not ddp._has_rebuilt_buckets:
            if self.used is not None:  # (the same on every rank: the reset is collective)
                raise RuntimeError(
                    f"zero_ext {_FLAG}: DDP's buckets were reset after the hook recorded them "
                    "(DistributedDataParallel._update_process_group): the steps in its "
                    "backward follow the recorded buckets, and the optimizer's own process "
                    "group would not change. Build a new DDP model, optimizer and hook")
            return fut  # warm-up: DDP's buckets are not final yet
        if self.used is None:
            self._record(bucket, fut)  # the first iteration after the rebuild: no step either
            return fut
        if bucket.index() == 0:
            self._start_iteration()
        self.pending.append((bucket.index(), bucket, fut))
        if bucket.is_last():
            for item in self.pending:
                item[2].wait()
            self._step(self.pending)
            self.pending = []
            if self.error is None and sorted(self.stepped) != list(range(bucket.index() + 1)):
                self.error = RuntimeError(  # (raised on every rank by _finish_iteration)
                    f"zero_ext {_FLAG}: DDP's buckets were stepped as {sorted(self.stepped)}, "
                    f"not each of 0..{bucket.index()} once")
            self._finish_iteration()
        elif self.interleaved:
            # one look at each future: one that completes meanwhile (on gloo's thread) must
            # land in exactly one of the two lists, or its bucket would never be stepped
            ready = [item[2].done() for item in self.pending]
            done = [item for item, r in zip(self.pending, ready) if r]
            if done:
                self.pending = [item for item, r in zip(self.pending, ready) if not r]
                self._step(done)
        return fut

    def _record(self, bucket, fut) -> None:
        if self.recording is None:
            self.recording, self.error = [], None
        if bucket.index() != len(self.recording) and self.error is None:
            self.error = RuntimeError(f"{_FLAG}: DDP's buckets arrived out of order")
        params = list(bucket.parameters())
        # the hook runs before DDP writes the averaged grads: a grad here is a local use
        self.recording.append((params, [p.grad is not None for p in params], fut))
        if not bucket.is_last():
            return
        recording, self.recording = self.recording, None
        for _, _, f in recording:
            f.wait()  # no collective of ours while one of DDP's is in flight
        group = self.ddp().process_group
        flags = agree(group, dist.get_world_size(group), self.error,
                      "zero_ext overlap: recording DDP's buckets",
                      tuple(int(u) for _, used, _ in recording for u in used))
        self.bucket_params = [ps for ps, _, _ in recording]
        it = iter(flags)  # max over the ranks: used on some rank, so averaged into every one
        self.used = [[bool(next(it)) for _ in ps] for ps in self.bucket_params]
        self.error = None

    # ------------------------------------------------------------------ per iteration

    def _start_iteration(self) -> None:
        zero, seam = self.zero, self.seam
        self.error, self.stepped = None, []
        try:
            if seam.refresh():  # memory replaced with p.data = t: follow it
                self.plan_key = None
            if self.plan_key != self._plan_key():
                self._bind_plan()
            groups_mod.copy_hyperparameters(zero.param_groups, zero.optim.param_groups)
            self.fused = seam.fused_step_supported()
        except Exception as exc:  # noqa: BLE001 - raised on every rank at the last bucket
            self.error = exc
        seam.state_changed()

    def _plan_key(self) -> tuple:
        zero = self.zero
        return id(zero.plan), id(zero.plan.local), len(self.seam.params)

    def _bind_plan(self) -> None:
        """Which of this rank's pieces each DDP bucket feeds (after construction, a new
        param group, or moved memory): from the recorded buckets, over the current params."""
        zero, params = self.zero, self.seam.params
        plan = zero.plan
        index = self.seam.param_index()
        self.bucket_ids = [[index.get(id(p)) for p in ps] for ps in self.bucket_params]
        where = {pid: b for b, ids in enumerate(self.bucket_ids) for pid in ids
                 if pid is not None}
        missing = [i for i, p in enumerate(params) if p.requires_grad and i not in where]
        if missing:  # e.g. add_param_group with params DDP does not reduce
            raise ValueError(f"params {missing[:8]} of the optimizer are in none of this DDP "
                             "model's buckets: its backward never gives them a grad to step")
        chunks: list[list[Segment]] = [[] for _ in self.bucket_ids]
        for lp in plan.local:
            b = where.get(lp.param_id)
            if b is not None:
                chunks[b].append(Segment(lp.key, 0, lp.length, lp.group, lp.param_id,
                                         lp.start))
        self.sources = [_GradSource(p.shape) for p in params]
        self.layout = StepLayout(self.sources, chunks)
        self.engine = AdamWEngine(zero.optimizer_class)
        self.plan_key = self._plan_key()

    def _step(self, items) -> None:
        """The local step of this rank's pieces of the buckets in `items` (all-reduced)."""
        if self.error is not None:
            return  # nothing more is stepped; the last bucket raises on every rank
        try:
            for src in self.sources:
                src.grad = None
            for b, bucket, fut in items:
                # wait(), not value(): on CUDA a done() future's all-reduce may still be
                # running; wait() makes this stream wait for it (free once done on gloo)
                self._set_grads(b, bucket, fut.wait())
            zero = self.zero
            if self.fused:
                self.engine.step(zero.optim.param_groups, zero.optim.state, self.layout)
            else:
                self._generic_step({b for b, _, _ in items})
            self.stepped += [b for b, _, _ in items]
        except Exception as exc:  # noqa: BLE001 - raised on every rank at the last bucket
            self.error = exc
        finally:
            for src in self.sources:
                src.grad = None

    def _set_grads(self, b: int, bucket, value) -> None:
        """The averaged grads of bucket `b`, from the hook's result (the bucket's own buffer
        for allreduce_hook, a new tensor for compressing hooks: the same layout). Only for
        params torch's optimizer would step: used on some rank (DDP then writes their .grad)
        or holding a grad already (DDP leaves it as it is); the others keep grad None, so
        neither their values nor their state move."""
        if isinstance(value, (list, tuple)):
            value = value[0]
        flat = value.reshape(-1)
        base = bucket.buffer().storage_offset()
        params = self.seam.params
        for pid, used, g in zip(self.bucket_ids[b], self.used[b], bucket.gradients()):
            if pid is not None and (used or params[pid].grad is not None):
                # DDP lays a dense param's grad out in the param's own memory order
                # (channels_last, a transposed weight), but GradBucket.gradients() views
                # every slice as row-major: take the slice with the param's strides
                off = g.storage_offset() - base
                p = params[pid]
                if p.is_complex():
                    # DDP buckets a complex grad as its real view (2 elements each), and
                    # GradBucket.gradients() shows only the first half of it
                    pairs = torch.view_as_complex(flat[off:off + 2 * p.numel()].view(-1, 2))
                    self.sources[pid].grad = (
                        pairs.as_strided(p.shape, p.stride(), pairs.storage_offset())
                        if _dense(p) else pairs.view(p.shape))
                    continue
                self.sources[pid].grad = (
                    flat.as_strided(p.shape, p.stride(), flat.storage_offset() + off)
                    if _dense(p) else g)

    def _generic_step(self, buckets: set[int]) -> None:
        """optimizer_class's own step, given only the pieces of `buckets` as grads (the user's
        `.grad` of a param is put back afterwards: DDP still writes it)."""
        zero = self.zero
        keys = [lp.key for lp in zero.plan.local]
        saved = [k.grad for k in keys]
        fed = {id(s.key) for b in buckets for s in self.layout.chunks[b]}
        try:
            for lp in zero.plan.local:
                g = self.sources[lp.param_id].grad if id(lp.key) in fed else None
                if g is not None and lp.key.shape != g.shape:
                    g = g.reshape(-1)[lp.start:lp.start + lp.length].view(lp.key.shape)
                lp.key.grad = g
            with torch.no_grad():
                zero.optim.step()
        finally:
            for k, g in zip(keys, saved):
                k.grad = g
            self.seam.reset_fused_views()  # the user's step path: state may be new

    def _finish_iteration(self) -> None:
        """Every all-reduce is done: agree on errors and hyperparameters, then every owner's
        update reaches every rank (the regular exchange of the optimizer)."""
        self.seam.finish_step(self.error, f"zero_ext {_FLAG} step in DDP's backward",
                              tuple(p.requires_grad for p in self.seam.params))
