"""Sharded, atomic, elastic checkpoints of zero_ext.ZeroRedundancyOptimizer.

    from zero_ext import checkpoint
    checkpoint.save(opt, "ckpt/optim")   # every rank writes only its own state
    checkpoint.load(opt, "ckpt/optim")   # any world size, either sharding mode

    python -m zero_ext.checkpoint convert ckpt/optim optim.pt   # -> plain torch format
    python -m zero_ext.checkpoint info ckpt/optim

Layout on disk: one torch.distributed.checkpoint (DCP, filesystem storage) directory. Every
per-element state tensor (exp_avg, ...) of every param is stored as 1-D chunks under the key
"state/<param index>/<name>/<first element>": each rank writes the chunks of the elements
it owns, cut at multiples of SAVE_CHUNK elements inside the param so that no stored item is
bigger than that. Other tensors with dims (param mode only, e.g. factored statistics) are
stored whole as "state/<param index>/<name>/whole". Next to DCP's own ".metadata", rank 0
writes META_NAME: the params' shapes/dtypes/groups, the group hyperparameters, the scalar
state (step, ...) and the map of chunks. Nothing is ever gathered: save sends only that small
description to rank 0, load reads on each rank exactly the element ranges it owns now.

Atomicity: save writes into "<path>.zero_ext-tmp", then rank 0 renames the previous
checkpoint to "<path>.zero_ext-old", the new one to <path>, and deletes the old one. A save
interrupted at any point leaves a complete checkpoint at <path> (or, between the two renames,
at "<path>.zero_ext-old", which load and the next save recover).

Hybrid layouts (the optimizer shards over a part of the job, e.g. one node, and every node
holds a replica): save and load are collective over the whole job by default (see
zero_ext.hybrid.job_of). The replicas hold identical shards under identical keys, so DCP's
planner writes every stored item once and spreads the writing over the replicas; rank 0 of
the job writes the metadata and swaps the directories; a failure on any rank raises on
every rank of the job. The checkpoint does not depend on the layout: it loads into any
other (another number of nodes, ranks per node, or sharding mode).
"""
from __future__ import annotations

import hashlib
import os
import shutil
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from .. import state
from . import _dcp
from ..agree import agree, rendezvous
from ..groups import hyperparameters, plain_value
from ..hybrid import Job, job_of
from ..state import zero_gaps
from ..sync import gather_objects
from .format import (FORMAT, META_NAME, OLD_SUFFIX, SAVE_CHUNK, TMP_SUFFIX,  # noqa: F401
                     VERSION, _build_meta, _dtype, _existing, _mismatches, _save_items,
                     is_checkpoint, read_meta)
from .reader import _plan_load, _quiet_single_process, _read, _Reads

if TYPE_CHECKING:  # pragma: no cover
    from ..zero import ZeroRedundancyOptimizer

# Read stored elements straight from the file into the optimizer's new state tensors when the
# stored item is a plain uncompressed tensor record (else DCP's reader: torch.load the whole
# item, then copy the needed part).
DIRECT_READS = os.environ.get("ZERO_EXT_CKPT_DIRECT_READS", "1") == "1"

# Test hook: called on rank 0 with the final path after the new checkpoint is complete in the
# temporary directory and before it is swapped into place (raising here simulates a crash).
_before_swap: Callable[[str], None] | None = None

__all__ = ["save", "load", "load_full", "convert", "is_checkpoint", "read_meta", "main"]


def _agree(job: Job, error: BaseException | None, what: str) -> None:
    """Every rank of the job learns whether any rank failed (one small collective), and
    raises."""
    agree(job.group, job.world, error, what, peer_value_error=True)


def _fingerprint(opt) -> str:
    """What must be equal on every rank of a job for their shards to be replicas."""
    cls = opt.optimizer_class
    text = repr((f"{cls.__module__}.{cls.__qualname__}", opt.sharding, opt.world_size,
                 [(tuple(p.shape), str(p.dtype), g)
                  for p, g in zip(opt.plan.params, opt.plan.group_of)]))
    return hashlib.sha256(text.encode()).hexdigest()


def _holdings(opt) -> str:
    """What the optimizer holds, beyond its structure: the group hyperparameters (by value:
    plain_value) and three elements (first, middle, last) of every param, bitwise. Replicas of one
    optimizer hold the same (DDP keeps their params equal); two optimizers over different
    params of equal shapes (pipeline stages, ensemble members) do not. Sampled, not summed:
    a sum's rounding depends on the thread count, which may differ between nodes."""
    picks: dict = {}  # device -> the sampled bytes there (one copy to the host each)
    for p in opt.plan.params:
        n = p.numel()
        if n and p.device.type != "meta":
            flat = p.detach().reshape(-1)
            picks.setdefault(p.device, []).append(flat[[0, n // 2, n - 1]].view(torch.uint8))
    h = hashlib.sha256(repr([sorted(((k, plain_value(v)) for k, v in hyperparameters(g).items()),
                                    key=lambda kv: kv[0])
                             for g in opt.param_groups]).encode())
    for dev in sorted(picks, key=str):
        h.update(torch.cat(picks[dev]).cpu().numpy().tobytes())
    return h.hexdigest()


def _join_job(opt, job: Job, path: str, what: str) -> tuple[Job, BaseException | None]:
    """The ranks of `job` meet (a store rendezvous first: a rank that never calls gives a
    warning naming it instead of a silent hang) and compare (path, optimizer, shard group):

    - one path: they save or load one checkpoint of replicas of one optimizer, each
      complete shard group inside the job;
    - several paths, each used by exactly one whole shard group (independent optimizers
      over parts of the job, as pipeline stages or an ensemble saving at the same time):
      each group saves or loads its own, the job narrows to the optimizer's group;
    - anything else is an error.

    Every rank decides from the same gathered facts, so all narrow or all fail alike.
    Returns (the job to use, this rank's error: raised on every rank by the caller)."""
    if job.world == 1:
        return job, None
    rendezvous(job.group, job.world, job.rank, what,
               "every rank of the job calls it: when the optimizer shards over a part of the "
               "job (shard within a node, replicate across nodes), that is every rank of the "
               "default process group; pass process_group=opt.process_group to save or load "
               "one group alone")
    shard = tuple(dist.get_process_group_ranks(opt.process_group))  # (a job of 2+: not None)
    # a save compares what the optimizers hold too: one checkpoint of two optimizers with
    # equal shapes would keep one's state only (a load reads, whatever the values)
    fingerprint = _fingerprint(opt) + (_holdings(opt) if what.endswith("save") else "")
    everyone: list = [None] * job.world
    dist.all_gather_object(everyone, (path, fingerprint, shard), group=job.group)
    members = dist.get_process_group_ranks(job.group)
    outside = sorted({r for e in everyone for r in e[2]} - set(members))
    if outside:
        return job, ValueError(f"{what}: ranks {outside} shard the optimizer with ranks of "
                               "this job but do not take part in it; every rank of a shard "
                               "group must")
    by_path: dict = {}
    for g, (p, fp, sh) in zip(members, everyone):
        by_path.setdefault(p, []).append((g, fp, sh))
    if len(by_path) == 1:
        if len({e[1] for e in everyone}) > 1:
            return job, ValueError(
                f"{what}: the ranks of the job hold different optimizers (params, their "
                "values, groups, hyperparameters, optimizer class, sharding or shard count "
                "differ): they cannot share one checkpoint; give each optimizer a path of "
                "its own, or pass process_group=")
        return job, None
    separate = all(sorted(g for g, _, _ in ranks) == sorted(ranks[0][2])
                   and len({fp for _, fp, _ in ranks}) == 1 for ranks in by_path.values())
    if not separate:
        return job, ValueError(
            f"{what}: the ranks of the job were given different paths {sorted(by_path)}; "
            "replicas of one optimizer pass the same path, and independent optimizers over "
            "parts of the job each use a path of their own for their whole group (or pass "
            "process_group= to name the ranks that save together)")
    return job_of(opt, opt.process_group), None


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _prepare(path: str, tmp: str, old: str) -> None:
    """Rank 0, before a save: recover an interrupted swap, clear leftovers, make tmp."""
    if not os.path.lexists(path) and is_checkpoint(old):
        os.rename(old, path)  # a previous save died between its two renames
    if os.path.lexists(path) and not is_checkpoint(path) and not (
            os.path.isdir(path) and not os.listdir(path)):
        raise ValueError(f"zero_ext.checkpoint.save: {path} exists and is not a zero_ext "
                         "optimizer checkpoint; refusing to replace it")
    for leftover in (tmp, old):
        if os.path.lexists(leftover):
            shutil.rmtree(leftover) if os.path.isdir(leftover) else os.remove(leftover)
    os.makedirs(tmp)


def _swap(path: str, tmp: str, old: str) -> None:
    """Rank 0: the complete checkpoint in `tmp` replaces `path`."""
    if os.path.lexists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(path))
    if os.path.lexists(old):
        shutil.rmtree(old, ignore_errors=True)


def save(optimizer: "ZeroRedundancyOptimizer", path: str | os.PathLike, *,
         sync_files: bool = True, process_group: Any = None) -> None:
    """Write the optimizer's state to the directory `path`, every rank its own share.

    Collective: call on every rank of the job with the same path on a filesystem they
    share. The job is the optimizer's process group, or the whole default group when the
    optimizer shards over a part of it (a hybrid layout: see zero_ext.hybrid); pass
    `process_group` to name it. No rank gathers the state; replicas write each shard once.
    Atomic: if this raises or the job dies, the previous checkpoint at `path` is still there,
    complete. `sync_files` fsyncs the files.
    """
    import torch.distributed.checkpoint as dcp

    opt = optimizer
    opt.wait_for_params()  # (overlap_param_gather: the last step's exchange, in flight)
    path = os.path.abspath(os.fspath(path))
    job, error = _join_job(opt, job_of(opt, process_group), path, "zero_ext.checkpoint.save")
    if error is None:  # (the job as joined: it may have narrowed to the optimizer's group)
        error = _dcp.group_problem(job.group, "zero_ext.checkpoint.save")
    tmp, old = path + TMP_SUFFIX, path + OLD_SUFFIX
    items, desc = {}, {}
    try:
        if error is None:
            if job.rank == 0:
                _prepare(path, tmp, old)
            items, desc = _save_items(opt, state.local_state(opt))
    except Exception as exc:  # noqa: BLE001 - shared with every rank below
        error = exc
    _agree(job, error, "zero_ext.checkpoint.save")

    with _quiet_single_process():
        _dcp.save(items, storage_writer=dcp.FileSystemWriter(tmp, sync_files=sync_files),
                  process_group=job.group, no_dist=job.group is None)
    descs = gather_objects(desc, 0, job.group, job.world)
    error = None
    if job.rank == 0:
        try:
            meta_file = os.path.join(tmp, META_NAME)
            with open(meta_file, "wb") as f:
                torch.save(_build_meta(opt, descs, replicas=job.world // opt.world_size), f)
                if sync_files:
                    f.flush()
                    os.fsync(f.fileno())
            if _before_swap is not None:
                _before_swap(path)
            _swap(path, tmp, old)
        except Exception as exc:  # noqa: BLE001
            error = exc
    _agree(job, error, "zero_ext.checkpoint.save")


def load(optimizer: "ZeroRedundancyOptimizer", path: str | os.PathLike, *,
         process_group: Any = None) -> None:
    """Load a checkpoint written by `save`, at any world size, layout (shard groups and
    replicas) and either sharding mode.

    Collective over the job, as `save`. Each rank reads only the elements it owns now. If
    the checkpoint does not fit the optimizer (param count, group count, shapes, dtypes),
    every rank of the job raises the same ValueError naming the mismatch and the optimizer
    is unchanged.
    """
    opt = optimizer
    opt.wait_for_params()  # (overlap_param_gather: the last step's exchange, in flight)
    path = os.path.abspath(os.fspath(path))
    job, error = _join_job(opt, job_of(opt, process_group), path, "zero_ext.checkpoint.load")
    if error is None:  # (the job as joined: it may have narrowed to the optimizer's group)
        error = _dcp.group_problem(job.group, "zero_ext.checkpoint.load")
    reads, local, meta, where = None, None, None, None
    try:
        if error is None:
            where = _existing(path)
            meta = read_meta(where)
            problems = _mismatches(opt, meta)
            if problems:
                raise ValueError(f"zero_ext.checkpoint.load: the checkpoint at {where} does "
                                 "not fit the optimizer: " + "; ".join(problems[:8])
                                 + (f"; and {len(problems) - 8} more" if len(problems) > 8
                                    else ""))
            reads, local = _plan_load(opt, meta)
    except Exception as exc:  # noqa: BLE001 - shared with every rank below
        error = exc
    _agree(job, error, "zero_ext.checkpoint.load")
    _read(where, reads, job.group, job.group is None, DIRECT_READS)
    state.install(opt, meta["param_groups"], local)


def load_full(path: str | os.PathLike) -> dict:
    """The whole checkpoint as a plain torch optimizer state dict (one process, no
    torch.distributed needed): what torch.optim.AdamW.load_state_dict accepts."""
    path = _existing(os.path.abspath(os.fspath(path)))
    meta = read_meta(path)
    reads = _Reads()
    state: dict[int, dict] = {}
    for pid, s in meta["state"].items():
        shape = tuple(meta["params"][pid][0])
        numel = 1
        for d in shape:
            numel *= int(d)
        st: dict[str, Any] = {}
        for name in s["order"]:
            if name in s["elems"]:
                dest = torch.empty(shape, dtype=_dtype(s["dtypes"][name]))
                covered: list = []
                spans = s["elems"][name]
                reads.elems(spans, [sp[0] for sp in spans], 0, numel, dest.view(-1), covered)
                zero_gaps(dest.view(-1), covered)
                st[name] = dest
            elif name in s["wholes"]:
                key, wshape = s["wholes"][name]
                dest = torch.empty(wshape, dtype=_dtype(s["dtypes"][name]))
                reads.items.append((key, 0, dest.numel(), dest.view(-1)))
                st[name] = dest
            elif name in s["scalars"]:
                st[name] = s["scalars"][name]
        state[pid] = st
    if reads.items:
        _read(path, reads, None, True, DIRECT_READS)
    return {"state": state, "param_groups": meta["param_groups"]}


def convert(path: str | os.PathLike, out: str | os.PathLike) -> dict:
    """Write the checkpoint at `path` as one torch.save file of the plain torch format."""
    sd = load_full(path)
    torch.save(sd, os.fspath(out))
    return sd


def main(argv: list[str] | None = None) -> int:
    """The command line (python -m zero_ext.checkpoint); see cli.py."""
    from .cli import main as cli_main

    return cli_main(argv)
