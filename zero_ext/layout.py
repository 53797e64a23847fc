"""Who owns which parameter elements, and where each parameter sits in a flat bucket.

A bucket is one flat buffer per (device, dtype) of the params added in one constructor or
`add_param_group` call. Every rank owns one contiguous range of each bucket:
- "param" mode: whole params; the bucket is ordered by owner rank, so a rank's params are
  adjacent. Ownership comes from `kernels.assign_params` (never worse balanced than torch).
- "flat" mode: the bucket is in global param order and cut into equal ranges, so params may
  straddle ranks. Balance is total/world, whatever the largest param.
The sync exchanges each rank's range; the optimizer steps its own.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from . import kernels

PARAM, FLAT = "param", "flat"


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


def assign_owners(numels: list[int], group_ids: list[int], world: int) -> list[int]:
    """Whole-param owners for the constructor's params (balanced over all of them)."""
    return kernels.assign_params(numels, group_ids, world)


def extend_owners(loads: list[int], numels: list[int]) -> list[int]:
    """Owners for params added later: sorted greedy on top of the current loads, so that
    params already placed (and their optimizer state) never move."""
    loads = list(loads)
    out = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(len(loads)), key=lambda r: (loads[r], r))
        out[i] = r
        loads[r] += numels[i]
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
        by_storage.setdefault((p.device, s.data_ptr()), []).append(i)
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
