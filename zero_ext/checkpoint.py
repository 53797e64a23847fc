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
"""
from __future__ import annotations

import argparse
import bisect
import io
import os
import shutil
import struct
import sys
import warnings
import zipfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from .agree import agree
from .sync import gather_objects

if TYPE_CHECKING:  # pragma: no cover
    from .zero import ZeroRedundancyOptimizer

FORMAT = "zero_ext.sharded_optimizer_checkpoint"
VERSION = 1
META_NAME = "zero_ext_meta.pt"
TMP_SUFFIX = ".zero_ext-tmp"
OLD_SUFFIX = ".zero_ext-old"
# Largest stored item, in elements (loading reads stored items whole, then keeps the part
# it needs: this bounds the transient memory of a load).
SAVE_CHUNK = int(os.environ.get("ZERO_EXT_SAVE_CHUNK", str(1 << 23)))
# Read stored elements straight from the file into the optimizer's new state tensors when the
# stored item is a plain uncompressed tensor record (else DCP's reader: torch.load the whole
# item, then copy the needed part).
DIRECT_READS = os.environ.get("ZERO_EXT_CKPT_DIRECT_READS", "1") == "1"

# Test hook: called on rank 0 with the final path after the new checkpoint is complete in the
# temporary directory and before it is swapped into place (raising here simulates a crash).
_before_swap: Callable[[str], None] | None = None


# ------------------------------------------------------------------------------ helpers


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))


def _ranges(start: int, end: int, chunk: int):
    """[start, end) cut at the multiples of `chunk`."""
    a = start
    while a < end:
        b = min(end, (a // chunk + 1) * chunk)
        yield a, b
        a = b


def _agree(opt, error: BaseException | None, what: str) -> None:
    """Every rank learns whether any rank failed (one small collective), and raises."""
    agree(opt.process_group, opt.world_size, error, what, peer_value_error=True)


class _quiet_single_process(warnings.catch_warnings):
    """DCP warns that it assumes a single process when torch.distributed is not initialized:
    that is exactly what we mean at world 1 without a process group."""

    def __enter__(self):
        super().__enter__()
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        return self


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


def is_checkpoint(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), META_NAME))


def _existing(path: str) -> str:
    """Where the checkpoint for `path` is: `path` itself, or the previous one that a save
    interrupted between its two renames left aside."""
    if not os.path.exists(path) and is_checkpoint(path + OLD_SUFFIX):
        return path + OLD_SUFFIX
    return path


def read_meta(path: str | os.PathLike) -> dict:
    """The small metadata file of a checkpoint (no tensors of the state)."""
    path = _existing(os.path.abspath(os.fspath(path)))
    file = os.path.join(path, META_NAME)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no zero_ext optimizer checkpoint at {path} "
                                f"({META_NAME} is missing)")
    meta = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{file} is not a zero_ext optimizer checkpoint")
    if meta.get("version", 0) > VERSION:
        raise ValueError(f"{path}: checkpoint format version {meta.get('version')} is newer "
                         f"than this zero_ext understands ({VERSION})")
    return meta


# ------------------------------------------------------------------------------ save


def _exact(t: torch.Tensor) -> torch.Tensor:
    """The same memory as a tensor whose storage holds exactly its elements. DCP's writer
    clones any tensor that is a view into a bigger storage and keeps every clone alive
    until the rank's file is closed (torch/distributed/checkpoint/filesystem.py): with
    views of the state that would be a full copy of this rank's share. (CPU only; DCP
    copies device tensors to the host anyway.)"""
    if t.device.type != "cpu" or t.untyped_storage().nbytes() == t.nbytes or t.numel() == 0:
        return t
    return torch.from_numpy(t.view(torch.uint8).numpy()).view(t.dtype)


def _save_items(opt, local) -> tuple[dict, dict]:
    """The DCP state dict of this rank (views, no copies) and its description for rank 0."""
    items: dict[str, torch.Tensor] = {}
    chunks, wholes = [], []
    for s in local.segments:
        dt = _dtype_name(s.tensor.dtype)
        if s.whole_shape is not None:
            key = f"state/{s.pid}/{s.name}/whole"
            items[key] = _exact(s.tensor)
            wholes.append((s.pid, s.name, key, tuple(s.whole_shape), dt))
            continue
        for a, b in _ranges(s.start, s.start + s.length, SAVE_CHUNK):
            key = f"state/{s.pid}/{s.name}/{a}"
            items[key] = _exact(s.tensor[a - s.start:b - s.start])
            chunks.append((s.pid, s.name, a, b - a, key, dt))
    from .state import _portable

    desc = {"chunks": chunks, "wholes": wholes, "order": dict(local.order),
            "scalars": {pid: {k: _portable(v) for k, v in sc.items()}
                        for pid, sc in local.scalars.items()}}
    return items, desc


def _build_meta(opt, descs: list[dict]) -> dict:
    from .state import torch_groups

    st: dict[int, dict] = {}
    for d in descs:
        for pid, names in d["order"].items():
            st.setdefault(pid, {"order": list(names), "scalars": {}, "elems": {},
                                "dtypes": {}, "wholes": {}})
        for pid, sc in d["scalars"].items():
            for k, v in sc.items():
                st[pid]["scalars"].setdefault(k, v)
        for pid, name, start, length, key, dt in d["chunks"]:
            st[pid]["elems"].setdefault(name, []).append((start, length, key))
            st[pid]["dtypes"][name] = dt
        for pid, name, key, shape, dt in d["wholes"]:
            st[pid]["wholes"][name] = (key, shape)
            st[pid]["dtypes"][name] = dt
    for s in st.values():
        for spans in s["elems"].values():
            spans.sort()
    cls = opt.optimizer_class
    return {
        "format": FORMAT, "version": VERSION,
        "world_size": opt.world_size, "sharding": opt.sharding,
        "optimizer_class": f"{cls.__module__}.{cls.__qualname__}",
        "params": [(tuple(p.shape), _dtype_name(p.dtype), g)
                   for p, g in zip(opt.plan.params, opt.plan.group_of)],
        "param_groups": torch_groups(opt),
        "state": dict(sorted(st.items())),
        "save_chunk": SAVE_CHUNK,
    }


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
         sync_files: bool = True) -> None:
    """Write the optimizer's state to the directory `path`, every rank its own share.

    Collective: call on every rank of the optimizer's process group, with the same path on a
    filesystem they share. No rank gathers the state. Atomic: if this raises or the job dies,
    the previous checkpoint at `path` is still there, complete. `sync_files` fsyncs the files.
    """
    import torch.distributed.checkpoint as dcp

    from . import state

    opt = optimizer
    path = os.path.abspath(os.fspath(path))
    tmp, old = path + TMP_SUFFIX, path + OLD_SUFFIX
    error, items, desc = None, {}, {}
    try:
        if opt.rank == 0:
            _prepare(path, tmp, old)
        items, desc = _save_items(opt, state.local_state(opt))
    except Exception as exc:  # noqa: BLE001 - shared with every rank below
        error = exc
    _agree(opt, error, "zero_ext.checkpoint.save")

    with _quiet_single_process():
        dcp.save(items, storage_writer=dcp.FileSystemWriter(tmp, sync_files=sync_files),
                 process_group=opt.process_group, no_dist=opt.process_group is None)
    descs = gather_objects(desc, 0, opt.process_group, opt.world_size)
    error = None
    if opt.rank == 0:
        try:
            meta_file = os.path.join(tmp, META_NAME)
            with open(meta_file, "wb") as f:
                torch.save(_build_meta(opt, descs), f)
                if sync_files:
                    f.flush()
                    os.fsync(f.fileno())
            if _before_swap is not None:
                _before_swap(path)
            _swap(path, tmp, old)
        except Exception as exc:  # noqa: BLE001
            error = exc
    _agree(opt, error, "zero_ext.checkpoint.save")


# ------------------------------------------------------------------------------ load


def _mismatches(opt, meta: dict) -> list[str]:
    out = []
    saved_groups, groups = meta["param_groups"], opt.param_groups
    n_saved, n_have = len(meta["params"]), len(opt.plan.params)
    if n_saved != n_have:
        out.append(f"param count: {n_saved} in the checkpoint, {n_have} in the optimizer")
    if len(saved_groups) != len(groups):
        out.append(f"param group count: {len(saved_groups)} in the checkpoint, "
                   f"{len(groups)} in the optimizer")
    for gi, (sg, g) in enumerate(zip(saved_groups, groups)):
        if len(sg["params"]) != len(g["params"]):
            out.append(f"param group {gi}: {len(sg['params'])} params in the checkpoint, "
                       f"{len(g['params'])} in the optimizer")
    if out:
        return out
    group_start = [0]
    for g in groups:
        group_start.append(group_start[-1] + len(g["params"]))
    for pid, ((shape, dt, _), p) in enumerate(zip(meta["params"], opt.plan.params)):
        gi = opt.plan.group_of[pid]
        where = f"param {pid} (group {gi}, index {pid - group_start[gi]})"
        if tuple(shape) != tuple(p.shape):
            out.append(f"{where}: shape {tuple(shape)} in the checkpoint, {tuple(p.shape)} "
                       "in the optimizer")
        if _dtype(dt) != p.dtype:
            out.append(f"{where}: dtype {_dtype(dt)} in the checkpoint, {p.dtype} in the "
                       "optimizer")
    from .state import state_problems

    for pid, s in meta["state"].items():
        numels = {name: sum(n for _, n, _ in spans) for name, spans in s["elems"].items()}
        for name, (_, shape) in s["wholes"].items():
            numels[name] = 1
            for d in shape:
                numels[name] *= d
        out += state_problems(opt, pid, s["order"], numels)
    if opt.sharding == "flat":
        for pid, s in meta["state"].items():
            if s["wholes"]:
                out.append(f"param {pid}: state {sorted(s['wholes'])} is not per-element "
                           "(saved with sharding='param'); it cannot be split for "
                           "sharding='flat'")
    return out


@dataclass
class _Reads:
    """Element ranges to read from stored items into destination views."""

    items: list[tuple[str, int, int, torch.Tensor]] = field(default_factory=list)
    #        (stored key, offset in it, length, destination 1-D view of that length)

    def elems(self, spans: list[tuple], starts: list[int], lo: int, hi: int,
              dest: torch.Tensor, covered: list) -> None:
        """Read param elements [lo, hi) of one state name into dest[0:hi-lo] from the
        stored chunks `spans` (sorted (start, length, key)); `starts` = their starts."""
        i = max(0, bisect.bisect_right(starts, lo) - 1)
        while i < len(spans) and spans[i][0] < hi:
            start, length, key = spans[i]
            a, b = max(lo, start), min(hi, start + length)
            if b > a:
                self.items.append((key, a - start, b - a, dest[a - lo:b - lo]))
                covered.append((a - lo, b - lo))
            i += 1


def _zero_gaps(dest: torch.Tensor, covered: list) -> None:
    pos = 0
    for a, b in sorted(covered):
        if a > pos:
            dest[pos:a].zero_()
        pos = max(pos, b)
    if pos < dest.numel():
        dest[pos:].zero_()


def _scalar_copy(v):
    from .state import _clone

    return _clone(v)


def _plan_load(opt, meta: dict) -> tuple[_Reads, dict[int, dict]]:
    """What this rank reads, and the local optimizer state it will become (allocated here,
    filled by the reads): only the elements this rank owns now, at their final size."""
    plan = opt.plan
    reads = _Reads()
    saved = meta["state"]
    starts = {pid: {n: [sp[0] for sp in spans] for n, spans in s["elems"].items()}
              for pid, s in saved.items()}
    local: dict[int, dict] = {}
    idx = 0
    for gi in range(len(opt.param_groups)):
        for lp in plan.local_pieces(gi):
            st: dict[str, Any] = {}
            s = saved.get(lp.param_id)
            p = plan.params[lp.param_id]
            # a whole param keeps its shape (param mode); a run of elements is 1-D (flat)
            shape = p.shape if lp.length == p.numel() and lp.key is p else (lp.length,)
            for name in (s["order"] if s else []):
                if name in s["elems"]:
                    dest = torch.empty(shape, dtype=_dtype(s["dtypes"][name]),
                                       device=lp.key.device)
                    covered: list = []
                    reads.elems(s["elems"][name], starts[lp.param_id][name], lp.start,
                                lp.start + lp.length, dest.view(-1), covered)
                    _zero_gaps(dest.view(-1), covered)
                    st[name] = dest
                elif name in s["wholes"]:
                    k, whole_shape = s["wholes"][name]
                    dest = torch.empty(whole_shape, dtype=_dtype(s["dtypes"][name]),
                                       device=lp.key.device)
                    reads.items.append((k, 0, dest.numel(), dest.view(-1)))
                    st[name] = dest
                elif name in s["scalars"]:
                    st[name] = _scalar_copy(s["scalars"][name])
            if st:
                local[idx] = st
            idx += 1
    return reads, local


def _make_planner(reads: _Reads):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner,
                                                      ReadItem)

    class RangeReadPlanner(LoadPlanner):
        """Reads element ranges of stored 1-D items straight into destination views."""

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            self.metadata = metadata

        def create_local_plan(self):
            md = self.metadata.state_dict_metadata if self.metadata is not None else {}
            items = []
            for i, (key, off, n, _) in enumerate(reads.items):
                if key not in md:
                    raise ValueError(f"the checkpoint's data has no item {key!r} (its "
                                     f"{META_NAME} and DCP metadata disagree)")
                items.append(ReadItem(
                    type=LoadItemType.TENSOR, dest_index=MetadataIndex(str(i), [0]),
                    dest_offsets=torch.Size([0]), storage_index=MetadataIndex(key, [0]),
                    storage_offsets=torch.Size([off]), lengths=torch.Size([n])))
            return LoadPlan(items)

        def create_global_plan(self, global_plan):
            return global_plan

        def finish_plan(self, central_plan):
            return central_plan

        def load_bytes(self, read_item, value):
            raise RuntimeError(f"unexpected non-tensor item {read_item.storage_index.fqn!r}")

        def resolve_tensor(self, read_item):
            return reads.items[int(read_item.dest_index.fqn)][3]

        def commit_tensor(self, read_item, tensor):
            pass  # the read went straight into the destination view

    return RangeReadPlanner()


class _Slice(io.RawIOBase):
    """A read-only window [offset, offset + length) of an open binary file."""

    def __init__(self, f, offset: int, length: int):
        super().__init__()
        self.f, self.base, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        self.f.seek(self.base + self.pos)
        got = self.f.readinto(memoryview(b)[:n]) or 0
        self.pos += got
        return got


def _raw_data_offset(f, info, nbytes: int) -> int | None:
    """File offset of the raw elements of a stored item (a torch.save zip holding one
    tensor), or None when the item is anything else (compressed, transformed, several
    storages, other byte order, unexpected size): then DCP's own reader handles it."""
    if getattr(info, "transform_descriptors", None) or sys.byteorder != "little":
        return None
    view = _Slice(f, info.offset, info.length)
    try:
        with zipfile.ZipFile(view) as zf:
            names = zf.namelist()
            data = [n for n in names if n.split("/")[-2:-1] == ["data"]]
            order = [n for n in names if n.endswith("/byteorder")]
            if len(data) != 1 or (order and zf.read(order[0]) != b"little"):
                return None
            zi = zf.getinfo(data[0])
            if zi.compress_type != zipfile.ZIP_STORED or zi.file_size != nbytes:
                return None
            view.seek(zi.header_offset)
            head = view.read(30)
            if len(head) != 30 or head[:4] != b"PK\x03\x04":
                return None
            name_len, extra_len = struct.unpack("<HH", head[26:30])
            return info.offset + zi.header_offset + 30 + name_len + extra_len
    except (zipfile.BadZipFile, OSError, ValueError, KeyError, struct.error):
        return None


def _make_reader(path: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan

    class DirectReader(dcp.FileSystemReader):
        """FileSystemReader that reads element ranges straight into the destinations."""

        def read_data(self, plan, planner):
            md = getattr(getattr(planner, "metadata", None), "state_dict_metadata", {})
            rest, by_file = [], {}
            for req in plan.items:
                info = self.storage_data[req.storage_index]
                by_file.setdefault(info.relative_path, []).append((req, info))
            for rel, reqs in by_file.items():
                with open(os.path.join(self.path, rel), "rb", buffering=0) as f:
                    where: dict[str, int | None] = {}
                    for req, info in reqs:
                        key = req.storage_index.fqn
                        dest = planner.resolve_tensor(req).detach()
                        tmd = md.get(key)
                        if not (isinstance(tmd, TensorStorageMetadata) and len(tmd.size) == 1
                                and tmd.properties.dtype == dest.dtype and dest.dim() == 1
                                and dest.device.type == "cpu" and dest.is_contiguous()):
                            rest.append(req)
                            continue
                        if key not in where:
                            where[key] = _raw_data_offset(
                                f, info, tmd.size[0] * dest.element_size())
                        if where[key] is None:
                            rest.append(req)
                            continue
                        buf = memoryview(dest.view(torch.uint8).numpy())
                        f.seek(where[key] + req.storage_offsets[0] * dest.element_size())
                        done = 0
                        while done < len(buf):
                            got = f.readinto(buf[done:])
                            if not got:
                                raise OSError(f"{rel}: unexpected end of file reading {key}")
                            done += got
            if rest:
                return super().read_data(LoadPlan(rest), planner)
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(None)
            return fut

    return DirectReader(path) if DIRECT_READS else dcp.FileSystemReader(path)


def _read(path: str, reads: _Reads, process_group, no_dist: bool) -> None:
    import torch.distributed.checkpoint as dcp

    with _quiet_single_process():
        dcp.load({}, storage_reader=_make_reader(path), planner=_make_planner(reads),
                 process_group=process_group, no_dist=no_dist)


def load(optimizer: "ZeroRedundancyOptimizer", path: str | os.PathLike) -> None:
    """Load a checkpoint written by `save`, at any world size and in either sharding mode.

    Collective: call on every rank. Each rank reads only the elements it owns now. If the
    checkpoint does not fit the optimizer (param count, group count, shapes, dtypes), every
    rank raises the same ValueError naming the mismatch and the optimizer is unchanged.
    """
    from . import state

    opt = optimizer
    error, reads, local, meta, where = None, None, None, None, None
    try:
        where = _existing(os.path.abspath(os.fspath(path)))
        meta = read_meta(where)
        problems = _mismatches(opt, meta)
        if problems:
            raise ValueError(f"zero_ext.checkpoint.load: the checkpoint at {where} does not "
                             "fit the optimizer: " + "; ".join(problems[:8])
                             + (f"; and {len(problems) - 8} more" if len(problems) > 8 else ""))
        reads, local = _plan_load(opt, meta)
    except Exception as exc:  # noqa: BLE001 - shared with every rank below
        error = exc
    _agree(opt, error, "zero_ext.checkpoint.load")
    _read(where, reads, opt.process_group, opt.process_group is None)
    state.install(opt, meta["param_groups"], local)


# ------------------------------------------------------------------------------ convert


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
                _zero_gaps(dest.view(-1), covered)
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
        _read(path, reads, None, True)
    return {"state": state, "param_groups": meta["param_groups"]}


def convert(path: str | os.PathLike, out: str | os.PathLike) -> dict:
    """Write the checkpoint at `path` as one torch.save file of the plain torch format."""
    sd = load_full(path)
    torch.save(sd, os.fspath(out))
    return sd


def _info(path: str) -> str:
    meta = read_meta(path)
    n = sum(1 for _ in meta["params"])
    numel = 0
    for shape, _, _ in meta["params"]:
        k = 1
        for d in shape:
            k *= int(d)
        numel += k
    lines = [f"zero_ext optimizer checkpoint {os.path.abspath(path)}",
             f"  saved by {meta['optimizer_class']} at world size {meta['world_size']}, "
             f"sharding={meta['sharding']!r}",
             f"  {n} params ({numel:,} elements) in {len(meta['param_groups'])} groups, "
             f"state for {len(meta['state'])} params"]
    for gi, g in enumerate(meta["param_groups"]):
        hyper = {k: v for k, v in g.items() if k != "params"}
        lines.append(f"  group {gi}: {len(g['params'])} params, {hyper}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(
        prog="python -m zero_ext.checkpoint", formatter_class=fmt,
        description="Tools for zero_ext sharded optimizer checkpoints. "
                    "`python -m zero_ext.checkpoint COMMAND --help` describes a command.")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    c = sub.add_parser("convert", formatter_class=fmt,
                       help="sharded checkpoint -> plain torch optimizer state dict "
                            "(torch.save file)",
                       description="Gather a sharded checkpoint into one plain torch optimizer "
                                   "state dict (loadable by torch.optim.AdamW and by "
                                   "zero_ext) and torch.save it.")
    c.add_argument("path", help="checkpoint directory written by zero_ext.checkpoint.save")
    c.add_argument("out", help="output file, e.g. optim.pt")
    i = sub.add_parser("info", formatter_class=fmt, help="describe a checkpoint",
                       description="Print a checkpoint's world size, sharding mode, params "
                                   "and param groups.")
    i.add_argument("path", help="checkpoint directory written by zero_ext.checkpoint.save")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "convert":
            sd = convert(args.path, args.out)
            print(f"wrote {args.out}: state for {len(sd['state'])} params, "
                  f"{len(sd['param_groups'])} param groups")
        else:
            print(_info(args.path))
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
