"""After the local step, every rank's updated range of every bucket reaches every rank.

Two forms of exchange:
- bucket views: each rank's range is one contiguous slice of a flat buffer that the params
  view, so it is broadcast (or all-gathered) in place;
- no bucket views: the params keep their own memory, and the exchange moves each owner's
  pieces straight into them (`exchange_pieces`). A piece of at least STAGING_BYTES is
  broadcast in place; smaller ones are packed into a staging buffer of that size, one per
  message in flight, so the step's transient memory is a small constant, not a model copy.

All transport is torch.distributed. Choice of collective per backend, from measurement
(DESIGN.md §6): on gloo one broadcast per rank range beats all_gather_into_tensor by ~4x;
on NCCL all_gather_into_tensor is used when the ranges have equal size (flat mode).
Buffers are exchanged as raw bytes-compatible integer views when the backend lacks the
dtype (gloo and bf16), which is exact since nothing is reduced.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from . import kernels

_GLOO_SAFE = {torch.float32, torch.float64, torch.float16, torch.int32, torch.int64,
              torch.uint8, torch.int8}
_SAME_WIDTH = {1: torch.uint8, 2: torch.float16, 4: torch.int32, 8: torch.int64}


def wire_view(t: torch.Tensor, backend: str) -> torch.Tensor:
    """A view of `t` in a dtype every backend can move (same bytes)."""
    if backend == "gloo" and t.dtype not in _GLOO_SAFE:
        return t.view(_SAME_WIDTH[t.element_size()])  # a copy, no arithmetic
    return t


class Exchanger:
    """Issues the collectives of one sync for a process group."""

    def __init__(self, group, rank: int, world: int, lanes: int = 2):
        self.group = group
        self.rank = rank
        self.world = world
        self.backend = dist.get_backend(group) if world > 1 else "none"
        self.global_ranks = [dist.get_global_rank(group, r) if world > 1 else r
                             for r in range(world)] if group is not None else list(range(world))
        # gloo moves one op per group at a time; extra groups ("lanes") over the same ranks
        # let two chunks travel at once (measured: 221 -> 136 ms for one exchange, DESIGN.md
        # §6; four lanes gave nothing more). new_group is collective over the whole world,
        # so lanes are only made when the group is the whole world.
        self.lanes = [group]
        if (self.backend == "gloo" and world == dist.get_world_size()
                and world > 1 and lanes > 1):
            self.lanes += [dist.new_group(backend="gloo") for _ in range(lanes - 1)]

    def pipeline(self) -> "BroadcastPipeline":
        return BroadcastPipeline(self)

    def exchange(self, regions: list[torch.Tensor], full: torch.Tensor | None = None) -> list:
        """Start moving regions[r] from rank r to all ranks; returns work handles.

        regions[self.rank] holds this rank's data, the others are receive buffers. `full`
        is the contiguous concatenation of regions when it exists (bucket views), which
        lets NCCL gather in one call.
        """
        if self.world == 1:
            return []
        sizes = {t.numel() for t in regions}
        if (self.backend == "nccl" and full is not None and len(sizes) == 1
                and full.numel() == self.world * regions[0].numel()):
            return [dist.all_gather_into_tensor(full, regions[self.rank], group=self.group,
                                                async_op=True)]
        if self.backend == "gloo":
            # gloo runs async ops on a small thread pool whose order can differ between
            # ranks; several broadcasts in flight on one group were seen to deadlock at
            # world 3. The pipeline keeps one in flight per lane.
            pipe = self.pipeline()
            pipe.send([(t, r) for r, t in enumerate(regions)])
            pipe.finish()
            return []
        return [dist.broadcast(t, src=self.global_ranks[r], group=self.group, async_op=True)
                for r, t in enumerate(regions) if t.numel() > 0]


def wait_all(works: list) -> None:
    for w in works:
        w.wait()


class BroadcastPipeline:
    """Broadcasts issued chunk by chunk, round robin over the lanes, at most one in flight
    per lane (the same order on every rank, so gloo cannot deadlock)."""

    def __init__(self, ex: Exchanger):
        self.ex = ex
        self.pending: list = [None] * len(ex.lanes)
        self.next_lane = 0

    def send(self, regions: list[tuple[torch.Tensor, int]]) -> None:
        """regions: (tensor, owner rank); the owner's tensor holds the data."""
        for t, r in regions:
            if t.numel() == 0:
                continue
            lane = self.next_lane
            self.next_lane = (lane + 1) % len(self.ex.lanes)
            if self.pending[lane] is not None:
                self.pending[lane].wait()
            self.pending[lane] = dist.broadcast(
                wire_view(t, self.ex.backend), src=self.ex.global_ranks[r],
                group=self.ex.lanes[lane], async_op=True)

    def finish(self) -> None:
        for w in self.pending:
            if w is not None:
                w.wait()
        self.pending = [None] * len(self.pending)


# Bytes of one staged message: 2 lanes in flight hold 8 MB, ~1.6% of GPT-2 small in fp32,
# while messages stay large enough that a collective's fixed cost is amortised.
STAGING_BYTES = 4 << 20


@dataclass
class Message:
    """One broadcast of the piece exchange: pieces (param_id, start, length) of one owner,
    all of one (device, dtype), either one piece in place or several through staging."""

    owner: int
    device: torch.device
    dtype: torch.dtype
    pieces: list[tuple[int, int, int]]
    numel: int
    direct: bool


def plan_messages(buckets, world: int, active: Callable[[int], bool]) -> list[Message]:
    """The message sequence for `buckets` (layout.Bucket), the same on every rank: it
    depends only on the layout and on which params are `active` (exchanged this step)."""
    out: list[Message] = []
    for b in buckets:
        cap = max(1, STAGING_BYTES // torch.empty((), dtype=b.dtype).element_size())
        for r in range(world):
            staged: list[tuple[int, int, int]] = []
            size = 0
            for pc in b.pieces(r):
                if not active(pc.param_id) or pc.length == 0:
                    continue
                if pc.length >= cap:
                    out.append(Message(r, b.device, b.dtype,
                                       [(pc.param_id, pc.start, pc.length)], pc.length, True))
                    continue
                if size + pc.length > cap:
                    out.append(Message(r, b.device, b.dtype, staged, size, False))
                    staged, size = [], 0
                staged.append((pc.param_id, pc.start, pc.length))
                size += pc.length
            if staged:
                out.append(Message(r, b.device, b.dtype, staged, size, False))
    return out


def exchange_pieces(ex: Exchanger, messages: list[Message],
                    view_of: Callable[[int, int, int], torch.Tensor]) -> None:
    """Broadcast every message from its owner into the params of every other rank.

    `view_of(param_id, start, length)` is the param's elements [start, start+length) as a
    tensor (a 1-D view for contiguous params). At most one message per lane is in flight;
    a lane's staging buffer is reused once its broadcast has completed.
    """
    if ex.world == 1 or not messages:
        return
    lanes = ex.lanes
    pending: list = [None] * len(lanes)
    staging: dict = {}

    def offsets(m: Message) -> list[int]:
        out, pos = [], 0
        for _, _, n in m.pieces:
            out.append(pos)
            pos += n
        return out

    def complete(lane: int) -> None:
        item = pending[lane]
        if item is None:
            return
        work, m, buf = item
        work.wait()
        if m.owner != ex.rank:
            if m.direct:
                target = view_of(*m.pieces[0])
                if target.data_ptr() != buf.data_ptr():
                    target.copy_(buf.view_as(target) if target.is_contiguous()
                                 else buf.view(target.shape))
            else:
                kernels.unflatten_from(buf, [view_of(*pc) for pc in m.pieces], offsets(m))
        pending[lane] = None

    for i, m in enumerate(messages):
        lane = i % len(lanes)
        complete(lane)
        if m.direct:
            buf = view_of(*m.pieces[0])
            if not buf.is_contiguous():  # a strided param: one temporary of its size
                buf = buf.contiguous()
            buf = buf.view(-1)
        else:
            key = (lane, m.device, m.dtype)
            cap = max(1, STAGING_BYTES // torch.empty((), dtype=m.dtype).element_size())
            if key not in staging:
                staging[key] = torch.empty(cap, dtype=m.dtype, device=m.device)
            buf = staging[key][:m.numel]
            if m.owner == ex.rank:
                kernels.flatten_into([view_of(*pc) for pc in m.pieces], buf, offsets(m))
        work = dist.broadcast(wire_view(buf, ex.backend), src=ex.global_ranks[m.owner],
                              group=lanes[lane], async_op=True)
        pending[lane] = (work, m, buf)
    for lane in range(len(lanes)):
        complete(lane)
