"""torch.amp.GradScaler's verdict on a step, made the same on every rank.

GradScaler decides from each rank's own grads whether they hold an inf or NaN, hands the
step that verdict (``found_inf``, with ``_step_supports_amp_scaling``), and at
``update()`` halves or grows its scale from the same per-rank verdict. With DDP's all-reduce
every rank holds every averaged grad, so the verdicts agree. Where a rank holds only part
of the averaged grads (zero_ext's ``reduce_scatter_hook``: each rank holds the averaged
elements it owns), an inf that one rank's grad carries into elements owned by another is
seen by the owner only: the step agrees across ranks and every rank skips, but each
scaler's ``update()`` would still read its own verdict, the owner would halve its scale and
the others would not, and from then on the ranks' grads would be summed at different
scales. (FSDP's ``ShardedGradScaler`` all-reduces the verdict for the same reason.)

So the step writes the agreed verdict back into the scaler that called it: GradScaler
keeps the per-device verdicts of each optimizer in the frame of its own ``step()``, which
called this optimizer's step; `scaler_verdicts` finds them there.

Why a torch internal (the frame's locals): torch's documented protocol
(``_step_supports_amp_scaling``) hands the optimizer ``found_inf`` as a fresh sum of the
per-device verdicts, so writing into it reaches nothing that ``update()`` reads, and no
documented way leads from the optimizer to its scaler (the older ``grad_scaler`` keyword is
deprecated: GradScaler warns at every step and then leaves unscaling and the inf check to the
optimizer). FSDP's ``ShardedGradScaler`` agrees the verdict itself, but only in
``unscale_``, and a script would have to change its scaler. If torch changes GradScaler.step
so that the verdicts are not found, nothing goes wrong silently: a step whose ranks saw
different verdicts raises on every rank (`share_verdict`), and one where they agree needs
nothing. tests/test_shutdown_and_amp_internals.py checks, on the installed torch, that the
frame holds the very tensors ``update()`` reads.
"""
from __future__ import annotations

import sys

import torch

_STACK_DEPTH = 32  # frames between GradScaler.step and ours (torch's step wrappers)


def scaler_verdicts(optimizer) -> list[torch.Tensor] | None:
    """The per-device found-inf tensors of the GradScaler whose ``step(optimizer)`` is
    running now (what its ``update()`` reads), or None when none is on the call stack."""
    try:
        from torch.amp.grad_scaler import GradScaler
    except ImportError:  # pragma: no cover - every supported torch has it
        return None
    code = GradScaler.step.__code__
    frame = sys._getframe(1)
    for _ in range(_STACK_DEPTH):
        if frame is None:
            return None
        if frame.f_code is code:
            local = frame.f_locals
            state = local.get("optimizer_state")
            if local.get("optimizer") is optimizer and isinstance(state, dict):
                found = state.get("found_inf_per_device")
                return list(found.values()) if isinstance(found, dict) else None
        frame = frame.f_back
    return None


def share_verdict(verdicts: list[torch.Tensor] | None, mine: int, anywhere: int,
                  everywhere: int, unreachable: int, what: str) -> None:
    """After the step's agreement: `mine` is this rank's verdict, `anywhere` / `everywhere`
    the max / min over the ranks, `unreachable` the max over the ranks of "a GradScaler
    drove the step but its verdicts were not found". Writes an inf found anywhere into
    this rank's scaler (its update() then backs off as every rank's does); raises (on every
    rank: every input here is agreed) when the verdicts differ and some rank's scaler is
    out of reach."""
    if anywhere == everywhere:
        return  # (every rank saw the same: nothing to share)
    if unreachable:
        raise RuntimeError(
            f"{what}: an inf/NaN grad was found on some ranks only (their grads hold "
            "different parts of the average: reduce_scatter_hook), so every rank skips this "
            "step, but the GradScaler of some rank could not be reached to tell it, and its "
            "scale would drift from the others'. Call scaler.step(optimizer) with "
            "torch.amp.GradScaler (or a subclass that keeps its step())")
    if anywhere and not mine and verdicts:
        verdicts[0].fill_(1.0)
