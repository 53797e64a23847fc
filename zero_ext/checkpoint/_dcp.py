"""torch.distributed.checkpoint's save and load with `no_dist`, on every supported torch.

`no_dist=True` means "this process alone", whatever torch.distributed holds: a checkpoint of
an optimizer built before the process group existed, or `convert` run on one rank of a job.
The public `dcp.save` / `dcp.load` take it as a keyword on recent torch only; before (torch
2.6) they decide by themselves, `no_dist = not dist.is_initialized()`, so on one rank of an
initialized job they would issue collectives over the whole default group, which the other
ranks never join. There the functions they call, `_save_state_dict` / `_load_state_dict`
(which have taken `no_dist` since torch 2.x), are called directly instead. Which one applies
is decided from the signature, not from a version number.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch.distributed as dist


def _takes_no_dist(fn) -> bool:
    try:
        return "no_dist" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # (a wrapper without a signature)
        return False


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def save(items: dict, *, storage_writer: Any, planner: Any = None, process_group: Any = None,
         no_dist: bool = False) -> None:
    import torch.distributed.checkpoint as dcp

    if _takes_no_dist(dcp.save):
        dcp.save(items, storage_writer=storage_writer, planner=planner,
                 process_group=process_group, no_dist=no_dist)
    elif no_dist == (not _initialized()):  # what torch's own save decides
        dcp.save(items, storage_writer=storage_writer, planner=planner,
                 process_group=process_group)
    else:
        from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

        _save_state_dict(state_dict=items, storage_writer=storage_writer,
                         process_group=process_group, no_dist=no_dist, planner=planner)


def load(items: dict, *, storage_reader: Any, planner: Any = None, process_group: Any = None,
         no_dist: bool = False) -> None:
    import torch.distributed.checkpoint as dcp

    if _takes_no_dist(dcp.load):
        dcp.load(items, storage_reader=storage_reader, planner=planner,
                 process_group=process_group, no_dist=no_dist)
    elif no_dist == (not _initialized()):
        dcp.load(items, storage_reader=storage_reader, planner=planner,
                 process_group=process_group)
    else:
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        _load_state_dict(state_dict=items, storage_reader=storage_reader,
                         process_group=process_group, no_dist=no_dist, planner=planner)


def _maps_its_coordinator() -> bool:
    """Whether DCP turns its coordinator (rank 0 of the group) into a global rank for its
    object collectives. torch 2.6's does not: it passes the group rank as the global one,
    which is right only where the group's first rank is global rank 0."""
    from torch.distributed.checkpoint.utils import _DistWrapper

    return hasattr(_DistWrapper(None, False, 0), "global_coordinator_rank")


def group_problem(group: Any, what: str) -> "RuntimeError | None":
    """A clear error (the same on every rank of `group`) where this torch's DCP cannot save
    or load over it; None where it can."""
    if group is None or _maps_its_coordinator():
        return None
    first = dist.get_global_rank(group, 0)
    if first != 0:
        import torch

        return RuntimeError(
            f"{what}: with torch {torch.__version__}, torch.distributed.checkpoint cannot "
            "save or load over a process group whose first rank is not global rank 0 (this "
            f"one's is rank {first}); newer torch releases can (docs/build.md, 'Supported "
            "torch versions'). Upgrade torch, or checkpoint with opt.state_dict().")
    return None
