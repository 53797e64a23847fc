"""Scale evidence without the hardware: zero_ext.ZeroRedundancyOptimizer at world 2 .. 1024.

One process plays rank 0 of a world of W ranks with torch's fake process group
(``torch.testing._internal.distributed.fake_pg``: every collective returns at once, nothing
moves), on parameters on the ``meta`` device (shapes and dtypes, no memory). For each model
(GPT-2 small, Llama-2 7B, Llama-2 70B; nanoGPT's groups: 2-D weights decay, 1-D don't) x
world x sharding ("param", "flat", "even"), with torch.optim.AdamW, it builds the optimizer,
runs one real step on fake grads, and reads the shard plan (``opt.plan``, zero_ext/layout.py)
for the figures of every other rank. Columns (a row marked ``*``: even mode above
--even-step-limit (param, rank) chunks, where the step's exchange costs O(params x world)
host work, seconds per step at world 1024: the step is not run, its figures come from the
plans and the agreement all-reduce from another mode's step at the same world):

- ``ctor ms``: construction of zero_ext's optimizer (median of --repeats, after a warm-up);
  ``plan ms``: the part spent in the shard plan (``ShardPlan.add_generation`` + ``bind_local``:
  owners, buckets, this rank's pieces). ``torch ms``: torch's own ZeroRedundancyOptimizer
  built from the same meta params at the same world (also works on meta + fake PG).
- ``state/rank max``, ``mean``, ``max/mean``: optimizer state bytes each rank holds, from the
  plan (every rank's pieces): AdamW keeps exp_avg + exp_avg_sq, 8 bytes per fp32 element
  (12 with ``--dtype bfloat16 --master-weights``: two fp32 moments + the fp32 master);
  padding excluded. Rank 0's figure is checked against ``opt.local_numel``.
- ``colls/step``: collectives rank 0 issued in its second step (counted by wrapping
  torch.distributed's collective functions; every rank issues the same sequence): the step's
  agreement all_reduce(s) + the exchange's broadcasts (even mode: all_gather_into_tensor, as
  the fake group is not gloo). ``bcast/gather`` of them are the exchange.
- ``sends/rank max`` and ``rank0 sends``: payload bytes a rank *sends* per step, defined as
  the bytes it is the source of: a broadcast it is ``src`` of (its own updated elements), its
  input to an all_reduce / all_gather. Rank 0's figure is counted from the wrapped calls,
  every rank's from the exchange plan (``sync.plan_messages`` / ``sync.plan_gathers``, the
  same code the step runs; the two agree for rank 0, checked). How many bytes cross each
  link is the backend's algorithm (a ring or tree broadcast forwards the payload through
  intermediate ranks), so ``recv/rank``, the bytes every rank must receive (all other ranks'
  updates: ~ the whole model in param dtype), is the algorithm-independent bound on a rank's
  inbound traffic (the critical-path table below models gloo's algorithms).
- ``step ms``: host time of one of rank 0's later steps (median of up to --repeats, ~0.5 s
  of them at most; fake collectives, meta tensors: the Python and dispatch cost of planning
  and issuing the step, not compute or transfer time).
- ``ckpt meta``: size of ``torch.save`` of the checkpoint metadata that rank 0 writes
  (``zero_ext.checkpoint.format._build_meta``), built from every rank's description as
  ``checkpoint.save`` would gather them (rank 0's from its real state after the step, the
  others' from the plan, in the same code: ``format._save_items``; rank 0's two are checked
  equal). ``gathered``: pickled size of all ranks' descriptions (what rank 0 receives via
  gather_object); ``meta ms``: time of ``_build_meta``.

Reduce-scatter mode (``zero_ext.ddp_zero_hook.reduce_scatter_hook``), one table per run:
collectives and bytes per iteration per rank, in the ring model of ``common.ring_wire_bytes``
(the one bench_iteration.py counts with), next to DDP's ring all-reduce of the model,
2(W-1)/W of its bytes. The hook needs DDP's GradBuckets, which DDP does not build on meta
params, so they are computed: DDP's rebuilt buckets (params in reverse module order, as
their grads become ready, cut by torch's own ``dist._compute_bucket_assignment_by_size``
at DDP's 1 MiB first / 25 MiB caps); each is then cut by the hook's own code
(``GradReducer.bucket_plan``, from the optimizer's plan) into the split sizes of its
``all_to_all_single`` per segment (the hook cuts a bucket into segments where a rank would
receive more than ``reduce_scatter.plan.SEGMENT_BYTES``): a rank sends each
bucket's elements owned by the others. Where that cutting would walk more than
--hook-plan-limit (all_to_all, rank) pairs (marked ``+``; O(segments x world) Python work,
minutes for Llama-2 70B at world 1024), the splits come per bucket from the hook's ownership
map (``HookSeam.ownership``) and the call count is estimated (``~``); the segments take
each rank's share of the bucket in proportion, so the critical path is the same (checked
where both are computed). The step's exchange comes from its plan (checked against rank 0's
counted calls where the step runs), its agreement is counted in one step of rank 0, and the
clip's one all-reduce (of 2W+1 float64: ``opt.clip_grad_norm_`` reads grad values, which
meta params do not have) is added; in the ring model they cost every rank the same.

Critical path, one table per run (the hook's iteration): a collective lasts as long as its
busiest rank's link, max(bytes sent, bytes received); the critical path sums that over the
collectives in issue order (``common.gloo_link_bytes`` / ``critical_path``, which
bench_iteration.py applies to traced runs). Every rank's figures come from the plans, no
collective runs: the hook's all_to_all, rank r sends sum_{j != r} split_j and receives
(W-1) split_r; gloo's broadcast, the root sends (W-1) n itself (param and flat modes: one
per owner's packed pieces; even mode at world 2 on gloo: one per owner packed across
params); a ring all_gather_into_tensor (even mode elsewhere: ``sync.plan_gathers``), (W-1)
parts each way on every link; the clip's and the agreement's all-reduces, rings. Columns,
in units of DDP's ring all-reduce of the grads (2(W-1)/W of the model on every link):
``grads`` = the all_to_alls, ``grads+params`` = the whole iteration, ``crit`` its critical
path, ``mean`` the bytes a rank sends, mean over ranks; ``params crit`` the exchange alone.
Even mode at world 2 is also given with its exchange as ring all-gathers (what NCCL and the
fake group run). Not modelled: collectives in flight together on gloo's two lanes (the
exchange and the hook alternate lanes), which share a link where this sums them.

Limits of meta + fake: no compute or transfer time (only host cost), no DCP file writing
(the ``.metadata`` of torch.distributed.checkpoint and the files are not produced), and the
fake backend is neither gloo nor NCCL: with ``--bucket-view`` the exchange takes the generic
path (one broadcast per non-empty rank range per bucket), where NCCL in flat mode issues one
all_gather_into_tensor per bucket and gloo sends each rank range in chunks over two lanes.

Extra checks (full run, or --extras): partition planning on a synthetic many-param model
(where an O(world) step per param or per local-search step shows), and the Exchanger's
rank translation for a process subgroup (torch.distributed.get_global_rank is O(group size),
called once per rank).

    python benchmarks/bench_scale.py            # full run (about a minute on 2 cores)
    python benchmarks/bench_scale.py --quick    # smoke run, well under a minute
    python benchmarks/bench_scale.py --models llama2-70b --worlds 1024 --profile
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import inspect
import io
import json
import os
import pickle
import pstats
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import model_shapes  # noqa: E402
from common import gloo_link_bytes, ring_wire_bytes, tensor_bytes  # noqa: E402

import zero_ext  # noqa: E402
from zero_ext import layout, state, sync  # noqa: E402
from zero_ext.reduce_scatter import hook as rs_hook  # noqa: E402
from zero_ext.reduce_scatter import plan as rs_plan  # noqa: E402
from zero_ext import sync as sync_mod  # noqa: E402
from zero_ext.checkpoint import format as ckpt_format  # noqa: E402
from zero_ext.kernels import partition  # noqa: E402
from zero_ext.kernels._loader import native_available  # noqa: E402

WORLDS = (2, 8, 64, 256, 1024)
MODELS = ("gpt2-small", "llama2-7b", "llama2-70b")
SHARDINGS = ("param", "flat", "even")
QUICK_WORLDS = (8, 1024)

GiB, MiB, KiB = float(1 << 30), float(1 << 20), float(1 << 10)


# ------------------------------------------------------------------ fake world

def init_world(world: int) -> None:
    """This process becomes rank 0 of a fake world of `world` ranks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def meta_params(shapes, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.empty(s, dtype=dtype, device="meta")) for _, s in shapes]


def nanogpt_groups(params) -> list[dict]:
    """nanoGPT's configure_optimizers: every 2-D+ tensor decays, biases and norms don't."""
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


# ------------------------------------------------------------------ counting collectives

_COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor",
                "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single",
                "all_to_all_single", "gather", "scatter", "reduce",
                "send", "recv", "isend", "irecv", "barrier", "all_gather_object",
                "gather_object", "broadcast_object_list")


class CollectiveCounter:
    """Wraps torch.distributed's collectives (module attributes, which zero_ext calls as
    ``dist.broadcast(...)``) and records per call (name, payload bytes, bytes this rank
    sent, its ring-model bytes (``common.ring_wire_bytes``), its link's bytes sent and
    received under gloo's algorithms (``common.gloo_link_bytes``))."""

    def __init__(self):
        self.calls: list[tuple[str, int, int, int, int, int]] = []
        self._saved: dict = {}

    def _sent(self, name, args, kwargs) -> tuple[int, int]:
        arg = lambda i, key: kwargs[key] if key in kwargs else (  # noqa: E731
            args[i] if len(args) > i else None)
        if name == "broadcast":
            t, src, group = arg(0, "tensor"), arg(1, "src"), arg(2, "group")
            me = dist.get_rank()  # src is a global rank
            if src is None and kwargs.get("group_src") is not None:
                src = dist.get_global_rank(group or dist.group.WORLD, kwargs["group_src"])
            n = tensor_bytes(t)
            return n, n if src == me else 0
        if name in ("all_reduce", "reduce", "send", "isend", "all_to_all_single"):
            t = arg(1, "input") if name == "all_to_all_single" else arg(0, "tensor")
            n = tensor_bytes(t)
            return n, n
        if name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single",
                    "reduce_scatter_single"):
            gather = name.startswith("all_gather")
            inp = arg(1, "input_tensor" if gather else "input")
            out = arg(0, "output_tensor" if gather else "output")
            return tensor_bytes(out), tensor_bytes(inp)
        if name == "all_gather":
            return tensor_bytes(arg(0, "tensor_list")), tensor_bytes(arg(1, "tensor"))
        if name in ("all_gather_object", "gather_object"):
            obj = arg(1, "obj") if name == "all_gather_object" else arg(0, "obj")
            n = len(pickle.dumps(obj))
            return n, n
        if name in ("recv", "irecv"):
            return tensor_bytes(arg(0, "tensor")), 0
        return 0, 0

    def __enter__(self):
        for name in _COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn
            sig = inspect.signature(fn)

            def wrapper(*args, __name=name, __fn=fn, __sig=sig, **kwargs):
                payload, sent = self._sent(__name, args, kwargs)
                bound = __sig.bind(*args, **kwargs)
                bound.apply_defaults()
                ring = ring_wire_bytes(__name, bound.arguments)
                out = __fn(*args, **kwargs)
                link = gloo_link_bytes(__name, bound.arguments)  # (object lists: filled)
                self.calls.append((__name, payload, sent, ring, *link))
                return out

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved = {}

    @property
    def count(self) -> int:
        return len(self.calls)

    def count_of(self, name: str) -> int:
        return sum(1 for c in self.calls if c[0] == name)

    @property
    def sent(self) -> int:
        return sum(c[2] for c in self.calls)


# ------------------------------------------------------------------ plan time

@contextlib.contextmanager
def plan_timer():
    """Accumulates the seconds spent in the shard plan while the context is open."""
    spent = [0.0]
    saved = {}
    for name in ("add_generation", "bind_local"):
        fn = getattr(layout.ShardPlan, name)
        saved[name] = fn

        def timed(self, *a, __fn=fn, **k):
            t0 = time.perf_counter()
            try:
                return __fn(self, *a, **k)
            finally:
                spent[0] += time.perf_counter() - t0

        setattr(layout.ShardPlan, name, timed)
    try:
        yield spent
    finally:
        for name, fn in saved.items():
            setattr(layout.ShardPlan, name, fn)


# ------------------------------------------------------------------ figures from the plan

def rank_elements(plan: layout.ShardPlan) -> list[int]:
    """Param elements whose optimizer state each rank holds (padding excluded)."""
    world = plan.world_size
    elems = [0] * world
    placed = set()
    for b in plan.buckets:
        placed.update(b.param_ids)
        for r in range(world):
            elems[r] += sum(pc.length for pc in b.pieces(r))
    if plan.sharding == layout.PARAM:  # owned params outside every bucket (frozen, tied)
        for pid, r in enumerate(plan.owner):
            if pid not in placed:
                elems[r] += plan.params[pid].numel()
    return elems


def _elem_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def rank_sends(opt) -> list[int]:
    """Bytes each rank is the source of in one step's exchange, from the exchange plan (the
    form the fake group runs: even mode's gathers, where every rank's input is its padded
    part of each)."""
    plan = opt.plan
    sent = [0] * plan.world_size
    if opt.parameters_as_bucket_view:
        for b in plan.buckets:
            size = _elem_size(b.dtype)
            for r, (lo, hi) in enumerate(b.rank_ranges):
                sent[r] += (hi - lo) * size
        return sent
    if plan.sharding == layout.EVEN:
        part = sum(g.size * _elem_size(g.dtype)
                   for g in sync.plan_gathers(plan.buckets, plan.world_size, plan.trainable))
        return [part] * plan.world_size
    for m in sync.plan_messages(plan.buckets, plan.world_size, plan.trainable):
        sent[m.owner] += m.numel * _elem_size(m.dtype)
    return sent


def state_template(opt):
    """(state names in order, per-element names with dtypes, scalars) of one param's state,
    taken from rank 0's real state after a step (AdamW's layout if rank 0 holds none)."""
    real = state.local_state(opt)
    if real.order:
        pid = next(iter(real.order))
        names = list(real.order[pid])
        per_elem = [(s.name, s.tensor.dtype) for s in real.segments if s.pid == pid]
        seen, uniq = set(), []
        for name, dt in per_elem:  # a flat-mode param may have several pieces here
            if name not in seen:
                seen.add(name)
                uniq.append((name, dt))
        return names, uniq, dict(real.scalars.get(pid, {}))
    dt = torch.float32
    return (["step", "exp_avg", "exp_avg_sq"], [("exp_avg", dt), ("exp_avg_sq", dt)],
            {"step": torch.tensor(1.0)})


def synthetic_local_state(opt, rank: int, template) -> state.LocalState:
    """What state.local_state(opt) returns on `rank` after a step, built from the plan
    (segments are meta tensors: only their lengths and dtypes are read)."""
    names, per_elem, scalars = template
    plan = opt.plan
    out = state.LocalState()
    pieces = [pc for b in plan.buckets for pc in b.pieces(rank)]
    if plan.sharding == layout.PARAM:
        placed = {pid for b in plan.buckets for pid in b.param_ids}
        pieces += [layout.Piece(pid, 0, plan.params[pid].numel(), 0)
                   for pid, r in enumerate(plan.owner) if r == rank and pid not in placed]
    for pc in pieces:
        out.order.setdefault(pc.param_id, list(names))
        for name, dt in per_elem:
            out.segments.append(state.Segment(pc.param_id, name, pc.start, pc.length,
                                              torch.empty(pc.length, dtype=dt, device="meta")))
        if scalars:
            out.scalars.setdefault(pc.param_id, dict(scalars))
    return out


def checkpoint_meta(opt) -> dict:
    """Size of the checkpoint metadata rank 0 would write, and of what it gathers."""
    template = state_template(opt)
    real_desc = ckpt_format._save_items(opt, state.local_state(opt))[1]
    descs = []
    for r in range(opt.world_size):
        descs.append(ckpt_format._save_items(opt, synthetic_local_state(opt, r, template))[1])
    mine = descs[opt.rank]
    if opt.plan.local and (mine["chunks"], mine["wholes"], mine["order"]) != (
            real_desc["chunks"], real_desc["wholes"], real_desc["order"]):
        raise AssertionError("rank 0's description from the plan differs from its real one")
    descs[opt.rank] = real_desc
    gathered = [len(pickle.dumps(d)) for d in descs]
    build = statistics.median(_timed(lambda: ckpt_format._build_meta(opt, descs))
                              for _ in range(3))
    meta = ckpt_format._build_meta(opt, descs)
    buf = io.BytesIO()
    torch.save(meta, buf)
    return {"meta_bytes": buf.tell(), "gathered_bytes": sum(gathered),
            "gathered_max_rank_bytes": max(gathered), "meta_build_s": build,
            "stored_chunks": sum(len(d["chunks"]) for d in descs)}


# ------------------------------------------------------------------ reduce-scatter mode

DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES = 1 << 20, 25 << 20  # DDP's defaults
# Above this many (all_to_all, rank) pairs the hook's own bucket_plan is not called: it cuts
# every bucket into segments rank by rank, O(segments x world) Python work (seconds at
# world >= 64 for the larger models); the figures then come from the same ownership map at
# bucket level (the segments take each rank's share in proportion: checked equal where both
# are computed).
HOOK_PLAN_LIMIT = 200_000
# Even mode: above this many (param, rank) chunks the step is not run (its exchange costs
# O(params x world) host work per step: ~1.4 s for GPT-2 small, ~9 s for Llama-2 70B at
# world 1024 on meta); the row's figures then come from the plans alone.
EVEN_STEP_LIMIT = 20_000


class PlannedBucket:
    """What reduce_scatter_hook reads of a DDP GradBucket (index, params, buffer size)."""

    def __init__(self, index: int, params: list):
        self._index, self._params = index, params
        self._numel = sum(p.numel() for p in params)

    def index(self) -> int:
        return self._index

    def parameters(self) -> list:
        return self._params

    def buffer(self) -> torch.Tensor:
        return torch.empty(self._numel, dtype=self._params[0].dtype, device="meta")


def ddp_buckets(params) -> list[PlannedBucket]:
    """DDP's buckets after its rebuild: params in the order their grads become ready
    (reverse module order here), cut at DDP's byte caps by torch's own function."""
    order = params[::-1]
    indices, _ = dist._compute_bucket_assignment_by_size(
        order, [DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES], [False] * len(order))
    return [PlannedBucket(i, [order[j] for j in ids]) for i, ids in enumerate(indices)]


def _segments_of(total: int, splits: list, elem_size: int) -> int:
    """How many all_to_alls the hook cuts a bucket into (reduce_scatter.plan.segment_count:
    by what its busiest rank receives): the estimate that decides whether its bucket_plan
    is called, and the count where it is not."""
    count = getattr(rs_plan, "segment_count", None)
    return 1 if count is None else count(splits, elem_size)


def reduce_scatter_bytes(opt, params, limit: int = HOOK_PLAN_LIMIT) -> dict:
    """The hook's all_to_alls in one iteration: per rank the bytes sent (every bucket's
    elements the other ranks own), the calls, and their link records (:func:`a2a_links`),
    per segment from the hook's own ``GradReducer.bucket_plan`` when the work is under
    `limit` (``planned``), else per bucket from the hook's ownership map."""
    reducer = rs_hook.reducer_of(opt)
    owned = opt.hook_seam.ownership().runs
    index = opt.hook_seam.param_index()
    world, size = opt.world_size, _elem_size(params[0].dtype)
    buckets = ddp_buckets(params)
    splits = []
    for b in buckets:
        s = [0] * world
        for p in b.parameters():
            for r, _start, length in owned[index[id(p)]]:
                s[r] += length
        splits.append(s)
    counts = [_segments_of(sum(s), s, size) for s in splits]
    planned = sum(counts) * world <= limit
    sent = [0] * world
    links, bucket_links, calls = [], a2a_links(splits, size), 0
    for b, s, count in zip(buckets, splits, counts):
        total = sum(s)
        for r in range(world):
            sent[r] += (total - s[r]) * size
        if not planned:
            calls += count
            continue
        bp = reducer.bucket_plan(b)
        if bp is None:
            raise AssertionError("a bucket of the optimizer's own params was not planned")
        if list(bp.splits) != s:
            raise AssertionError("the hook's bucket plan differs from its ownership map")
        segs = [seg.splits for seg in getattr(bp, "segments", None) or [bp]]
        links += a2a_links(segs, size)
        calls += len(segs)
    if planned:
        seg_crit = sum(x.busiest for x in links)
        bucket_crit = sum(x.busiest for x in bucket_links)
        if abs(seg_crit - bucket_crit) > 1e-3 * max(1, bucket_crit):
            raise AssertionError(f"segments' critical path {seg_crit} != buckets' "
                                 f"{bucket_crit}")
    else:
        links = bucket_links
    return {"buckets": len(buckets), "a2a_calls": calls, "planned": planned,
            "a2a_sent": sent, "a2a_links": links}


# ------------------------------------------------------------------ critical path
# A collective lasts as long as its busiest rank's link (full duplex: max(bytes sent, bytes
# received)); the critical path of an iteration sums that over its collectives in issue
# order (benchmarks/common.py: gloo_link_bytes, critical_path, which bench_iteration.py
# applies to traced runs). Here every rank's figures come from the plans: no collective runs.

# (the all-gather under the name zero_ext calls it by: all_gather_single from torch 2.14)
GATHER = sync_mod.ALL_GATHER
EXCHANGE_COLLECTIVES = ("broadcast", GATHER)


class Link(tuple):
    """One collective: (name, the busiest rank's max(sent, received), bytes sent summed over
    the ranks, rank 0's (sent, received), bytes per rank in the ring model)."""

    name = property(lambda self: self[0])
    busiest = property(lambda self: self[1])
    sent_total = property(lambda self: self[2])
    rank0 = property(lambda self: self[3])
    ring = property(lambda self: self[4])


def a2a_links(split_lists, size: int) -> list[Link]:
    """The hook's all_to_all_single per segment (output splits equal, input splits the
    plan's): rank r sends the elements the others own, sum_{j != r} split_j, and receives
    its own share from each of the others, (W-1) split_r."""
    out = []
    for splits in split_lists:
        world, total = len(splits), sum(splits)
        busiest = max(max(total - s, (world - 1) * s) for s in splits)
        out.append(Link(("all_to_all_single", busiest * size, (world - 1) * total * size,
                         ((total - splits[0]) * size, (world - 1) * splits[0] * size),
                         (world - 1) * total * size / world)))
    return out


def _broadcast_link(n: int, owner: int, world: int) -> Link:
    """gloo's broadcast: the root sends to every rank itself, (W-1) n; the others receive n."""
    return Link(("broadcast", (world - 1) * n, (world - 1) * n,
                 ((world - 1) * n, 0) if owner == 0 else (0, n), (world - 1) / world * n))


def _gather_link(part: int, world: int) -> Link:
    """A ring all_gather_into_tensor of `part` bytes from each rank: (W-1) parts each way on
    every link (gloo's ring and NCCL's alike)."""
    n = (world - 1) * part
    return Link((GATHER, n, world * n, (n, n), n))


def exchange_links(opt, backend: str) -> list[Link]:
    """The step's exchange of the updated params as issued over `backend`, from the same
    plans the step runs (zero_ext/replicas.py `sync`): bucket views, one broadcast per
    non-empty rank range per bucket (gloo's path and the fake group's generic one); param
    and flat modes, ``sync.plan_messages`` (one broadcast per owner's packed pieces); even
    mode, ``sync.plan_gathers`` (one ring all-gather per packed group of params) where
    ``sync.uses_gathers`` would hold (not gloo, or world > 2), else ``sync.plan_messages``
    across buckets (broadcasts per owner packed across params: gloo at world 2)."""
    plan, world = opt.plan, opt.plan.world_size
    if world == 1:
        return []
    if opt.parameters_as_bucket_view:
        out = []
        for b in plan.buckets:
            size = _elem_size(b.dtype)
            out += [_broadcast_link((hi - lo) * size, r, world)
                    for r, (lo, hi) in enumerate(b.rank_ranges) if hi > lo]
        return out
    if plan.sharding == layout.EVEN and (backend != "gloo" or world > 2):
        return [_gather_link(g.size * _elem_size(g.dtype), world)
                for g in sync.plan_gathers(plan.buckets, world, plan.trainable)]
    messages = sync.plan_messages(plan.buckets, world, plan.trainable,
                                  across_buckets=plan.sharding == layout.EVEN)
    return [_broadcast_link(m.numel * _elem_size(m.dtype), m.owner, world) for m in messages]


def uniform_link(name: str, sent: int, recv: int, ring: float, world: int) -> Link:
    """A collective that costs every rank the same (the step's agreement all-reduce and the
    clip's: rings), from rank 0's figures."""
    return Link((name, max(sent, recv), world * sent, (sent, recv), ring))


def link_totals(links, world: int) -> dict:
    """crit: the busiest links summed; mean: bytes sent per rank, mean over ranks."""
    return {"crit": float(sum(x.busiest for x in links)),
            "mean": sum(x.sent_total for x in links) / world}


def clip_link(world: int) -> Link:
    """opt.clip_grad_norm_ reads grad values (not on meta): its one all-reduce of 2W+1
    float64 (zero_ext/grad_norm.py), in the ring model."""
    arg = {"tensor": torch.empty(2 * world + 1, dtype=torch.float64, device="meta"),
           "group": None}
    return uniform_link("all_reduce", *gloo_link_bytes("all_reduce", arg),
                        ring_wire_bytes("all_reduce", arg), world)


def reduce_scatter_row(model: str, opt, params, hook: dict, agree: list[Link],
                       stepped: bool) -> dict:
    """The hook's iteration: its all_to_alls (backward), the clip's all-reduce, the step
    (the agreement all-reduce(s), the params' exchange), in bytes per rank (ring model) and
    on the critical path."""
    world = opt.world_size
    numel = sum(p.numel() for p in params)
    size = _elem_size(params[0].dtype)
    sent = hook["a2a_sent"]
    gloo_form = exchange_links(opt, "gloo")
    ring_form = exchange_links(opt, "fake")  # NCCL's, and what the fake group ran
    clip = clip_link(world)
    exchange = sum(x.ring for x in ring_form) + sum(x.ring for x in agree)
    common_bytes = exchange + clip.ring  # ring model: the same on every rank
    ddp = 2 * (world - 1) / world * numel * size
    grads = link_totals(hook["a2a_links"], world)
    it = link_totals(hook["a2a_links"] + [clip] + agree + gloo_form, world)
    ring = link_totals(hook["a2a_links"] + [clip] + agree + ring_form, world)
    params_x = link_totals(gloo_form, world)
    return {"model": model, "world": world, "sharding": opt.plan.sharding,
            "elements": numel, "ddp_buckets": hook["buckets"], "a2a_calls": hook["a2a_calls"],
            "hook_planned": hook["planned"], "stepped": stepped,
            "step_calls": len(ring_form) + len(agree) + 1,
            "a2a_mean": sum(sent) / world, "a2a_max": max(sent), "exchange": exchange,
            "clip": clip.ring, "sent_mean": sum(sent) / world + common_bytes,
            "sent_max": max(sent) + common_bytes, "ddp": ddp,
            "crit_grads": grads["crit"] / ddp, "mean_grads": grads["mean"] / ddp,
            "crit_iter": it["crit"] / ddp, "mean_iter": it["mean"] / ddp,
            "crit_params": params_x["crit"] / ddp, "mean_params": params_x["mean"] / ddp,
            "params_exchange": _form(gloo_form),
            "crit_iter_ring": ring["crit"] / ddp, "params_exchange_ring": _form(ring_form)}


def _form(links) -> str:
    names = {"broadcast": "bcast", GATHER: "all_gather"}
    counts: dict = {}
    for x in links:
        counts[x.name] = counts.get(x.name, 0) + 1
    return ", ".join(f"{names.get(k, k)} x{c}" for k, c in counts.items()) or "-"


RS_HEADERS = ["model", "world", "sharding", "DDP buckets", "all_to_all calls",
              "other colls (step + clip)", "all_to_all MiB/rank mean", "max",
              "exchange MiB/rank", "total MiB/rank mean", "x DDP bytes (mean)",
              "x DDP (max rank)"]


def _mark(r: dict) -> str:
    """* : the step was not run (figures from the plans); + : the hook's bucket_plan was not
    called (all_to_alls per bucket from its ownership map, the count estimated)."""
    return r["sharding"] + ("" if r.get("stepped", True) else "*") + (
        "" if r.get("hook_planned", True) else "+")


def rs_table_row(r: dict) -> list[str]:
    return [r["model"], str(r["world"]), _mark(r), str(r["ddp_buckets"]),
            str(r["a2a_calls"]) if r["hook_planned"] else f"~{r['a2a_calls']}",
            str(r["step_calls"]), _mib(r["a2a_mean"]), _mib(r["a2a_max"]),
            _mib(r["exchange"]), _mib(r["sent_mean"]), f"{r['sent_mean'] / r['ddp']:.4f}",
            f"{r['sent_max'] / r['ddp']:.4f}"]


CRIT_HEADERS = ["model", "world", "sharding", "DDP all-reduce MiB/rank", "grads crit",
                "grads mean", "grads+params crit", "grads+params mean", "params crit",
                "params' exchange (gloo)"]


def _x(v: float) -> str:
    return f"{v:.3f}x" if v < 10 else f"{v:.1f}x"


def crit_table_row(r: dict) -> list[str]:
    return [r["model"], str(r["world"]), _mark(r), _mib(r["ddp"]), _x(r["crit_grads"]),
            _x(r["mean_grads"]), _x(r["crit_iter"]), _x(r["mean_iter"]), _x(r["crit_params"]),
            r["params_exchange"]]


# ------------------------------------------------------------------ one case

def build_zero(shapes, dtype, sharding, bucket_view, master_weights):
    params = meta_params(shapes, dtype)
    opt = zero_ext.ZeroRedundancyOptimizer(
        nanogpt_groups(params), torch.optim.AdamW, sharding=sharding,
        parameters_as_bucket_view=bucket_view, master_weights=master_weights, lr=1e-4)
    return opt, params


def build_torch_zero(shapes, dtype):
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    params = meta_params(shapes, dtype)
    return TorchZero(nanogpt_groups(params), torch.optim.AdamW, lr=1e-4)


def agreement_of(calls) -> list[tuple]:
    """The step's collectives other than the exchange (its agreement all-reduce), as
    (name, sent, received, ring bytes) of rank 0: the same on every rank."""
    return [(c[0], c[4], c[5], c[3]) for c in calls if c[0] not in EXCHANGE_COLLECTIVES]


def step_agreement(model: str, world: int, args, cache: dict) -> list[tuple]:
    """The agreement collectives of a step of `model` at `world` (mode-independent: checked
    where several modes are stepped), counted in a param-mode step if no case stepped yet."""
    key = (model, world)
    if key not in cache:
        opt, params = build_zero(model_shapes.model_shapes(model), getattr(torch, args.dtype),
                                 "param", False, args.master_weights)
        for p in params:
            p.grad = torch.empty_like(p)
        opt.step()
        with CollectiveCounter() as cc:
            opt.step()
        cache[key] = agreement_of(cc.calls)
    return cache[key]


def run_case(model: str, world: int, sharding: str, args,
             agreements: dict) -> tuple[dict, dict | None]:
    """The main table's row and (unless --no-reduce-scatter) the reduce-scatter row."""
    shapes = model_shapes.model_shapes(model)
    dtype = getattr(torch, args.dtype)
    row = {"model": model, "world": world, "sharding": sharding,
           "params": len(shapes), "elements": sum(model_shapes.numel(s) for _, s in shapes)}
    ctor, plan_s = [], []
    opt = params = None
    for _ in range(args.repeats):
        opt = params = None
        gc.collect()
        with plan_timer() as spent:
            t0 = time.perf_counter()
            opt, params = build_zero(shapes, dtype, sharding, args.bucket_view,
                                     args.master_weights)
            ctor.append(time.perf_counter() - t0)
        plan_s.append(spent[0])
    row["ctor_s"], row["plan_s"] = statistics.median(ctor), statistics.median(plan_s)
    if not args.no_torch:
        times = []
        for _ in range(args.repeats):
            times.append(_timed(lambda: build_torch_zero(shapes, dtype)))
        row["torch_ctor_s"] = statistics.median(times)

    # state per rank, from the plan
    elems = rank_elements(opt.plan)
    assert elems[opt.rank] == opt.local_numel, (elems[opt.rank], opt.local_numel)
    assert sum(elems) == row["elements"], (sum(elems), row["elements"])
    per_elem = 2 * (4 if args.master_weights else _elem_size(dtype)) + (
        4 if args.master_weights else 0)
    row["state_bytes_per_elem"] = per_elem
    row["state_max"] = max(elems) * per_elem
    row["state_mean"] = sum(elems) * per_elem / world
    row["ranks_without_state"] = sum(1 for e in elems if e == 0)

    hook = None if args.no_reduce_scatter else reduce_scatter_bytes(opt, params,
                                                                     args.hook_plan_limit)
    sends = rank_sends(opt)
    fake_form = exchange_links(opt, dist.get_backend())
    stepped = not (sharding == layout.EVEN and len(params) * world > args.even_step_limit)
    row["stepped"] = stepped
    if stepped:
        # one step on fake grads: collectives and bytes sent, counted for real
        for p in params:
            p.grad = torch.empty_like(p)
        opt.step()  # the first step builds the exchange plan
        with CollectiveCounter() as cc:
            opt.step()
        steps, spent = [], 0.0
        for _ in range(args.repeats):  # (at most ~0.5 s of them after the first)
            steps.append(_timed(opt.step))
            spent += steps[-1]
            if spent > 0.5:
                break
        row["step_s"] = statistics.median(steps)
        ran = [(c[0], c[4], c[5]) for c in cc.calls if c[0] in EXCHANGE_COLLECTIVES]
        if ran != [(x.name, *x.rank0) for x in fake_form]:
            raise AssertionError(f"{model} world {world} {sharding}: rank 0's exchange "
                                 "differs from the one modelled from the plan")
        agree = agreement_of(cc.calls)
        ring = sum(c[3] for c in cc.calls)
        if abs(ring - sum(x.ring for x in fake_form) - sum(a[3] for a in agree)) > len(
                cc.calls):
            raise AssertionError(f"{model} world {world} {sharding}: rank 0's ring bytes "
                                 "differ from the plan's")
        known = agreements.setdefault((model, world), agree)
        if known != agree:
            raise AssertionError(f"{model} world {world}: the step's agreement differs "
                                 f"between modes: {known} vs {agree}")
        row["colls"] = cc.count
        row["rank0_sent"] = cc.sent
        agree_bytes = sum(c[2] for c in cc.calls if c[0] not in EXCHANGE_COLLECTIVES)
        if sends[0] + agree_bytes != cc.sent:
            raise AssertionError(f"rank 0 sent {cc.sent} bytes, the plan says "
                                 f"{sends[0]} + {agree_bytes}")
    else:
        agree = step_agreement(model, world, args, agreements)
        agree_bytes = sum(s for _n, s, _v, _ring in agree)  # all-reduces: input = sent
        row["step_s"] = None
        row["colls"] = len(fake_form) + len(agree)
        row["rank0_sent"] = sends[0] + agree_bytes
    row["bcasts"] = sum(1 for x in fake_form if x.name == "broadcast")
    row["gathers"] = sum(1 for x in fake_form if x.name == GATHER)
    row["all_reduces"] = sum(1 for a in agree if a[0] == "all_reduce")
    row["sent_max"] = max(sends) + agree_bytes
    row["sent_mean"] = sum(sends) / world + agree_bytes
    total = sum(sends)
    row["recv_max"] = total - min(sends)
    if not args.no_checkpoint and stepped:
        row.update(checkpoint_meta(opt))
    rs = None
    if hook is not None:
        links = [uniform_link(n, s, v, ring, world) for n, s, v, ring in agree]
        rs = reduce_scatter_row(model, opt, params, hook, links, stepped)
    return row, rs


# ------------------------------------------------------------------ output

def _gib(b):
    return f"{b / GiB:.3f}" if b < 10 * GiB else f"{b / GiB:.1f}"


def _mib(b):
    return f"{b / MiB:.2f}" if b < 100 * MiB else f"{b / MiB:.0f}"


def _ms(s):
    return f"{s * 1e3:.1f}" if s < 1 else f"{s * 1e3:.0f}"


HEADERS = ["model", "world", "sharding", "ctor ms", "plan ms", "torch ms",
           "state/rank max GiB", "mean GiB", "max/mean", "colls/step", "bcast/gather",
           "sends/rank max MiB", "rank0 sends MiB", "recv/rank MiB", "step ms",
           "ckpt meta KiB", "gathered KiB", "meta ms"]


def table_row(r: dict) -> list[str]:
    return [r["model"], str(r["world"]), _mark(r), _ms(r["ctor_s"]), _ms(r["plan_s"]),
            _ms(r["torch_ctor_s"]) if "torch_ctor_s" in r else "-",
            _gib(r["state_max"]), _gib(r["state_mean"]),
            f"{r['state_max'] / r['state_mean']:.2f}", str(r["colls"]),
            str(r["bcasts"] + r.get("gathers", 0)),
            _mib(r["sent_max"]), _mib(r["rank0_sent"]), _mib(r["recv_max"]),
            "-" if r["step_s"] is None else _ms(r["step_s"]),
            f"{r['meta_bytes'] / KiB:.0f}" if "meta_bytes" in r else "-",
            f"{r['gathered_bytes'] / KiB:.0f}" if "gathered_bytes" in r else "-",
            _ms(r["meta_build_s"]) if "meta_build_s" in r else "-"]


def print_table(rows: list[dict], headers=HEADERS, row_fn=table_row) -> str:
    cells = [row_fn(r) for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(headers)]
    line = lambda cs: "| " + " | ".join(c.rjust(w) for c, w in zip(cs, widths)) + " |"  # noqa: E731
    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(c) for c in cells]
    text = "\n".join(out)
    print(text, flush=True)
    return text


# ------------------------------------------------------------------ extra checks

def extras(worlds, n_params: int = 20000) -> None:
    """Where per-param or per-step work over every rank would show: a model of many params
    (partition, construction, add_param_group), and rank translation for a subgroup."""
    print(f"\nSynthetic model: {n_params} params of 2^10..2^22 elements (log-uniform), 2 "
          "interleaved groups, fp32 meta, AdamW (ms; assign_params and extend_owners: median "
          "of 3, constructions: fastest of 3)")
    numels = model_shapes.random_numels(n_params, seed=0, max_log2=22, min_log2=10)
    groups = [i % 2 for i in range(len(numels))]
    print("| world | assign_params (native) | extend_owners, all params | ctor param | "
          "ctor flat | add_param_group (500 params, after a step, param) | max/mean param |")
    print("|------:|------:|------:|------:|------:|------:|------:|")
    for world in worlds:
        init_world(world)
        t_assign = statistics.median(
            _timed(lambda: partition.assign_params(numels, groups, world)) for _ in range(3))
        t_extend = statistics.median(
            _timed(lambda: layout.extend_owners([0] * world, numels)) for _ in range(3))
        owners = partition.assign_params(numels, groups, world)
        ratio = partition.max_over_mean(partition.rank_loads(numels, owners, world))
        ctor = {}
        for sharding in ("param", "flat"):  # (even: one bucket of W ranges per param)
            for _ in range(3):  # the fastest of 3: a loaded machine adds, never removes
                opt = None
                params = [torch.nn.Parameter(torch.empty(n, device="meta")) for n in numels]
                pg = [{"params": params[0::2], "weight_decay": 0.1},
                      {"params": params[1::2], "weight_decay": 0.0}]
                gc.collect()
                t0 = time.perf_counter()
                opt = zero_ext.ZeroRedundancyOptimizer(pg, torch.optim.AdamW,
                                                       sharding=sharding, lr=1e-4)
                ctor[sharding] = min(ctor.get(sharding, 1e9), time.perf_counter() - t0)
            if sharding == "param":
                for p in params:
                    p.grad = torch.empty_like(p)
                opt.step()  # state exists: new params are placed on top of the loads
                extra = [torch.nn.Parameter(torch.empty(n, device="meta"))
                         for n in model_shapes.random_numels(500, seed=1, max_log2=20)]
                t_add = _timed(lambda: opt.add_param_group({"params": extra,
                                                            "weight_decay": 0.0}))
            del opt, params, pg
        print(f"| {world} | {t_assign * 1e3:.1f} | {t_extend * 1e3:.1f} | "
              f"{ctor['param'] * 1e3:.0f} | {ctor['flat'] * 1e3:.0f} | {t_add * 1e3:.1f} | "
              f"{ratio:.4f} |", flush=True)

    print("\nExchanger (the step's transport) built for the WORLD group and for a process "
          "subgroup of the same ranks (ms)")
    print("| world | WORLD | subgroup |")
    print("|------:|------:|---------:|")
    for world in sorted(set(worlds) | {4096}):
        init_world(world)
        sub = dist.new_group(list(range(world)))
        t_world = _timed(lambda: sync.Exchanger(dist.group.WORLD, 0, world))
        t_sub = _timed(lambda: sync.Exchanger(sub, 0, world))
        print(f"| {world} | {t_world * 1e3:.2f} | {t_sub * 1e3:.2f} |", flush=True)


def _timed(fn) -> float:
    """Seconds of one call of fn, after a garbage collection (so that a collection of the
    previous case's garbage does not land inside this one)."""
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ------------------------------------------------------------------ main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: worlds {QUICK_WORLDS}, 1 repeat, no extras")
    ap.add_argument("--models", nargs="+", default=list(MODELS),
                    choices=model_shapes.MODELS, metavar="MODEL",
                    help=f"models, from {model_shapes.MODELS} (default: {' '.join(MODELS)})")
    ap.add_argument("--worlds", nargs="+", type=int, default=None,
                    help=f"world sizes (default {WORLDS}; --quick: {QUICK_WORLDS})")
    ap.add_argument("--shardings", nargs="+", default=list(SHARDINGS), choices=SHARDINGS,
                    help="sharding modes (default: all three; even is skipped with "
                         "--bucket-view, which it does not support)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="constructions timed per case, median reported (default 3; quick 1)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="param dtype (default: float32)")
    ap.add_argument("--master-weights", action="store_true",
                    help="master_weights=True (fp32 masters for bf16/fp16 params)")
    ap.add_argument("--bucket-view", action="store_true",
                    help="parameters_as_bucket_view=True (the fake backend then takes the "
                         "generic broadcast path, see the docstring)")
    ap.add_argument("--no-torch", action="store_true",
                    help="skip torch's ZeroRedundancyOptimizer construction")
    ap.add_argument("--no-reduce-scatter", action="store_true",
                    help="skip the reduce-scatter mode's bytes per iteration")
    ap.add_argument("--no-checkpoint", action="store_true",
                    help="skip the checkpoint metadata columns")
    ap.add_argument("--extras", action="store_true",
                    help="also run the extra checks (default in a full run)")
    ap.add_argument("--no-extras", action="store_true", help="skip the extra checks")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile each case at the largest world (constructions, steps, checkpoint "
                         "meta) and print the top functions")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    ap.add_argument("--hook-plan-limit", type=int, default=HOOK_PLAN_LIMIT,
                    help="call the hook's bucket_plan only up to this many (all_to_all, "
                         f"rank) pairs (default {HOOK_PLAN_LIMIT})")
    ap.add_argument("--even-step-limit", type=int, default=EVEN_STEP_LIMIT,
                    help="even mode: run the step only up to this many (param, rank) "
                         f"chunks (default {EVEN_STEP_LIMIT})")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    worlds = tuple(args.worlds or (QUICK_WORLDS if args.quick else WORLDS))
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    run_extras = args.extras or not (args.quick or args.no_extras)
    if args.bucket_view and "even" in args.shardings:
        args.shardings = [s for s in args.shardings if s != "even"]
        print("(even mode skipped: it has no bucket views)", flush=True)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*fake.*")
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated")
    logging_quiet()

    zero_ext.load_native()
    native = native_available("assign_params", "cpu")
    print(f"torch {torch.__version__}, zero_ext native partition kernel: {native}; "
          f"rank 0 of a fake world, meta params, {args.dtype}"
          f"{' + master weights' if args.master_weights else ''}, AdamW, "
          f"bucket views {'on' if args.bucket_view else 'off'}, median of {args.repeats} "
          "construction(s)", flush=True)
    # Warm-up: the first optimizer of a process imports torch._dynamo (~1 s) and loads the
    # native ops; neither is part of the construction cost at any world.
    init_world(8)
    build_zero(model_shapes.model_shapes("gpt2-small"), torch.float32, "param", False, False)
    build_torch_zero(model_shapes.model_shapes("gpt2-small"), torch.float32)
    # torch's and dynamo's ~300k long-lived objects out of the collector's reach: each
    # gc.collect() before a timed call (_timed) then costs microseconds, not ~0.15 s
    gc.collect()
    gc.freeze()

    rows, rs_rows, agreements = [], [], {}
    t_start = time.perf_counter()
    for world in worlds:
        init_world(world)
        for model in args.models:
            for sharding in args.shardings:
                prof = None
                if args.profile and world == max(worlds):
                    prof = cProfile.Profile()
                    prof.enable()
                row, rs = run_case(model, world, sharding, args, agreements)
                if prof is not None:
                    prof.disable()
                    print(f"\n--- profile: {model}, world {world}, {sharding} (construction "
                          f"x{args.repeats} + steps + checkpoint meta + the hook's plan), "
                          "top by own time")
                    pstats.Stats(prof).sort_stats("tottime").print_stats(15)
                rows.append(row)
                if rs is not None:
                    rs_rows.append(rs)
                step = "not run" if row["step_s"] is None else f"{_ms(row['step_s'])} ms"
                print(f"  done {model} world {world} {sharding}: ctor {_ms(row['ctor_s'])} ms,"
                      f" step {step}", file=sys.stderr, flush=True)
    order = lambda r: (args.models.index(r["model"]), r["world"],  # noqa: E731
                       args.shardings.index(r["sharding"]))
    rows.sort(key=order)
    rs_rows.sort(key=order)
    print()
    print_table(rows)
    skipped = [r for r in rows if not r["stepped"]]
    if skipped:
        names = ", ".join(f"{r['model']} world {r['world']}" for r in skipped)
        print(f"* step not run ({names}): even mode above {args.even_step_limit} (param, "
              "rank) chunks, where its exchange costs O(params x world) host work per step "
              "(seconds); its figures come from the plans, the agreement all-reduce from "
              "another mode's step")
    print(f"\n(cases took {time.perf_counter() - t_start:.0f} s)")
    if rs_rows:
        print("\nReduce-scatter mode (zero_ext.ddp_zero_hook.reduce_scatter_hook): bytes per "
              "iteration per rank, ring model (DDP: 2(W-1)/W of the model); DDP's rebuilt "
              "buckets computed, cut by the hook's own plan (see the docstring)")
        print_table(rs_rows, RS_HEADERS, rs_table_row)
        print("\nCritical path with the hook (per collective, in issue order, the busiest "
              "rank's max(sent, received), summed), next to the mean bytes a rank sends, in "
              "units of DDP's ring all-reduce of the grads (2(W-1)/W of the model on every "
              "link); grads = the hook's all_to_alls, grads+params = + the clip's and the "
              "step's all-reduces + the params' exchange as gloo runs it (broadcasts from "
              "the root to every rank; ring all-gathers); every rank's figures from the plans")
        print_table(rs_rows, CRIT_HEADERS, crit_table_row)
        for r in rs_rows:
            if r["params_exchange_ring"] != r["params_exchange"]:
                print(f"  {r['model']} world {r['world']} {r['sharding']}: with the exchange "
                      f"as ring all-gathers ({r['params_exchange_ring']}: NCCL, and the fake "
                      f"group) grads+params crit {_x(r['crit_iter_ring'])}")
        if any(not r["hook_planned"] for r in rs_rows):
            print(f"+ the hook's bucket_plan not called (above {args.hook_plan_limit} "
                  "(all_to_all, rank) pairs: O(segments x world) Python work): the "
                  "all_to_alls per DDP bucket from the hook's ownership map "
                  "(HookSeam.ownership), the call count estimated; where both are "
                  "computed the segments' critical path equals the buckets'")
    if run_extras:
        extras(worlds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows + rs_rows, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def logging_quiet() -> None:
    import logging

    logging.getLogger("zero_ext").setLevel(logging.WARNING)


if __name__ == "__main__":
    sys.exit(main())
