"""How a DDP bucket is cut by the optimizer's plan for reduce_scatter_hook: per destination
rank, the runs of the bucket it owns; one collective per bucket, or segments where what a
rank would receive exceeds SEGMENT_BYTES (the hook's scratch is bounded by one segment per
lane, whatever DDP's bucket_cap_mb is).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field


# Bytes one rank receives at most in one collective of the hook (its receive scratch): a
# bucket that would give a rank more travels as several segments, each taking its share of
# every rank's runs, so that the scratch stays bounded by the segments in flight (one per
# lane). What a rank receives is (W-1) copies of its share on the all_to_all (all of a
# bucket at world 2 when one rank owns it, as in param and flat modes), one block on the
# reduce_scatter, none where that one runs in place in the bucket (even mode on NCCL,
# one-param buckets). Each collective costs the host 0.1-0.5 ms (Python, the backend's
# call), which a GPU's iteration pays in full, so a bucket of DDP's default size (25 MB) is
# one collective where its shares are even: at 8 MB of bucket per segment, GPT-2 small took
# 68 collectives per backward (1.53x DDP's iteration on an H200 at world 1).
# At 16 MB the peak memory of the 33.6M MLP at world 2 stays within 48 MB of plain zero_ext
# in even and param modes; flat mode, where one rank receives whole buckets, reached +102
# in some repeats (+46 at 8 MB: docs/performance.md, "Host cost").
# ZERO_EXT_HOOK_SEGMENT_BYTES sets it (benchmarks, tests; every rank alike).
SEGMENT_BYTES = int(os.environ.get("ZERO_EXT_HOOK_SEGMENT_BYTES", 16 << 20))


def segment_count(splits: list, element_size: int, scatter: bool = False,
                  in_place: bool = False) -> int:
    """How many collectives a bucket with these owners' `splits` (elements per rank)
    travels in: by what its busiest rank receives (see SEGMENT_BYTES). `scatter`: by
    reduce_scatter_tensor; `in_place`: each rank owns one run and the runs, in rank order,
    are the bucket (its output is then the bucket itself)."""
    world, top = len(splits), max(splits, default=0)
    if scatter:
        received = 0 if in_place and all(n == top for n in splits) else top
    else:
        received = (world - 1) * top
    cap = max(1, SEGMENT_BYTES // element_size)
    return max(1, -(-received // cap))


@dataclass
class Segment:
    """One collective of a DDP bucket: per destination rank, the (offset, length) runs of
    the bucket buffer it owns, in rank order."""

    runs: list             # runs[r]: [(offset, length)] owned by rank r
    splits: list           # elements owned by each rank
    start: int             # where the first run starts in the bucket
    in_place: bool         # the runs in rank order are contiguous from `start`: the send
    #                        is that slice of the bucket itself, no packing
    # (the transport's, kept with the segment) lane -> its views of the bucket and scratch
    views: dict = field(default_factory=dict)


@dataclass
class BucketPlan:
    """How one DDP bucket travels, cut by the optimizer's plan."""

    params: tuple          # identities of the bucket's params (DDP rebuilds buckets)
    plan_key: object       # the token of the ownership map it was cut by
    param_ids: tuple       # their indices in the optimizer's params
    splits: list           # elements owned by each rank
    segments: list         # [Segment], each moved by one collective
    used: bool = False     # reduced since the last step (else its views are let go)


def cut(bucket, ownership, index: dict, world: int, cache: dict, params=None,
        scatters=None) -> "BucketPlan | None":
    """The plan of DDP's `bucket` under `ownership` (the seam's Ownership; `index`: id(param)
    -> the optimizer's index of it), or None when the bucket holds params the optimizer does
    not own entirely (then it is all-reduced). Plans are kept in `cache` until the bucket's
    params or the ownership change. `params`: the bucket's, when the caller has them;
    `scatters(buffer, splits)`: whether a bucket so shared travels by reduce_scatter_tensor
    (its segments are counted by what that receives)."""
    params = bucket.parameters() if params is None else params
    ident = tuple(map(id, params))
    owned = ownership.runs
    key = (ident[0], bucket.index())  # (several DDP models: each has a bucket 0)
    bp = cache.get(key)
    if bp is not None and bp.params == ident and bp.plan_key is ownership.token:
        return bp
    runs: list[list] = [[] for _ in range(world)]
    offset, ids = 0, []
    for p in params:
        pid = index.get(id(p))
        if pid is None:
            return None
        ids.append(pid)
        # DDP buckets a complex grad as its real view: 2 bucket elements per element
        k = 2 if p.is_complex() else 1
        for r, start, length in sorted(owned.get(pid, ()), key=lambda x: x[1]):
            if length:
                _append_run(runs[r], offset + k * start, k * length)
        offset += k * p.numel()
    if offset != bucket.buffer().numel():
        raise RuntimeError(
            f"reduce_scatter_hook: DDP bucket {bucket.index()} holds "
            f"{bucket.buffer().numel()} elements, its params {offset}: an unknown DDP "
            "bucket layout; use DDP's default all-reduce")
    splits = [sum(n for _, n in rr) for rr in runs]
    whole = _segment(runs)
    count = segment_count(splits, bucket.buffer().element_size(),
                          scatter=scatters is not None and scatters(bucket.buffer(), splits),
                          in_place=whole.in_place and all(len(rr) == 1 for rr in runs))
    bp = BucketPlan(ident, ownership.token, tuple(ids), splits,
                    [whole] if count == 1 else
                    [_segment([_part(rr, k, count) for rr in runs]) for k in range(count)])
    cache[key] = bp
    return bp


def _part(runs: list, k: int, count: int) -> list:
    """Part k of `count` of a rank's runs: the elements [k n / count, (k+1) n / count) of
    their concatenation (n their total), as runs."""
    total = sum(n for _, n in runs)
    lo, hi = k * total // count, (k + 1) * total // count
    out, pos = [], 0
    for o, n in runs:
        a, b = max(lo, pos), min(hi, pos + n)
        if b > a:
            out.append((o + a - pos, b - a))
        pos += n
    return out


def _segment(runs: list) -> Segment:
    flat = [run for rr in runs for run in rr]
    start = flat[0][0] if flat else 0
    in_place, pos = True, start
    for o, n in flat:
        in_place = in_place and o == pos
        pos = o + n
    return Segment(runs, [sum(n for _, n in rr) for rr in runs], start, in_place)


def _append_run(runs: list, offset: int, length: int) -> None:
    if runs and runs[-1][0] + runs[-1][1] == offset:
        runs[-1] = (runs[-1][0], runs[-1][1] + length)
    else:
        runs.append((offset, length))
