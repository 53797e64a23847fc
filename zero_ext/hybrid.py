"""Hybrid layouts: optimizer state sharded within a node, replicated across nodes.

The optimizer's ``process_group`` is the group it shards over. On a cluster the usual choice
is the node (the parameter exchange after each step then stays on the fast intra-node links)
while DDP averages the grads over the whole job: every node holds a full replica of the
optimizer state, cut the same way.

- `hybrid_groups()` builds those groups from torchrun's environment (collective over the
  whole job): this rank's shard group (its node) and its replica group (the ranks with the
  same local rank on every node).
- `job_of(opt, process_group)`: the ranks that take part in a job-wide operation of the
  optimizer (a checkpoint save or load): by default the whole job when the optimizer shards
  over a part of it, so that the replicas write one checkpoint together (each shard once)
  and a failure on any node stops every node.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["hybrid_groups", "replica_group_of", "job_of", "replicated_job", "Job"]


def hybrid_groups(shard_size: int | None = None, backend: Any = None) -> tuple[Any, Any]:
    """(shard_group, replica_group) of this rank, for
    ``ZeroRedundancyOptimizer(..., process_group=shard_group)`` with DDP over the job.

    Ranks [k*S, (k+1)*S) form shard group k, S = `shard_size` (default: torchrun's
    LOCAL_WORLD_SIZE, i.e. one group per node); the ranks with the same index in their shard
    group form a replica group. Collective over the default process group: every rank calls
    it, in the same order relative to other group creations. Raises ValueError on every rank
    when the world is not a multiple of S, or when a shard group would span two nodes
    (torchrun's GROUP_RANK differs inside it)."""
    if not dist.is_initialized():
        raise RuntimeError("hybrid_groups() needs torch.distributed to be initialized")
    world, rank = dist.get_world_size(), dist.get_rank()
    if shard_size is None:
        shard_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    # every rank learns every rank's node (torchrun's GROUP_RANK) and shard size, so that a
    # bad layout is the same ValueError everywhere
    mine = (int(shard_size), os.environ.get("GROUP_RANK"))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    sizes = sorted({s for s, _ in everyone})
    if len(sizes) != 1:
        raise ValueError(f"hybrid_groups: ranks disagree on the shard size: {sizes} "
                         "(LOCAL_WORLD_SIZE differs between nodes?); pass shard_size")
    size = sizes[0]
    if size < 1 or world % size:
        raise ValueError(f"hybrid_groups: world size {world} is not a multiple of the shard "
                         f"size {size}")
    for k in range(world // size):
        nodes = {everyone[r][1] for r in range(k * size, (k + 1) * size)}
        if len(nodes) > 1 and None not in nodes:
            raise ValueError(f"hybrid_groups: ranks {k * size}-{(k + 1) * size - 1} are on "
                             f"different nodes (GROUP_RANK {sorted(nodes)}); torchrun numbers "
                             "the ranks of a node contiguously, so the shard size must be "
                             "LOCAL_WORLD_SIZE or divide it")
    shard = replica = None
    for k in range(world // size):
        g = dist.new_group(list(range(k * size, (k + 1) * size)), backend=backend)
        if rank // size == k:
            shard = g
    for j in range(size):
        g = dist.new_group(list(range(j, world, size)), backend=backend)
        if rank % size == j:
            replica = g
    _REPLICA_OF[id(shard)] = (shard, replica)
    return shard, replica


_REPLICA_OF: dict = {}  # id(shard group) -> (shard group, replica group), per hybrid_groups()


def replica_group_of(shard_group: Any) -> Any:
    """The replica group that `hybrid_groups()` returned with `shard_group` (the ranks
    holding the same shard on other nodes); ValueError for a group it did not make."""
    entry = _REPLICA_OF.get(id(shard_group))
    if entry is None or entry[0] is not shard_group:
        raise ValueError(
            "zero_ext: the optimizer shards over a part of the job, but its process group "
            "was not made by zero_ext.hybrid_groups(), so the ranks holding the same shard "
            "elsewhere are unknown; build the groups with hybrid_groups()")
    return entry[1]


@dataclass(frozen=True)
class Job:
    """The ranks of a job-wide operation: `group` (None: a single process), this rank's
    index in it and its size."""

    group: Any
    rank: int
    world: int


def replicated_job(process_group: Any, rank: int, world: int) -> Job:
    """The ranks that load a state dict together with an optimizer over `process_group`
    (of `world` ranks, this one `rank` in it): the whole job when that group is a shard
    group of hybrid_groups() (its replicas load together, so a dict read on rank 0 only
    serves every replica, and a bad dict stops every replica), else the group itself (other
    subgroups may be independent optimizers that load at their own time: pipeline
    stages)."""
    if process_group is None:
        return Job(None, 0, 1)
    try:
        replica_group_of(process_group)
    except ValueError:  # not made by hybrid_groups()
        return Job(process_group, rank, world)
    return Job(dist.group.WORLD, dist.get_rank(), dist.get_world_size())


def job_of(opt, process_group: Any = None) -> Job:
    """The ranks that save or load `opt`'s checkpoints together: `process_group` when
    given, else the whole job (the default group) when `opt` shards over a part of it (a
    hybrid layout: every replica takes part, each shard is written once), else `opt`'s own
    process group."""
    if process_group is None:
        if opt.process_group is None:
            return Job(None, 0, 1)
        whole = dist.get_world_size()
        process_group = dist.group.WORLD if whole > opt.world_size else opt.process_group
    return Job(process_group, dist.get_rank(process_group), dist.get_world_size(process_group))
