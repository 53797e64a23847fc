"""The shard plan: who owns which parameter elements, where each sits in a flat bucket,
and what this rank's local optimizer steps. Built once per layout change (construction,
add_param_group, a change of trainable params with bucket views); every other module reads
the plan (`ShardPlan`) instead of the optimizer's internals.

A bucket is one flat buffer per (device, dtype) of the params added in one constructor or
`add_param_group` call. Every rank owns one contiguous range of each bucket:
- "param" mode: whole params; the bucket is ordered by owner rank, so a rank's params are
  adjacent. Ownership comes from `kernels.assign_params` (never worse balanced than torch).
- "flat" mode: the bucket is in global param order and cut into equal ranges, so params may
  straddle ranks. Balance is total/world, whatever the largest param.
- "even" mode: every param is a bucket of its own, cut into `world` equal ranges (the last
  ones shorter, which rank takes which chunk then rotating with the param's index), so every
  rank owns 1/world of every param: any set of params (a DDP bucket) is split evenly over
  the ranks, up to one element per param, and so are the collectives that move it.
The sync exchanges each rank's range; the optimizer steps its own.
"""
from __future__ import annotations

import bisect
import hashlib
import heapq
from dataclasses import dataclass, field

import torch

from . import kernels

PARAM, FLAT, EVEN = "param", "flat", "even"
SPLIT_MODES = (FLAT, EVEN)  # modes that split params between ranks (elementwise only)


@dataclass
class Piece:
    """A contiguous run of one param's elements inside a bucket."""

    param_id: int       # global index (torch's state-dict numbering)
    start: int          # first element inside the param (flattened)
    length: int
    bucket_start: int   # where that element sits in the bucket


@dataclass
class Bucket:
    device: torch.device
    dtype: torch.dtype
    param_ids: list[int]             # global indices, in buffer order
    offsets: list[int]               # start of each param in the buffer, ascending
    numels: list[int]
    rank_ranges: list[tuple[int, int]]  # [start, end) of the buffer owned by each rank
    numel: int                       # buffer size, padding included
    _pieces: dict = field(default_factory=dict, repr=False)

    def pieces(self, rank: int) -> list[Piece]:
        """Params (or parts of them) inside `rank`'s range, in buffer order."""
        if rank not in self._pieces:
            lo, hi = self.rank_ranges[rank]
            out = []
            i = max(0, bisect.bisect_right(self.offsets, lo) - 1)
            while i < len(self.param_ids) and self.offsets[i] < hi:
                start, end = self.offsets[i], self.offsets[i] + self.numels[i]
                a, b = max(start, lo), min(end, hi)
                if b > a:
                    out.append(Piece(self.param_ids[i], a - start, b - a, a))
                i += 1
            self._pieces[rank] = out
        return self._pieces[rank]



def _group_by_key(params: list[torch.Tensor], ids: list[int]) -> dict:
    by_key: dict = {}
    for pid in ids:
        p = params[pid]
        by_key.setdefault((p.device, p.dtype), []).append(pid)
    return by_key


def param_mode_buckets(params, ids, owner, world) -> list[Bucket]:
    """Buckets of `ids` (global indices), each rank's params adjacent and aligned."""
    buckets = []
    for (device, dtype), key_ids in _group_by_key(params, ids).items():
        align = kernels.flatten.alignment_elems(dtype)
        ordered = sorted(key_ids, key=lambda pid: (owner[pid], pid))
        numels = [params[pid].numel() for pid in ordered]
        offsets, total = kernels.aligned_offsets(numels, align)
        ranges, pos = [], 0
        for r in range(world):
            start = pos
            while pos < len(ordered) and owner[ordered[pos]] == r:
                pos += 1
            lo = offsets[start] if start < len(ordered) else total
            hi = offsets[pos] if pos < len(ordered) else total
            ranges.append((lo, hi))
        buckets.append(Bucket(device, dtype, ordered, offsets, numels, ranges, total))
    return buckets


def flat_mode_buckets(params, ids, world) -> list[Bucket]:
    """Buckets of `ids` in global order, cut into `world` equal aligned ranges."""
    buckets = []
    for (device, dtype), key_ids in _group_by_key(params, ids).items():
        align = kernels.flatten.alignment_elems(dtype)
        numels = [params[pid].numel() for pid in key_ids]
        offsets = kernels.flat_offsets(numels, world, align)
        total = offsets[-1]
        shard = total // world
        ranges = [(r * shard, (r + 1) * shard) for r in range(world)]
        buckets.append(Bucket(device, dtype, list(key_ids), list(offsets[:-1]), numels,
                              ranges, total))
    return buckets


def even_mode_buckets(params, ids, world) -> list[Bucket]:
    """One bucket per param of `ids`, cut into `world` chunks of ceil(n / world) elements
    (the last ones shorter or empty). Equal chunks go to the ranks in order; otherwise
    param i's chunk j goes to rank (i + j) % world, so that the short chunks rotate over
    the ranks instead of always landing on the last ones. No alignment padding (the pieces
    are views of the params' own memory)."""
    buckets = []
    for pid in ids:
        p = params[pid]
        n = p.numel()
        c = -(-n // world)
        # Equal chunks stay in rank order: the r-th of W equal blocks is where an all-gather
        # or a reduce-scatter puts rank r's, so the param is exchanged in its own memory.
        first = 0 if n % world == 0 else pid % world
        ranges = [(0, 0)] * world
        for j in range(world):
            ranges[(first + j) % world] = (min(j * c, n), min((j + 1) * c, n))
        buckets.append(Bucket(p.device, p.dtype, [pid], [0], [n], ranges, n))
    return buckets


def assign_owners(numels: list[int], group_ids: list[int], world: int) -> list[int]:
    """Whole-param owners for the constructor's params (balanced over all of them)."""
    return kernels.assign_params(numels, group_ids, world)


def extend_owners(loads: list[int], numels: list[int]) -> list[int]:
    """Owners for params added later: sorted greedy on top of the current loads, so that
    params already placed (and their optimizer state) never move."""
    # Least-loaded rank by a heap of (load, rank): the lowest rank on ties, as min() over
    # every rank would pick, in O(log world) per param instead of O(world).
    heap = [(int(load), r) for r, load in enumerate(loads)]
    heapq.heapify(heap)
    out = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        load, r = heap[0]
        out[i] = r
        heapq.heapreplace(heap, (load + numels[i], r))
    return out


def _extent(p: torch.Tensor) -> int:
    """Elements from the first to one past the last element of `p` in its storage."""
    if p.numel() == 0:
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(p.shape, p.stride()))


def find_aliases(params: list[torch.Tensor]) -> dict[int, int]:
    """Params that are distinct objects over the same memory (the old tying idiom
    ``head.weight.data = emb.weight.data``): {index: index of the first such param}.

    A torch optimizer steps each of them, both updates landing in the one storage; we can
    reproduce that only if one rank steps all of them. Views of one storage that overlap
    without being identical cannot be sharded at all: ValueError.
    """
    by_storage: dict = {}
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        s = p.untyped_storage()
        # Meta tensors have no memory (every data_ptr is 0): tell their storages apart by
        # identity instead, so that views of one meta storage still count as aliases.
        where = s._cdata if p.device.type == "meta" else s.data_ptr()
        by_storage.setdefault((p.device, where), []).append(i)
    aliases: dict[int, int] = {}
    for ids in by_storage.values():
        if len(ids) < 2:
            continue
        spans = []
        for i in ids:
            p = params[i]
            lo = p.storage_offset() * p.element_size()
            spans.append((lo, lo + _extent(p) * p.element_size(), i))
        spans.sort()
        for (lo_a, hi_a, a), (lo_b, hi_b, b) in zip(spans, spans[1:]):
            pa, pb = params[a], params[b]
            if lo_b >= hi_a:
                continue  # disjoint parts of one buffer (e.g. bucket views): fine
            same = (lo_a == lo_b and pa.shape == pb.shape and pa.stride() == pb.stride()
                    and pa.dtype == pb.dtype)
            if not same:
                raise ValueError(
                    f"parameters {a} and {b} overlap in memory without being the same "
                    "tensor; a sharded optimizer cannot update them consistently. Tie "
                    "weights by sharing one Parameter (`head.weight = emb.weight`).")
            first = min(a, b, aliases.get(a, a), aliases.get(b, b))
            aliases[max(a, b)] = first
    # point every member at the first of its set
    for i in sorted(aliases):
        aliases[i] = aliases.get(aliases[i], aliases[i])
    return aliases


def chunk_bounds(lo: int, hi: int, chunks: int, align: int) -> list[tuple[int, int]]:
    """Split [lo, hi) into `chunks` aligned pieces (some may be empty)."""
    n = hi - lo
    cuts = [lo + min(n, -(-(n * k // chunks) // align) * align) for k in range(chunks)] + [hi]
    return [(cuts[k], cuts[k + 1]) for k in range(chunks)]


@dataclass
class LocalPiece:
    """One tensor this rank's local optimizer steps, its state living under `key`: a whole
    param in "param" mode, a 1-D view of a run of one param's elements in "flat" mode, or
    (`host`, offload_optimizer) a host tensor of its own that stands in for those elements
    (offload.HostShard: copied from the param before the step, into it after)."""

    key: torch.Tensor
    param_id: int        # global index (torch's state-dict numbering)
    start: int           # first element inside the param (flattened)
    length: int
    group: int
    bucket: int          # index into ShardPlan.buckets; -1 when outside every bucket
    bucket_start: int    # where `start` sits in that bucket
    host: bool = False   # the key is a host copy (offload_optimizer), not the param's memory


@dataclass
class ShardPlan:
    """The whole layout of one ZeroRedundancyOptimizer (see the module docstring)."""

    sharding: str                     # PARAM, FLAT or EVEN
    world_size: int
    rank: int
    bucket_view: bool
    params: list[torch.Tensor]        # every param, in the user's group order
    group_of: list[int]               # global group of every param
    alias_of: dict[int, int]          # param over another's memory -> the first one
    owner: list[int] = field(default_factory=list)   # PARAM mode: rank of every param
    generations: list[list[int]] = field(default_factory=list)  # ids per ctor/add call
    buckets: list[Bucket] = field(default_factory=list)
    local: list[LocalPiece] = field(default_factory=list)
    chunks: int = 1                   # chunks of the local step (overlapped exchange)

    # ---------------------------------------------------------------- building

    def add_generation(self, ids: list[int], initial: bool) -> None:
        """Place params `ids` (all new): owners (PARAM mode), buckets, local pieces."""
        # A param over another's memory weighs nothing and goes to that param's owner.
        numels = [0 if i in self.alias_of else self.params[i].numel() for i in ids]
        if self.sharding == PARAM:
            if initial:
                owners = assign_owners(numels, [self.group_of[i] for i in ids],
                                       self.world_size)
            else:
                owners = extend_owners(self.rank_loads(), numels)
            self.owner.extend(owners)
            for i in ids:
                if i in self.alias_of:
                    self.owner[i] = self.owner[self.alias_of[i]]
        self.generations.append(ids)
        self._add_buckets(ids)

    def rebuild_buckets(self) -> None:
        """After params were frozen or unfrozen (PARAM mode with bucket views)."""
        self.buckets = []
        for ids in self.generations:
            self._add_buckets(ids)

    def _add_buckets(self, ids: list[int]) -> None:
        if self.sharding == PARAM:
            # A param over another's memory is exchanged as part of that one. Frozen params
            # stay out of bucket views (their buffers are exchanged every step); without
            # views they are in the plan and travel only in a step that updated one (a
            # torch optimizer steps a frozen param that still holds a grad).
            placed = [i for i in ids if i not in self.alias_of
                      and (self.trainable(i) or not self.bucket_view)]
            self.buckets += param_mode_buckets(self.params, placed, self.owner,
                                               self.world_size)
        elif self.sharding == EVEN:
            self.buckets += even_mode_buckets(self.params, ids, self.world_size)
        else:
            self.buckets += flat_mode_buckets(self.params, ids, self.world_size)

    def bind_local(self) -> None:
        """The local pieces of every param placed so far (keys of new pieces only: a key
        that exists keeps its identity, the local optimizer's state lives under it). Call
        after bucket views were attached: flat keys view the params' current memory."""
        old = {(lp.param_id, lp.start): lp for lp in self.local}
        local: list[LocalPiece] = []
        for pid, start, length, bi, bucket_start in self.pieces_of(self.rank):
            prev = old.get((pid, start))
            if self.sharding == PARAM:
                key = self.params[pid]
            elif prev is not None:
                key = prev.key
            else:
                key = self.element_view(pid, start, length)
            local.append(LocalPiece(key, pid, start, length, self.group_of[pid], bi,
                                    bucket_start))
        self.local = local

    def pieces_of(self, rank: int) -> list[tuple[int, int, int, int, int]]:
        """What rank `rank`'s local optimizer steps, as (param_id, start, length, bucket,
        bucket_start): its range of every bucket, then ("param" mode) the params it owns
        outside the buckets (frozen ones with bucket views, params over another's memory),
        which still step when they hold a grad, as in torch (bucket -1)."""
        out, placed = [], set()
        for bi, b in enumerate(self.buckets):
            for pc in b.pieces(rank):
                placed.add(pc.param_id)
                out.append((pc.param_id, pc.start, pc.length, bi, pc.bucket_start))
        if self.sharding == PARAM:
            for pid, r in enumerate(self.owner):
                if r == rank and pid not in placed:
                    out.append((pid, 0, self.params[pid].numel(), -1, 0))
        return out

    def rebind(self, param_ids: set[int]) -> None:
        """Flat mode: re-point the keys of these params at their current memory (after
        `p.data = t`); the key objects, and so the optimizer state, stay."""
        if self.sharding not in SPLIT_MODES:
            return
        for lp in self.local:
            if lp.param_id in param_ids and not lp.host:  # (a host key is memory of its own)
                lp.key.data = self.element_view(lp.param_id, lp.start, lp.length)

    # ---------------------------------------------------------------- reading

    def trainable(self, pid: int) -> bool:
        """Whether param `pid`'s memory can change in a step: it requires grad, or a param
        over the same memory does (a frozen param tied to a trained one)."""
        if self.params[pid].requires_grad:
            return True
        first = self.alias_of.get(pid, pid)
        return any(self.params[i].requires_grad
                   for i in [first] + [i for i, f in self.alias_of.items() if f == first])

    def element_view(self, pid: int, start: int, length: int) -> torch.Tensor:
        """Elements [start, start+length) of param `pid` (flattened), as a view of its
        current memory (the whole strided param when it is not contiguous)."""
        p = self.params[pid].detach()
        if start == 0 and length == p.numel() and not p.is_contiguous():
            return p
        return p.view(-1)[start:start + length]

    def local_order(self, rank: int) -> list[tuple[int, int, int, int]]:
        """(group, param_id, start, length) of every piece rank `rank`'s local optimizer
        steps, in that optimizer's order: group by group, global param order within a group
        (params over one memory are stepped in torch's order). The one definition of that
        order, for this rank (local_pieces) and for any other (state dicts cut for it)."""
        return sorted((self.group_of[pid], pid, start, length)
                      for pid, start, length, _, _ in self.pieces_of(rank))

    def local_pieces(self, gi: int) -> list[LocalPiece]:
        """This rank's pieces of global group gi, in the local optimizer's order."""
        at = {(lp.param_id, lp.start): lp for lp in self.local}
        return [at[(pid, start)] for g, pid, start, _ in self.local_order(self.rank) if g == gi]

    def digest(self) -> int:
        """60 bits of a hash of what decides every rank's pieces (modes, owners, buckets):
        equal on two optimizers whose shards line up piece for piece."""
        text = repr((self.sharding, self.world_size, self.owner, self.group_of,
                     [(str(b.dtype), b.param_ids, b.offsets, b.numels, b.rank_ranges)
                      for b in self.buckets],
                     [tuple(p.shape) for p in self.params]))
        return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)

    def local_keys(self, gi: int) -> list[torch.Tensor]:
        return [lp.key for lp in self.local_pieces(gi)]

    def rank_loads(self) -> list[int]:
        return kernels.partition.rank_loads([p.numel() for p in self.params], self.owner,
                                            self.world_size)

    @property
    def local_numel(self) -> int:
        if self.sharding == PARAM:
            return sum(p.numel() for p, r in zip(self.params, self.owner) if r == self.rank)
        return sum(lp.length for lp in self.local)

    def chunk_ranges(self, bi: int, r: int) -> list[tuple[int, int]]:
        """Rank r's range of bucket bi cut into the step's chunks."""
        b = self.buckets[bi]
        lo, hi = b.rank_ranges[r]
        return chunk_bounds(lo, hi, self.chunks, kernels.flatten.alignment_elems(b.dtype))
