"""Reading a sharded checkpoint: which stored element ranges this rank needs (the plan of
a load), a DCP load planner that asks for exactly those, and a direct reader that copies
plain tensor records from the files into the destination views."""
from __future__ import annotations

import bisect
import io
import os
import struct
import sys
import warnings
import zipfile
from dataclasses import dataclass, field
from typing import Any

import torch

from ..state import _clone, zero_gaps
from .format import META_NAME, _dtype

class _quiet_single_process(warnings.catch_warnings):
    """DCP warns that it assumes a single process when torch.distributed is not initialized:
    that is exactly what we mean at world 1 without a process group."""

    def __enter__(self):
        super().__enter__()
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        return self


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


def _scalar_copy(v):
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
            # (the key's own shape: a param mode key, the param's or its host copy's)
            shape = lp.key.shape if lp.length == p.numel() and lp.key.shape == p.shape \
                else (lp.length,)
            for name in (s["order"] if s else []):
                if name in s["elems"]:
                    dest = torch.empty(shape, dtype=_dtype(s["dtypes"][name]),
                                       device=lp.key.device)
                    covered: list = []
                    reads.elems(s["elems"][name], starts[lp.param_id][name], lp.start,
                                lp.start + lp.length, dest.view(-1), covered)
                    zero_gaps(dest.view(-1), covered)
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


def _make_reader(path: str, direct: bool):
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

    return DirectReader(path) if direct else dcp.FileSystemReader(path)


def _read(path: str, reads: _Reads, process_group, no_dist: bool, direct: bool) -> None:
    from . import _dcp

    with _quiet_single_process():
        _dcp.load({}, storage_reader=_make_reader(path, direct), planner=_make_planner(reads),
                  process_group=process_group, no_dist=no_dist)
