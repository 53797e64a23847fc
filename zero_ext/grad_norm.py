"""Global grad-norm clipping without a pass over every grad on every rank.

``torch.nn.utils.clip_grad_norm_`` reads every grad to compute the norm and then scales
every grad: two passes over all grads, on every rank. Here each rank computes the norm
terms of the grad elements it owns (1/world of them), one small all-reduce gives every
rank the same total, and the clip coefficient is not applied to the grads at all: it is
kept as a pending factor that the next step multiplies into the grads it reads (inside
the fused kernel, or on the temporary grads of the generic path). The grads themselves
keep their values.
"""
from __future__ import annotations

import math
import weakref
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .sync import backend_device


# bf16/fp16 grads are upcast in chunks of this many elements (4 MB of float32 at a time):
# torch._foreach_norm(..., dtype=torch.float32) on bf16 is about 8x slower on CPU than
# upcasting and taking the float32 norm (219 vs 28 ms for 62M elements, one thread).
UPCAST_CHUNK = 1 << 20


def local_terms(pieces: Sequence[Tensor], norm_type: float) -> float:
    """Sum of |x|^p over the elements of `pieces` (max |x| for p = inf), in float64.
    float32 pieces are reduced per tensor as torch.nn.utils.clip_grad_norm_ does (so the
    norms agree to float32 rounding); bf16/fp16 pieces in float32, chunk by chunk."""
    if not pieces:
        return 0.0
    wide = [t for t in pieces if t.dtype not in (torch.bfloat16, torch.float16)]
    norms = list(torch._foreach_norm(wide, norm_type)) if wide else []
    for t in pieces:
        if t.dtype in (torch.bfloat16, torch.float16):
            flat = t.reshape(-1)
            norms += [torch.linalg.vector_norm(c.float(), norm_type)
                      for c in flat.split(UPCAST_CHUNK)]
    by_dev = {}
    for n in norms:
        by_dev.setdefault(n.device, []).append(n)
    vals = torch.cat([torch.stack(v).to("cpu", torch.float64) for v in by_dev.values()])
    if math.isinf(norm_type):
        return float(vals.max()) if not torch.isnan(vals).any() else float("nan")
    return float(vals.pow(norm_type).sum())


def total_norm(term: float, norm_type: float, group, world_size: int, rank: int,
               failed: bool = False, stale: bool = False) -> tuple[float, bool, bool]:
    """Combine every rank's `local_terms`: one all-reduce of a [world + 2] vector (each
    rank its own slot, so a NaN on any rank is NaN everywhere for every norm type; then the
    number of ranks that `failed` to compute theirs, and of ranks whose pending clip is
    `stale`). Returns (norm, some rank failed, some rank's pending clip is stale)."""
    if world_size > 1 and (group is not None or dist.is_initialized()):
        vec = torch.zeros(world_size + 2, dtype=torch.float64, device=backend_device(group))
        vec[rank] = 0.0 if failed else term
        vec[world_size] = float(failed)
        vec[world_size + 1] = float(stale)
        dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=group)
        vals = vec.tolist()
        terms, failed, stale = vals[:world_size], vals[world_size] > 0, vals[-1] > 0
    else:
        terms = [term]
    if any(math.isnan(t) for t in terms):
        return float("nan"), failed, stale
    if math.isinf(norm_type):
        return max(terms), failed, stale
    s = sum(terms)
    return (s ** (1.0 / norm_type) if s > 0 else 0.0), failed, stale


def validate(max_norm, norm_type) -> tuple[float, float]:
    try:
        max_norm, norm_type = float(max_norm), float(norm_type)
    except (TypeError, ValueError):
        raise TypeError("clip_grad_norm_: max_norm and norm_type must be numbers, got "
                        f"{max_norm!r} and {norm_type!r}") from None
    if norm_type <= 0 and not math.isinf(norm_type) or math.isnan(norm_type):
        raise ValueError(f"clip_grad_norm_: norm_type must be positive or inf, got {norm_type}")
    return max_norm, norm_type


class PendingClip:
    """A clip factor waiting for the next step, and the grads it was computed from (weak
    references and version counters: a grad replaced or written since, by a backward or a
    zero_grad, means the factor belongs to grads that are gone)."""

    def __init__(self, factor: Tensor, grads: Sequence[Tensor]):
        self.factor = factor
        self._grads = [(weakref.ref(g), g._version) for g in grads]

    def same_grads(self, grads: Sequence[Tensor]) -> bool:
        return len(grads) == len(self._grads) and all(
            r() is g and v == g._version for (r, v), g in zip(self._grads, grads))

    def factor_for(self, grads: Sequence[Tensor], scaler_checked: bool = False
                   ) -> Optional[Tensor]:
        """The factor a step reading `grads` applies: this clip's, if they are the grads it
        was computed from; None if those were replaced since (a backward after
        zero_grad(set_to_none=True): the clip applied to grads that are gone, as in torch);
        an error if they were changed in place (a backward accumulating into them): the
        step cannot apply the clip as torch would have (to the old part only).
        `scaler_checked`: a GradScaler looked at the grads in place since (see below)."""
        if self.same_grads(grads):
            return self.factor
        # GradScaler.step (when unscale_ was not called) checks the grads for infs with an
        # in-place multiply by 1.0: one version bump per grad, values unchanged.
        if scaler_checked and len(grads) == len(self._grads) and all(
                r() is g and g._version == v + 1 for (r, v), g in zip(self._grads, grads)):
            return self.factor
        if len(grads) != len(self._grads) or any(
                r() is not g for (r, _), g in zip(self._grads, grads)):
            return None
        raise RuntimeError(
            "clip_grad_norm_ was called, then the grads were changed in place before step() "
            "(e.g. another backward accumulated into them, or GradScaler checked still-scaled "
            "grads): the clip cannot be applied as torch would have. Clip after the last "
            "backward (with a GradScaler, after scaler.unscale_(opt))")


def clip(norm: float, max_norm: float, norm_type: float, error_if_nonfinite: bool,
         pending: Optional[PendingClip], grads: Sequence[Tensor]) -> tuple[PendingClip, float]:
    """The new pending clip: torch's clamp(max_norm / (norm + 1e-6), max=1), times the
    factor of `pending` (a clip of these same grads, not applied yet: clipping twice; the
    caller passes None when it no longer applies); raises like torch when asked to and the
    norm is not finite. `norm` is of the grads as they are in memory; the returned norm is
    of the grads as the step will see them."""
    if pending is not None:
        norm *= float(pending.factor)
    if error_if_nonfinite and not math.isfinite(norm):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    coef = torch.tensor(max_norm / (norm + 1e-6), dtype=torch.float32).clamp(max=1.0)
    return PendingClip(coef if pending is None else coef * pending.factor, grads), norm
