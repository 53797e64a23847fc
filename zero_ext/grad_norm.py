"""Global grad-norm clipping without a pass over every grad on every rank.

``torch.nn.utils.clip_grad_norm_`` reads every grad to compute the norm and then scales
every grad: two passes over all grads, on every rank. Here each rank computes the norm
terms of the grad elements it owns (1/world of them), one small all-reduce gives every
rank the same total, and the clip coefficient is not applied to the grads at all: it is
kept as a pending factor that the next step multiplies into the grads it reads (inside
the fused kernel, or on the temporary grads of the generic path). The grads themselves
keep their values.

A pending clip belongs to the grads it was computed from, param by param (`PendingClip`):
the step applies it to exactly those grads, whatever happened to the layout in between
(params frozen or unfrozen, bucket views rebuilt, param groups added, ownership moved).
"""
from __future__ import annotations

import math
import weakref
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .sync import backend_device, small_all_reduce


# bf16/fp16 grads are upcast in chunks of this many elements (4 MB of float32 at a time):
# torch._foreach_norm(..., dtype=torch.float32) on bf16 is about 8x slower on CPU than
# upcasting and taking the float32 norm (219 vs 28 ms for 62M elements, one thread).
UPCAST_CHUNK = 1 << 20


def _is_min_norm(norm_type: float) -> bool:
    """Norms whose total is dominated by the smallest terms (p < 0, -inf): a rank or a
    piece without elements must not take part, rather than count as zero."""
    return norm_type < 0


def local_terms(pieces: Sequence[Tensor], norm_type: float,
                scales: Optional[Sequence[Optional[float]]] = None) -> tuple[float, int]:
    """This rank's part of the total norm of `pieces` (each times its entry of `scales`,
    None meaning 1), in float64, and how many non-empty pieces it covers: the sum of
    |x|^p for finite p, the max (p = inf) or min (p = -inf) of |x|. float32 pieces are
    reduced per tensor as torch.nn.utils.clip_grad_norm_ does (so the norms agree to
    float32 rounding); bf16/fp16 pieces in float32, chunk by chunk."""
    pieces = [(t, 1.0 if scales is None or scales[i] is None else abs(float(scales[i])))
              for i, t in enumerate(pieces) if t.numel() > 0]
    if not pieces:
        return (0.0 if not _is_min_norm(norm_type) else math.inf), 0
    wide = [(t, s) for t, s in pieces if t.dtype not in (torch.bfloat16, torch.float16)]
    norms = list(torch._foreach_norm([t for t, _ in wide], norm_type)) if wide else []
    factors = [s for _, s in wide]
    for t, s in pieces:
        if t.dtype in (torch.bfloat16, torch.float16):
            for c in t.reshape(-1).split(UPCAST_CHUNK):
                norms.append(torch.linalg.vector_norm(c.float(), norm_type))
                factors.append(s)
    by_dev: dict = {}
    for n, s in zip(norms, factors):
        by_dev.setdefault(n.device, ([], []))
        by_dev[n.device][0].append(n)
        by_dev[n.device][1].append(s)
    vals = torch.cat([torch.stack(v).to("cpu", torch.float64) for v, _ in by_dev.values()])
    vals = vals * torch.tensor([s for _, f in by_dev.values() for s in f],
                               dtype=torch.float64)
    if torch.isnan(vals).any():
        return float("nan"), len(pieces)
    if norm_type == math.inf:
        return float(vals.max()), len(pieces)
    if norm_type == -math.inf:
        return float(vals.min()), len(pieces)
    return float(vals.pow(norm_type).sum()), len(pieces)


def combine(terms: Sequence[float], counts: Sequence[int], norm_type: float) -> float:
    """The total norm from every rank's `local_terms` (torch's value for no grads: 0)."""
    present = [t for t, n in zip(terms, counts) if n > 0]
    if any(math.isnan(t) for t in present):
        return float("nan")
    if not present:
        return 0.0
    if norm_type == math.inf:
        return max(present)
    if norm_type == -math.inf:
        return min(present)
    s = sum(present)
    if norm_type > 0:
        return s ** (1.0 / norm_type) if s > 0 else 0.0
    # p < 0: a zero element makes its term inf and the norm 0, infinite elements make
    # their terms 0 (all of them infinite: the norm is inf), as in torch
    if math.isinf(s):
        return 0.0
    return math.inf if s == 0 else s ** (1.0 / norm_type)


def total_norm(term: float, count: int, norm_type: float, group, world_size: int,
               rank: int, failed: bool = False) -> tuple[float, bool]:
    """Combine every rank's `local_terms`: one all-reduce of a [2 * world + 1] vector (each
    rank its own slots, so a NaN on any rank is NaN everywhere for every norm type; then
    the number of ranks that `failed` to compute theirs). Returns (norm, some rank failed)."""
    if world_size > 1 and (group is not None or dist.is_initialized()):
        vec = torch.zeros(2 * world_size + 1, dtype=torch.float64,
                          device=backend_device(group))
        vec[rank] = 0.0 if failed else term
        vec[world_size + rank] = 0 if failed else count
        vec[2 * world_size] = float(failed)
        small_all_reduce(vec, dist.ReduceOp.SUM, group)
        vals = vec.tolist()
        terms, counts = vals[:world_size], vals[world_size:2 * world_size]
        failed = vals[-1] > 0
    else:
        terms, counts = [term], [count]
    return combine(terms, counts, norm_type), failed


def validate(max_norm, norm_type) -> tuple[float, float]:
    """torch.nn.utils.clip_grad_norm_'s conversions (float(); "inf" and "-inf" are
    accepted as strings, "fro" is a ValueError), plus a clear refusal of norm_type=0,
    whose "norm" counts non-zero grads and is not one we can split between ranks."""
    try:
        norm_type = float(norm_type)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"clip_grad_norm_: norm_type must be a number (or 'inf'), got "
                        f"{norm_type!r}: {exc}") from None
    try:
        max_norm = float(max_norm)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"clip_grad_norm_: max_norm must be a number, got {max_norm!r}: "
                        f"{exc}") from None
    if math.isnan(norm_type):
        raise ValueError("clip_grad_norm_: norm_type is NaN")
    if norm_type == 0:
        raise ValueError("clip_grad_norm_: norm_type=0 (a count of non-zero gradients, not "
                         "a norm) is not supported; use a positive or negative p, or inf")
    return max_norm, norm_type


class PendingClip:
    """Clip factors of grads, each with the grad it was computed from (a weak reference
    and the version counter). torch's clip scales the grads in place; we keep the factor
    instead and apply it where the grads are read (the step, a second clip), so:

    - a grad changed after the clip and before the step that applies it cannot get what
      torch would have given it, and is an error at that step (or at a second clip): written
      in place (a backward accumulating into it: torch's result, clipped old part plus new
      part, is gone), or replaced by another tensor (``p.grad = p.grad + noise``, a cast:
      torch's new tensor would be computed from the clipped values). A grad set to None is
      simply not stepped. ``zero_grad()`` on the optimizer drops pending clips;
    - a clipped grad that survives a step unchanged (a frozen param's stale grad, when
      nothing zeroes the grads) is still clipped at the next step, as in torch; replaced or
      written in place after that step (zeroed and filled by a new backward), it is a new
      grad.

    Entries are keyed by the index of the param in the optimizer's list of all params, so
    the factor of a param does not depend on which rank owns it or on the order in which
    a rank lists its grads. Factors of 1 (a clip that did not scale) are not kept."""

    __slots__ = ("entries",)

    def __init__(self, entries: dict):
        # param index -> (weakref to the grad, version, factor, applied by a step already)
        self.entries = entries

    def __bool__(self) -> bool:
        return bool(self.entries)

    def factors(self, grads: Sequence[Optional[Tensor]], for_clip: bool = False
                ) -> list[Optional[Tensor]]:
        """The factor each of `grads` (one per param index) carries: None when it was not
        clipped (or was, before a step that it survived and was rewritten after). Raises if
        a grad clipped for the coming step was changed or replaced since; `for_clip` (a
        second clip_grad_norm_ reads the factors): a replaced grad is a new grad there (the
        grads of a skipped step, dropped and recomputed), only an in-place change raises."""
        out: list[Optional[Tensor]] = [None] * len(grads)
        for i, (ref, version, factor, applied) in self.entries.items():
            g = grads[i] if i < len(grads) else None
            if g is None:
                continue
            if ref() is g and g._version == version:
                out[i] = factor
                continue
            if applied or (for_clip and ref() is not g):
                continue  # rewritten after the step that applied the clip, or a new grad
            how = "changed in place" if ref() is g else "replaced by another tensor"
            raise RuntimeError(
                f"clip_grad_norm_ was called, then a clipped grad was {how} (another backward "
                "accumulating into it, p.grad = <a new tensor>, ...) before step() or another "
                "clip_grad_norm_: zero_ext applies the clip inside step(), so it cannot be "
                "applied as torch would have. Change the grads before clipping (with a "
                "GradScaler: scaler.unscale_(opt), then clip), or call opt.zero_grad() to drop "
                "the clip")
        return out

    def after_step(self, grads: Sequence[Optional[Tensor]]) -> Optional["PendingClip"]:
        """What remains after a step applied these factors: the grads still in place, as
        clipped grads of an earlier step (see the class docstring); None if none is. They
        are also left with the grads themselves (`with_carried`)."""
        kept = {}
        for i, (ref, _version, factor, _applied) in self.entries.items():
            g = grads[i] if i < len(grads) else None
            if g is not None and ref() is g:
                kept[i] = (ref, g._version, factor, True)
                _carry(g, factor)
        return PendingClip(kept) if kept else None


# The factors that clipped grads carry past the step that applied them, by the grad's id
# (each entry dies with its grad): an optimizer built later over the same params, which
# would find torch's clip in the grads' values, finds it here (a phase of training that
# rebuilds the optimizer without zeroing the grads first).
_CARRIED: dict = {}


def _carry(g: Tensor, factor: Tensor) -> None:
    key = id(g)
    ref = weakref.ref(g, lambda _ref, key=key: _CARRIED.pop(key, None))
    _CARRIED[key] = (ref, g._version, factor)


def with_carried(pending: Optional[PendingClip], grads: Sequence[Optional[Tensor]]
                 ) -> Optional[PendingClip]:
    """`pending` (an optimizer's own clip, by param index) plus the factors that any of
    `grads` still carries, unchanged since, from a step of another optimizer that clipped
    it (as applied factors: a grad rewritten since is a new grad)."""
    if not _CARRIED:
        return pending
    entries = dict(pending.entries) if pending else {}
    for i, g in enumerate(grads):
        if g is None or i in entries:
            continue
        carried = _CARRIED.get(id(g))
        if carried is not None and carried[0]() is g and g._version == carried[1]:
            entries[i] = (carried[0], carried[1], carried[2], True)
    return PendingClip(entries) if entries else None


def clip(norm: float, max_norm: float, norm_type: float, error_if_nonfinite: bool,
         grads: Sequence[Optional[Tensor]], prior: Optional[Sequence[Optional[Tensor]]]
         ) -> Optional[PendingClip]:
    """The new pending clip of `grads` (one per param index, None for params without a
    grad): torch's clamp(max_norm / (norm + 1e-6), max=1), times each grad's `prior`
    factor (a clip of these same grads not applied yet: clipping twice). `norm` is of the
    grads as the step would see them (prior factors included). Raises like torch when
    asked to and the norm is not finite."""
    if error_if_nonfinite and not math.isfinite(norm):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    coef = torch.tensor(max_norm / (norm + 1e-6), dtype=torch.float32).clamp(max=1.0)
    scales = float(coef) != 1.0
    entries = {}
    combined: dict = {}  # prior factor (by identity) -> coef * prior: one tensor per value
    for i, g in enumerate(grads):
        if g is None:
            continue
        p = None if prior is None else prior[i]
        if p is None:
            if not scales:
                continue
            f = coef
        else:
            f = combined.get(id(p))
            if f is None:
                f = combined[id(p)] = p if not scales else coef * p
        entries[i] = (weakref.ref(g), g._version, f, False)
    return PendingClip(entries) if entries else None


def uniform_factor(factors: Sequence[Optional[Tensor]], stepped: Sequence[int]
                   ) -> tuple[Optional[Tensor], bool]:
    """(factor, uniform): the one factor shared by the grads at indices `stepped` (None:
    no factor at all), and whether one factor covers them all. When not uniform, the
    caller scales the clipped grads one by one (see `applied`)."""
    first = None
    seen_none = False
    for i in stepped:
        f = factors[i]
        if f is None:
            seen_none = True
        elif first is None:
            first = f
        elif f is not first and float(f) != float(first):
            return None, False
    if first is None:
        return None, True
    return (first, True) if not seen_none else (None, False)


@contextmanager
def applied(pending: Optional[PendingClip], params: Sequence[Tensor], stepped: Sequence[int]
            ) -> Iterator[Optional[Tensor]]:
    """Apply a pending clip to a step over `params` (all of the optimizer's, by index) that
    reads the grads of the params at indices `stepped`. Yields the factor the step applies
    to every grad it reads (the kernel's divisor, or the generic path's multiplier), or
    None: either nothing is clipped, or the clipped grads are a strict subset (a param group
    added or a grad replaced after the clip), and then each clipped grad is replaced by its
    scaled copy in ``.grad`` for the duration of the step and put back afterwards."""
    if not pending:
        yield None
        return
    grads = [p.grad for p in params]
    factors = pending.factors(grads)
    factor, uniform = uniform_factor(factors, stepped)
    if uniform:
        yield factor
        return
    swapped = []
    try:
        with torch.no_grad():
            for i in stepped:
                if factors[i] is not None:
                    swapped.append((params[i], grads[i]))
                    params[i].grad = grads[i].mul(factors[i].to(grads[i].device))
        yield None
    finally:
        for p, g in swapped:
            p.grad = g


def scale_in_place(pending: Optional[PendingClip], params: Sequence[Tensor],
                   indices: Sequence[int]) -> None:
    """Multiply the grads of params[i], i in `indices`, in place by their pending factors,
    as torch's clip does (the path that hands the closure to the local optimizer; the
    caller then drops the pending clip: the grads hold the clipped values)."""
    if not pending:
        return
    grads = [p.grad for p in params]
    factors = pending.factors(grads)
    with torch.no_grad():
        for i in indices:
            if factors[i] is not None and grads[i] is not None:
                grads[i].mul_(factors[i].to(grads[i].device))
