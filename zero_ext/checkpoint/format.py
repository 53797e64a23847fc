"""The on-disk format of zero_ext's sharded checkpoints: names, the metadata file (params,
groups, scalar state, the map of stored chunks), what each rank stores, and the checks of a
checkpoint against an optimizer. See the package docstring for the layout."""
from __future__ import annotations

import os

import torch

from ..state import _portable, state_problems, torch_groups

FORMAT = "zero_ext.sharded_optimizer_checkpoint"
VERSION = 1
META_NAME = "zero_ext_meta.pt"
TMP_SUFFIX = ".zero_ext-tmp"
OLD_SUFFIX = ".zero_ext-old"
# Largest stored item, in elements (loading reads stored items whole, then keeps the part
# it needs: this bounds the transient memory of a load).
SAVE_CHUNK = int(os.environ.get("ZERO_EXT_SAVE_CHUNK", str(1 << 23)))


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
    desc = {"chunks": chunks, "wholes": wholes, "order": dict(local.order),
            "scalars": {pid: {k: _portable(v) for k, v in sc.items()}
                        for pid, sc in local.scalars.items()}}
    return items, desc


def _build_meta(opt, descs: list[dict], replicas: int = 1) -> dict:
    """The metadata of a checkpoint from every saving rank's description (replicas of a
    shard describe the same chunks under the same keys: each is listed once)."""
    st: dict[int, dict] = {}
    seen: set = set()
    for d in descs:
        for pid, names in d["order"].items():
            st.setdefault(pid, {"order": list(names), "scalars": {}, "elems": {},
                                "dtypes": {}, "wholes": {}})
        for pid, sc in d["scalars"].items():
            for k, v in sc.items():
                st[pid]["scalars"].setdefault(k, v)
        for pid, name, start, length, key, dt in d["chunks"]:
            if key in seen:
                continue
            seen.add(key)
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
        "world_size": opt.world_size, "replicas": replicas, "sharding": opt.sharding,
        "optimizer_class": f"{cls.__module__}.{cls.__qualname__}",
        "params": [(tuple(p.shape), _dtype_name(p.dtype), g)
                   for p, g in zip(opt.plan.params, opt.plan.group_of)],
        "param_groups": torch_groups(opt),
        "state": dict(sorted(st.items())),
        "save_chunk": SAVE_CHUNK,
    }


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
    for pid, s in meta["state"].items():
        numels = {name: sum(n for _, n, _ in spans) for name, spans in s["elems"].items()}
        for name, (_, shape) in s["wholes"].items():
            numels[name] = 1
            for d in shape:
                numels[name] *= d
        out += state_problems(opt, pid, s["order"], numels)
    if opt.sharding in ("flat", "even"):
        for pid, s in meta["state"].items():
            if s["wholes"]:
                out.append(f"param {pid}: state {sorted(s['wholes'])} is not per-element "
                           "(saved with sharding='param'); it cannot be split for "
                           f"sharding={opt.sharding!r}")
    return out
