"""How reduce_scatter_hook moves a segment of a DDP bucket: the collectives, on which lane,
in which order, into which scratch.

- On NCCL, where the owners' shares of the segment are near equal ("even" mode), one
  `reduce_scatter_single` of W equal blocks (each rank's runs packed into its block, the sum
  on the wire in the grads' dtype as DDP's all-reduce sums; float16 divided first).
- Elsewhere one `all_to_all_single` with split sizes, then a local sum: on gloo it costs
  less than a reduce-scatter, which costs a whole all-reduce there, and it moves raw bytes
  (bf16 too) while the sum runs here in float32 for bf16/fp16 grads.
- Hybrid layouts: each owned sum is then all-reduced over the replica group, in segment
  order on every rank.
- Consecutive segments alternate between the exchange's lanes, at most one in flight per
  lane; the scratch is kept per lane from one segment and one iteration to the next (on
  the CPU in mappings of its own, outside malloc's heap).
- On the all_to_all a rank's own share does not travel (but where the send is a slice of
  the bucket with the share in its middle): the sum reads it in the bucket.
"""
# (no `from __future__ import annotations`: kept alike with the hook's module)
import collections
import mmap
import os
import threading

import torch
import torch.distributed as dist

from ..sync import reduce_scatter_single, wire_view
from .plan import Segment


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


def reduces_by_scatter(buf: torch.Tensor, backend: str, splits: list) -> bool:
    """Whether a segment of `buf` with these owners' `splits` travels by
    reduce_scatter_tensor over a group of `backend` (decided from the plan: alike on every
    rank)."""
    if TRANSPORT not in TRANSPORTS:
        raise ValueError(f"ZERO_EXT_HOOK_TRANSPORT must be one of {TRANSPORTS}, got "
                         f"{TRANSPORT!r}")
    if TRANSPORT != "auto":
        return TRANSPORT == "reduce_scatter"
    padded = len(splits) * max(splits)
    return (buf.is_cuda and "nccl" in backend
            and padded <= (1 + REDUCE_SCATTER_MAX_PADDING) * sum(splits))


class Transfers:
    """The hook's collectives for one optimizer: segments issued in order on the lanes of
    its exchange, their scratch, and (hybrid) the replica all-reduces in issue order."""

    def __init__(self, seam, world: int, rank: int):
        self.seam = seam
        self.world, self.rank = world, rank
        self.replica_group = None  # hybrid: the owned sums are all-reduced over it
        self.seq = 0            # the hook's segments since the last step (issue order)
        self.ordered = _InOrder()
        self.in_flight: dict = {}  # lane -> the future of its last segment
        self._backends: dict = {}  # id(lane group) -> its backend's name, lower case
        # lane -> how many times its scratch was replaced (the segments' views name it)
        self.grown: "collections.defaultdict[int, int]" = collections.defaultdict(int)
        # Scratch per lane, (lane, name, dtype, device) -> buffer, grown to the largest
        # bucket: bounded by the buckets in flight (one per lane), not one set per bucket,
        # and kept from one backward to the next (a fresh multi-MB buffer per bucket per
        # iteration costs its page faults every time: on gloo, 2 ranks, 33.6M fp32
        # elements, a reduce-scatter took 105 ms with kept buffers, 200-265 ms with fresh)
        self.scratch: dict = {}
        # Buffers the scratch outgrew, kept until the next step: a finished collective's
        # work may still hold views of them on the backend's thread, which must not be the
        # one to free them (freeing a mapped buffer takes the GIL)
        self.outgrown: list = []

    def _backend_of(self, group) -> str:
        """A lane's backend name, asked of torch once per lane (~20 us a call)."""
        name = self._backends.get(id(group))
        if name is None:
            name = self._backends[id(group)] = str(dist.get_backend(group)).lower()
        return name

    def scatters(self, buf: torch.Tensor, splits: list) -> bool:
        """Whether a bucket like `buf` with these owners' `splits` travels by
        reduce_scatter_tensor (plan.cut counts its segments by what that receives)."""
        return reduces_by_scatter(buf, self._backend_of(self.seam.lanes[0]), splits)

    def restart(self) -> None:
        """At a step: no transfer is in flight (DDP waited for every one before its
        backward returned); the next backward issues afresh."""
        self.seq, self.ordered, self.in_flight = 0, _InOrder(), {}
        self.outgrown = []

    def reduce(self, buf: torch.Tensor, segments: list) -> torch.futures.Future:
        """The future of `buf` (a DDP bucket) once every segment's owned sum is in it."""
        if self.world == 1 and self.replica_group is None:
            # (nothing to send, nothing to average: the bucket is its own sum)
            done = _future_on(buf)
            done.set_result(buf)
            return done
        futs = [self._reduce_segment(buf, seg) for seg in segments]
        if len(futs) == 1:
            return futs[0]
        # (a future made here knows no CUDA streams unless told: DDP would read the bucket
        # before the segments' sums on other streams are done)
        result = _future_on(buf)
        torch.futures.collect_all(futs).then(lambda f: _settle(
            result, lambda: ([x.wait() for x in f.wait()], buf)[1]))
        return result

    def _reduce_segment(self, buf: torch.Tensor, seg: Segment) -> torch.futures.Future:
        seq, self.seq = self.seq, self.seq + 1
        me = self.rank
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
        total = self.world * (1 if replicas is None else dist.get_world_size(replicas))
        group = lanes[lane]
        backend = self._backend_of(group)
        if reduces_by_scatter(buf, backend, seg.splits):
            work, owned_sum, write_back = self._issue_reduce_scatter(group, lane, buf, seg,
                                                                     me, total)
        else:
            work, owned_sum, write_back = self._issue_all_to_all(
                group, backend, lane, buf, seg, me, total, direct=replicas is None)

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

    def _issue_all_to_all(self, group, backend: str, lane: int, buf: torch.Tensor,
                          seg: Segment, me: int, total: int, direct: bool):
        """Every rank's runs to their owner in one all_to_all (raw bytes: any dtype on
        gloo), then the W copies summed here. Returns the work, the function that gives
        this rank's sum in run order (None: already summed into the runs of `buf`), and
        the one that writes that sum, divided by `total`, into the bucket.

        This rank's own share does not travel: it is read from `buf` where the sum needs
        it (a send that must be packed leaves it out; a send that is a slice of the bucket
        leaves it out when it is at an end), so the scratch holds the other W - 1 shares
        (at world 2 half of it) and nothing is copied to itself.

        Each step is one tensor op over all the runs (torch.cat, the _foreach ops), on
        views made once per bucket buffer and scratch (_AllToAllViews)."""
        v = seg.views.get(lane)
        if v is None or v.key != (buf.data_ptr(), self.grown[lane]):
            v = seg.views[lane] = self._all_to_all_views(lane, buf, seg, me, backend, direct)
        if v.send_parts:
            torch.cat(v.send_parts, out=v.send)
        work = dist.all_to_all_single(v.wire_recv, v.wire_send,
                                      output_split_sizes=v.out_splits,
                                      input_split_sizes=v.in_splits, group=group,
                                      async_op=True)
        direct, home, acc = v.direct, v.home, v.acc

        # The own share that stayed home is the first part: the sum is written over it,
        # so it must be read first. (Float addition commutes: at world 2 the sum is bitwise
        # the rank-order one; from world 3 the order of its additions depends on `me`.)
        def owned_sum():
            if direct:  # into this rank's runs of the bucket, rank by rank
                rows = v.rows
                if not home:
                    torch._foreach_copy_(v.own, rows[0])
                    rows = rows[1:]
                for row in rows:
                    torch._foreach_add_(v.own, row)
                return None
            rows = v.recv_rows  # (whole rows: contiguous; add_ into float32 sums in it)
            if home:  # this rank's runs, packed into the sum (float32 if low)
                torch._foreach_copy_(v.acc_parts, v.own)
            else:
                acc.copy_(rows[0])
                rows = rows[1:]
            for row in rows:
                acc.add_(row)
            return acc

        def write_back(summed) -> torch.Tensor:
            if summed is None:  # (direct: in the runs already)
                torch._foreach_div_(v.own, total)
                return buf
            summed.div_(total)
            torch._foreach_copy_(v.own, v.acc_parts)
            return buf

        return work, owned_sum, write_back

    def _all_to_all_views(self, lane: int, buf: torch.Tensor, seg: Segment, me: int,
                          backend: str, direct: bool) -> "_AllToAllViews":
        """What one segment's all_to_all needs of the bucket and of the lane's scratch,
        made when either is new (kept while DDP keeps its bucket buffer and the lane its
        scratch)."""
        world, mine = len(seg.splits), seg.splits[me]
        low = buf.dtype in (torch.bfloat16, torch.float16)  # summed in float32
        # full-precision sums without replicas go straight into this rank's runs of the
        # bucket; bf16/fp16 ones are summed in float32, hybrid ones all-reduced first
        direct = direct and not low
        size = sum(seg.splits)
        # (in place with the share in the middle: it travels to itself, as it must then)
        home = world > 1 and (not seg.in_place or me in (0, world - 1))
        in_splits = list(seg.splits)
        out_splits = [mine] * world
        if home:
            in_splits[me] = out_splits[me] = 0
        if seg.in_place:
            send = buf[seg.start:seg.start + size]
            if home:
                send = send[mine:] if me == 0 else send[:size - mine]
        else:
            send = self._scratch(lane, "send", sum(in_splits), buf)
        recv = self._scratch(lane, "recv", sum(out_splits), buf)
        acc = None if direct else self._scratch(lane, "sum", mine, buf,
                                                torch.float32 if low else buf.dtype)
        return _AllToAllViews((buf.data_ptr(), self.grown[lane]), buf, seg, me, home,
                              direct, in_splits, out_splits, send, recv, acc, backend)

    def _issue_reduce_scatter(self, group, lane: int, buf: torch.Tensor, seg: Segment,
                              me: int, total: int):
        """One `reduce_scatter_tensor` (NCCL's: every link does equal work, the sum on the
        wire in the grads' dtype, as DDP's all-reduce sums): rank r's runs packed into the
        r-th of W equal blocks (the largest rank's share; the rest of a block is padding
        nobody reads). With a single owned run of the block's length the output is that
        run of the bucket itself. float16 grads are divided by `total` once packed, before
        the sum (as DDP divides before its all-reduce): W copies summed on the wire would
        overflow from 65504 / W. Returns the work, the function that gives this rank's
        sum, and the one that writes it, divided, into the bucket."""
        mine = seg.splits[me]
        first = buf.dtype == torch.float16
        v = seg.views.get(lane)
        if v is None or v.key != (buf.data_ptr(), self.grown[lane]):
            v = seg.views[lane] = self._reduce_scatter_views(lane, buf, seg, me, group)
        send, out, straight = v.send, v.out, v.straight
        if v.blocks:
            torch._foreach_copy_(v.blocks, v.runs)
            if first:
                send.div_(total)
        work = reduce_scatter_single(out, send, group=group, async_op=True)

        def owned_sum():
            return out[:mine]

        def write_back(summed) -> torch.Tensor:
            if not first:
                summed.div_(total)
            if not straight:
                torch._foreach_copy_(v.own, v.out_parts)
            return buf

        return work, owned_sum, write_back

    def _reduce_scatter_views(self, lane: int, buf: torch.Tensor, seg: Segment, me: int,
                              group) -> "_ReduceScatterViews":
        """What one segment's reduce_scatter needs of the bucket and of the lane's scratch
        (see _all_to_all_views)."""
        world, mine = len(seg.splits), seg.splits[me]
        block = max(seg.splits)
        first = buf.dtype == torch.float16
        packed = not (seg.in_place and all(n == block for n in seg.splits) and not first)
        send = (self._scratch(lane, "send", block * world, buf) if packed
                else buf[seg.start:seg.start + block * world])
        # (an output inside the input is NCCL's in-place form; gloo is not promised it, but
        # torch 2.14's gloo gives the right sums for it, so the transport forced on gloo
        # runs NCCL's form exactly: tests/test_nccl_paths.py)
        straight = (len(seg.runs[me]) == 1 and mine == block
                    and (send.data_ptr() != buf.data_ptr() + seg.start * buf.element_size()
                         or _is_nccl(group) or TRANSPORT == "reduce_scatter"))
        out = (buf[seg.runs[me][0][0]:seg.runs[me][0][0] + block] if straight
               else self._scratch(lane, "recv", block, buf))
        return _ReduceScatterViews((buf.data_ptr(), self.grown[lane]), buf, seg, me,
                                   send, packed, out, straight)

    def _scratch(self, lane: int, name: str, n: int, like: torch.Tensor,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = like.dtype if dtype is None else dtype
        key = (lane, name, dtype, like.device)
        buf = self.scratch.get(key)
        if buf is None or buf.numel() < n:
            if buf is not None:
                self.outgrown.append(buf)
            buf = self.scratch[key] = (_mapped_empty(n, dtype) if like.device.type == "cpu"
                                       else torch.empty(n, dtype=dtype, device=like.device))
            self.grown[lane] += 1  # (the segments' views of the old one are stale)
        return buf[:n]


def _mapped_empty(n: int, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of `n` elements in an anonymous mapping of its own, not in malloc's heap.
    The scratch lives for the whole run: in the heap it was placed among the grads that
    `zero_grad(set_to_none=True)` frees and backward allocates again each iteration, and
    pinned the heap's memory around it (glibc's dynamic mmap threshold puts blocks below
    the largest one freed, 16 MB weight grads here, in the heap). Measured on the 33.6M MLP
    at world 2 with 8 MB segments: peak RSS over plain zero_ext +13..+78 MB in the heap (6
    repeats), -22..+57 mapped (9). The mapping is freed (munmap) with the last tensor
    viewing it."""
    itemsize = dtype.itemsize
    # (private: a forked child writes its own copy, as with malloc's memory; zero pages,
    # touched only when written)
    pages = mmap.mmap(-1, max(n, 1) * itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype)[:n]


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


def _runs_of(buf: torch.Tensor, runs) -> list:
    return [buf[o:o + n] for o, n in runs]


class _AllToAllViews:
    """One segment's all_to_all over one bucket buffer and the scratch of its lane (`key`:
    the buffer's address, the lane's scratch generation): the split sizes, the send and
    receive tensors as they go on the wire, and the views that make each step of the
    segment one tensor op over all its runs. DDP keeps its bucket buffers from one backward
    to the next and the lanes keep their scratch, so these are made once."""

    __slots__ = ("key", "home", "direct", "in_splits", "out_splits", "send", "acc",
                 "wire_send", "wire_recv", "send_parts", "own", "rows", "recv_rows",
                 "acc_parts")

    def __init__(self, key, buf, seg: Segment, me: int, home: bool, direct: bool,
                 in_splits, out_splits, send, recv, acc, backend: str):
        self.key, self.home, self.direct = key, home, direct
        self.in_splits, self.out_splits = in_splits, out_splits
        self.send, self.acc = send, acc
        self.wire_send, self.wire_recv = wire_view(send, backend), wire_view(recv, backend)
        mine = seg.splits[me]
        lengths = [n for _, n in seg.runs[me]]
        # the runs this rank packs into the send scratch, in its order (its own left out
        # when it stays home); none when the send is a slice of the bucket
        self.send_parts = ([] if seg.in_place else
                           [buf[o:o + n] for r, rr in enumerate(seg.runs)
                            if not (home and r == me) for o, n in rr])
        self.own = _runs_of(buf, seg.runs[me])
        self.recv_rows = list(recv.view(-1, mine).unbind(0)) if mine else []
        self.rows = [list(row.split(lengths)) for row in self.recv_rows]
        self.acc_parts = [] if acc is None else list(acc.split(lengths))


class _ReduceScatterViews:
    """One segment's reduce_scatter (see _AllToAllViews): its send (packed scratch or a
    slice of the bucket) and output (scratch, or this rank's run of the bucket itself:
    `straight`), where each run goes in the packed send, and this rank's runs."""

    __slots__ = ("key", "send", "out", "straight", "runs", "blocks", "own", "out_parts")

    def __init__(self, key, buf, seg: Segment, me: int, send, packed: bool, out,
                 straight: bool):
        self.key, self.send, self.out, self.straight = key, send, out, straight
        block = max(seg.splits)
        self.runs, self.blocks = [], []
        if packed:
            for r, rr in enumerate(seg.runs):
                pos = r * block
                for o, n in rr:
                    self.runs.append(buf[o:o + n])
                    self.blocks.append(send[pos:pos + n])
                    pos += n
        self.own = _runs_of(buf, seg.runs[me])
        # (the owned sum, out[:mine], as this rank's runs)
        self.out_parts = list(out[:seg.splits[me]].split([n for _, n in seg.runs[me]]))
