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
                    "all_to_all_single", "all_gather", "reduce", "send", "isend", "recv", "irecv",
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
    if name == "all_gather_into_tensor":
        return round(frac * tensor_bytes(bound["output_tensor"]))
    if name == "reduce_scatter_tensor":
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


class WireCounter:
    """While open, wraps torch.distributed's Python collectives (the module attributes that
    code calls as ``dist.all_reduce(...)``) and records ``(name, wire bytes)`` per call,
    with :func:`ring_wire_bytes`. Collectives issued from C++ (DDP's built-in all-reduce)
    are not seen: register a Python comm hook to count them."""

    def __init__(self):
        self.calls: List[tuple] = []
        self._saved: Dict[str, Callable] = {}

    def __enter__(self) -> "WireCounter":
        import inspect

        import torch.distributed as dist

        for name in WIRE_COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn
            sig = inspect.signature(fn)

            def wrapper(*args, __name=name, __fn=fn, __sig=sig, **kwargs):
                bound = __sig.bind(*args, **kwargs)
                bound.apply_defaults()
                self.calls.append((__name, ring_wire_bytes(__name, bound.arguments)))
                return __fn(*args, **kwargs)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)
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
