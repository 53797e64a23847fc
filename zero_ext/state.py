"""Optimizer state in torch's format, whatever the sharding.

torch's format: {"state": {global index: {name: value}}, "param_groups": [{..., "params":
[global indices]}]}, indices numbering params in the user's group order. A rank holds
"segments" of that state: whole params ("param" mode) or element ranges of them ("flat"
mode). Per-element values (exp_avg, momentum_buffer, ...) are split with the param; scalar
values (step, 0-d tensors, numbers) are the same for every segment of a param.

This module owns three things:
- `local_state(opt)`: this rank's segments as views (no copies), plus scalars; shared by the
  consolidation below and by the sharded checkpoints (checkpoint.py).
- `consolidate(opt, to)`: the full state on rank `to` only. Tensors travel with point-to-point
  sends in messages of at most CONSOLIDATE_CHUNK elements (no pickling of tensors); only
  the small description of every rank's segments goes through gather_object. Peak extra
  memory: full state + one chunk on `to`, one chunk elsewhere (none when every message is
  a view of a single state tensor, the usual case for big params).
- `load(opt, torch_format_dict)` and `install(...)`: put state into the local optimizer.
  Where only some ranks hold the dict and the others the placeholder that `state_dict()`
  returns away from the consolidating rank (`placeholder`), one holder sends every other
  rank its share (`_scatter`): a load never needs the whole state on every rank.
"""
from __future__ import annotations

import copy
import hashlib
import inspect
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import layout
from .agree import agree
from .engine import MASTER, keep_loaded_state
from .hybrid import Job
from .fused_adamw import FusedAdamW
from .groups import copy_hyperparameters, hyperparameters
from .sync import backend_device, gather_objects, recv_segments, send_segments

if TYPE_CHECKING:  # pragma: no cover
    from .zero import ZeroRedundancyOptimizer

# Elements per consolidation message (also the size of the staging buffer when a message
# packs several small segments, or when the transport device differs from the state's).
CONSOLIDATE_CHUNK = int(os.environ.get("ZERO_EXT_CONSOLIDATE_CHUNK", str(1 << 22)))


def _is_per_element(value, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


def _clone(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _portable(value):
    """A CPU copy of a scalar state value, safe to pickle and to hand out."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return copy.deepcopy(value)


def _flat(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


# ------------------------------------------------------------------------ local segments


@dataclass
class Segment:
    """A run of one state tensor of one param that this rank holds."""

    pid: int                  # global param index (torch's state-dict numbering)
    name: str                 # state name ("exp_avg", ...)
    start: int                # first element inside the param (flattened); 0 for whole
    length: int
    tensor: torch.Tensor      # 1-D contiguous view of the local state (no copy)
    whole_shape: tuple | None = None  # set for dim>0 tensors that are not per-element

    def describe(self) -> tuple:
        return (self.pid, self.name, self.start, self.length, str(self.tensor.dtype),
                self.whole_shape)


@dataclass
class LocalState:
    segments: list[Segment] = field(default_factory=list)
    scalars: dict[int, dict] = field(default_factory=dict)   # pid -> {name: value}
    order: dict[int, list[str]] = field(default_factory=dict)  # pid -> state names

    def describe(self) -> dict:
        """Small, picklable: what the segments are, scalars copied to CPU."""
        return {"segs": [s.describe() for s in self.segments],
                "scalars": {pid: {k: _portable(v) for k, v in sc.items()}
                            for pid, sc in self.scalars.items()},
                "order": dict(self.order)}


def local_state(opt: "ZeroRedundancyOptimizer") -> LocalState:
    """This rank's optimizer state as segments (views into the local optimizer's state)."""
    out = LocalState()
    plan = opt.plan
    for lp in plan.local:
        st = opt.optim.state.get(lp.key)
        if not st:
            continue
        out.order.setdefault(lp.param_id, list(st))
        for k, v in st.items():
            if _is_per_element(v, lp.length):
                out.segments.append(Segment(lp.param_id, k, lp.start, lp.length, _flat(v)))
            elif (plan.sharding == layout.PARAM and isinstance(v, torch.Tensor)
                  and v.dim() > 0 and v.numel() > 0):  # whole-param state of another shape
                out.segments.append(Segment(lp.param_id, k, 0, v.numel(), _flat(v),
                                            tuple(v.shape)))
            else:  # 0-d and empty tensors, numbers, anything else: small
                out.scalars.setdefault(lp.param_id, {}).setdefault(k, v)
    return out


# ------------------------------------------------------------------------ consolidation


def zero_gaps(dest: torch.Tensor, covered: list) -> None:
    """Zero the elements of 1-D `dest` outside the [a, b) spans in `covered`."""
    pos = 0
    for a, b in sorted(covered):
        if a > pos:
            dest[pos:a].zero_()
        pos = max(pos, b)
    if pos < dest.numel():
        dest[pos:].zero_()


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))


class _FullState:
    """Rank `to`'s full-size state tensors (CPU), filled segment by segment."""

    def __init__(self, opt):
        self.opt = opt
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}
        self.covered: dict[tuple, list[tuple[int, int]]] = {}
        self.scalars: dict[int, dict] = {}
        self.order: dict[int, list[str]] = {}

    def add_rank(self, desc: dict) -> list[torch.Tensor]:
        """Allocate what rank's segments need; returns one 1-D destination per segment."""
        dests = []
        for pid, name, start, length, dt, whole in desc["segs"]:
            st = self.tensors.setdefault(pid, {})
            if whole is not None:
                if name not in st:
                    st[name] = torch.empty(whole, dtype=_dtype(dt))
                dests.append(st[name].view(-1))
                continue
            if name not in st:
                st[name] = torch.empty(self.opt.plan.params[pid].numel(), dtype=_dtype(dt))
            self.covered.setdefault((pid, name), []).append((start, start + length))
            dests.append(st[name][start:start + length])
        for pid, sc in desc["scalars"].items():
            into = self.scalars.setdefault(pid, {})
            for k, v in sc.items():
                into.setdefault(k, v)
        for pid, names in desc["order"].items():
            self.order.setdefault(pid, names)
        return dests

    def result(self) -> dict[int, dict]:
        for (pid, name), spans in self.covered.items():  # elements no rank had: zeros
            zero_gaps(self.tensors[pid][name], spans)
        full: dict[int, dict] = {}
        for pid in sorted(set(self.tensors) | set(self.scalars)):
            shape = self.opt.plan.params[pid].shape
            values = dict(self.scalars.get(pid, {}))
            for name, t in self.tensors.get(pid, {}).items():
                values[name] = t.view(shape) if (pid, name) in self.covered else t
            names = self.order.get(pid, [])
            full[pid] = {k: values[k] for k in names if k in values}
            full[pid].update({k: v for k, v in values.items() if k not in full[pid]})
        return full


def consolidate(opt: "ZeroRedundancyOptimizer", to: int) -> dict | None:
    """Gather every rank's state on rank `to` only; returns the full state there.

    Collective (call on every rank). Tensors move rank -> `to` with send/recv in messages
    of at most CONSOLIDATE_CHUNK elements; the result lives on the CPU.
    """
    if not 0 <= to < opt.world_size:
        raise ValueError(f"consolidate_state_dict: to={to} is not a rank of the process group "
                         f"(world size {opt.world_size})")
    mine = local_state(opt)
    desc = mine.describe()
    chunk = CONSOLIDATE_CHUNK
    if opt.world_size == 1:
        full = _FullState(opt)
        for seg, dst in zip(mine.segments, full.add_rank(desc)):
            dst.copy_(seg.tensor)
        return full.result()
    group = opt.process_group
    gathered = gather_objects(desc, to, group, opt.world_size)
    if opt.rank != to:
        send_segments(group, [seg.tensor for seg in mine.segments], desc["segs"], to, chunk)
        return None
    full = _FullState(opt)
    per_rank = [full.add_rank(d) for d in gathered]
    for seg, dst in zip(mine.segments, per_rank[to]):
        dst.copy_(seg.tensor)
    for r in range(opt.world_size):
        if r != to:
            recv_segments(group, gathered[r]["segs"], per_rank[r], r, chunk)
    return full.result()


def created_at_init(opt: "ZeroRedundancyOptimizer") -> bool:
    """Whether optimizer_class made per-param state when it was built (torch's Adagrad, a
    custom warm start), before any step or load: state_dict() must then gather it instead
    of answering "empty" at once. The same answer on every rank without communication,
    also on a rank that holds no piece: a probe instance over meta copies of every param
    (no memory, no data); if the class cannot be built so, this rank's own state decides."""
    if any(opt.optim.state.values()):
        return True
    cls = opt.optimizer_class
    groups = [{**hyperparameters(g), "params": [torch.empty_like(p, device="meta")
                                                for p in g["params"]]}
              for g in opt.param_groups]
    try:
        accepted = inspect.signature(cls).parameters
        first = groups[0] if groups else {}
        probe = cls(groups, **{k: v for k, v in first.items()
                               if k in accepted and k != "params"})
        return any(probe.state.values())
    except Exception:  # noqa: BLE001 - a class that needs real data to be built
        return False


def torch_format(opt: "ZeroRedundancyOptimizer", full_state: dict) -> dict:
    return {"state": full_state, "param_groups": torch_groups(opt)}


# state_dict() away from the rank the state was consolidated on returns this
PLACEHOLDER_KEY = "zero_ext_placeholder"


def placeholder(opt: "ZeroRedundancyOptimizer", to: int) -> dict:
    """What state_dict() returns on the ranks that did not receive the consolidated state:
    where it is, and no "state" key, so that it cannot pass for a state dict (torch's
    load_state_dict raises KeyError on it). load_state_dict takes it: the ranks holding the
    real dict send the others their shares."""
    g = to if opt.process_group is None else dist.get_global_rank(opt.process_group, to)
    return {PLACEHOLDER_KEY: {"consolidated_on_group_rank": to, "global_rank": g,
                              "world_size": opt.world_size}}


def is_placeholder(state_dict) -> bool:
    return (isinstance(state_dict, dict) and PLACEHOLDER_KEY in state_dict
            and "state" not in state_dict)


def torch_groups(opt: "ZeroRedundancyOptimizer") -> list[dict]:
    groups, start = [], 0
    for g in opt.param_groups:
        n = len(g["params"])
        groups.append({**hyperparameters(g),
                       "params": list(range(start, start + n))})
        start += n
    return groups


# ------------------------------------------------------------------------ loading


def install(opt: "ZeroRedundancyOptimizer", saved_groups: list[dict],
            local_states: dict[int, dict], class_policy: bool = False) -> None:
    """Copy the saved groups' hyperparameters into the optimizer and load `local_states`
    (local index, in plan.local_pieces order -> state) into the local optimizer. The values
    must not be shared with anything the caller keeps: the optimizer steps them in place.
    `class_policy`: the hyperparameters become what optimizer_class's own load_state_dict
    makes of them, as for a plain torch optimizer (a torch-format load); else they are
    restored exactly (our own checkpoints)."""
    for g, sg in zip(opt.param_groups, saved_groups):
        for k, v in sg.items():
            if k not in ("params", "param_names"):
                g[k] = copy.deepcopy(v)
    local_groups, idx = [], 0
    for gi, g in enumerate(opt.param_groups):
        n = len(opt.plan.local_pieces(gi))
        local_groups.append({**hyperparameters(g), "params": list(range(idx, idx + n))})
        idx += n
    opt.optim.load_state_dict({"state": local_states, "param_groups": local_groups})
    _keep_master_state(opt, local_states)
    if class_policy:  # e.g. AdamW sets decoupled_weight_decay=True on load
        copy_hyperparameters(opt.optim.param_groups, opt.param_groups)
    opt.state_loaded()


def _keep_master_state(opt: "ZeroRedundancyOptimizer", local_states: dict[int, dict]) -> None:
    """Loaded float32 masters and moments stay float32 (see engine.keep_loaded_state); a
    state without a master gets one from the param at the next step."""
    keys = [lp.key for gi in range(len(opt.param_groups)) for lp in opt.plan.local_pieces(gi)]
    for idx, saved in local_states.items():
        st = opt.optim.state.get(keys[idx])
        if st:  # `saved` is install's own copy: no need to copy again
            keep_loaded_state(st, keys[idx], saved, opt.master_weights, copy=False)


_ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")


def required_state_keys(optimizer_class: type, group: dict) -> tuple[str, ...]:
    """Per-param state keys without which `optimizer_class` cannot step (its own
    load_state_dict accepts anything and fails only at the next step). Empty when unknown:
    SGD, for one, starts a missing momentum buffer afresh, as torch does."""
    if isinstance(optimizer_class, type) and issubclass(
            optimizer_class, (torch.optim.Adam, torch.optim.AdamW, FusedAdamW)):
        return _ADAM_KEYS + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
    return ()


# Per-param state tensors of torch's built-in optimizers that hold one value per element.
_PER_ELEMENT_KEYS = {
    "SGD": ("momentum_buffer",), "Adagrad": ("sum",), "Adadelta": ("square_avg", "acc_delta"),
    "RMSprop": ("square_avg", "momentum_buffer", "grad_avg"), "Adamax": ("exp_avg", "exp_inf"),
    "NAdam": ("exp_avg", "exp_avg_sq"), "RAdam": ("exp_avg", "exp_avg_sq"),
    "Rprop": ("prev", "step_size"), "ASGD": ("ax",),
    "Adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "AdamW": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
}


def _per_element_keys(optimizer_class: type) -> tuple[str, ...]:
    if issubclass(optimizer_class, FusedAdamW):
        return _PER_ELEMENT_KEYS["AdamW"]
    for base in optimizer_class.__mro__:
        if base.__module__.startswith("torch.optim") and base.__name__ in _PER_ELEMENT_KEYS:
            return _PER_ELEMENT_KEYS[base.__name__]
    return ()


def state_problems(opt: "ZeroRedundancyOptimizer", pid: int, names, numels: dict) -> list[str]:
    """What is wrong with the saved state of global param `pid` for this optimizer:
    `names` are its state keys, `numels` the element count of each tensor-valued key."""
    p = opt.plan.params[pid]
    gi = opt.plan.group_of[pid]
    cls = opt.optimizer_class
    out = []
    names = set(names)
    if names:
        missing = [k for k in required_state_keys(cls, opt.param_groups[gi]) if k not in names]
        if missing:
            out.append(f"param {pid} (group {gi}) has state {sorted(names)} but "
                       f"{cls.__name__} needs {missing} (saved by another optimizer class, "
                       "or with other settings such as amsgrad?)")
    for k in _per_element_keys(cls) + (MASTER,):
        n = numels.get(k)
        if n is not None and n != p.numel():
            out.append(f"param {pid} (group {gi}): state {k!r} has {n} elements, the param "
                       f"has {p.numel()} (shape {tuple(p.shape)})")
    if opt.sharding in layout.SPLIT_MODES:
        for k, n in numels.items():
            if k not in _ADAM_KEYS and n is not None and n > 1 and n != p.numel():
                out.append(f"param {pid}: state {k!r} has {n} elements, the param has "
                           f"{p.numel()}; sharding={opt.sharding!r} can only split "
                           "per-element state")
    return out


def _shape_problems(opt: "ZeroRedundancyOptimizer", pid: int, st: dict) -> list[str]:
    """Per-element state of another shape than the param (a (4, 6) weight saved, a (6, 4)
    one now): the same numel would slice and step, silently on transposed values. Compared
    with the user's param, never with a flat-mode key (1-D)."""
    p = opt.plan.params[pid]
    return [f"param {pid} (group {opt.plan.group_of[pid]}): state {k!r} has shape "
            f"{tuple(v.shape)}, the param has shape {tuple(p.shape)}"
            for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim() > 0
            and v.numel() == p.numel() and v.shape != p.shape]


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
    mapped, problems = {}, []
    for sid, st in state_dict["state"].items():
        if sid not in id_map:
            raise ValueError(f"loaded state dict has state for unknown param id {sid!r}")
        if not isinstance(st, dict):
            raise ValueError(f"loaded state of param id {sid!r} is a {type(st).__name__}, "
                             "not a dict")
        numels = {k: v.numel() for k, v in st.items()
                  if isinstance(v, torch.Tensor) and v.dim() > 0}
        problems += state_problems(opt, id_map[sid], st.keys(), numels)
        problems += _shape_problems(opt, id_map[sid], st)
        mapped[id_map[sid]] = st
    if problems:
        raise ValueError("load_state_dict: the state dict does not fit the optimizer: "
                         + "; ".join(problems[:8])
                         + (f"; and {len(problems) - 8} more" if len(problems) > 8 else ""))
    return mapped


def load(opt: "ZeroRedundancyOptimizer", state_dict: dict | None) -> None:
    """Load a torch-format optimizer state dict (the caller's dict is never aliased).

    Collective: every rank validates the whole dict (every param's state keys and shapes,
    not only its own share) and the ranks agree before anything is installed, so a bad
    dict raises the same error on every rank and leaves the optimizer unchanged. Ranks
    given None or the placeholder of `state_dict()` receive their share from the lowest
    rank that holds a real dict (every rank's share comes from that one dict then). The
    ranks holding a dict must hold the same one (a digest of its structure, scalars and
    the ends of every tensor is compared): a fresh optimizer's state_dict() passed on some
    ranks next to a checkpoint's on others is an error on every rank, not a half-load.
    Under hybrid_groups() the ranks are the whole job (`_load_job`)."""
    holder = state_dict is not None and not is_placeholder(state_dict)
    job = _load_job(opt)
    error, saved, local_state_, digest = None, None, {}, 0
    try:
        if holder:
            saved = _check_and_map(opt, state_dict)
            digest = _digest(state_dict)
            local_state_ = _local_states(opt.plan, opt.rank, saved)
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
        error = exc
    # replicas whose pieces differ cannot serve each other's shares
    shards = opt.plan.digest() if job.world > opt.world_size else 0
    # max over ranks: any holder, any non-holder, the lowest holder, the holders' digests
    # (max of d and of -d; a non-holder stays below every holder in both), the plans'
    holders, others, first, top, bottom, s_top, s_bottom = agree(
        job.group, job.world, error, "load_state_dict",
        (int(holder), int(not holder), job.world - job.rank if holder else 0,
         digest if holder else -1, -digest if holder else -(1 << 62), shards, -shards),
        peer_value_error=True)  # a dict that does not fit is a ValueError everywhere
    if holders and top != -bottom:
        raise ValueError(
            "load_state_dict: the ranks were given different state dicts (another save, "
            "or a fresh optimizer's state_dict() on some ranks): give every rank the same "
            "dict, or give it to some ranks and None to the others (they receive their "
            "share)")
    if s_top != -s_bottom:
        raise ValueError(
            "load_state_dict: the shard groups of hybrid_groups() hold optimizers cut "
            "differently (other params, groups, sharding or frozen params): they are not "
            "replicas of one optimizer")
    saved_groups = state_dict["param_groups"] if holder else None
    if others:
        if not holders:
            raise ValueError(
                "load_state_dict: no rank was given a state dict (every rank got None or "
                "the placeholder that state_dict() returns on ranks that did not receive "
                "the consolidated state); load the dict saved from the consolidating rank "
                "(rank 0) on at least one rank")
        local_state_, saved_groups = _scatter(opt, job, job.world - first, saved,
                                              saved_groups, local_state_)
    install(opt, saved_groups, local_state_, class_policy=True)


def _load_job(opt: "ZeroRedundancyOptimizer") -> Job:
    """The ranks of a load_state_dict: the optimizer's process group, or the whole job when
    that group is a shard group of hybrid_groups() (its replicas load together, so the
    README's `torch.load(f) if rank == 0 else None` serves every replica, and a bad dict
    stops every replica before any returns). Other subgroups stay on their own: they may be
    independent optimizers (pipeline stages) that load at their own time."""
    return opt.replicated_job


def _scatter(opt: "ZeroRedundancyOptimizer", job: Job, src: int, saved: dict | None,
             saved_groups: list | None, mine: dict) -> tuple[dict, list]:
    """Job rank `src` (which holds the real dict) sends every other rank of the job its
    local state: first its description (names, dtypes, shapes, scalars, the saved groups)
    as an object, then the tensors as bounded point-to-point messages
    (sync.send_segments). Returns this rank's (local state, saved param groups)."""
    group, plan = job.group, opt.plan
    dev = backend_device(group)
    if job.rank == src:
        for j in range(job.world):
            if j == src:
                continue
            # hybrid_groups() cuts the job into blocks of opt.world_size ranks: job rank j
            # is rank j % world of its shard group (the job is the group itself otherwise)
            states = _local_states(plan, j % opt.world_size, saved)
            tensors, descs, scalars = [], [], {}
            for idx, st in states.items():
                for name, v in st.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        t = v.detach().reshape(-1)
                        tensors.append(t if t.device == dev else t.to(dev))
                        descs.append((idx, name, 0, t.numel(), str(t.dtype), tuple(v.shape)))
                    else:
                        scalars.setdefault(idx, {})[name] = _portable(v)
            order = {idx: list(st) for idx, st in states.items()}
            desc = [{"segs": descs, "scalars": scalars, "order": order,
                     "groups": saved_groups}]
            dist.send_object_list(desc, dst=dist.get_global_rank(group, j), group=group)
            send_segments(group, tensors, descs, j, CONSOLIDATE_CHUNK)
        return mine, saved_groups
    box = [None]
    dist.recv_object_list(box, src=dist.get_global_rank(group, src), group=group)
    desc = box[0]
    dests = [torch.empty(d[3], dtype=_dtype(d[4]), device=dev) for d in desc["segs"]]
    recv_segments(group, desc["segs"], dests, src, CONSOLIDATE_CHUNK)
    values: dict[int, dict] = {}
    for d, t in zip(desc["segs"], dests):
        values.setdefault(d[0], {})[d[1]] = t.view(d[5])
    for idx, sc in desc["scalars"].items():
        values.setdefault(idx, {}).update(sc)
    local = {idx: {k: values[idx][k] for k in names if k in values[idx]}
             for idx, names in desc["order"].items()}
    return local, desc["groups"]


def _digest(state_dict: dict) -> int:
    """60 bits of a hash of what a state dict is: its groups' hyperparameters and param
    ids, every state entry's name, and for tensors their shape, dtype, first and last
    element (no pass over the data), for other values their value."""
    def value(v):
        if isinstance(v, torch.Tensor):
            flat = v.detach().reshape(-1)
            ends = (flat[0].item(), flat[-1].item()) if flat.numel() else ()
            return ("T", tuple(v.shape), str(v.dtype), ends)
        if isinstance(v, (list, tuple)):
            return tuple(value(x) for x in v)
        return repr(v)

    groups = [sorted((k, value(v)) for k, v in g.items()) for g in state_dict["param_groups"]]
    st = [(repr(pid), sorted((k, value(v)) for k, v in s.items()))
          for pid, s in sorted(state_dict["state"].items(), key=lambda kv: repr(kv[0]))]
    return int(hashlib.sha256(repr((groups, st)).encode()).hexdigest()[:15], 16)


def _local_states(plan: layout.ShardPlan, rank: int, saved: dict) -> dict:
    """{local index: state} of group rank `rank`'s pieces, in its local optimizer's order."""
    out = {}
    for idx, (_, pid, start, length) in enumerate(plan.local_order(rank)):
        st = _slice_state(plan, pid, start, length, saved)
        if st:
            out[idx] = st
    return out


def _slice_state(plan: layout.ShardPlan, pid: int, start: int, length: int,
                 saved: dict) -> dict:
    """The state of one piece (elements [start, start+length) of param `pid`): a copy of the
    saved per-param state, per-element values cut to the piece and shaped like its key (the
    param's own shape in "param" mode, 1-D in "flat"). Never aliases the caller's tensors."""
    s = saved.get(pid)
    if not s:
        return {}
    p = plan.params[pid]
    numel = p.numel()
    shape = p.shape if plan.sharding == layout.PARAM else (length,)
    return {k: (v.detach().reshape(-1)[start:start + length].clone().view(shape)
                if _is_per_element(v, numel) else _clone(v))
            for k, v in s.items()}
