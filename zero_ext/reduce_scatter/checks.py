"""reduce_scatter_hook's checks at the start of a step, registered with the optimizer's
seam: the grads the step reads must be what the hook left (not changed in place, not
accumulated into by a second backward, not cut by another optimizer's plan or a partition
changed since), else an error on every rank before anything is stepped. Also
`gather_grads`, which makes the grads whole on every rank for readers outside the step.
"""
from __future__ import annotations

import torch

from ..agree import agree
from ..seam import register_step_check
from .hook import _REDUCERS
from .record import _Cut


def _reduced_for_another(opt, reducer) -> list[int]:
    """Indices of `opt`'s params whose current grad the hook reduce-scattered for another
    optimizer (the hook's state is an optimizer since replaced): each rank holds the
    averaged grad only where that one's plan gave it the elements."""
    if not any(reducer is None or c.record() is not reducer.record
               for c in list(_Cut.unconsumed)):
        return []  # (no grad carries another's tag not yet read)
    out = []
    for i, p in enumerate(opt.hook_seam.params):
        cut = None if p.grad is None else getattr(p.grad, "_zero_ext_cut", None)
        if cut is not None and not cut.consumed and (reducer is None
                                                      or cut.record() is not reducer.record):
            out.append(i)
    return out


def check_grads(opt, scaler: bool, error: BaseException | None
                ) -> tuple[bool, BaseException | None]:
    """At the start of `opt`'s step: whether the hook reduced its grads since the last
    step (the same on every rank: DDP ran the hook everywhere), and `error`, or an error
    naming what makes those grads unusable when there is none yet: grads changed after the
    hook, a second backward without no_sync, a partition changed since, or grads reduced
    for another optimizer."""
    reducer = _REDUCERS.get(opt)
    foreign = _reduced_for_another(opt, reducer)
    if foreign and error is None:
        error = RuntimeError(
            f"ZeroRedundancyOptimizer.step: the grads of params {_some(foreign)} were "
            "reduce-scattered by zero_ext's reduce_scatter_hook for another "
            "ZeroRedundancyOptimizer, whose partition decided which rank holds which "
            "averaged elements; this optimizer would step partial grads. A DDP model takes "
            "one comm hook: register it with state None "
            "(`ddp.register_comm_hook(None, reduce_scatter_hook)`) so that it follows the "
            "newest optimizer over the params, and build a replacement optimizer before the "
            "backward whose grads it steps (zero_grad() and a new backward continue from "
            "here)")
    if reducer is None:
        return bool(foreign), error
    # (before the record is asked: a partition changed since a reduction is wrong whether
    # or not the backward's record ran; every rank reduced the same params)
    moved = reducer.record.moved_ownership()
    if reducer.record.seen is None and not moved:
        reducer.start_step()
        return bool(foreign), error
    if moved and error is None:
        error = RuntimeError(
            f"ZeroRedundancyOptimizer.step: the partition of params {_some(moved)} changed "
            "after zero_ext's reduce_scatter_hook reduced their grads (add_param_group "
            "between backward and step re-partitions while no optimizer state exists), so "
            "their new owners hold unreduced grads. Call add_param_group before the backward "
            "or after the step; zero_grad() and a new backward continue from here")
    if opt.hook_seam.wants_unchanged:  # (offload_optimizer: which early copies still hold)
        opt.hook_seam.unchanged = reducer.record.unchanged_grads(scaler)
    changed = reducer.record.changed_grads(scaler)
    reducer.start_step()
    if reducer.record.accumulated:
        reducer.record.accumulated = False
        if error is None:
            error = RuntimeError(
                "ZeroRedundancyOptimizer.step: several backward passes ran through DDP with "
                "zero_ext's reduce_scatter_hook before this step. After the hook each rank's "
                ".grad holds the averaged grad only where the rank owns the elements, so a "
                "second reduction adds local and averaged grads. Accumulate micro-batches "
                "under `with ddp.no_sync():` for all but the last backward (which is also "
                "what saves DDP's bytes), or use DDP's default all-reduce")
    if changed and error is None:
        error = RuntimeError(
            f"ZeroRedundancyOptimizer.step: the grads of params {_some(changed)} were "
            "changed after zero_ext's "
            "reduce_scatter_hook reduced them. With that hook each rank's .grad holds the "
            "averaged grad only for the elements the rank owns, so torch.nn.utils."
            "clip_grad_norm_ (or any in-place change of the grads) computes from partial "
            "grads: use opt.clip_grad_norm_(max_norm), which returns the true global norm "
            "and clips inside the step (GradScaler works as usual)")
    return True, error


@torch._disable_dynamo
def gather_grads(opt) -> None:
    """Collective (every rank of the optimizer's group): after a backward through
    `reduce_scatter_hook`, every rank's ``.grad`` holds the averaged grads DDP's all-reduce
    would have left, so that code reading grads outside the optimizer (a grad-norm log, an
    EMA of grads, torch's clip_grad_norm_) sees DDP's values. It costs an all-gather of the
    reduced grads ((W-1)/W of their bytes per rank: what the hook saved); call it only
    where such a reader runs (a logging step). Nothing to do when the grads are whole
    already (no backward through the hook since the last step, DDP's first iteration)."""
    reducer = _REDUCERS.get(opt)
    reduced = set() if reducer is None or reducer.record.seen is None else set(reducer.record.seen)
    ids = sorted(reduced)
    digest = hash(tuple(ids)) & ((1 << 62) - 1)
    error = None if reducer is None or not reducer.record.pending else RuntimeError(
        "gather_grads: a backward through reduce_scatter_hook has not finished")
    top, bottom = agree(opt.process_group, opt.world_size, error, "gather_grads",
                        (digest, -digest))
    if top != -bottom:
        raise RuntimeError("gather_grads: ranks hold reduced grads of different params "
                           "(call it on every rank, after the same backward)")
    if not reduced:
        return
    changed = reducer.record.changes(reduced)  # (before the exchange writes into them)
    opt.hook_seam.exchange_grads(reduced)
    # whole grads now: as after DDP's all-reduce, anything may read or change them; what
    # was done to them before, on partial grads, the step still checks
    reducer.record.gathered_changes.update({i: c for i, c in changed.items()
                                     if c == "replaced" or c[0]})
    reducer.record.forget(ids)
    for i in ids:
        g = opt.hook_seam.params[i].grad
        if g is not None and getattr(g, "_zero_ext_cut", None) is not None:
            g._zero_ext_cut = None


def _some(ids: list[int]) -> str:
    return f"{ids[:8]}{'...' if len(ids) > 8 else ''}"


def checked_closure(opt, closure):
    """`closure` (a step's closure, which frameworks use to run forward and backward inside
    ``step()``: Lightning) followed by the check of `check_grads`. Collective when the hook
    ran in it: every rank ran the same closure."""

    def run():
        error, loss = None, None
        try:
            loss = closure()
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc  # (after its backward: every rank's hook ran, so every rank agrees)
        reduced, error = check_grads(opt, False, error)
        if reduced:
            agree(opt.process_group, opt.world_size, error, "ZeroRedundancyOptimizer.step")
        elif error is not None:
            raise error  # (the step's own agreement raises it on every rank)
        return loss

    return run


def _check_step(opt, closure, scaler: bool):
    """The check at the start of every ZeroRedundancyOptimizer step (seam.register_step_check):
    whether the hook reduced its grads since the last step and what makes them unusable
    (check_grads), and the closure checked after it ran."""
    reduced, error = check_grads(opt, scaler, None)
    return reduced, error, (None if closure is None else checked_closure(opt, closure))


# Registered when this module loads: before any DDP model can run the hook, and before the
# step whose closure may run the first backward through it. Every optimizer's step runs it,
# also one the hook never saw (one built to replace another).
register_step_check(_check_step)
