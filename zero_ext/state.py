"""Optimizer state in torch's format, whatever the sharding.

torch's format: {"state": {global index: {name: value}}, "param_groups": [{..., "params":
[global indices]}]}, indices numbering params in the user's group order. A rank holds
"pieces" of that state: whole params ("param" mode) or element ranges of them ("flat"
mode). Per-element values (exp_avg, momentum_buffer, ...) are split with the param; scalar
values (step, 0-d tensors, numbers) are the same for every piece of a param.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import layout

if TYPE_CHECKING:  # pragma: no cover
    from .zero import ZeroRedundancyOptimizer


def _is_per_element(value, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


def _clone(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def local_param_ids(opt: "ZeroRedundancyOptimizer", gi: int) -> list[int]:
    """Param mode: global indices of this rank's params in group gi, in local order."""
    return [pid for pid, (g, r) in enumerate(zip(opt._group_of, opt._owner))
            if g == gi and r == opt.rank]


def local_pieces(opt: "ZeroRedundancyOptimizer", to_cpu: bool = True) -> list[tuple]:
    """This rank's state as pieces: ("whole", pid, state) or
    ("part", pid, start, length, per_element {name: 1-D}, scalars {name: value})."""
    move = (lambda t: t.detach().to("cpu", copy=True)) if to_cpu else (lambda t: t.detach())
    out: list[tuple] = []
    if opt.sharding == layout.PARAM:
        for pid, (p, r) in enumerate(zip(opt._all_params, opt._owner)):
            st = opt.optim.state.get(p) if r == opt.rank else None
            if st:
                out.append(("whole", pid, {k: move(v) if isinstance(v, torch.Tensor)
                                            else copy.deepcopy(v) for k, v in st.items()}))
        return out
    for sh in opt._shards:
        for run in sh["runs"]:
            st = opt.optim.state.get(run["param"])
            if not st:
                continue
            n = run["end"] - run["start"]
            for pc in run["pieces"]:
                rel = pc.bucket_start - sh["lo"] - run["start"]
                elems = {k: move(v.reshape(-1)[rel:rel + pc.length]).clone()
                         for k, v in st.items() if _is_per_element(v, n)}
                scalars = {k: (move(v) if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                           for k, v in st.items() if not _is_per_element(v, n)}
                out.append(("part", pc.param_id, pc.start, pc.length, elems, scalars))
    return out


def assemble(opt: "ZeroRedundancyOptimizer", pieces_per_rank: list[list[tuple]]) -> dict:
    """Full per-param state {global index: {name: value}} from every rank's pieces."""
    full: dict[int, dict] = {}
    for pieces in pieces_per_rank:
        for piece in pieces:
            if piece[0] == "whole":
                full[piece[1]] = piece[2]
                continue
            _, pid, start, length, elems, scalars = piece
            p = opt._all_params[pid]
            st = full.setdefault(pid, {})
            for k, v in scalars.items():
                st.setdefault(k, v)
            for k, v in elems.items():
                if k not in st:
                    st[k] = torch.zeros(p.numel(), dtype=v.dtype, device=v.device)
                st[k][start:start + length].copy_(v)
    for pid, st in full.items():
        shape = opt._all_params[pid].shape
        for k, v in st.items():
            if _is_per_element(v, opt._all_params[pid].numel()) and v.shape != shape:
                st[k] = v.view(shape)
    return dict(sorted(full.items()))


def consolidate(opt: "ZeroRedundancyOptimizer", to: int) -> dict | None:
    """Gather every rank's pieces on rank `to` only; returns the full state there."""
    if not 0 <= to < opt.world_size:
        raise ValueError(f"consolidate_state_dict: to={to} is not a rank of the process group "
                         f"(world size {opt.world_size})")
    mine = local_pieces(opt, to_cpu=True)
    if opt.world_size == 1:
        return assemble(opt, [mine])
    gathered = [None] * opt.world_size if opt.rank == to else None
    dst = dist.get_global_rank(opt.process_group, to)
    dist.gather_object(mine, gathered, dst=dst, group=opt.process_group)
    return assemble(opt, gathered) if opt.rank == to else None


def torch_format(opt: "ZeroRedundancyOptimizer", full_state: dict) -> dict:
    groups, start = [], 0
    for g in opt.param_groups:
        n = len(g["params"])
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": list(range(start, start + n))})
        start += n
    return {"state": full_state, "param_groups": groups}


def _check_and_map(opt: "ZeroRedundancyOptimizer", state_dict: dict) -> dict[int, dict]:
    """Validate a torch-format dict against the optimizer; map its ids to global indices."""
    if not isinstance(state_dict, dict) or "state" not in state_dict \
            or "param_groups" not in state_dict:
        raise ValueError("load_state_dict expects a torch optimizer state dict with 'state' "
                         "and 'param_groups' keys")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, the "
                         f"optimizer has {len(opt.param_groups)}")
    id_map, pid = {}, 0
    for gi, (g, sg) in enumerate(zip(opt.param_groups, saved_groups)):
        if len(sg["params"]) != len(g["params"]):
            raise ValueError(f"loaded state dict's param group {gi} has {len(sg['params'])} "
                             f"params, the optimizer's has {len(g['params'])}")
        for sid in sg["params"]:
            id_map[sid] = pid
            pid += 1
    mapped = {}
    for sid, st in state_dict["state"].items():
        if sid not in id_map:
            raise ValueError(f"loaded state dict has state for unknown param id {sid!r}")
        p = opt._all_params[id_map[sid]]
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() != p.numel() \
                    and opt.sharding == layout.FLAT:
                raise ValueError(f"state {k!r} of param {sid} has {v.numel()} elements, the "
                                 f"param has {p.numel()}")
        mapped[id_map[sid]] = st
    return mapped


def load(opt: "ZeroRedundancyOptimizer", state_dict: dict) -> None:
    saved = _check_and_map(opt, state_dict)
    for g, sg in zip(opt.param_groups, state_dict["param_groups"]):
        for k, v in sg.items():
            if k not in ("params", "param_names"):
                g[k] = copy.deepcopy(v)

    local_groups, local_state, idx = [], {}, 0
    for gi, g in enumerate(opt.param_groups):
        hyper = {k: v for k, v in g.items() if k != "params"}
        ids = []
        if opt.sharding == layout.PARAM:
            for pid in local_param_ids(opt, gi):
                if pid in saved:
                    local_state[idx] = {k: _clone(v) for k, v in saved[pid].items()}
                ids.append(idx)
                idx += 1
        else:
            for sh in opt._shards:
                for run in sh["runs"]:
                    if run["group"] != gi:
                        continue
                    st = _run_state(sh, run, saved, opt)
                    if st:
                        local_state[idx] = st
                    ids.append(idx)
                    idx += 1
        local_groups.append({**hyper, "params": ids})
    opt.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
    if opt._stepper is not None:
        opt._stepper.reset()


def _run_state(sh: dict, run: dict, saved: dict, opt) -> dict:
    """Flat mode: the state of one local run, cut out of the saved per-param states."""
    n = run["end"] - run["start"]
    st: dict = {}
    for pc in run["pieces"]:
        s = saved.get(pc.param_id)
        if not s:
            continue
        rel = pc.bucket_start - sh["lo"] - run["start"]
        numel = opt._all_params[pc.param_id].numel()
        for k, v in s.items():
            if _is_per_element(v, numel):
                if k not in st:
                    st[k] = torch.zeros(n, dtype=v.dtype, device=v.device)
                st[k][rel:rel + pc.length].copy_(v.reshape(-1)[pc.start:pc.start + pc.length])
            elif k not in st:
                st[k] = _clone(v)
    return st
