"""The local step of the fused path: one multi-group AdamW call per chunk of this rank's share.

The share is cut into a few chunks (per bucket, at aligned boundaries) so the exchange of
chunk k can run while chunk k+1 is computed. Each chunk is one `kernels.fused_adamw_` call
over segments of every group. Segments read the grads straight from `p.grad` (flat mode
too: no copy into a gradient shard) and the state from the local optimizer's torch-format
state, which stays the single source of truth for checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels, layout
from .kernels.adamw import group_hparams_table


@dataclass
class Unit:
    """A run of elements of this rank's share: part of one user param."""

    key: torch.Tensor      # the local optimizer's param (its state lives under this key)
    key_offset: int        # first element inside `key` (flattened)
    length: int
    bucket: int
    bucket_start: int
    param_id: int
    param_start: int       # first element inside the user param (flattened)
    group: int


def share_units(opt) -> list[Unit]:
    """Every unit of this rank's share, in bucket order."""
    units = []
    if opt.sharding == layout.PARAM:
        placed = set()
        for bi, b in enumerate(opt._buckets):
            for pc in b.pieces(opt.rank):
                p = opt._all_params[pc.param_id]
                placed.add(pc.param_id)
                units.append(Unit(p, 0, pc.length, bi, pc.bucket_start, pc.param_id, 0,
                                  opt._group_of[pc.param_id]))
        # Owned params outside the buckets (frozen ones, with bucket views) still step
        # when they hold a grad, as in torch; they go with the last chunk.
        for pid, (p, r) in enumerate(zip(opt._all_params, opt._owner)):
            if r == opt.rank and pid not in placed and p.numel() > 0:
                units.append(Unit(p, 0, p.numel(), -1, 0, pid, 0, opt._group_of[pid]))
        return units
    for sh in opt._shards:
        for run in sh["runs"]:
            for pc in run["pieces"]:
                rel = pc.bucket_start - sh["lo"] - run["start"]
                units.append(Unit(run["param"], rel, pc.length, sh["bucket"], pc.bucket_start,
                                  pc.param_id, pc.start, run["group"]))
    return units


def chunk_bounds(lo: int, hi: int, chunks: int, align: int) -> list[tuple[int, int]]:
    """Split [lo, hi) into `chunks` aligned pieces (some may be empty)."""
    n = hi - lo
    cuts = [lo + min(n, -(-(n * k // chunks) // align) * align) for k in range(chunks)] + [hi]
    return [(cuts[k], cuts[k + 1]) for k in range(chunks)]


class FusedShardStep:
    """Steps this rank's share with the fused kernel, chunk by chunk."""

    def __init__(self, opt, chunks: int):
        self.opt = opt
        self.units = share_units(opt)
        self.chunks = chunks
        # chunk k -> list of (unit, start within unit, length)
        self.plan: list[list[tuple[Unit, int, int]]] = [[] for _ in range(chunks)]
        by_bucket: dict[int, list[Unit]] = {}
        for u in self.units:
            by_bucket.setdefault(u.bucket, []).append(u)
        self.group_of_key = {id(u.key): u.group for u in self.units}
        self._cache: dict | None = None
        self.bounds: dict[int, list[tuple[int, int]]] = {}
        for u in by_bucket.get(-1, []):
            self.plan[-1].append((u, 0, u.length))
        for bi, b in enumerate(opt._buckets):
            lo, hi = b.rank_ranges[opt.rank]
            self.bounds[bi] = bounds = chunk_bounds(lo, hi, chunks,
                                                    kernels.flatten.alignment_elems(b.dtype))
            for u in by_bucket.get(bi, []):
                for k, (clo, chi) in enumerate(bounds):
                    a = max(u.bucket_start, clo)
                    z = min(u.bucket_start + u.length, chi)
                    if z > a:
                        self.plan[k].append((u, a - u.bucket_start, z - a))

    # -------------------------------------------------------------- state and steps

    def _init_state(self, key: torch.Tensor, amsgrad: bool) -> dict:
        """torch.optim.AdamW's per-param state, created lazily at the first grad."""
        st = self.opt.optim.state[key]
        if not st:
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(key, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(key, memory_format=torch.preserve_format)
        if amsgrad and "max_exp_avg_sq" not in st:
            st["max_exp_avg_sq"] = torch.zeros_like(key, memory_format=torch.preserve_format)
        return st

    def reset(self) -> None:
        """Forget the cached views of the state (after load_state_dict replaced it)."""
        self._cache = None

    def _views(self, amsgrad: list[bool], stepping: set[int] | None) -> dict:
        """Views of params and state per (chunk, device) for the local params that step
        (`stepping`: ids of their keys; None = all). Cached while every local param steps
        (the common case), so a step costs one Python pass over the segments, not six
        view() calls each, and one _foreach_add_ for all the steps. Step VALUES are never
        cached: they are read from the state's step tensors at every step, so a step taken
        by another path (step kwargs, the generic optimizer) is always counted."""
        keys: dict[int, torch.Tensor] = {}
        for u in self.units:
            if stepping is None or id(u.key) in stepping:
                keys.setdefault(id(u.key), u.key)
        key_index = {kid: i for i, kid in enumerate(keys)}
        states = [self._init_state(k, amsgrad[self.group_of_key[kid]])
                  for kid, k in keys.items()]
        chunks = []
        for segs in self.plan:
            by_device: dict = {}
            for u, a, n in segs:
                if id(u.key) not in key_index:
                    continue
                c = by_device.setdefault(u.key.device, {
                    "ps": [], "ms": [], "vs": [], "xs": [], "grad_src": [], "key": [],
                    "grp": []})
                st = states[key_index[id(u.key)]]
                o = u.key_offset + a
                c["ps"].append(u.key.detach().view(-1)[o:o + n])
                c["ms"].append(st["exp_avg"].view(-1)[o:o + n])
                c["vs"].append(st["exp_avg_sq"].view(-1)[o:o + n])
                x = st.get("max_exp_avg_sq")
                c["xs"].append(x.view(-1)[o:o + n] if x is not None else u.key.new_empty(0))
                c["grad_src"].append((u.param_id, u.param_start + a, n))
                c["key"].append(key_index[id(u.key)])
                c["grp"].append(u.group)
            for c in by_device.values():
                c["grp"] = torch.tensor(c["grp"], dtype=torch.int64)
                c["key"] = torch.tensor(c["key"], dtype=torch.int64)
            chunks.append(list(by_device.values()))
        return {"amsgrad": list(amsgrad), "chunks": chunks,
                "steps": [st["step"] for st in states]}

    def run(self, after_chunk=None) -> None:
        """One step; `after_chunk(k)` is called once chunk k's params are final. Local
        params without a grad are skipped and their step is not advanced, as in torch."""
        opt = self.opt
        params = opt._all_params
        amsgrad = [bool(g.get("amsgrad", False)) for g in opt.optim.param_groups]
        if all(params[u.param_id].grad is not None for u in self.units):
            if self._cache is None or self._cache["amsgrad"] != amsgrad:
                self._cache = self._views(amsgrad, None)
            views = self._cache
        else:
            self._cache = None
            views = self._views(amsgrad, {id(u.key) for u in self.units
                                          if params[u.param_id].grad is not None})
        steps = views["steps"]
        if steps:
            torch._foreach_add_(steps, 1.0)
            # one float32 vector of every stepping key's count, gathered on the CPU
            values = torch.stack([t.detach().to("cpu", torch.float32).reshape(())
                                  for t in steps])
        table = group_hparams_table(opt.optim.param_groups)
        any_amsgrad = any(amsgrad)
        for k, calls in enumerate(views["chunks"]):
            for c in calls:  # one kernel call per device
                gs = []
                for pid, a, n in c["grad_src"]:
                    g = params[pid].grad
                    gs.append((g.view(-1) if g.is_contiguous() else g.reshape(-1))[a:a + n])
                kernels.fused_adamw_(c["ps"], gs, c["ms"], c["vs"],
                                     c["xs"] if any_amsgrad else [],
                                     values.index_select(0, c["key"]), c["grp"], table)
            if after_chunk is not None:
                after_chunk(k)
