"""Grads reduce-scattered to their owners during DDP's backward: ZeRO at DDP's bytes.

DDP all-reduces every grad to every rank (2(W-1)/W of the model's bytes per rank), and a
ZeRO step then sends every owner's updated params again ((W-1)/W more: 1.5x DDP). Yet a
rank's step reads only the grads of the elements it owns. `reduce_scatter_hook`, a DDP comm
hook, sends each bucket's grads only to their owners: every rank sends the elements others
own ((W-1)/W of the bytes), every owner sums what it receives. With the exchange after the
step, an iteration moves DDP's bytes.

- Ownership is the optimizer's own plan (whole params or flat ranges, any sharding mode),
  so nothing about the step, the state or checkpoints changes; a DDP bucket is cut by it.
- Transport, per segment of at most 4 MB of a bucket: on NCCL one `reduce_scatter_tensor`
  of W equal blocks (each rank's runs packed into its block; the sum on the wire in the
  grads' dtype, as DDP's all-reduce sums). Elsewhere one `all_to_all_single` with split
  sizes, then a local sum: on gloo it costs less than `reduce_scatter_tensor`, which costs
  as much as a whole all-reduce (measured: docs/design.md), and it moves raw bytes (bf16
  too) while the sum runs here in float32 for bf16/fp16 grads. `ZERO_EXT_HOOK_TRANSPORT`
  forces one.
- Hybrid layouts (the optimizer shards over a part of the job, `zero_ext.hybrid_groups()`):
  the owned sum is then all-reduced over the replica group.
- A bucket that holds params of no zero_ext optimizer, or of several, is all-reduced as DDP
  does (correct, DDP's bytes for it).
- The optimizer is reached only through its `hook_seam` (zero_ext/seam.py); this module
  keeps its own state per optimizer and registers its check before a step with the seam.

After the hook, `.grad` holds the averaged grad only where this rank owns the elements;
elsewhere it is this rank's local grad. So a script that changes grads in place between
backward and step (torch.nn.utils.clip_grad_norm_ computes from partial grads) is caught:
every grad's version counter is read once DDP has written the grads back, and the next
step raises on every rank when one changed (GradScaler's own in-place inf check and
`unscale_`, a uniform scaling that commutes with the average, are allowed).
"""
# (no `from __future__ import annotations`: DDP checks the hook's annotations as objects)
import functools
import itertools
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .agree import agree
from .seam import HookSeam, newest_holding, register_step_check
from .sync import reduce_scatter_single, wire_view


# Elements one all_to_all of the hook moves at most: a larger DDP bucket travels as several
# segments, each taking its share of every rank's runs, so the scratch (a receive buffer
# of world x this rank's share, a packed send buffer) stays bounded by the segments in
# flight (one per lane), whatever bucket_cap_mb is. 4 MB: on the 33.6M-param MLP at world 2
# the scratch is 13-18 MB per rank (27-36 MB with 8 MB segments, which measured 40-50 MB
# more peak RSS for the hook in "even" mode).
SEGMENT_BYTES = 4 << 20

# How a segment travels: "auto" is `reduce_scatter_tensor` on NCCL when the owners' shares
# of the segment are near equal (every link then does equal work, half an all-reduce's
# time), else `all_to_all_single` plus a local sum: reduce_scatter_tensor moves W equal
# blocks, so a segment one rank owns (param mode) would cost W-1 times its size per rank.
# On gloo reduce_scatter_tensor costs a whole all-reduce (134-145 ms against 100-111 ms for
# a 4 MB bucket at world 4 behind 400 Mbit/s links). "reduce_scatter" or "all_to_all"
# force one (tests, benchmarks). Every rank must use the same.
TRANSPORTS = ("auto", "reduce_scatter", "all_to_all")
TRANSPORT = os.environ.get("ZERO_EXT_HOOK_TRANSPORT", "auto")
# "auto" takes reduce_scatter_tensor when the padding to W equal blocks adds at most this
# much to the segment (sharding="even": chunk rounding only)
REDUCE_SCATTER_MAX_PADDING = 0.125


def _is_nccl(group) -> bool:
    return "nccl" in str(dist.get_backend(group)).lower()


def reduce_scatters(buf: torch.Tensor, group, splits: list) -> bool:
    """Whether a segment of `buf` with these owners' `splits` travels by
    reduce_scatter_tensor over `group` (decided from the plan: alike on every rank)."""
    if TRANSPORT not in TRANSPORTS:
        raise ValueError(f"ZERO_EXT_HOOK_TRANSPORT must be one of {TRANSPORTS}, got "
                         f"{TRANSPORT!r}")
    if TRANSPORT != "auto":
        return TRANSPORT == "reduce_scatter"
    padded = len(splits) * max(splits)
    return (buf.is_cuda and _is_nccl(group)
            and padded <= (1 + REDUCE_SCATTER_MAX_PADDING) * sum(splits))


@dataclass
class _Segment:
    """One all_to_all of a DDP bucket: per destination rank, the (offset, length) runs of
    the bucket buffer it owns, in rank order."""

    runs: list             # runs[r]: [(offset, length)] owned by rank r
    splits: list           # elements owned by each rank
    start: int             # where the first run starts in the bucket
    in_place: bool         # the runs in rank order are contiguous from `start`: the send
    #                        is that slice of the bucket itself, no packing


@dataclass
class _BucketPlan:
    """How one DDP bucket travels, cut by the optimizer's plan."""

    params: tuple          # identities of the bucket's params (DDP rebuilds buckets)
    plan_key: object       # the token of the ownership map it was cut by
    param_ids: tuple       # their indices in the optimizer's params
    splits: list           # elements owned by each rank
    segments: list         # [_Segment], each moved by one all_to_all


class GradReducer:
    """The reduce-scatter of one optimizer's grads, and the check before its step."""

    def __init__(self, opt):
        self.opt = weakref.ref(opt)
        self.seam: HookSeam = opt.hook_seam  # all this reads of the optimizer, or asks
        self.buckets: dict = {}  # (first param's id, DDP bucket index) -> _BucketPlan
        self.replica_group = None
        self.seq = 0            # the hook's segments since the last step (issue order)
        self.ordered = _InOrder()
        self.in_flight: dict = {}  # lane -> the future of its last segment
        # Scratch per lane, (lane, name, dtype, device) -> buffer, grown to the largest
        # bucket: bounded by the buckets in flight (one per lane), not one set per bucket,
        # and kept from one backward to the next (a fresh multi-MB buffer per bucket per
        # iteration costs its page faults every time: on gloo, 2 ranks, 33.6M fp32
        # elements, a reduce-scatter took 105 ms with kept buffers, 200-265 ms with fresh)
        self.scratch: dict = {}
        self.accumulated = False  # a backward ran onto reduced grads
        self._watched = 0         # params whose incoming grads are watched
        # Everything below spans the backward passes since the last step (one per DDP
        # model under this optimizer, each possibly made of nested backwards: reentrant
        # activation checkpointing), and the step consumes it.
        self.pending: set[int] = set()  # params reduced, their grads not read yet
        self._record_queued = False  # a record of `pending` runs after DDP's write-back
        # param_id -> (weakref to its grad, the grad's version) once DDP wrote it (weak: a
        # grad dropped by zero_grad is freed); params whose buckets were all-reduced have
        # none (their grads are whole: anything may read or change them)
        self.seen: dict[int, tuple] | None = None
        self.cuts: list[_Cut] = []  # the tags of the grads recorded since the last step
        # what changed grads had undergone when gather_grads made them whole (changes()):
        # a clip of partial grads before the gather is still an error at the step
        self.gathered_changes: dict = {}
        self.reduced_under: dict = {}  # param_id -> the seam's Ownership it was cut by
        self.checked_ddps: "weakref.WeakSet" = weakref.WeakSet()  # layouts checked

    # -------------------------------------------------------------- ownership
    def bucket_plan(self, bucket) -> _BucketPlan | None:
        """The plan of DDP's `bucket`, or None when it holds params this optimizer does not
        own entirely (then it is all-reduced)."""
        params = bucket.parameters()
        ident = tuple(id(p) for p in params)
        ownership = self.seam.ownership()
        owned = ownership.runs
        key = (ident[0], bucket.index())  # (several DDP models: each has a bucket 0)
        bp = self.buckets.get(key)
        if bp is not None and bp.params == ident and bp.plan_key is ownership.token:
            return bp
        index = self.seam.param_index()
        world = self.opt().world_size
        runs: list[list] = [[] for _ in range(world)]
        offset, ids = 0, []
        for p in params:
            pid = index.get(id(p))
            if pid is None:
                return None
            ids.append(pid)
            # DDP buckets a complex grad as its real view: 2 bucket elements per element
            k = 2 if p.is_complex() else 1
            for r, start, length in sorted(owned.get(pid, ()), key=lambda x: x[1]):
                if length:
                    _append_run(runs[r], offset + k * start, k * length)
            offset += k * p.numel()
        if offset != bucket.buffer().numel():
            raise RuntimeError(
                f"reduce_scatter_hook: DDP bucket {bucket.index()} holds "
                f"{bucket.buffer().numel()} elements, its params {offset}: an unknown DDP "
                "bucket layout; use DDP's default all-reduce")
        splits = [sum(n for _, n in rr) for rr in runs]
        cap = max(1, SEGMENT_BYTES // bucket.buffer().element_size())
        # by the bucket's size: an evenly split bucket then receives about `cap` elements
        # per segment too; a plan that gives a bucket to one owner receives world x its
        # share, segments or not (counting by that would issue world-fold collectives)
        count = max(1, -(-offset // cap))
        bp = _BucketPlan(ident, ownership.token, tuple(ids), splits,
                         [_segment([_part(rr, k, count) for rr in runs])
                          for k in range(count)])
        self.buckets[key] = bp
        return bp

    # -------------------------------------------------------------- the reduce
    def reduce(self, bucket, bp: _BucketPlan) -> torch.futures.Future:
        ownership = self.seam.ownership()
        for pid in bp.param_ids:
            self.reduced_under[pid] = ownership
        self.pending.update(bp.param_ids)
        buf = bucket.buffer()
        futs = [self._reduce_segment(buf, seg) for seg in bp.segments]
        if len(futs) == 1:
            return futs[0]
        # (a future made here knows no CUDA streams unless told: DDP would read the bucket
        # before the segments' sums on other streams are done)
        result = _future_on(buf)
        torch.futures.collect_all(futs).then(lambda f: _settle(
            result, lambda: ([x.wait() for x in f.wait()], buf)[1]))
        return result

    def _reduce_segment(self, buf: torch.Tensor, seg: _Segment) -> torch.futures.Future:
        seq, self.seq = self.seq, self.seq + 1
        opt = self.opt()
        world, me = opt.world_size, opt.rank
        mine = seg.splits[me]
        # gloo moves one op per process group at a time: consecutive segments alternate
        # between the exchange's lanes (groups over the same ranks) to travel at once
        # (measured: a 33.6M-element reduce-scatter 105 -> 65 ms on two lanes). At most
        # one op in flight per lane: several async ops on one gloo group can start in a
        # different order on different ranks (broadcasts were seen to deadlock at world 3).
        lanes = self.seam.lanes
        lane = seq % len(lanes)
        prev = self.in_flight.pop(lane, None)
        if prev is not None:
            prev.wait()  # the lane's last segment, written back: its scratch is free again
        replicas = self.replica_group
        total = world * (1 if replicas is None else dist.get_world_size(replicas))
        # (divisor: what the sum is still to be divided by)
        if reduce_scatters(buf, lanes[lane], seg.splits):
            work, owned_sum, divisor = self._issue_reduce_scatter(lanes[lane], lane, buf, seg,
                                                                  me, total)
        else:
            work, owned_sum, divisor = self._issue_all_to_all(lanes[lane], lane, buf, seg, me,
                                                              total, direct=replicas is None)

        def write_back(summed) -> torch.Tensor:
            if summed is None:  # (direct: in the runs already)
                for o, n in seg.runs[me]:
                    buf[o:o + n].div_(divisor)
                return buf
            if divisor != 1:
                summed.div_(divisor)
            pos = 0
            for o, n in seg.runs[me]:
                buf[o:o + n].copy_(summed[pos:pos + n])
                pos += n
            return buf

        if replicas is None:
            done = _future_of(work, buf).then(
                lambda fut: (fut.wait(), write_back(owned_sum()) if mine else buf)[1])
            self.in_flight[lane] = done
            return done
        # Hybrid: the owned sum is then all-reduced across the replicas. Futures complete
        # in any order, but collectives must be issued in the same order on every rank:
        # the segment order (DDP runs the hook bucket by bucket, alike everywhere).
        result = _future_on(buf)

        def after_shard_sum(fut) -> None:
            try:
                fut.wait()
                summed = owned_sum() if mine else None
            except Exception as exc:  # noqa: BLE001 - handed to DDP through the future
                result.set_exception(exc)
                summed = None

            def issue() -> None:
                if summed is None:
                    if not result.done():
                        result.set_result(buf)
                    return
                w = dist.all_reduce(summed, group=replicas, async_op=True)
                w.get_future().then(lambda f: _settle(result, lambda: (
                    f.wait(), write_back(summed))[1]))

            self.ordered.submit(seq, issue)

        _future_of(work, buf).then(after_shard_sum)
        self.in_flight[lane] = result
        return result

    def _issue_all_to_all(self, group, lane: int, buf: torch.Tensor, seg: _Segment,
                          me: int, total: int, direct: bool):
        """Every rank's runs to their owner in one all_to_all (raw bytes: any dtype on
        gloo), then the W copies summed here. Returns the work, the function that gives
        this rank's sum in run order (None: already summed into the runs of `buf`), and
        what that sum is still to be divided by (`total`)."""
        world, mine = len(seg.splits), seg.splits[me]
        low = buf.dtype in (torch.bfloat16, torch.float16)  # summed in float32
        # full-precision sums without replicas go straight into this rank's runs of the
        # bucket; bf16/fp16 ones are summed in float32, hybrid ones all-reduced first
        direct = direct and not low
        recv = self._scratch(lane, "recv", world * mine, buf)
        acc = None if direct else self._scratch(lane, "sum", mine, buf,
                                                torch.float32 if low else buf.dtype)
        size = sum(seg.splits)
        if seg.in_place:
            send = buf[seg.start:seg.start + size]
        else:
            send = self._scratch(lane, "send", size, buf)
            _pack(send, buf, seg.runs, list(itertools.accumulate([0] + seg.splits[:-1])))
        backend = dist.get_backend(group)
        work = dist.all_to_all_single(wire_view(recv, backend), wire_view(send, backend),
                                      output_split_sizes=[mine] * world,
                                      input_split_sizes=seg.splits, group=group,
                                      async_op=True)

        def chain_of_adds(parts, out) -> None:
            # 2.4x faster than torch.sum over the rank dim on one CPU thread (4.2M fp32
            # elements: 3.1 vs 7.6 ms)
            if len(parts) == 1:
                out.copy_(parts[0])
            elif low:  # (add_ into a float32 tensor sums in float32)
                out.copy_(parts[0]).add_(parts[1])
            else:
                torch.add(parts[0], parts[1], out=out)
            for part in parts[2:]:
                out.add_(part)

        def owned_sum():
            parts = recv.view(world, mine).unbind(0)
            if not direct:
                chain_of_adds(parts, acc)
                return acc
            pos = 0
            for o, n in seg.runs[me]:
                chain_of_adds([q[pos:pos + n] for q in parts], buf[o:o + n])
                pos += n
            return None

        return work, owned_sum, total

    def _issue_reduce_scatter(self, group, lane: int, buf: torch.Tensor, seg: _Segment,
                              me: int, total: int):
        """One `reduce_scatter_tensor` (NCCL's: every link does equal work, the sum on the
        wire in the grads' dtype, as DDP's all-reduce sums): rank r's runs packed into the
        r-th of W equal blocks (the largest rank's share; the rest of a block is padding
        nobody reads). With a single owned run of the block's length the output is that
        run of the bucket itself. float16 grads are divided by `total` while packed, before
        the sum (as DDP divides before its all-reduce): W copies summed on the wire would
        overflow from 65504 / W. Returns the work, the function that gives this rank's sum,
        and what that sum is still to be divided by."""
        world, mine = len(seg.splits), seg.splits[me]
        block = max(seg.splits)
        first = buf.dtype == torch.float16
        if seg.in_place and all(n == block for n in seg.splits) and not first:
            send = buf[seg.start:seg.start + block * world]
        else:
            send = self._scratch(lane, "send", block * world, buf)
            _pack(send, buf, seg.runs, [r * block for r in range(world)],
                  total if first else None)
        # (an output inside the input is NCCL's in-place form; gloo is not promised it, but
        # torch 2.14's gloo gives the right sums for it, so the transport forced on gloo
        # runs NCCL's form exactly: tests/test_nccl_paths.py)
        straight = (len(seg.runs[me]) == 1 and mine == block
                    and (send.data_ptr() != buf.data_ptr() + seg.start * buf.element_size()
                         or _is_nccl(group) or TRANSPORT == "reduce_scatter"))
        out = (buf[seg.runs[me][0][0]:seg.runs[me][0][0] + block] if straight
               else self._scratch(lane, "recv", block, buf))
        work = reduce_scatter_single(out, send, group=group, async_op=True)

        def owned_sum():
            return out[:mine]

        return work, owned_sum, 1 if first else total

    def _scratch(self, lane: int, name: str, n: int, like: torch.Tensor,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = like.dtype if dtype is None else dtype
        key = (lane, name, dtype, like.device)
        buf = self.scratch.get(key)
        if buf is None or buf.numel() < n:
            buf = self.scratch[key] = torch.empty(n, dtype=dtype, device=like.device)
        return buf[:n]

    # -------------------------------------------------------------- the check
    def after_bucket(self, bucket) -> None:
        """After the hook ran for `bucket` (here, on the autograd thread): watch incoming
        grads, and at DDP's last bucket queue the record of the grads reduced since the
        last record, to run once DDP has written them back. DDP queues its write-back
        (finalize) right after the last bucket's hook, into the graph task running now (the
        innermost backward, under reentrant activation checkpointing); a callback queued
        from a callback that runs before it comes after it."""
        self._watch_accumulation()
        if not bucket.is_last() or not self.pending or self._record_queued:
            return
        engine = torch.autograd.Variable._execution_engine
        try:
            engine.queue_callback(lambda: engine.queue_callback(self._record))
            self._record_queued = True
        except RuntimeError:  # not inside a backward (DDP's join hook runs buckets itself)
            pass

    def _watch_accumulation(self) -> None:
        """A hook on every trainable param's incoming grad (registered once per param)
        notices a backward that adds onto a grad this hook reduced, untouched since (no
        step, no zero_grad between): the elements a rank does not own hold its local grad,
        so the next reduction would mix averaged and local grads. The next step raises."""
        params = self.seam.params
        me = weakref.ref(self)
        for i in range(self._watched, len(params)):
            if params[i].requires_grad:
                params[i].register_hook(functools.partial(_incoming_grad, me, i))
        self._watched = len(params)

    @torch._disable_dynamo
    def _record(self) -> None:
        """Each grad reduced since the last record, as DDP wrote it: its identity, its
        version, and the tag naming this optimizer's plan. Kept with the records of the
        other backward passes before the step (several DDP models): a grad changed after
        its own model's backward is caught even when another backward came after."""
        self._record_queued = False
        opt = self.opt()
        if opt is None:
            return
        params = self.seam.params
        pending, self.pending = self.pending, set()
        if self.seen is None:
            self.seen = {}
        cut = _Cut(self)
        self.cuts.append(cut)
        _Cut.made = True
        for i in pending:
            g = params[i].grad
            if g is not None:
                self.seen[i] = (weakref.ref(g), g._version)
                g._zero_ext_cut = cut

    def start_step(self) -> None:
        """The step reads the grads: what the backward passes left is consumed, and the
        transfers start afresh (DDP waited for every one before its backward returned)."""
        self.seen, self.cuts, self.reduced_under, self.gathered_changes = None, [], {}, {}
        self.seq, self.ordered, self.in_flight = 0, _InOrder(), {}

    def moved_ownership(self) -> list[int]:
        """Indices of reduced params whose owners changed since the reduction (a new
        partition between backward and step): their owners now hold unreduced grads."""
        if not self.reduced_under:
            return []
        now = self.seam.ownership()
        return sorted(i for i, then in self.reduced_under.items()
                      if then.token is not now.token
                      and sorted(then.runs.get(i, ())) != sorted(now.runs.get(i, ())))

    def changes(self, ids=None) -> dict:
        """param_id -> "replaced", or (its version bumps since the hook, its grad's counter
        key), for every recorded grad still held (of `ids`, when given)."""
        out = {}
        params = self.seam.params
        for i, s in (self.seen or {}).items():
            g = params[i].grad
            if g is None or (ids is not None and i not in ids):
                continue  # dropped (not stepped)
            out[i] = "replaced" if g is not s[0]() else (g._version - s[1], _counter_key(g))
        return out

    def changed_grads(self, scaler: bool) -> list[int]:
        """Indices of params whose grad was replaced or written in place since the hook
        (GradScaler's one in-place pass over every grad allowed when `scaler`), also those
        changed before gather_grads made them whole."""
        if self.seen is None:
            return []
        for cut in self.cuts:
            cut.consumed = True
        # A grad's version counter is shared by every grad viewing one buffer (DDP's
        # gradient_as_bucket_view); GradScaler's pass (its inf check in step(), or
        # unscale_) bumps it once per such grad, where its kernel bumps versions at all.
        allowed: dict = {}
        if scaler:
            for p in self.seam.params:
                if p.grad is not None and _scaler_bumps_versions(p.grad.device):
                    k = _counter_key(p.grad)
                    allowed[k] = allowed.get(k, 0) + 1
        return [i for i, c in sorted({**self.gathered_changes, **self.changes()}.items())
                if c == "replaced" or (c[0] and c[0] != allowed.get(c[1]))]


class _Cut:
    """One backward's reduce-scatter, tagged onto every grad it wrote (`._zero_ext_cut`):
    whose plan decided which rank holds which averaged elements, and whether that
    optimizer's step has read them. On the grads, not in a registry, so that every rank
    sees the same tags whether or not the old optimizer is still alive."""

    __slots__ = ("reducer", "consumed")
    made = False  # any in this process: else no grad needs looking at

    def __init__(self, reducer):
        self.reducer = weakref.ref(reducer)
        self.consumed = False


_SCALER_BUMPS: dict = {}


def _scaler_bumps_versions(device: torch.device) -> bool:
    """Whether GradScaler's in-place unscale kernel advances the version counters of the
    grads on `device` (it does not on CPU in torch 2.14): asked once per device type."""
    if device.type not in _SCALER_BUMPS:
        t = torch.zeros(1, device=device)
        v = t._version
        torch._amp_foreach_non_finite_check_and_unscale_(
            [t], torch.zeros(1, device=device), torch.ones(1, device=device))
        _SCALER_BUMPS[device.type] = t._version != v
    return _SCALER_BUMPS[device.type]


@torch._disable_dynamo
def _incoming_grad(reducer_ref, i: int, grad):
    """Tensor hook of param i (see GradReducer._watch_accumulation): runs before autograd
    adds `grad` to the param's .grad."""
    r = reducer_ref()
    s = None if r is None or r.seen is None else r.seen.get(i)
    if s is not None:
        g = None if r.opt() is None else r.seam.params[i].grad
        if g is not None and g is s[0]() and g._version == s[1]:
            r.accumulated = True
    return None


class _InOrder:
    """Runs submitted actions in the order of their sequence numbers, whichever thread
    submits them (each runs once every earlier one has been submitted and run)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.next = 0
        self.waiting: dict = {}

    def submit(self, seq: int, action) -> None:
        with self.lock:
            self.waiting[seq] = action
            while self.next in self.waiting:
                self.waiting.pop(self.next)()
                self.next += 1


def _future_on(t: torch.Tensor) -> torch.futures.Future:
    """A future whose completion orders `t`'s device streams (CUDA) as the collectives'
    own futures do."""
    return torch.futures.Future(devices=[t.device]) if t.is_cuda else torch.futures.Future()


def _future_of(work, t: torch.Tensor) -> torch.futures.Future:
    """The future of a collective's `work` on `t`. gloo's reduce_scatter_tensor work has
    none (the transport forced on gloo, for tests): it is waited for here instead."""
    try:
        return work.get_future()
    except RuntimeError:
        work.wait()
        done = _future_on(t)
        done.set_result([t])
        return done


def _settle(result: torch.futures.Future, compute) -> None:
    try:
        result.set_result(compute())
    except Exception as exc:  # noqa: BLE001 - handed to DDP through the future
        result.set_exception(exc)


def _counter_key(g: torch.Tensor) -> tuple:
    base = g._base if g._base is not None else g
    return (base.device, base.untyped_storage().data_ptr())


def _pack(send: torch.Tensor, buf: torch.Tensor, runs: list, starts: list,
          divisor: int | None = None) -> None:
    """Rank r's runs of `buf`, in order, into `send` from starts[r] (divided by `divisor`
    on the way when one is given)."""
    for rr, pos in zip(runs, starts):
        for o, n in rr:
            if divisor is None:
                send[pos:pos + n].copy_(buf[o:o + n])
            else:
                torch.div(buf[o:o + n], divisor, out=send[pos:pos + n])
            pos += n


def _part(runs: list, k: int, count: int) -> list:
    """Part k of `count` of a rank's runs: the elements [k n / count, (k+1) n / count) of
    their concatenation (n their total), as runs."""
    total = sum(n for _, n in runs)
    lo, hi = k * total // count, (k + 1) * total // count
    out, pos = [], 0
    for o, n in runs:
        a, b = max(lo, pos), min(hi, pos + n)
        if b > a:
            out.append((o + a - pos, b - a))
        pos += n
    return out


def _segment(runs: list) -> _Segment:
    flat = [run for rr in runs for run in rr]
    start = flat[0][0] if flat else 0
    in_place, pos = True, start
    for o, n in flat:
        in_place = in_place and o == pos
        pos = o + n
    return _Segment(runs, [sum(n for _, n in rr) for rr in runs], start, in_place)


def _append_run(runs: list, offset: int, length: int) -> None:
    if runs and runs[-1][0] + runs[-1][1] == offset:
        runs[-1] = (runs[-1][0], runs[-1][1] + length)
    else:
        runs.append((offset, length))


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
    from .hybrid import replica_group_of

    if group is None:
        return None
    try:
        return replica_group_of(group)
    except ValueError:
        return None


# What _ddp_of knows of a bucket's DDP model, by the bucket's first param: GradBucket does
# not say which DDP runs the hook, nor over which process group. id(param) -> (weakref to
# the param, weakref to the one DDP holding it or None, that DDP's process group, or
# _SEVERAL when DDP models over different groups hold it, or None when none was found).
_DDP_OF: dict = {}
_SEVERAL = object()


def _ddp_of(bucket) -> tuple:
    """(the DDP model whose bucket this is, or None when several or none hold its params;
    its process group, or _SEVERAL, or None when no DDP model was found). One scan of the
    live objects per bucket layout (DDP rebuilds its buckets once), cached after."""
    p = bucket.parameters()[0]
    entry = _DDP_OF.get(id(p))
    if entry is None or entry[0]() is not p:
        found = _ddp_holding(p)
        groups = {tuple(sorted(dist.get_process_group_ranks(d.process_group)))
                  for d in found}
        group = None if not found else (found[0].process_group if len(groups) == 1
                                        else _SEVERAL)
        for k in [k for k, e in _DDP_OF.items() if e[0]() is None]:
            del _DDP_OF[k]  # (params of models gone)
        entry = _DDP_OF[id(p)] = (weakref.ref(p),
                                  weakref.ref(found[0]) if len(found) == 1 else None, group)
    return (None if entry[1] is None else entry[1]()), entry[2]


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
    opt = reducer.opt()
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


def _owner_of(bucket, state: Any):
    if state is not None:
        if not isinstance(getattr(state, "hook_seam", None), HookSeam):
            raise TypeError("reduce_scatter_hook: the hook's state must be a zero_ext "
                            f"ZeroRedundancyOptimizer or None, got {type(state).__name__}")
        return state
    return newest_holding(bucket.parameters()[0])


@torch._disable_dynamo  # a backward inside a compiled function: collective, data-dependent
def reduce_scatter_hook(state: Any, bucket: dist.GradBucket
                        ) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: each grad goes, summed and averaged, only to the rank that owns its
    elements in zero_ext's optimizer (`state`, or None to find the optimizer holding the
    bucket's params). Register with ``ddp.register_comm_hook(opt_or_None,
    reduce_scatter_hook)``; then call ``opt.clip_grad_norm_`` (not torch's) and
    ``opt.step()`` as usual. See the module docstring for what ``.grad`` holds."""
    opt = _owner_of(bucket, state)
    ddp, group = _ddp_of(bucket)
    if opt is None:  # no zero_ext optimizer holds these params: DDP's own all-reduce
        if group is _SEVERAL:
            raise ValueError(
                "reduce_scatter_hook: the params of DDP bucket "
                f"{bucket.index()} belong to DDP models over different process groups, and "
                "no zero_ext optimizer holds them: which group averages them is unknown. "
                "Register DDP's default all-reduce on the model whose params no zero_ext "
                "optimizer holds")
        return _all_reduce(bucket, group)
    if opt.hook_seam.joined:
        raise NotImplementedError(
            "reduce_scatter_hook under a Join context (uneven inputs) is not supported: "
            "register DDP's default all-reduce for training with Join")
    reducer = reducer_of(opt)
    check_layout(reducer, ddp, group)
    if group is None or group is _SEVERAL:  # (unknown: the optimizer's layout decides)
        group = None if reducer.replica_group else opt.process_group
    try:
        if ddp is not None and not ddp._has_rebuilt_buckets and (
                not ddp.find_unused_parameters or ddp.static_graph):
            # DDP's first iteration: one bucket of every grad, rebuilt into buckets of
            # bucket_cap_mb afterwards; reduce-scattering it would need scratch of the
            # model's size for the whole run. All-reduced as DDP does: its bytes, once.
            return _all_reduce(bucket, group)
        bp = reducer.bucket_plan(bucket)
        if bp is None:  # (params of no or another optimizer: DDP's all-reduce)
            return _all_reduce(bucket, group)
        return reducer.reduce(bucket, bp)
    finally:
        reducer.after_bucket(bucket)


def _all_reduce(bucket, group) -> torch.futures.Future:
    """What DDP does by default: the bucket summed over `group` (None: the job), averaged."""
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(group))
    work = dist.all_reduce(buf, group=group, async_op=True)
    return work.get_future().then(lambda fut: (fut.wait(), buf)[1])


def _reduced_for_another(opt, reducer) -> list[int]:
    """Indices of `opt`'s params whose current grad the hook reduce-scattered for another
    optimizer (the hook's state is an optimizer since replaced): each rank holds the
    averaged grad only where that one's plan gave it the elements."""
    if not _Cut.made:
        return []
    out = []
    for i, p in enumerate(opt.hook_seam.params):
        cut = None if p.grad is None else getattr(p.grad, "_zero_ext_cut", None)
        if cut is not None and not cut.consumed and (reducer is None
                                                      or cut.reducer() is not reducer):
            out.append(i)
    return out


def check_grads(opt, scaler: bool, error: BaseException | None
                ) -> tuple[bool, BaseException | None]:
    """At the start of `opt`'s step: whether the hook reduced its grads since the last
    step (the same on every rank: DDP ran the hook everywhere), and `error`, or an error
    naming what makes those grads unusable when there is none yet: grads changed after the
    hook, a second backward without no_sync, a partition changed since, or grads reduced
    for another optimizer."""
    reducer = _REDUCERS.get(opt)
    foreign = _reduced_for_another(opt, reducer)
    if foreign and error is None:
        error = RuntimeError(
            f"ZeroRedundancyOptimizer.step: the grads of params {_some(foreign)} were "
            "reduce-scattered by zero_ext's reduce_scatter_hook for another "
            "ZeroRedundancyOptimizer, whose partition decided which rank holds which "
            "averaged elements; this optimizer would step partial grads. A DDP model takes "
            "one comm hook: register it with state None "
            "(`ddp.register_comm_hook(None, reduce_scatter_hook)`) so that it follows the "
            "newest optimizer over the params, and build a replacement optimizer before the "
            "backward whose grads it steps (zero_grad() and a new backward continue from "
            "here)")
    if reducer is None:
        return bool(foreign), error
    if reducer.seen is None:
        reducer.start_step()
        return bool(foreign), error
    moved = reducer.moved_ownership()
    if moved and error is None:
        error = RuntimeError(
            f"ZeroRedundancyOptimizer.step: the partition of params {_some(moved)} changed "
            "after zero_ext's reduce_scatter_hook reduced their grads (add_param_group "
            "between backward and step re-partitions while no optimizer state exists), so "
            "their new owners hold unreduced grads. Call add_param_group before the backward "
            "or after the step; zero_grad() and a new backward continue from here")
    changed = reducer.changed_grads(scaler)
    reducer.start_step()
    if reducer.accumulated:
        reducer.accumulated = False
        if error is None:
            error = RuntimeError(
                "ZeroRedundancyOptimizer.step: several backward passes ran through DDP with "
                "zero_ext's reduce_scatter_hook before this step. After the hook each rank's "
                ".grad holds the averaged grad only where the rank owns the elements, so a "
                "second reduction adds local and averaged grads. Accumulate micro-batches "
                "under `with ddp.no_sync():` for all but the last backward (which is also "
                "what saves DDP's bytes), or use DDP's default all-reduce")
    if changed and error is None:
        error = RuntimeError(
            f"ZeroRedundancyOptimizer.step: the grads of params {_some(changed)} were "
            "changed after zero_ext's "
            "reduce_scatter_hook reduced them. With that hook each rank's .grad holds the "
            "averaged grad only for the elements the rank owns, so torch.nn.utils."
            "clip_grad_norm_ (or any in-place change of the grads) computes from partial "
            "grads: use opt.clip_grad_norm_(max_norm), which returns the true global norm "
            "and clips inside the step (GradScaler works as usual)")
    return True, error


@torch._disable_dynamo
def gather_grads(opt) -> None:
    """Collective (every rank of the optimizer's group): after a backward through
    `reduce_scatter_hook`, every rank's ``.grad`` holds the averaged grads DDP's all-reduce
    would have left, so that code reading grads outside the optimizer (a grad-norm log, an
    EMA of grads, torch's clip_grad_norm_) sees DDP's values. It costs an all-gather of the
    reduced grads ((W-1)/W of their bytes per rank: what the hook saved); call it only
    where such a reader runs (a logging step). Nothing to do when the grads are whole
    already (no backward through the hook since the last step, DDP's first iteration)."""
    reducer = _REDUCERS.get(opt)
    reduced = set() if reducer is None or reducer.seen is None else set(reducer.seen)
    ids = sorted(reduced)
    digest = hash(tuple(ids)) & ((1 << 62) - 1)
    error = None if reducer is None or not reducer.pending else RuntimeError(
        "gather_grads: a backward through reduce_scatter_hook has not finished")
    top, bottom = agree(opt.process_group, opt.world_size, error, "gather_grads",
                        (digest, -digest))
    if top != -bottom:
        raise RuntimeError("gather_grads: ranks hold reduced grads of different params "
                           "(call it on every rank, after the same backward)")
    if not reduced:
        return
    changed = reducer.changes(reduced)  # (before the exchange writes into them)
    opt.hook_seam.exchange_grads(reduced)
    # whole grads now: as after DDP's all-reduce, anything may read or change them; what
    # was done to them before, on partial grads, the step still checks
    reducer.gathered_changes.update({i: c for i, c in changed.items()
                                     if c == "replaced" or c[0]})
    for i in ids:
        g = opt.hook_seam.params[i].grad
        reducer.seen.pop(i, None)
        reducer.reduced_under.pop(i, None)
        if g is not None and getattr(g, "_zero_ext_cut", None) is not None:
            g._zero_ext_cut = None


def _some(ids: list[int]) -> str:
    return f"{ids[:8]}{'...' if len(ids) > 8 else ''}"


def checked_closure(opt, closure):
    """`closure` (a step's closure, which frameworks use to run forward and backward inside
    ``step()``: Lightning) followed by the check of `check_grads`. Collective when the hook
    ran in it: every rank ran the same closure."""

    def run():
        error, loss = None, None
        try:
            loss = closure()
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc  # (after its backward: every rank's hook ran, so every rank agrees)
        reduced, error = check_grads(opt, False, error)
        if reduced:
            agree(opt.process_group, opt.world_size, error, "ZeroRedundancyOptimizer.step")
        elif error is not None:
            raise error  # (the step's own agreement raises it on every rank)
        return loss

    return run


def _check_step(opt, closure, scaler: bool):
    """The check at the start of every ZeroRedundancyOptimizer step (seam.register_step_check):
    whether the hook reduced its grads since the last step and what makes them unusable
    (check_grads), and the closure checked after it ran."""
    reduced, error = check_grads(opt, scaler, None)
    return reduced, error, (None if closure is None else checked_closure(opt, closure))


# Registered when this module loads: before any DDP model can run the hook, and before the
# step whose closure may run the first backward through it. Every optimizer's step runs it,
# also one the hook never saw (one built to replace another).
register_step_check(_check_step)
