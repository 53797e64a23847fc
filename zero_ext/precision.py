"""Mixed precision around a local optimizer that is not the fused AdamW engine.

The fused engine does all of this inside its kernel (engine.py). Any other
``optimizer_class`` (SGD, Adam with L2 decay, a custom subclass) steps plain tensors, so
`generic_precision` hands it, for the duration of one ``step()``:

- for each bfloat16/float16 key (with ``master_weights``): its float32 master in place of
  its data, and a float32 copy of its grad, so the optimizer steps the master and creates
  float32 state; afterwards the key gets its data back and receives the master rounded to
  nearest even;
- a grad multiplied by ``factor`` (GradScaler's unscale and a pending clip factor), as a
  temporary, so the user's ``.grad`` is never modified.

The master is kept as ``state[key]["master"]``, the same entry the fused engine uses, so
state dicts do not depend on the path. The param stays the source of truth: an element
whose bits differ from its master's rounding takes its master from the param first.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor

from .engine import LOW_PRECISION, MASTER, ensure_master_state, has_master, memory_of


def resync_master(master: Tensor, key: Tensor) -> None:
    """Elements of `key` that no longer hold `master`'s rounding were written by someone
    else (weights loaded, surgery): their master takes the param's value."""
    stale = master.to(key.dtype).view(torch.int16) != key.view(torch.int16)
    master.copy_(torch.where(stale, key.to(torch.float32), master))


@contextmanager
def generic_precision(keys: Sequence[Tensor], state: dict, master_weights: bool,
                      factor: Optional[Tensor]) -> Iterator[None]:
    """See the module docstring. `keys` are the local optimizer's params (their ``.grad``
    set); `state` its state. Nothing is swapped when there is nothing to do."""
    swaps = []  # (key, data, grad, master or None)
    shared: dict = {}  # keys over one memory (tied params) share one master
    if not master_weights and factor is None:
        keys = ()  # nothing to swap: no per-key work on this path's every step
    try:
        with torch.no_grad():
            for k in keys:
                g = k.grad
                if g is None:
                    continue
                use_master = master_weights and has_master(k)
                if not use_master and factor is None:
                    continue
                master = None
                if use_master:
                    st = state.get(k)
                    if st:  # (an empty state stays empty: the optimizer creates its own)
                        ensure_master_state(st, k)
                    mem = memory_of(k)
                    if mem in shared:
                        master = shared[mem]
                    elif st:
                        master = st[MASTER]
                        resync_master(master, k)
                    else:
                        master = k.detach().to(torch.float32, copy=True)
                    shared.setdefault(mem, master)
                    g2 = g.to(torch.float32, copy=True)
                    if factor is not None:
                        g2.mul_(factor.to(g2.device))
                else:  # in float32, rounded once (as torch's clip multiplies bf16 grads)
                    g2 = (g.to(torch.float32) * factor.to(g.device)).to(g.dtype) \
                        if g.dtype in LOW_PRECISION else g * factor.to(g.device, g.dtype)
                data = k.data
                swaps.append((k, data, g, master))
                k.grad = None  # a grad must match the data's dtype when data is swapped
                if master is not None:
                    k.data = master
                k.grad = g2
        yield
    finally:
        with torch.no_grad():
            for k, data, g, master in swaps:
                k.grad = None
                if master is not None:
                    k.data = data
                    data.copy_(master)  # rounds to nearest even
                    # After the step: an optimizer that creates state at a key's first step
                    # has done so (it saw an empty state); one that keeps none (SGD
                    # without momentum) gets an entry holding only the master.
                    state[k] = state.get(k) or {}
                    state[k][MASTER] = master
                k.grad = g


def kernel_divisor(grad_scale: Optional[Tensor], clip: Optional[Tensor]
                   ) -> Optional[Tensor]:
    """What the fused kernel divides the grads by for this step (its ``grad_scale``):
    GradScaler's scale (not unscaled yet) over a pending clip coefficient, one element;
    None when both are absent. The reciprocal of `scale_factor`."""
    if clip is None:
        return grad_scale
    if grad_scale is None:
        return clip.reciprocal().reshape(1)
    return (grad_scale.reshape(()).float() / clip.to(grad_scale.device)).reshape(1)


def scale_factor(grad_scale: Optional[Tensor], clip: Optional[Tensor]) -> Optional[Tensor]:
    """The multiplier of the grads for this step: 1/grad_scale (GradScaler, not unscaled
    yet) times a pending clip coefficient; None when both are absent."""
    if grad_scale is None and clip is None:
        return None
    f = torch.ones((), dtype=torch.float32)
    if grad_scale is not None:
        f = f.to(grad_scale.device) / grad_scale.reshape(()).to(torch.float32)
    if clip is not None:
        f = f * clip.to(f.device, torch.float32).reshape(())
    return f


def found_inf_flag(found_inf) -> bool:
    """GradScaler's ``found_inf`` as a bool: a tensor (any non-zero element), or the plain
    number torch hands over when this optimizer had no grads to check (the int 0)."""
    if found_inf is None:
        return False
    if isinstance(found_inf, Tensor):
        return bool(found_inf.ne(0).any())
    if isinstance(found_inf, (bool, int, float)):
        return found_inf != 0
    raise TypeError(f"found_inf (set by GradScaler) must be a tensor or a number, got "
                    f"{type(found_inf).__name__}")
