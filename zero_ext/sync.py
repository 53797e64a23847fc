"""After the local step, every rank's updated range of every bucket reaches every rank.

All transport is torch.distributed. Choice of collective per backend, from measurement
(DESIGN.md §6): on gloo one broadcast per rank range beats all_gather_into_tensor by ~4x;
on NCCL all_gather_into_tensor is used when the ranges have equal size (flat mode).
Buffers are exchanged as raw bytes-compatible integer views when the backend lacks the
dtype (gloo and bf16), which is exact since nothing is reduced.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_GLOO_SAFE = {torch.float32, torch.float64, torch.float16, torch.int32, torch.int64,
              torch.uint8, torch.int8}
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def wire_view(t: torch.Tensor, backend: str) -> torch.Tensor:
    """A view of `t` in a dtype every backend can move (same bytes)."""
    if backend == "gloo" and t.dtype not in _GLOO_SAFE:
        return t.view(_SAME_WIDTH_INT[t.element_size()])
    return t


class Exchanger:
    """Issues the collectives of one sync for a process group."""

    def __init__(self, group, rank: int, world: int):
        self.group = group
        self.rank = rank
        self.world = world
        self.backend = dist.get_backend(group) if world > 1 else "none"
        self.global_ranks = [dist.get_global_rank(group, r) if world > 1 else r
                             for r in range(world)] if group is not None else list(range(world))

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
        works = []
        for r, t in enumerate(regions):
            if t.numel() == 0:
                continue
            # gloo runs async ops on a small thread pool whose order can differ between
            # ranks; several broadcasts in flight on one group were seen to deadlock at
            # world 3. One at a time per group is safe.
            work = dist.broadcast(wire_view(t, self.backend), src=self.global_ranks[r],
                                  group=self.group, async_op=True)
            if self.backend == "gloo":
                work.wait()
            else:
                works.append(work)
        return works


def wait_all(works: list) -> None:
    for w in works:
        w.wait()
