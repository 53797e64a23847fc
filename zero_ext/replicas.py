"""Every rank's copy of the params: where their memory is, and how each owner's update
reaches all ranks after the local step.

- Bucket views (``parameters_as_bucket_view=True``): one flat buffer per bucket, the params
  are views into it, and each rank's range is exchanged in place (overlapped with the
  local step on gloo: chunk k goes out while chunk k+1 is computed).
- No bucket views: the params keep their own memory, and the exchange moves each owner's
  pieces straight into them with bounded staging (sync.exchange_pieces).
- The params are the source of truth: nothing keeps a private copy of them, and memory the
  script replaced (``p.data = t``, ``load_state_dict(..., assign=True)``) is followed at
  the next step (`refresh`).
"""
from __future__ import annotations

import os
import time

import torch

from . import kernels, layout
from .sync import (STAGING_BYTES, Exchanger, Gather, bucket_gathers, exchange_gathers,
                   exchange_pieces, plan_gathers, plan_messages, uses_gathers)

# The exchange left in flight (overlap_param_gather) packs small pieces up to this many
# bytes per collective instead of STAGING_BYTES: the forward's first module waits for the
# first collective, so it should be small; each collective costs its fixed latency (a ring
# all-gather: world - 1 hops), which is why a small param joins the collective before it
# (sync.plan_gathers). Behind netlab's links, 8 x Linear(512) (a layer's weight 1 MB):
# world 4, forward 16 ms per layer: 4 MB packs, the first module waited 97-106 ms; 2 MB
# (two layers in flight sharing the links) 34 ms; 1 MB 19-34 ms. World 8, 44 ms per layer:
# 1 MB packs with each bias in a collective of its own, 369 ms of waits per forward; 4 MB
# 240; the weight and its bias together, the first collective alone in flight, 87 ms.
# ZERO_EXT_DEFERRED_PACK_BYTES sets it (benchmarks; every rank alike).
DEFERRED_PACK_BYTES = int(os.environ.get("ZERO_EXT_DEFERRED_PACK_BYTES", 1 << 20))


class OverlappedSends:
    """gloo with bucket views: chunk k of every rank's range goes out as soon as this rank
    has computed its own chunk k, while chunk k+1 computes. `finish` sends whatever was not
    sent (after a local failure too: every rank must issue the same broadcasts)."""

    def __init__(self, regions: list, exchanger: Exchanger):
        self.regions = regions
        self.pipe = exchanger.pipeline()
        self.sent = 0
        self.comm = 0.0  # seconds spent issuing/waiting for broadcasts

    def send(self, k: int) -> None:
        t = time.perf_counter()
        for j in range(self.sent, k + 1):
            self.pipe.send(self.regions[j])
        self.sent = k + 1
        self.comm += time.perf_counter() - t

    def finish(self) -> None:
        if self.sent < len(self.regions):
            self.send(len(self.regions) - 1)
        t = time.perf_counter()
        self.pipe.finish()
        self.comm += time.perf_counter() - t


class Replicas:
    """The params of one ZeroRedundancyOptimizer as every rank holds them."""

    def __init__(self, exchanger: Exchanger, bucket_view: bool):
        self.ex = exchanger
        self.bucket_view = bucket_view
        self.plan: layout.ShardPlan | None = None
        self.buffers: dict[int, torch.Tensor] = {}  # bucket index -> flat buffer
        self._messages: dict = {}  # piece-exchange plans by active set (no bucket views)
        self._regions: list | None = None  # overlapped exchange: regions per chunk
        self._ptrs: list = []  # where every param's memory was at the last check
        self._meta: list = []

    @property
    def overlapped(self) -> bool:
        """gloo with bucket views: broadcast chunk k while chunk k+1 is computed. (On NCCL
        one all_gather_into_tensor per bucket after the step is already the fast path.)"""
        return (self.ex.world > 1 and self.bucket_view and self.ex.backend == "gloo"
                and not bucket_gathers(self.ex.backend))

    @property
    def frozen_outside_buckets(self) -> bool:
        """Param mode with bucket views keeps frozen params out of the buffers."""
        return self.bucket_view and self.plan.sharding == layout.PARAM

    # ---------------------------------------------------------------- layout changes

    def adopt(self, plan: layout.ShardPlan, fresh: bool) -> None:
        """Follow `plan` after a layout change: bucket views for its new buckets (all of
        them when `fresh`: a new plan, or buckets rebuilt), plans of the exchange reset.
        Memory the script replaced before this is still followed at the next step: only
        the params placed now have their memory recorded here."""
        self.plan = plan
        known = len(self._ptrs)
        if fresh:
            # The old buffers stay referenced until the new ones exist: a new buffer must
            # not reuse an old one's address, or it would look like an old buffer below.
            old_buffers, self.buffers = list(self.buffers.values()), {}
            if self.bucket_view:
                for bi in range(len(plan.buckets)):
                    self._attach_buffer(bi)
                self._release_old_buffers({b.untyped_storage().data_ptr() for b in old_buffers})
            del old_buffers
            known = 0  # every param was (re)placed from its current memory
        elif self.bucket_view:
            for bi in range(len(self.buffers), len(plan.buckets)):
                self._attach_buffer(bi)
        self._messages, self._regions = {}, None
        self.record(start=known)

    def _release_old_buffers(self, old: set) -> None:
        """Params left outside the new buffers (frozen, with bucket views) that still view
        an old buffer get memory of their own, so the old buffer is freed."""
        plan = self.plan
        for i, p in enumerate(plan.params):
            if i not in plan.alias_of and p.numel() and \
                    p.untyped_storage().data_ptr() in old:
                p.data = p.detach().clone()
        for i, first in plan.alias_of.items():
            plan.params[i].data = plan.params[first].data

    def _attach_buffer(self, bi: int) -> None:
        """The flat buffer of bucket `bi`, filled from the params' current values; the
        params become views into it (params over another's memory follow)."""
        plan = self.plan
        b = plan.buckets[bi]
        params = plan.params
        buf = torch.empty(b.numel, dtype=b.dtype, device=b.device)
        kernels.flatten_into([params[i].detach() for i in b.param_ids], buf, b.offsets)
        ends = [off + n for off, n in zip(b.offsets, b.numels)]
        for gap_lo, gap_hi in zip(ends, b.offsets[1:] + [b.numel]):
            if gap_hi > gap_lo:
                buf[gap_lo:gap_hi].zero_()  # alignment padding: deterministic bytes
        for pid, off, n in zip(b.param_ids, b.offsets, b.numels):
            params[pid].data = buf[off:off + n].view_as(params[pid])
        for i, first in plan.alias_of.items():
            if first in b.param_ids:
                params[i].data = params[first].data
        self.buffers[bi] = buf

    # ---------------------------------------------------------------- params are the truth

    def record(self, start: int = 0) -> None:
        """Remember where the memory of params[start:] is, to notice `p.data = ...` later
        (params before `start` keep what was recorded for them)."""
        params = self.plan.params
        self._ptrs = self._ptrs[:start] + [p.data_ptr() if p.numel() else None
                                           for p in params[start:]]
        self._meta = self._meta[:start] + [(p.shape, p.dtype, p.device) for p in params[start:]]

    def refresh(self) -> bool:
        """Follow params whose memory the script replaced since the last step: with bucket
        views their new values are copied into the buffer and they view it again; in flat
        mode the local optimizer's views are re-pointed (their state stays). Values written
        in place need nothing: every step reads the params themselves. Returns whether
        anything moved (cached views of the params are then stale)."""
        plan = self.plan
        params = plan.params
        ptrs = [p.data_ptr() if p.numel() else None for p in params]
        if ptrs == self._ptrs:
            return False
        changed = [i for i, (a, b) in enumerate(zip(ptrs, self._ptrs)) if a != b]
        for i in changed:
            p = params[i]
            if (p.shape, p.dtype, p.device) != self._meta[i]:
                raise ValueError(
                    f"parameter {i} changed shape, dtype or device after the optimizer was "
                    f"built ({self._meta[i]} -> {(p.shape, p.dtype, p.device)}); "
                    "build the optimizer after moving or casting the model")
            if plan.sharding in layout.SPLIT_MODES and not p.is_contiguous():
                raise ValueError(
                    f"parameter {i} was given non-contiguous memory after the optimizer was "
                    f"built (p.data = a transposed or strided tensor); sharding="
                    f"{plan.sharding!r} splits params by element and needs them contiguous: "
                    "assign a .contiguous() tensor")
        known = {ptr: i for i, ptr in enumerate(ptrs) if ptr is not None and i not in changed}
        for i in changed:
            tied = plan.alias_of.get(i)
            if tied is not None and ptrs[i] != ptrs[tied]:
                raise ValueError(
                    f"parameter {i} shared memory with parameter {tied} when the optimizer "
                    "was built and no longer does; build the optimizer after tying weights")
            other = known.get(ptrs[i])
            if tied is None and other is not None and plan.alias_of.get(other) != i:
                raise ValueError(
                    f"parameter {i} now shares memory with parameter {other} (tied after the "
                    "optimizer was built); tie weights before building the optimizer")
        if self.bucket_view:
            # A bucket with a moved member gets a new buffer, filled from every member's
            # current memory; the old one is left to whoever still holds it (a backup, the
            # other side of an EMA swap), never written again.
            moved = set(changed)
            for bi, b in enumerate(plan.buckets):
                if moved.intersection(b.param_ids):
                    self._attach_buffer(bi)
                    plan.rebind(set(b.param_ids))  # flat keys view the new buffer
            self._regions = None
            for i, first in plan.alias_of.items():
                params[i].data = params[first].data
        else:
            plan.rebind(set(changed))
        self.record()
        return True

    # ---------------------------------------------------------------- exchange

    def chunk_regions(self) -> list[list[tuple[torch.Tensor, int]]]:
        """(region, owner) per chunk, for every rank's range of every bucket: the order of
        the overlapped exchange (the generic step sends the same sequence)."""
        if self._regions is None:
            plan = self.plan
            out: list[list[tuple[torch.Tensor, int]]] = [[] for _ in range(plan.chunks)]
            for bi in range(len(plan.buckets)):
                for r in range(plan.world_size):
                    for k, (a, z) in enumerate(plan.chunk_ranges(bi, r)):
                        if z > a:
                            out[k].append((self.buffers[bi][a:z], r))
            self._regions = out
        return self._regions

    def overlapped_sends(self) -> OverlappedSends:
        return OverlappedSends(self.chunk_regions(), self.ex)

    def stepped_a_frozen_param(self) -> bool:
        """Whether a param that does not require grad holds a grad (a torch optimizer steps
        it): its update must then reach every rank."""
        if self.bucket_view and not self.frozen_outside_buckets:
            return False  # flat bucket views hold frozen params: always exchanged
        return any(not p.requires_grad and p.grad is not None for p in self.plan.params)

    def sync(self, exchange_frozen: bool, buffers_sent: bool = False,
             trainable: tuple[bool, ...] | None = None, deferred=None):
        """Send this rank's updated elements of every bucket to all ranks (`buffers_sent`:
        the overlapped local step already sent the bucket buffers; `trainable`: every
        param's requires_grad, when the caller has it already). `deferred` (no bucket views):
        a param_gather.ParamGather that leaves the exchange in flight, planned in the order
        the forward first uses the params; returns (its queue, each item's param ids)."""
        plan = self.plan
        if plan.world_size == 1:
            return None
        if self.bucket_view:
            if buffers_sent:
                pass
            elif self.overlapped:
                self.overlapped_sends().finish()
            else:
                self.ex.exchange_buffers([(self.buffers[bi], b.rank_ranges)
                                          for bi, b in enumerate(plan.buckets)])
            if exchange_frozen and self.frozen_outside_buckets:
                self._exchange_frozen()
            return
        # No bucket views: straight into the params, with bounded staging. Frozen params
        # travel only when some rank stepped one (it held a grad).
        if trainable is None:
            trainable = tuple(p.requires_grad for p in plan.params)
        order = None if deferred is None else deferred.positions
        key = (exchange_frozen, trainable, None if order is None else id(order))
        if key not in self._messages:
            active = (lambda pid: True) if exchange_frozen else plan.trainable
            if len(self._messages) > 16:  # one plan per trainable mask seen: keep it bounded
                self._messages.clear()
            buckets = plan.buckets
            if order is not None:  # (the forward's order: its first params travel first)
                last = len(order)
                buckets = sorted(buckets, key=lambda b: min(
                    order.get(pid, last + pid) for pid in b.param_ids))
            # (left in flight, smaller collectives: the forward's first module waits
            # only for the first one)
            pack = STAGING_BYTES if order is None else DEFERRED_PACK_BYTES
            if plan.sharding != layout.EVEN:
                self._messages[key] = plan_messages(buckets, plan.world_size, active,
                                                    pack_bytes=pack)
            elif uses_gathers(self.ex):  # every link does equal work (see sync.py)
                self._messages[key] = plan_gathers(buckets, plan.world_size, active,
                                                   pack_bytes=pack)
            else:  # (gloo at world 2: one broadcast per owner on each of two lanes)
                self._messages[key] = plan_messages(buckets, plan.world_size, active,
                                                    across_buckets=True, pack_bytes=pack)
        messages = self._messages[key]
        gathers = bool(messages) and isinstance(messages[0], Gather)
        exchange = exchange_gathers if gathers else exchange_pieces
        if deferred is None:
            exchange(self.ex, messages, plan.element_view)
            return None
        lanes, bounded = deferred.transport(self.ex, len(messages), gathers)

        def data_view(pid: int, start: int, length: int) -> torch.Tensor:
            # (through .data, whose version counter is its own: the exchange's writes, some
            # made on the backend's threads, leave the params' counters alone, and a move of
            # one while in flight is a write by another hand: param_gather watches them)
            p = plan.params[pid].data
            if start == 0 and length == p.numel() and not p.is_contiguous():
                return p
            return p.view(-1)[start:start + length]

        queue = exchange(self.ex, messages, data_view, lanes=lanes, defer=True,
                         bounded=bounded)
        return queue, [[pc[0] for pc in (m.params if gathers else m.pieces)]
                       for m in messages]

    def exchange_views(self, view_of, active) -> None:
        """Every owner's elements of tensors laid out like the params (`view_of(param_id,
        start, length)`: their grads), from the owner to every rank, for the params where
        `active(param_id)`, by the plan of the params' own exchange."""
        plan = self.plan
        if plan.world_size == 1:
            return
        if plan.sharding == layout.EVEN and uses_gathers(self.ex):
            exchange_gathers(self.ex, plan_gathers(plan.buckets, plan.world_size, active),
                             view_of)
        else:
            exchange_pieces(self.ex, plan_messages(plan.buckets, plan.world_size, active,
                                                   across_buckets=plan.sharding == layout.EVEN),
                            view_of)

    def _exchange_frozen(self) -> None:
        """Param mode with bucket views: the frozen params (outside the buffers) after a
        step that updated one of them."""
        plan = self.plan
        frozen = [i for i in range(len(plan.params))
                  if i not in plan.alias_of and not plan.trainable(i)]
        key = ("frozen", tuple(frozen))
        if key not in self._messages:
            buckets = layout.param_mode_buckets(plan.params, frozen, plan.owner,
                                                plan.world_size)
            self._messages[key] = plan_messages(buckets, plan.world_size, lambda pid: True)
        exchange_pieces(self.ex, self._messages[key], plan.element_view)
