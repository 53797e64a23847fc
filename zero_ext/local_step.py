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
        for bi, b in enumerate(opt._buckets):
            for pc in b.pieces(opt.rank):
                p = opt._all_params[pc.param_id]
                units.append(Unit(p, 0, pc.length, bi, pc.bucket_start, pc.param_id, 0,
                                  opt._group_of[pc.param_id]))
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
        self.regions = None  # the exchange's regions per chunk, cached by the optimizer
        self.bounds: dict[int, list[tuple[int, int]]] = {}
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

    def _prepare_state(self) -> dict:
        """Init state lazily and advance the step of every local param that has a grad."""
        state = self.opt.optim.state
        has_grad: dict[int, bool] = {}
        keys: dict[int, torch.Tensor] = {}
        for u in self.units:
            g = self.opt._all_params[u.param_id].grad
            has_grad[id(u.key)] = has_grad.get(id(u.key), False) or g is not None
            keys[id(u.key)] = u.key
        amsgrad = [bool(g.get("amsgrad", False)) for g in self.opt.optim.param_groups]
        steps = {}
        for kid, key in keys.items():
            if not has_grad[kid]:
                continue
            st = state[key]
            if not st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(key, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(key, memory_format=torch.preserve_format)
            if amsgrad[self.group_of_key[kid]] and "max_exp_avg_sq" not in st:
                st["max_exp_avg_sq"] = torch.zeros_like(key, memory_format=torch.preserve_format)
            st["step"] += 1
            steps[kid] = float(st["step"])
        return steps

    def reset(self) -> None:
        """Nothing cached depends on the state's tensors (kept for load_state_dict)."""

    def run(self, after_chunk=None) -> None:
        """One step; `after_chunk(k)` is called once chunk k's params are final."""
        opt = self.opt
        steps = self._prepare_state()
        table = group_hparams_table(opt.optim.param_groups)
        state = opt.optim.state
        any_amsgrad = bool(table[:, 5].any()) if table.numel() else False
        for k, segs in enumerate(self.plan):
            ps, gs, ms, vs, xs, st, grp = [], [], [], [], [], [], []
            for u, a, n in segs:
                g = opt._all_params[u.param_id].grad
                if g is None:
                    continue
                s = state[u.key]
                o = u.key_offset + a
                ps.append(u.key.detach().view(-1)[o:o + n])
                gs.append(g.reshape(-1)[u.param_start + a:u.param_start + a + n])
                ms.append(s["exp_avg"].view(-1)[o:o + n])
                vs.append(s["exp_avg_sq"].view(-1)[o:o + n])
                if any_amsgrad:
                    x = s.get("max_exp_avg_sq")
                    xs.append(x.view(-1)[o:o + n] if x is not None else ps[-1].new_empty(0))
                st.append(steps[id(u.key)])
                grp.append(u.group)
            if ps:
                kernels.fused_adamw_(ps, gs, ms, vs, xs, torch.tensor(st, dtype=torch.float32),
                                     torch.tensor(grp, dtype=torch.int64), table)
            if after_chunk is not None:
                after_chunk(k)
