"""After the local step, every rank's updated range of every bucket reaches every rank.

Two forms of exchange:
- bucket views: each rank's range is one contiguous slice of a flat buffer that the params
  view, so it is broadcast (or all-gathered) in place;
- no bucket views: the params keep their own memory, and the exchange moves each owner's
  pieces straight into them (`exchange_pieces`). A piece of at least STAGING_BYTES is
  broadcast in place; smaller ones are packed into a staging buffer of that size, one per
  message in flight, so the step's transient memory is a small constant, not a model copy
  (an exchange left in flight on NCCL issues every message at once, each with its own
  staging, freed as the next forward uses it: LaneQueue, `_staging`).

All transport is torch.distributed. Choice of collective per backend, from measurement
(2 ranks, 62M fp32 elements each): on gloo one broadcast per rank range beats
an all-gather by ~4x;
on NCCL an all-gather (all_gather_single) is used when the ranges have equal size (flat mode).
Buffers are exchanged as raw bytes-compatible integer views when the backend lacks the
dtype (gloo and bf16), which is exact since nothing is reduced.
"""
from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from . import kernels

# torch 2.14 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
# reduce_scatter_single (the old names print a FutureWarning at every call); older torch has
# only the old ones. Looked up at each call, so that a wrapper of torch.distributed's
# function (a test's spy) sees the call.
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else \
    "all_gather_into_tensor"
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else \
    "reduce_scatter_tensor"


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None,
                      async_op: bool = False):
    """`input` from every rank of `group`, concatenated in rank order into `output`."""
    return getattr(dist, ALL_GATHER)(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group=None,
                          async_op: bool = False):
    """The sum over the ranks of `group` of `input`, block r of it into rank r's `output`."""
    return getattr(dist, REDUCE_SCATTER)(output, input, group=group, async_op=async_op)


_GLOO_SAFE = {torch.float32, torch.float64, torch.float16, torch.int32, torch.int64,
              torch.uint8, torch.int8}
_SAME_WIDTH = {1: torch.uint8, 2: torch.float16, 4: torch.int32, 8: torch.int64}


def wire_view(t: torch.Tensor, backend: str) -> torch.Tensor:
    """A view of `t` in a dtype every backend can move (same bytes)."""
    if backend == "gloo" and t.dtype not in _GLOO_SAFE:
        return t.view(_SAME_WIDTH[t.element_size()])  # a copy, no arithmetic
    return t


# What zero_ext keeps for the current world (torch's default group) alone: the extra
# groups it made and their counts. A re-initialised world starts afresh; release_lanes
# drops it all when the world is destroyed.
_WORLD_STATE: dict = {}


def this_world(key: str, make: Callable):
    """The current world's entry `key` (made by `make()` the first time)."""
    world = dist.group.WORLD
    if _WORLD_STATE.get("world") is not world:  # a new world (re-initialised)
        _WORLD_STATE.clear()
        _WORLD_STATE["world"] = world
    if key not in _WORLD_STATE:
        _WORLD_STATE[key] = make()
    return _WORLD_STATE[key]


def _shared_lanes(n: int) -> list:
    """`n` extra gloo groups over the whole world, made once per world and shared by every
    optimizer (every rank builds its optimizers in the same order, so the collective
    new_group calls match). They go with the world: destroy_process_group() frees them."""
    lanes = this_world("shared_lanes", list)
    while len(lanes) < n:
        lanes.append(dist.new_group(backend="gloo"))
    return lanes[:n]


_EXCHANGERS: "weakref.WeakSet[Exchanger]" = weakref.WeakSet()


def release_lanes() -> None:
    """(the world destroyed) Drop every reference to the extra groups, so that they are
    freed now, not at the interpreter's teardown (where gloo's threads, destroyed late,
    abort the process: "terminate called without an active exception")."""
    _WORLD_STATE.clear()
    for ex in list(_EXCHANGERS):
        ex.lanes = ex.lanes[:1]


class Exchanger:
    """Issues the collectives of one sync for a process group."""

    def __init__(self, group, rank: int, world: int, lanes: int = 2):
        _EXCHANGERS.add(self)
        self.group = group
        self.rank = rank
        self.world = world
        self.backend = dist.get_backend(group) if world > 1 else "none"
        # group rank -> global rank, in O(world): get_global_rank per rank scans the group's
        # map each time (O(world^2) for a subgroup: 22 ms at 1024 ranks, 290 ms at 4096)
        self.global_ranks = list(range(world))
        if group is not None and world > 1:
            for g in dist.get_process_group_ranks(group):
                self.global_ranks[dist.get_group_rank(group, g)] = g
        # gloo moves one op per group at a time; extra groups ("lanes") over the same ranks
        # let two chunks travel at once (measured on 2 ranks, 62M fp32 elements each: one
        # exchange 221 -> 136 ms; four lanes gave nothing more). new_group is collective
        # over the whole world, so lanes are only made when the group is the whole world.
        self.lanes = [group]
        if (self.backend == "gloo" and world == dist.get_world_size()
                and world > 1 and lanes > 1):
            self.lanes += _shared_lanes(lanes - 1)

    def pipeline(self) -> "BroadcastPipeline":
        return BroadcastPipeline(self)

    def exchange_buffers(self, buffers: list[tuple[torch.Tensor, list[tuple[int, int]]]]):
        """Bucket views: for every (flat buffer, [(lo, hi) per rank]), rank r's range goes
        from rank r to all ranks, in place. Returns when everything has arrived."""
        if self.world == 1:
            return
        gathers = bucket_gathers(self.backend)
        if self.backend == "gloo" and not gathers:
            # gloo runs async ops on a small thread pool whose order can differ between
            # ranks; several broadcasts in flight on one group were seen to deadlock at
            # world 3. The pipeline keeps one in flight per lane.
            pipe = self.pipeline()
            for full, ranges in buffers:
                pipe.send([(full[lo:hi], r) for r, (lo, hi) in enumerate(ranges)])
            pipe.finish()
            return
        works = []
        for full, ranges in buffers:
            sizes = {hi - lo for lo, hi in ranges}
            if gathers and len(sizes) == 1 and full.numel() == self.world * next(iter(sizes)):
                lo, hi = ranges[self.rank]
                works.append(all_gather_single(
                    wire_view(full, self.backend), wire_view(full[lo:hi], self.backend),
                    group=self.group, async_op=True))
            else:
                works += [dist.broadcast(wire_view(full[lo:hi], self.backend),
                                         src=self.global_ranks[r], group=self.group,
                                         async_op=True)
                          for r, (lo, hi) in enumerate(ranges) if hi > lo]
            if self.backend == "gloo":  # (forced gathers, tests: one op at a time on gloo)
                for w in works:
                    w.wait()
                works = []
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


def plan_messages(buckets, world: int, active: Callable[[int], bool],
                  across_buckets: bool = False, pack_bytes: int = STAGING_BYTES
                  ) -> list[Message]:
    """The message sequence for `buckets` (layout.Bucket), the same on every rank: it
    depends only on the layout and on which params are `active` (exchanged this step).
    Small pieces of one owner are packed up to `pack_bytes`, within a bucket, or with
    `across_buckets` (an even plan: one bucket per param) across buckets, the owners'
    messages then interleaved as they fill."""
    out: list[Message] = []
    staged: dict = {}  # (device, dtype, owner) -> [pieces, size]

    def flush(key) -> None:
        pieces, size = staged.pop(key, ([], 0))
        if pieces:
            out.append(Message(key[2], key[0], key[1], pieces, size, False))

    for b in buckets:
        cap = max(1, pack_bytes // torch.empty((), dtype=b.dtype).element_size())
        for r in range(world):
            key = (b.device, b.dtype, r)
            for pc in b.pieces(r):
                if not active(pc.param_id) or pc.length == 0:
                    continue
                if pc.length >= cap:
                    out.append(Message(r, b.device, b.dtype,
                                       [(pc.param_id, pc.start, pc.length)], pc.length, True))
                    continue
                if key in staged and staged[key][1] + pc.length > cap:
                    flush(key)
                entry = staged.setdefault(key, [[], 0])
                entry[0].append((pc.param_id, pc.start, pc.length))
                entry[1] += pc.length
            if not across_buckets:
                flush(key)
    for key in list(staged):
        flush(key)
    return out


def _staging(kept: dict | None, key, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """n elements of staging for one collective. Bounded queues keep one buffer per `key`
    (lane, device, dtype), grown to its largest message and reused once the lane's last
    collective finished; an unbounded queue's items are all in flight at once, so each gets
    its own (`kept` None), freed once finished rather than held until the whole exchange
    ends (on NCCL every item of an exchange left in flight is issued at the step)."""
    if kept is None:
        return torch.empty(n, dtype=dtype, device=device)
    if key not in kept or kept[key].numel() < n:
        kept[key] = torch.empty(n, dtype=dtype, device=device)
    return kept[key][:n]


def _used_here(buf: torch.Tensor) -> None:
    """A CUDA buffer finished on this thread's current stream (a forward may run on another
    stream than the step that allocated it): its memory is not reused before that stream
    is done with it."""
    if buf.is_cuda:
        buf.record_stream(torch.cuda.current_stream(buf.device))


class LaneQueue:
    """The collectives of one exchange, issued in order, item i on lane i % len(lanes).

    Bounded (gloo): at most one op in flight per lane (several async ops on one gloo group
    can start in a different order on different ranks: broadcasts were seen to deadlock at
    world 3), so an item is issued once the item before it on its lane has finished.
    Unbounded (NCCL, an exchange left in flight): every item is issued at once (a
    communicator runs its ops in issue order). `issue(item, group, slot)` starts an item's op
    and returns (work, state); `slot` names the buffers it may use (its lane when bounded,
    the item itself otherwise); `finish(item, state)` runs once the op is done, in issue
    order. One thread drives a queue; with `wait_finished` another may wait on it."""

    def __init__(self, lanes: list, items: list, issue: Callable, finish: Callable,
                 bounded: bool = True, solo_first: bool = False):
        self.lanes, self.items = lanes, items
        self.issue_fn, self.finish_fn = issue, finish
        self.bounded = bounded
        # (bounded) item 0 alone in flight: a forward waiting for it gets the links' full
        # rate (the next item would share them and double its time)
        self.solo_first = solo_first
        self.issued = 0
        self.finished = 0
        self.inflight: dict = {}
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        # watch(i): called once item i has finished, on the thread that drives the queue
        # (the exchange left in flight checks there that nothing else wrote its params)
        self.watch: Callable[[int], None] | None = None

    @property
    def size(self) -> int:
        return len(self.items)

    @property
    def done(self) -> bool:
        return self.finished == len(self.items)

    def pump(self) -> None:
        """Issue every item the lanes have room for; nothing once the exchange has failed
        (its failure is raised: a later collective may run on groups already torn down)."""
        self._raise_kept()
        lanes = len(self.lanes)
        while self.issued < len(self.items) and (
                not self.bounded or self.issued - self.finished < lanes):
            if self.bounded and self.solo_first and self.issued == 1 and self.finished == 0:
                break
            i = self.issued
            slot = i % lanes if self.bounded else i
            self.inflight[i] = self.issue_fn(self.items[i], self.lanes[i % lanes], slot)
            self.issued += 1

    def complete_through(self, k: int) -> None:
        """Items 0..k finished (issuing later ones as lanes free up)."""
        k = min(k, len(self.items) - 1)
        self._raise_kept()
        try:
            while self.finished <= k:
                if self.finished == self.issued:
                    self.pump()
                i = self.finished
                work, state = self.inflight[i]  # (its staging held until it has finished)
                work.wait()
                self.finish_fn(self.items[i], state)
                if self.watch is not None:
                    self.watch(i)
                del self.inflight[i]
                with self.cond:
                    self.finished += 1
                    self.cond.notify_all()
                self.pump()
        except BaseException as exc:
            with self.cond:  # every later wait raises it too: the params are not all there
                self.error = self.error or exc
                self.cond.notify_all()
            raise

    def _raise_kept(self) -> None:
        if self.error is not None:
            what = str(self.error) or type(self.error).__name__  # (KeyboardInterrupt: "")
            raise RuntimeError(f"zero_ext: the params' exchange failed: {what}") \
                from self.error

    def complete_all(self) -> None:
        self.pump()
        self.complete_through(len(self.items) - 1)

    def run_to_end(self) -> None:
        """(a worker thread) Everything, keeping an error for wait_finished to raise."""
        try:
            self.complete_all()
        except BaseException as exc:  # noqa: BLE001 - raised in the waiting thread
            with self.cond:  # (the first error is the one that says what went wrong)
                self.error = self.error or exc
                self.cond.notify_all()

    def wait_finished(self, k: int) -> None:
        """(another thread) Block until items 0..k have finished."""
        k = min(k, len(self.items) - 1)
        with self.cond:
            while self.finished <= k and self.error is None:
                self.cond.wait()
            self._raise_kept()


def exchange_pieces(ex: Exchanger, messages: list[Message],
                    view_of: Callable[[int, int, int], torch.Tensor], lanes: list | None = None,
                    defer: bool = False, bounded: bool = True) -> LaneQueue:
    """Broadcast every message from its owner into the params of every other rank.

    `view_of(param_id, start, length)` is the param's elements [start, start+length) as a
    tensor (a 1-D view for contiguous params). On `lanes` (default: the exchanger's), at
    most one message per lane in flight when `bounded`, a lane's staging buffer reused once
    its broadcast has completed (unbounded: each message has its own). Returns the queue,
    completed unless `defer` (then nothing is issued yet: the caller drives it).
    """
    lanes = lanes or ex.lanes
    if ex.world == 1:
        messages = []
    staging: dict = {}

    def offsets(m: Message) -> list[int]:
        out, pos = [], 0
        for _, _, n in m.pieces:
            out.append(pos)
            pos += n
        return out

    def finish(m: Message, buf: torch.Tensor) -> None:
        _used_here(buf)
        if m.owner != ex.rank:
            if m.direct:
                target = view_of(*m.pieces[0])
                if target.data_ptr() != buf.data_ptr():
                    target.copy_(buf.view_as(target) if target.is_contiguous()
                                 else buf.view(target.shape))
            else:
                kernels.unflatten_from(buf, [view_of(*pc) for pc in m.pieces], offsets(m))

    def issue(m: Message, group, slot: int) -> tuple:
        if m.direct:
            buf = view_of(*m.pieces[0])
            if not buf.is_contiguous():  # a strided param: one temporary of its size
                buf = buf.contiguous()
            buf = buf.view(-1)
        else:
            buf = _staging(staging if bounded else None, (slot, m.device, m.dtype), m.numel,
                           m.dtype, m.device)
            if m.owner == ex.rank:
                kernels.flatten_into([view_of(*pc) for pc in m.pieces], buf, offsets(m))
        work = dist.broadcast(wire_view(buf, ex.backend), src=ex.global_ranks[m.owner],
                              group=group, async_op=True)
        return work, buf

    queue = LaneQueue(lanes, messages, issue, finish, bounded)
    if not defer:
        queue.complete_all()
    return queue


# ------------------------------------------------------------------ the even exchange
# sharding="even": every rank owns one chunk of every param, so each rank sends 1/W of the
# model and receives the rest. One broadcast per owner would load one rank's link at a time
# (gloo's broadcast sends from the root to every rank itself); an all-gather is a ring, with
# equal work on every link. Over gloo at world 2 the two are equally balanced and the
# broadcasts cost less CPU (measured on loopback, 62M fp32 elements per rank: 239 ms for one
# broadcast per rank against 913 ms for all_gather_into_tensor), so they are kept there.


@dataclass
class Gather:
    """One all_gather_into_tensor of the even exchange: consecutive params of one (device,
    dtype). Every rank contributes its chunk of each, padded to the chunk size, so that all
    contributions have one size and rank r's part lands at [r * size, (r + 1) * size)."""

    device: torch.device
    dtype: torch.dtype
    params: list  # (param_id, [(lo, hi) per rank], offset in a rank's part)
    size: int     # elements of one rank's part
    direct: bool  # one param whose chunks are rank-ordered and equal: gathered in place


# How bucket views travel (parameters_as_bucket_view=True): "auto" is one
# all_gather_into_tensor per bucket on NCCL (where the ranks' ranges are equal: flat mode),
# broadcast chunks overlapped with the local step on gloo; "gather" forces NCCL's form on
# gloo too (ZERO_EXT_BUCKET_EXCHANGE, for tests). Every rank must use the same.
BUCKET_EXCHANGES = ("auto", "gather")
BUCKET_EXCHANGE = os.environ.get("ZERO_EXT_BUCKET_EXCHANGE", "auto")


def bucket_gathers(backend: str) -> bool:
    if BUCKET_EXCHANGE not in BUCKET_EXCHANGES:
        raise ValueError(f"ZERO_EXT_BUCKET_EXCHANGE must be one of {BUCKET_EXCHANGES}, got "
                         f"{BUCKET_EXCHANGE!r}")
    return backend == "nccl" or BUCKET_EXCHANGE == "gather"


# How the even exchange travels: "auto" is one broadcast per owner on gloo at world 2 and
# all-gathers everywhere else; "gather" or "broadcast" force one (ZERO_EXT_EVEN_EXCHANGE:
# tests run NCCL's all-gathers on gloo at world 2 too). Every rank must use the same.
EVEN_EXCHANGES = ("auto", "gather", "broadcast")
EVEN_EXCHANGE = os.environ.get("ZERO_EXT_EVEN_EXCHANGE", "auto")
# A param of at least this many bytes whose chunks are equal and in rank order is gathered
# in place, straight into its own memory (below it, params are packed: one collective for
# many small ones). ZERO_EXT_DIRECT_GATHER_BYTES lowers it so that tests reach the in-place
# form with small params.
DIRECT_GATHER_BYTES = int(os.environ.get("ZERO_EXT_DIRECT_GATHER_BYTES", STAGING_BYTES // 2))


def uses_gathers(ex: Exchanger) -> bool:
    if EVEN_EXCHANGE not in EVEN_EXCHANGES:
        raise ValueError(f"ZERO_EXT_EVEN_EXCHANGE must be one of {EVEN_EXCHANGES}, got "
                         f"{EVEN_EXCHANGE!r}")
    if ex.world == 1 or EVEN_EXCHANGE != "auto":
        return ex.world > 1 and EVEN_EXCHANGE == "gather"
    return ex.backend != "gloo" or ex.world > 2


def plan_gathers(buckets, world: int, active: Callable[[int], bool],
                 pack_bytes: int = STAGING_BYTES) -> list[Gather]:
    """The gathers of an even plan's buckets (one param each), the same on every rank:
    params packed up to `pack_bytes` per gather, a large param with equal chunks in rank
    order on its own, in place. A small param (a bias, a norm's weight) that would open a
    gather of its own joins the one before instead, up to a quarter more: each gather
    costs world - 1 hops of latency whatever its size, and a module's weight and bias then
    travel together."""
    out: list[Gather] = []
    cur: Gather | None = None
    for b in buckets:
        pid = b.param_ids[0]
        if not active(pid) or b.numel == 0:
            continue
        chunk = max(hi - lo for lo, hi in b.rank_ranges)
        size = torch.empty((), dtype=b.dtype).element_size()
        # in place only where rank r's chunk is the r-th of `world` equal blocks: that is
        # where all_gather_into_tensor puts it (the even plan rotates the first owner from
        # param to param, so most params are not in rank order)
        ordered = all(b.rank_ranges[r] == (r * chunk, (r + 1) * chunk) for r in range(world))
        if ordered and world * chunk * size >= DIRECT_GATHER_BYTES:
            out.append(Gather(b.device, b.dtype, [(pid, b.rank_ranges, 0)], chunk, True))
            continue
        cap = max(1, pack_bytes // size // world)
        fits = cur is not None and (cur.size + chunk <= cap or (
            chunk <= cap // 16 and cur.size + chunk <= cap + cap // 4))
        if not fits or (cur.device, cur.dtype) != (b.device, b.dtype):
            cur = Gather(b.device, b.dtype, [], 0, False)
            out.append(cur)
        cur.params.append((pid, b.rank_ranges, cur.size))
        cur.size += chunk
    return out


def exchange_gathers(ex: Exchanger, gathers: list[Gather],
                     view_of: Callable[[int, int, int], torch.Tensor], lanes: list | None = None,
                     defer: bool = False, bounded: bool = True) -> LaneQueue:
    """Every rank's chunks of every gather's params into every rank's params. On `lanes`
    (default: the exchanger's), at most one gather per lane in flight when `bounded`, a
    lane's buffers reused once its gather completed (unbounded: each has its own). Returns
    the queue, completed unless `defer` (see exchange_pieces)."""
    lanes = lanes or ex.lanes
    if ex.world == 1:
        gathers = []
    me, world = ex.rank, ex.world
    staging: dict = {}

    def finish(g: Gather, recv: torch.Tensor) -> None:
        _used_here(recv)
        if g.direct:
            return
        # Per param, its chunks sit in column block [off, off + chunk) of the (world, size)
        # parts, chunk j in row (first + j) % world: two block copies (the rows before and
        # after the wrap), whatever the world, plus the short last chunk. (This rank's own
        # chunk is copied onto itself: the same values.)
        parts = recv.view(world, g.size)
        for pid, ranges, off in g.params:
            chunk = max(hi - lo for lo, hi in ranges)
            if chunk == 0:
                continue
            first = next(r for r, (lo, _) in enumerate(ranges) if lo == 0)
            n = max(hi for _, hi in ranges)
            full, tail = divmod(n, chunk)
            dst = view_of(pid, 0, n)
            head = min(full, world - first)
            if head:
                dst[:head * chunk].view(head, chunk).copy_(
                    parts[first:first + head, off:off + chunk])
            if full > head:
                dst[head * chunk:full * chunk].view(full - head, chunk).copy_(
                    parts[:full - head, off:off + chunk])
            if tail:
                dst[full * chunk:].copy_(parts[(first + full) % world, off:off + tail])

    def issue(g: Gather, group, slot: int) -> tuple:
        if g.direct:
            pid, ranges, _ = g.params[0]
            # (split modes keep params contiguous: Replicas.refresh refuses strided memory)
            full = view_of(pid, 0, world * g.size).view(-1)
            lo, hi = ranges[me]
            send, recv = full[lo:hi], full
        else:
            buf = _staging(staging if bounded else None, (slot, g.device, g.dtype),
                           (world + 1) * g.size, g.dtype, g.device)
            send, recv = buf[:g.size], buf[g.size:]
            srcs, offs = [], []
            for pid, ranges, off in g.params:
                lo, hi = ranges[me]
                if hi > lo:
                    srcs.append(view_of(pid, lo, hi - lo))
                    offs.append(off)
            if srcs:
                kernels.flatten_into(srcs, send, offs)
        work = all_gather_single(wire_view(recv, ex.backend),
                                           wire_view(send, ex.backend),
                                           group=group, async_op=True)
        return work, recv

    queue = LaneQueue(lanes, gathers, issue, finish, bounded, solo_first=defer)
    if not defer:
        queue.complete_all()
    return queue


# ------------------------------------------------------------------ state transport
# (consolidation and sharded checkpoints): small descriptions as objects, tensors as
# point-to-point messages of bounded size.


def gather_objects(obj, to: int, group, world_size: int) -> list | None:
    """Every rank's picklable `obj` on group rank `to` (None elsewhere)."""
    if world_size == 1:
        return [obj]
    me = dist.get_rank(group)
    out = [None] * world_size if me == to else None
    dist.gather_object(obj, out, dst=dist.get_global_rank(group, to), group=group)
    return out


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))


def message_plan(seg_descs: list[tuple], chunk: int) -> list[tuple[str, list[tuple]]]:
    """How one rank's segments travel: [(dtype, [(segment index, offset, length), ...])].

    Per dtype, in segment order: a segment of at least chunk/2 elements goes alone, cut into
    messages of at most `chunk` (a view on both ends: no copy); smaller ones are packed
    together up to `chunk` elements. Sender and receiver compute the same plan.
    """
    chunk = max(1, int(chunk))
    by_dtype: dict[str, list[int]] = {}
    for i, d in enumerate(seg_descs):
        if d[3] > 0:
            by_dtype.setdefault(d[4], []).append(i)
    plan: list[tuple[str, list[tuple]]] = []
    for dt in sorted(by_dtype):
        pack: list[tuple] = []
        packed = 0
        for i in by_dtype[dt]:
            n = seg_descs[i][3]
            if 2 * n >= chunk:
                for off in range(0, n, chunk):
                    plan.append((dt, [(i, off, min(chunk, n - off))]))
                continue
            if packed + n > chunk:
                plan.append((dt, pack))
                pack, packed = [], 0
            pack.append((i, 0, n))
            packed += n
        if pack:
            plan.append((dt, pack))
    return plan


# Up to this many ranks a small all-reduce on gloo is one all_to_all (see small_all_reduce)
SMALL_ALL_TO_ALL_MAX_WORLD = 64


def small_all_reduce(vec: torch.Tensor, op, group) -> None:
    """`vec` (a few numbers: flags, digests, norm terms) reduced over `group` in place, by
    the fewest sequential hops the backend offers. On gloo (up to 64 ranks) one all_to_all:
    every rank sends its vector to every other rank directly, one hop, where gloo's ring
    all-reduce takes 2(W-1) in turn (measured behind netlab's rate-limited links: 2.5
    against 5.4-7.5 ms at world 4, 5.4 against 14 ms at world 8), then the reduction here;
    elsewhere (NCCL's small all-reduce is latency-optimized already) all_reduce."""
    world = dist.get_world_size(group)
    if dist.get_backend(group) != "gloo" or world > SMALL_ALL_TO_ALL_MAX_WORLD:
        dist.all_reduce(vec, op=op, group=group)
        return
    every = torch.empty(world * vec.numel(), dtype=vec.dtype, device=vec.device)
    dist.all_to_all_single(every, vec.repeat(world), group=group)
    rows = every.view(world, vec.numel())
    if op == dist.ReduceOp.MAX:
        vec.copy_(rows.max(dim=0).values)
    elif op == dist.ReduceOp.SUM:
        vec.copy_(rows.sum(dim=0))
    else:
        raise ValueError(f"small_all_reduce: unsupported op {op}")


def backend_device(group) -> torch.device:
    """Where tensors handed to `group`'s collectives must live (NCCL: the current GPU)."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Staging:
    """Per dtype, one buffer as big as the largest message that cannot go as a view (at
    most one chunk), allocated on first use; one dtype at a time (the plan is sorted)."""

    def __init__(self, plan: list, direct, device: torch.device):
        self.device, self.bufs, self.need = device, {}, {}
        for k, (dt, parts) in enumerate(plan):
            if not direct(k):
                self.need[dt] = max(self.need.get(dt, 0), sum(n for _, _, n in parts))

    def get(self, dtype: str, n: int) -> torch.Tensor:
        if dtype not in self.bufs:
            self.bufs.clear()
            self.bufs[dtype] = torch.empty(self.need[dtype], dtype=_dtype(dtype),
                                           device=self.device)
        return self.bufs[dtype][:n]


def _messages(plan: list, tensors: list[torch.Tensor], dev: torch.device):
    """Each message of `plan` as (buffer, parts, staged): the tensor's own slice when the
    message is one segment already on the transport device, else a staging buffer that the
    caller packs before sending (or unpacks after receiving)."""
    def direct(k):
        parts = plan[k][1]
        return len(parts) == 1 and tensors[parts[0][0]].device == dev

    staging = _Staging(plan, direct, dev)
    for k, (dt, parts) in enumerate(plan):
        if direct(k):
            i, off, n = parts[0]
            yield tensors[i][off:off + n], parts, False
        else:
            yield staging.get(dt, sum(n for _, _, n in parts)), parts, True


def send_segments(group, tensors: list[torch.Tensor], descs: list[tuple], dst: int,
                  chunk: int) -> None:
    """Send 1-D `tensors` (described by `descs`: (.., .., .., length, dtype name, ..)) to
    group rank `dst`, which calls recv_segments with the same descs."""
    backend = dist.get_backend(group)
    dst = dist.get_global_rank(group, dst)
    for buf, parts, staged in _messages(message_plan(descs, chunk), tensors,
                                        backend_device(group)):
        if staged:
            pos = 0
            for i, off, n in parts:
                buf[pos:pos + n].copy_(tensors[i][off:off + n])
                pos += n
        dist.send(wire_view(buf, backend), dst=dst, group=group)


def recv_segments(group, seg_descs: list[tuple], dests: list[torch.Tensor], src: int,
                  chunk: int) -> None:
    """Receive what group rank `src` sends with send_segments into `dests`."""
    backend = dist.get_backend(group)
    src = dist.get_global_rank(group, src)
    for buf, parts, staged in _messages(message_plan(seg_descs, chunk), dests,
                                        backend_device(group)):
        dist.recv(wire_view(buf, backend), src=src, group=group)
        if staged:
            pos = 0
            for i, off, n in parts:
                dests[i][off:off + n].copy_(buf[pos:pos + n])
                pos += n


