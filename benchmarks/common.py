"""Timing and table helpers shared by the benchmarks.

- :func:`time_fn`: median (and min) of repeated calls, with CUDA synchronisation when the
  work runs on a GPU; :func:`time_interleaved`: the same for several variants timed in turns.
  Machines are noisy, so compare ratios measured in one run.
- :func:`copy_bandwidth`: measured copy bandwidth (bytes read + written per second), the
  ceiling a memory-bound kernel is compared with.
- :func:`print_table`: a markdown table; :func:`speedup_rows` builds rows with ms, GB/s and a
  speedup column against each baseline.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from a source checkout
    sys.path.insert(0, ROOT)


def _sync(device) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], reps: int = 10, warmup: int = 2,
            device=None, max_seconds: Optional[float] = None) -> Dict[str, float]:
    """Run ``fn`` ``warmup`` times, then time ``reps`` calls one by one (synchronising the
    CUDA device before and after each when ``device`` is a GPU). Stops early once
    ``max_seconds`` of timed calls have passed (at least 3 calls). Returns seconds:
    ``{"median", "min", "n"}``."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times: List[float] = []
    spent = 0.0
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
        if max_seconds is not None and spent > max_seconds and len(times) >= 3:
            break
    return {"median": statistics.median(times), "min": min(times), "n": len(times)}


def time_interleaved(fns: Dict[str, Callable[[], object]], reps: int = 10, warmup: int = 2,
                     device=None, max_seconds: Optional[Dict[str, float]] = None,
                     min_calls: int = 3) -> Dict[str, Dict[str, float]]:
    """Like :func:`time_fn` for several variants, timed in turns (one call of each per
    round), so that a load change on a noisy machine hits all of them alike. A variant
    whose ``max_seconds[name]`` is spent drops out after at least ``min_calls`` calls."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    times: Dict[str, List[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            budget = (max_seconds or {}).get(name)
            if budget is not None and len(times[name]) >= min_calls and sum(times[name]) > budget:
                continue
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return {k: {"median": statistics.median(v), "min": min(v), "n": len(v)}
            for k, v in times.items()}


def exit_without_teardown(rc: int) -> None:
    """Leave a process that ran gloo collectives with exit status `rc`, once its results
    are written, without the interpreter's teardown: with torch 2.14 + gloo that teardown
    aborts now and then ("terminate called without an active exception", SIGABRT, after
    destroy_process_group() too: gloo's worker threads meet the finalizing interpreter;
    plain DDP does it as well)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def spawned_rank(rank: int, body: Callable, *args) -> None:
    """An ``mp.spawn`` target: ``body(rank, *args)``, then :func:`exit_without_teardown`
    (an abort in the teardown would make mp.spawn report a failed rank). An exception
    still propagates to mp.spawn as usual."""
    body(rank, *args)
    exit_without_teardown(0)


def copy_bandwidth(device="cpu", nbytes: int = 256 << 20, reps: int = 10) -> float:
    """GB/s of ``dst.copy_(src)`` on ``device``, counting the bytes read and written."""
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), reps=reps, warmup=2, device=device)
    return 2 * n * 4 / t["median"] / 1e9


def fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"


def print_table(title: str, headers: Sequence[str], rows: Iterable[Sequence[object]],
                file=None) -> str:
    """Print (and return) a markdown table with a title line."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    out = [f"\n{title}", line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in rows]
    text = "\n".join(out)
    print(text, file=file or sys.stdout, flush=True)
    return text


def speedup_rows(times: Dict[str, float], ours: str, bytes_moved: Optional[float] = None
                 ) -> List[List[str]]:
    """Rows ``[name, ms, GB/s, speedup]`` where speedup = time(name) / time(ours): how many
    times faster ``ours`` is than each variant (1.00x on its own row)."""
    rows = []
    for name, t in times.items():
        gbs = f"{bytes_moved / t / 1e9:.1f}" if bytes_moved else "-"
        rows.append([name, fmt_ms(t), gbs, f"{t / times[ours]:.2f}x"])
    return rows


SPEEDUP_HEADERS = ["variant", "ms (median)", "GB/s", "speedup of ours"]


# ----------------------------------------------------------------------------- wire bytes
# Bytes a rank puts on the wire per collective, in the standard ring model (the algorithm
# gloo and NCCL use for large payloads), so that modes are compared by what they move, not
# by what one run happened to measure. Object collectives count their pickled size.
WIRE_COLLECTIVES = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
                    "all_gather_single", "reduce_scatter_single", "all_to_all_single", "all_gather", "reduce", "send", "isend", "recv", "irecv",
                    "all_gather_object", "broadcast_object_list", "gather_object", "barrier")


def tensor_bytes(t) -> int:
    """Bytes of a tensor or of a (nested) list of tensors; 0 for anything else."""
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(tensor_bytes(x) for x in t)
    return 0


def ring_wire_bytes(name: str, bound: Dict[str, object]) -> int:
    """Bytes this rank sends for one call of ``torch.distributed.<name>`` whose arguments
    are ``bound`` (name -> value, defaults included), in the ring model:
    all_reduce 2(W-1)/W n; broadcast and reduce (W-1)/W n (a ring broadcast forwards the
    payload through W-1 ranks: averaged over ranks); all_gather_into_tensor and
    reduce_scatter_tensor (W-1)/W of the full tensor; all_gather (W-1) n; all_to_all_single
    exactly the elements this rank sends to the others (from its split sizes); send n;
    recv 0."""
    import pickle

    import torch.distributed as dist

    group = bound.get("group")
    world = dist.get_world_size(group)
    if world <= 1 or name in ("recv", "irecv", "barrier"):
        return 0
    frac = (world - 1) / world
    if name == "all_reduce":
        return round(2 * frac * tensor_bytes(bound["tensor"]))
    if name in ("broadcast", "reduce"):
        return round(frac * tensor_bytes(bound["tensor"]))
    if name in ("all_gather_into_tensor", "all_gather_single"):
        return round(frac * tensor_bytes(bound["output_tensor"]))
    if name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        return round(frac * tensor_bytes(bound["input"]))
    if name == "all_gather":
        return (world - 1) * tensor_bytes(bound["tensor"])
    if name == "all_to_all_single":
        inp = bound["input"]
        splits = bound.get("input_split_sizes")
        if not splits:
            return round(frac * tensor_bytes(inp))
        me = dist.get_rank(group)
        per_row = inp.element_size() * (inp[0].numel() if inp.dim() > 1 else 1)
        return per_row * sum(n for r, n in enumerate(splits) if r != me)
    if name in ("send", "isend"):
        return tensor_bytes(bound["tensor"])
    if name == "all_gather_object":
        return (world - 1) * len(pickle.dumps(bound["obj"]))
    if name == "broadcast_object_list":
        return round(frac * len(pickle.dumps(bound["object_list"])))
    if name == "gather_object":
        return len(pickle.dumps(bound["obj"]))  # one hop to the destination
    return 0


def wrap_calls(module, names: Sequence[str], around: Callable) -> Dict[str, Callable]:
    """Replace ``module.<name>`` for each of `names` that exists by a wrapper that returns
    ``around(name, bound_arguments, call)``, ``call()`` running the original; returns the
    originals, for :func:`restore_calls`."""
    import inspect

    saved: Dict[str, Callable] = {}
    for name in names:
        fn = getattr(module, name, None)
        if fn is None or not callable(fn):
            continue
        saved[name] = fn
        sig = inspect.signature(fn)

        def wrapper(*args, __name=name, __fn=fn, __sig=sig, **kwargs):
            bound = __sig.bind(*args, **kwargs)
            bound.apply_defaults()
            return around(__name, bound.arguments, lambda: __fn(*args, **kwargs))

        wrapper.__name__ = getattr(fn, "__name__", name)
        wrapper.__wrapped__ = fn  # (a wrapper of this wrapper binds the original's signature)
        setattr(module, name, wrapper)
    return saved


def restore_calls(module, saved: Dict[str, Callable]) -> None:
    for name, fn in saved.items():
        setattr(module, name, fn)


class WireCounter:
    """While open, wraps torch.distributed's Python collectives (the module attributes that
    code calls as ``dist.all_reduce(...)``) and records ``(name, wire bytes)`` per call,
    with :func:`ring_wire_bytes`. Collectives issued from C++ (DDP's built-in all-reduce)
    are not seen: register a Python comm hook to count them."""

    def __init__(self):
        self.calls: List[tuple] = []
        self._saved: Dict[str, Callable] = {}

    def __enter__(self) -> "WireCounter":
        import torch.distributed as dist

        def around(name, args, call):
            self.calls.append((name, ring_wire_bytes(name, args)))
            return call()

        self._saved = wrap_calls(dist, WIRE_COLLECTIVES, around)
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        restore_calls(dist, self._saved)
        self._saved = {}

    @property
    def total(self) -> int:
        return sum(b for _, b in self.calls)

    def by_name(self) -> Dict[str, List[int]]:
        """name -> [calls, wire bytes]."""
        out: Dict[str, List[int]] = {}
        for name, b in self.calls:
            c = out.setdefault(name, [0, 0])
            c[0] += 1
            c[1] += b
        return out


# ----------------------------------------------------------------------------- link bytes
# Per rank and per collective call, the bytes a rank's link sends and receives under the
# algorithm gloo actually runs (not the ring average of ring_wire_bytes): a collective
# lasts as long as its busiest link, so the critical path of an iteration is the sum over
# its collectives, in issue order, of the busiest rank's max(sent, received).
TRACED_COLLECTIVES = WIRE_COLLECTIVES + (
    "reduce_scatter", "all_to_all", "gather",
    "scatter", "batch_isend_irecv", "send_object_list", "recv_object_list",
    "scatter_object_list")
P2P_NAMES = ("send", "isend", "recv", "irecv", "batch_isend_irecv", "send_object_list",
             "recv_object_list")
_AFTER_CALL = ("broadcast_object_list", "recv_object_list", "scatter_object_list")


def _group_rank(group, global_rank, group_rank):
    import torch.distributed as dist

    if group_rank is not None:
        return group_rank
    if global_rank is None:
        return 0
    return global_rank if group is None else dist.get_group_rank(group, global_rank)


def _pickled(obj) -> int:
    import pickle

    try:
        return len(pickle.dumps(obj))
    except Exception:  # an unpicklable object fails in the call itself
        return 0


def gloo_link_bytes(name: str, bound: Dict[str, object]) -> tuple:
    """(sent, received) bytes of this rank's link for one call of
    ``torch.distributed.<name>`` with arguments ``bound`` (defaults included), under gloo's
    algorithms: all_reduce ring, 2(W-1)/W n each way; broadcast from the root to every rank
    directly, so the root sends (W-1) n and every other rank receives n (reduce, gather
    and scatter likewise go straight between the root and each rank);
    all_gather_into_tensor / all_gather ring, (W-1) n_in each way; reduce_scatter_tensor
    ring, (W-1)/W n_in each way; all_to_all_single: the elements of the input splits for
    other ranks sent, of the output splits from other ranks received (equal splits when
    none are given); point-to-point: the tensor's bytes one way. Object collectives count
    their pickled size (the small size tensors that precede them are left out)."""
    import torch.distributed as dist

    group = bound.get("group")
    if name == "batch_isend_irecv":
        from torch.distributed import distributed_c10d as c10d

        sent = recv = 0
        for op in bound["p2p_op_list"]:
            if op.op is c10d.isend:
                sent += tensor_bytes(op.tensor)
            else:
                recv += tensor_bytes(op.tensor)
        return sent, recv
    if name in ("send", "isend"):
        return tensor_bytes(bound["tensor"]), 0
    if name in ("recv", "irecv"):
        return 0, tensor_bytes(bound["tensor"])
    if name == "send_object_list":
        return _pickled(list(bound["object_list"])), 0
    if name == "recv_object_list":
        return 0, _pickled(list(bound["object_list"]))
    world = dist.get_world_size(group)
    if world <= 1 or name == "barrier":
        return 0, 0
    me = dist.get_rank(group)
    frac = (world - 1) / world
    if name == "all_reduce":
        n = round(2 * frac * tensor_bytes(bound["tensor"]))
        return n, n
    if name in ("broadcast", "broadcast_object_list", "scatter", "scatter_object_list"):
        root = _group_rank(group, bound.get("src"), bound.get("group_src"))
        if name == "broadcast":
            n = tensor_bytes(bound["tensor"])
        elif name == "broadcast_object_list":
            n = _pickled(list(bound["object_list"]))  # after the call: filled everywhere
        elif name == "scatter":
            n = tensor_bytes(bound["tensor"])
        else:
            n = _pickled(list(bound["scatter_object_output_list"]))
        return ((world - 1) * n, 0) if me == root else (0, n)
    if name in ("reduce", "gather", "gather_object"):
        root = _group_rank(group, bound.get("dst"), bound.get("group_dst"))
        n = (_pickled(bound["obj"]) if name == "gather_object"
             else tensor_bytes(bound["tensor"]))
        return (0, (world - 1) * n) if me == root else (n, 0)
    if name in ("all_gather_into_tensor", "all_gather_single", "all_gather"):
        key = "tensor" if name == "all_gather" else "input_tensor"
        n = (world - 1) * tensor_bytes(bound[key])
        return n, n
    if name == "all_gather_object":
        n = (world - 1) * _pickled(bound["obj"])
        return n, n
    if name in ("reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter"):
        full = tensor_bytes(bound["input" if name != "reduce_scatter" else "input_list"])
        n = round(frac * full)
        return n, n
    if name == "all_to_all_single":
        inp, out = bound["input"], bound["output"]
        ins, outs = bound.get("input_split_sizes"), bound.get("output_split_sizes")

        def moved(t, splits):
            if not splits:
                return round(frac * tensor_bytes(t))
            row = t.element_size() * (t[0].numel() if t.dim() > 1 else 1)
            return row * sum(int(n) for r, n in enumerate(splits) if r != me)

        return moved(inp, ins), moved(out, outs)
    if name == "all_to_all":
        ins, outs = bound["input_tensor_list"], bound["output_tensor_list"]
        return (sum(tensor_bytes(t) for r, t in enumerate(ins) if r != me),
                sum(tensor_bytes(t) for r, t in enumerate(outs) if r != me))
    return 0, 0


class CollectiveTrace:
    """While open, wraps torch.distributed's Python collectives (the module attributes that
    code calls as ``dist.all_reduce(...)``) and records, per call in issue order, this
    rank's link bytes (:func:`gloo_link_bytes`) with the current :attr:`phase` (set it, e.g.
    "forward" / "backward" / "step", as the iteration goes). ``dist.P2POp`` is replaced
    by a subclass that accepts the wrapped isend/irecv, and ``batch_isend_irecv`` is one
    record (a list of P2POps is one step of an algorithm). Collectives issued from C++
    (DDP's built-in all-reduce) are not seen: register a Python comm hook for them.

    Records are ``[key, name, phase, sent, received]``; ``key`` matches the same
    collective across ranks: ``["c", group ranks, k]`` for the k-th collective on a group,
    ``["p", n, j]`` for the j-th point-to-point call after this rank's n-th collective.
    Gather every rank's :attr:`records` and pass them to :func:`critical_path`."""

    def __init__(self):
        self.records: List[list] = []
        self.phase = ""
        self._saved: Dict[str, object] = {}
        self._per_group: Dict[tuple, int] = {}
        self._ncoll = 0
        self._np2p = 0

    def _key(self, name: str, group) -> list:
        import torch.distributed as dist

        if name in P2P_NAMES:
            key = ["p", self._ncoll, self._np2p]
            self._np2p += 1
            return key
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
        if ranks == tuple(range(dist.get_world_size())):
            ranks = ()  # the default group, passed or not
        k = self._per_group.get(ranks, 0)
        self._per_group[ranks] = k + 1
        self._ncoll += 1
        self._np2p = 0
        return ["c", list(ranks), k]

    def __enter__(self) -> "CollectiveTrace":
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        def around(name, args, call):
            rec = [self._key(name, args.get("group")), name, self.phase, 0, 0]
            self.records.append(rec)
            if name not in _AFTER_CALL:
                rec[3], rec[4] = gloo_link_bytes(name, args)
            out = call()
            if name in _AFTER_CALL:
                rec[3], rec[4] = gloo_link_bytes(name, args)
            return out

        self._saved = wrap_calls(dist, TRACED_COLLECTIVES, around)
        unwrap: Dict[int, Callable] = {}
        for name in ("isend", "irecv"):
            if name in self._saved:
                unwrap[id(getattr(dist, name))] = getattr(c10d, name)
                unwrap[id(self._saved[name])] = getattr(c10d, name)
        real_p2pop = dist.P2POp
        self._saved["P2POp"] = real_p2pop

        class P2POp(real_p2pop):  # accepts the wrapped isend / irecv
            def __new__(cls, op, *args, **kwargs):
                return real_p2pop.__new__(cls, unwrap.get(id(op), op), *args, **kwargs)

            def __init__(self, op, *args, **kwargs):
                super().__init__(unwrap.get(id(op), op), *args, **kwargs)

        dist.P2POp = P2POp
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        restore_calls(dist, self._saved)  # (P2POp too)
        self._saved = {}


def critical_path(per_rank: Sequence[Sequence[list]],
                  phases: Optional[Sequence[str]] = None) -> Dict[str, float]:
    """From every rank's :class:`CollectiveTrace` records (rank order), restricted to
    ``phases`` (None: all): ``critical`` = sum over collectives (matched by key, in issue
    order) of the busiest rank's max(sent, received), in bytes; ``mean_sent`` = bytes
    sent per rank, mean over ranks; ``max_sent`` = the largest rank total; ``calls``."""
    busiest: Dict[tuple, int] = {}
    sent = [0] * len(per_rank)
    for r, records in enumerate(per_rank):
        for key, _name, phase, s, v in records:
            if phases is not None and phase not in phases:
                continue
            k = tuple(tuple(x) if isinstance(x, list) else x for x in key)
            busiest[k] = max(busiest.get(k, 0), s, v)
            sent[r] += s
    n = max(1, len(per_rank))
    return {"critical": float(sum(busiest.values())), "mean_sent": sum(sent) / n,
            "max_sent": float(max(sent, default=0)), "calls": len(busiest)}


# ----------------------------------------------------------------------------- functional
# DTensor (and so FSDP2's clip_grad_norm_ over DTensor grads) issues its collectives through
# torch.distributed._functional_collectives ("funcol"), called as module attributes
# (``funcol.all_reduce(...)``); FSDP2 itself issues its all-gathers and reduce-scatters
# through ``dist.all_gather_single`` / ``dist.reduce_scatter_single``, which
# :class:`CollectiveTrace` already wraps.
FUNCOL_COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "all_gather_tensor",
                      "all_gather_single", "all_gather_into_tensor_coalesced",
                      "all_gather_single_coalesced", "reduce_scatter_tensor",
                      "reduce_scatter_single", "reduce_scatter_tensor_coalesced",
                      "reduce_scatter_single_coalesced", "all_to_all_single", "broadcast")


def _funcol_group(group, tag: str = ""):
    """The ProcessGroup behind a functional collective's ``group`` argument (a
    ProcessGroup, a group name, a 1-D DeviceMesh, (mesh, dim), or a rank list)."""
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed import distributed_c10d as c10d

    g = funcol._resolve_group(group, tag)
    return c10d._resolve_process_group(g) if isinstance(g, str) else g


def funcol_link_bytes(name: str, bound: Dict[str, object], group) -> tuple:
    """(sent, received) of this rank's link for one call of
    ``_functional_collectives.<name>``, as :func:`gloo_link_bytes` counts the
    torch.distributed collective it runs (all_reduce, all_gather_into_tensor,
    reduce_scatter_tensor, all_to_all_single, broadcast)."""
    import torch.distributed as dist

    x = bound.get("self", bound.get("inputs"))
    if name.startswith("all_reduce"):
        return gloo_link_bytes("all_reduce", {"tensor": x, "group": group})
    if name.startswith("all_gather"):
        return gloo_link_bytes("all_gather_into_tensor", {"input_tensor": x, "group": group})
    if name.startswith("reduce_scatter"):
        return gloo_link_bytes("reduce_scatter_tensor", {"input": x, "group": group})
    if name == "broadcast":
        return gloo_link_bytes("broadcast", {"tensor": x, "src": bound["src"], "group": group})
    if name == "all_to_all_single":
        world = dist.get_world_size(group)
        me = dist.get_rank(group)
        row = x.element_size() * (x[0].numel() if x.dim() > 1 else 1)
        full = tensor_bytes(x)

        def moved(splits):
            if not splits:
                return round((world - 1) / world * full) if world > 1 else 0
            return row * sum(int(n) for r, n in enumerate(splits) if r != me)

        return moved(bound.get("input_split_sizes")), moved(bound.get("output_split_sizes"))
    return 0, 0


class CheckedCollectiveTrace(CollectiveTrace):
    """:class:`CollectiveTrace` that also wraps the functional collectives
    (:data:`FUNCOL_COLLECTIVES`, recorded as ``"funcol.<name>"``; a functional collective
    called from inside another is recorded once) and checks that it saw everything: on
    exit, :attr:`missed` is, per process group that ``check_groups`` names (default: the
    default group), the number of collectives the group ran (its sequence number, which
    ProcessGroupGloo advances once per collective, barrier included) minus the collectives
    recorded on it; 0 when every call went through a wrapped Python function. Exact for
    tensor collectives (one op per call); object collectives (several ops per call) and
    point-to-point make it inexact: use it where a trace has neither."""

    def __init__(self, check_groups: Optional[Sequence[object]] = None):
        super().__init__()
        self._check_groups = check_groups
        self._seq0: Dict[tuple, int] = {}
        self._depth = 0
        self.missed: Dict[tuple, int] = {}

    @staticmethod
    def _ranks(group) -> tuple:
        import torch.distributed as dist

        ranks = tuple(dist.get_process_group_ranks(group))
        return () if ranks == tuple(range(dist.get_world_size())) else ranks

    def _groups(self) -> list:
        import torch.distributed as dist

        return list(self._check_groups) if self._check_groups else [dist.group.WORLD]

    def __enter__(self) -> "CheckedCollectiveTrace":
        from torch.distributed import _functional_collectives as funcol

        self._seq0 = {self._ranks(g): g._get_sequence_number_for_group()
                      for g in self._groups()}
        super().__enter__()

        def around(name, args, call):
            if self._depth:  # (called from inside another functional collective)
                return call()
            group = _funcol_group(args["group"], args.get("tag", ""))
            rec = [self._key(name, group), "funcol." + name, self.phase, 0, 0]
            rec[3], rec[4] = funcol_link_bytes(name, args, group)
            self.records.append(rec)
            self._depth += 1
            try:
                return call()
            finally:
                self._depth -= 1

        self._saved_funcol = wrap_calls(funcol, FUNCOL_COLLECTIVES, around)
        return self

    def __exit__(self, *exc) -> None:
        from torch.distributed import _functional_collectives as funcol

        restore_calls(funcol, self._saved_funcol)
        self._saved_funcol = {}
        super().__exit__(*exc)
        seen: Dict[tuple, int] = {}
        for key, *_ in self.records:
            if key[0] == "c":
                k = tuple(key[1])
                seen[k] = seen.get(k, 0) + 1
        self.missed = {}
        for g in self._groups():
            k = self._ranks(g)
            self.missed[k] = g._get_sequence_number_for_group() - self._seq0[k] - seen.get(k, 0)

    @property
    def complete(self) -> bool:
        return not any(self.missed.values())
