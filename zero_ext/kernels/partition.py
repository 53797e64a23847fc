"""Partition planning: which rank owns which parameters (or which elements of the flat buffer).

Ops (CPU only, host logic: inputs are small int64 CPU tensors whatever device the params live
on, so no CUDA kernel is registered for them):

- ``assign_params(numels, groups, world_size)``: whole-param ownership, never worse (max rank
  load) than torch's ZeroRedundancyOptimizer rule (:func:`torch_greedy`) and better where the
  sizes allow.
- ``flat_offsets(numels, world_size, alignment)``: aligned layout of the flat buffer for
  element-level sharding; rank ``r`` owns ``[r*S, (r+1)*S)`` with ``S = offsets[-1] // world``.

The algorithm of ``assign_params`` (``assign_params_reference`` is its exact twin, the tests
compare assignments element for element):

1. Candidate A is torch's rule: groups by ascending id (params of a group keep their given
   order), inside a group numel descending with a stable sort, each param to the least-loaded
   rank (lowest rank on ties); loads carry across groups.
2. Candidate B is LPT over all params: numel descending, ties by index, same greedy.
3. Start from the candidate with the smaller max load (A on ties), then local search: take the
   heaviest rank ``h`` (lowest index on ties); stop if its load already equals the lower bound
   ``max(ceil(total / world), max numel)``; else visit the other ranks ``r`` by ascending load
   (index on ties) and, for the first one that has any, apply its best single move of one
   param ``h -> r`` or swap of a pair ``h <-> r`` that leaves ``max(load_h', load_r')`` strictly
   below ``load_h``. Best: smallest resulting pair max, then a move before a swap, then the
   smaller index of the param leaving ``h``, then of the param leaving ``r``. Repeat until no
   step exists or after ``MAX_LOCAL_SEARCH_ITERS`` steps. Each step strictly lowers the sum of
   squared loads, so the search always ends; the max load never rises.

Everything is integer arithmetic, so every rank computes the same plan. Zero-numel params stay
where the greedy put them (they never move).
"""
from __future__ import annotations

import bisect
import heapq
from typing import List, Sequence, Tuple

import torch

from ._loader import ensure_loaded

__all__ = [
    "assign_params",
    "assign_params_reference",
    "torch_greedy",
    "flat_offsets",
    "flat_offsets_reference",
    "rank_pieces",
    "rank_loads",
    "max_over_mean",
    "MAX_LOCAL_SEARCH_ITERS",
]

# Must equal kMaxLocalSearchIters in csrc/partition.cpp.
MAX_LOCAL_SEARCH_ITERS = 10000


# --------------------------------------------------------------------------- helpers

def _as_int_list(values, name: str) -> List[int]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got {values.dim()}-D")
        return [int(v) for v in values.tolist()]
    return [int(v) for v in values]


def _check_inputs(numels: List[int], groups: List[int] | None, world_size: int) -> None:
    if int(world_size) < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if groups is not None and len(groups) != len(numels):
        raise ValueError(
            f"numels and groups must have the same length, got {len(numels)} and {len(groups)}")
    for i, n in enumerate(numels):
        if n < 0:
            raise ValueError(f"numels[{i}] = {n} is negative")


def _greedy(order: Sequence[int], numels: Sequence[int], world_size: int) -> Tuple[List[int], List[int]]:
    """Each param of ``order`` to the least-loaded rank (lowest rank on ties)."""
    owner = [0] * len(numels)
    loads = [0] * world_size
    heap = [(0, r) for r in range(world_size)]
    for i in order:
        load, r = heapq.heappop(heap)
        owner[i] = r
        loads[r] = load + numels[i]
        heapq.heappush(heap, (loads[r], r))
    return owner, loads


def rank_loads(numels: Sequence[int], owners: Sequence[int], world_size: int) -> List[int]:
    """Elements owned by each rank under a whole-param assignment."""
    loads = [0] * int(world_size)
    for n, r in zip(numels, owners):
        loads[int(r)] += int(n)
    return loads


def max_over_mean(loads: Sequence[int]) -> float:
    """Max rank load over mean rank load (1.0 is perfect; 1.0 as well when all loads are 0)."""
    loads = [int(x) for x in loads]
    total = sum(loads)
    if not loads or total == 0:
        return 1.0
    return max(loads) * len(loads) / total


# --------------------------------------------------------------------------- torch's rule

def torch_greedy(numels: Sequence[int], groups: Sequence[int], world_size: int) -> List[int]:
    """Ranks under torch's ZeroRedundancyOptimizer rule (the baseline we must never lose to).

    Groups in ascending id order; inside a group, params sorted by numel descending with a
    stable sort; each to the least-loaded rank so far (lowest rank on ties); loads carry over.
    """
    numels = _as_int_list(numels, "numels")
    groups = _as_int_list(groups, "groups")
    _check_inputs(numels, groups, world_size)
    order = sorted(range(len(numels)), key=lambda i: (groups[i], -numels[i], i))
    return _greedy(order, numels, int(world_size))[0]


# --------------------------------------------------------------------------- reference

def _best_step(vh: List[Tuple[int, int]], vr: List[Tuple[int, int]], lh: int, lr: int):
    """Best move/swap between heaviest rank h and rank r (see module doc), or None.

    vh, vr: ascending (numel, index) lists of the non-empty params of h and r.
    Returns (value, is_swap, p, q, p_numel, q_numel).
    """
    gap = lh - lr
    half_lo, half_hi = gap // 2, gap - gap // 2
    best = None

    def key(step):
        value, is_swap, p, q = step[0], step[1], step[2], step[3]
        return (value, is_swap, p, q)

    def offer(step):
        nonlocal best
        if best is None or key(step) < key(best):
            best = step

    def first_at_least(v, s):
        k = bisect.bisect_left(v, (s, -1))
        return v[k] if k < len(v) else None

    def first_of_largest_at_most(v, s):
        k = bisect.bisect_right(v, (s, float("inf")))
        if k == 0:
            return None
        return first_at_least(v, v[k - 1][0])

    lo = first_of_largest_at_most(vh, half_lo)
    if lo is not None:
        offer((lh - lo[0], False, lo[1], -1, lo[0], 0))
    hi = first_at_least(vh, half_hi)
    if hi is not None and hi[0] < gap:
        offer((lr + hi[0], False, hi[1], -1, hi[0], 0))
    if best is not None and best[0] == lr + half_hi:
        return best  # perfect split; a swap could only tie, and moves win ties
    k = 0
    while k < len(vh):
        a, p = vh[k]
        if a >= 2:
            b1 = first_at_least(vr, max(1, a - half_lo))
            if b1 is not None and b1[0] <= a - 1:
                offer((lh - (a - b1[0]), True, p, b1[1], a, b1[0]))
            b2 = first_of_largest_at_most(vr, a - half_hi)
            if b2 is not None and b2[0] >= max(1, a - gap + 1):
                offer((lr + (a - b2[0]), True, p, b2[1], a, b2[0]))
        k = bisect.bisect_right(vh, (a, float("inf")), k)
    return best


def _local_search(numels: List[int], world_size: int, owner: List[int], loads: List[int]) -> None:
    total = sum(numels)
    bound = max(-(-total // world_size), max(numels, default=0))
    if world_size < 2 or max(loads) <= bound:
        return
    items: List[List[Tuple[int, int]]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(numels)), key=lambda i: (numels[i], i)):
        if numels[i] > 0:
            items[owner[i]].append((numels[i], i))
    # Every rank as (load, rank), ascending, kept sorted as loads change (two per step):
    # the heaviest rank and the others in visiting order without sorting every rank again.
    by_load = sorted((loads[r], r) for r in range(world_size))
    for _ in range(MAX_LOCAL_SEARCH_ITERS):
        # heaviest: the lowest rank of the largest load
        h = by_load[bisect.bisect_left(by_load, (by_load[-1][0], -1))][1]
        if loads[h] <= bound:
            return
        applied = False
        for load_r, r in by_load:  # the other ranks by ascending (load, rank)
            if r == h:
                continue
            if loads[h] - load_r < 2:
                break
            step = _best_step(items[h], items[r], loads[h], load_r)
            if step is None:
                continue
            _, is_swap, p, q, p_numel, q_numel = step
            items[h].remove((p_numel, p))
            bisect.insort(items[r], (p_numel, p))
            owner[p] = r
            delta = p_numel
            if is_swap:
                items[r].remove((q_numel, q))
                bisect.insort(items[h], (q_numel, q))
                owner[q] = h
                delta -= q_numel
            for rank, new in ((h, loads[h] - delta), (r, load_r + delta)):
                del by_load[bisect.bisect_left(by_load, (loads[rank], rank))]
                bisect.insort(by_load, (new, rank))
                loads[rank] = new
            applied = True
            break
        if not applied:
            return


def assign_params_reference(numels: Sequence[int], groups: Sequence[int], world_size: int) -> List[int]:
    """Pure-Python twin of the C++ ``assign_params`` (same algorithm, same ties)."""
    numels = _as_int_list(numels, "numels")
    groups = _as_int_list(groups, "groups")
    world_size = int(world_size)
    _check_inputs(numels, groups, world_size)
    n = len(numels)
    if n == 0 or world_size == 1:
        return [0] * n
    order_a = sorted(range(n), key=lambda i: (groups[i], -numels[i], i))
    order_b = sorted(range(n), key=lambda i: (-numels[i], i))
    owner_a, loads_a = _greedy(order_a, numels, world_size)
    owner_b, loads_b = _greedy(order_b, numels, world_size)
    owner, loads = (owner_b, loads_b) if max(loads_b) < max(loads_a) else (owner_a, loads_a)
    _local_search(numels, world_size, owner, loads)
    return owner


def flat_offsets_reference(numels: Sequence[int], world_size: int, alignment: int) -> List[int]:
    """Pure-Python twin of the C++ ``flat_offsets``."""
    numels = _as_int_list(numels, "numels")
    _check_inputs(numels, None, world_size)
    if int(alignment) < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}")
    alignment = int(alignment)
    offsets = []
    cursor = end = 0
    for n in numels:
        start = -(-cursor // alignment) * alignment
        offsets.append(start)
        end = cursor = start + n
    unit = int(world_size) * alignment
    offsets.append(-(-end // unit) * unit)
    return offsets


# --------------------------------------------------------------------------- wrappers
# torch.ops.zero_ext.* (zero_ext/kernels/_ops.py): the compiled CPU kernel when the native
# library is loaded, else the references above (the op's default kernel).

def _int64_cpu(values, name: str) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.to(device="cpu", dtype=torch.int64)
    return torch.tensor(list(values), dtype=torch.int64)


def assign_params(numels: Sequence[int], groups: Sequence[int], world_size: int) -> List[int]:
    """Rank owning each whole param: never a higher max load than :func:`torch_greedy`.

    numels: elements of each param; groups: group id of each param (groups are processed by
    ascending id). Deterministic (integer arithmetic only).
    """
    ensure_loaded()
    out = torch.ops.zero_ext.assign_params(
        _int64_cpu(numels, "numels"), _int64_cpu(groups, "groups"), int(world_size))
    return out.tolist()


def flat_offsets(numels: Sequence[int], world_size: int, alignment: int) -> List[int]:
    """Aligned start of each param in the flat buffer, then the padded total.

    ``offsets[i]`` is a multiple of ``alignment``; ``offsets[n]`` is the smallest multiple of
    ``world_size * alignment`` not below the end of the last param, so each rank's shard
    ``offsets[n] // world_size`` is a multiple of ``alignment``. It is 0 when there is no
    element at all (no params, or only empty ones at offset 0).
    """
    ensure_loaded()
    out = torch.ops.zero_ext.flat_offsets(
        _int64_cpu(numels, "numels"), int(world_size), int(alignment))
    return out.tolist()


def rank_pieces(offsets: Sequence[int], numels: Sequence[int], world_size: int,
                rank: int) -> List[Tuple[int, int, int, int]]:
    """Pieces of params inside rank's range ``[rank*S, (rank+1)*S)``, ``S = offsets[-1] // world``.

    Returns ``(param_index, start_in_param, length, start_in_flat)`` in param order, one per
    param that overlaps the range (empty params never do). Binary search finds the first
    param, so the cost is O(log n + pieces) even for millions of params.
    """
    if isinstance(offsets, torch.Tensor):
        offsets = offsets.tolist()
    if isinstance(numels, torch.Tensor):
        numels = numels.tolist()
    n = len(numels)
    if len(offsets) != n + 1:
        raise ValueError(f"offsets must have len(numels) + 1 = {n + 1} entries, got {len(offsets)}")
    world_size, rank = int(world_size), int(rank)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    shard = int(offsets[n]) // world_size
    lo, hi = rank * shard, (rank + 1) * shard
    pieces = []
    # Last param starting at or before lo (it may straddle lo), through the last before hi.
    i = max(bisect.bisect_right(offsets, lo, 0, n) - 1, 0)
    end_i = bisect.bisect_left(offsets, hi, 0, n)
    for i in range(i, end_i):
        start, size = int(offsets[i]), int(numels[i])
        a, b = max(start, lo), min(start + size, hi)
        if b > a:
            pieces.append((i, a - start, b - a, a))
    return pieces
