"""Mixed precision around a local optimizer that is not the fused AdamW engine.

The fused engine does all of this inside its kernel (engine.py). Any other
``optimizer_class`` (SGD, Adam with L2 decay, a custom subclass) steps plain tensors, so
`generic_precision` hands it, for the duration of one ``step()``:

- for each bfloat16/float16 key (with ``master_weights``): its float32 master IN PLACE OF
  the key, in the group's ``"params"`` list (the same list object: LBFGS keeps a reference
  to it) and as the key of its state entry, with a float32 copy of the key's grad as the
  master's ``.grad``; the optimizer steps the master and creates float32 state, then the
  key is put back and receives the master rounded to nearest even. The key itself is never
  given other data: a ``.data`` of another dtype would make autograd drop the param's grad
  accumulator, where DDP hung its all-reduce hook (its grads would no longer be averaged);
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


def _master_of(key: Tensor, state: dict, shared: dict) -> Tensor:
    """The float32 master `key` is stepped through: the one of an earlier key over the same
    memory (tied params share it), its state's (resynced from the key), or a fresh copy
    (the first step: the optimizer creates the rest of the state)."""
    st = state.get(key)
    if st:  # (an empty state stays empty: the optimizer creates its own)
        ensure_master_state(st, key)
    mem = memory_of(key)
    if mem not in shared:
        if st:
            resync_master(st[MASTER], key)
            shared[mem] = st[MASTER]
        else:
            shared[mem] = key.detach().to(torch.float32, copy=True)
    return shared[mem]


@contextmanager
def generic_precision(optim: torch.optim.Optimizer, keys: Sequence[Tensor],
                      master_weights: bool, factor: Optional[Tensor]) -> Iterator[None]:
    """See the module docstring. `keys` are the local optimizer `optim`'s params (their
    ``.grad`` set). Nothing is touched when there is nothing to do."""
    scaled = []  # (key, its own grad): keys stepped with a scaled copy in .grad
    stand_ins = []  # (key, the float32 tensor stepped in its place, master)
    shared: dict = {}  # keys over one memory (tied params) share one master
    if not master_weights and factor is None:
        keys = ()  # no per-key work on this path's every step
    swapped = []  # (key, stand-in, master, params list, index, key's version)
    stood_in: set = set()  # ids of the masters already handed to the optimizer
    state = optim.state
    try:
        with torch.no_grad():
            for k in keys:
                g = k.grad
                if g is None:
                    continue
                if master_weights and has_master(k):
                    master = _master_of(k, state, shared)
                    # a second key over the same memory: its own tensor (its own grad and
                    # state entry) over the same master values
                    stand_in = master if id(master) not in stood_in else master.view_as(master)
                    stood_in.add(id(master))
                    stand_in.grad = g.to(torch.float32, copy=True)
                    if factor is not None:
                        stand_in.grad.mul_(factor.to(g.device))
                    stand_ins.append((k, stand_in, master))
                elif factor is not None:  # in float32, rounded once (as torch's clip
                    scaled.append((k, g))  # multiplies bf16 grads)
                    k.grad = (g.to(torch.float32) * factor.to(g.device)).to(g.dtype) \
                        if g.dtype in LOW_PRECISION else g * factor.to(g.device, g.dtype)
            if stand_ins:
                where = {id(p): (grp["params"], i) for grp in optim.param_groups
                         for i, p in enumerate(grp["params"])}
                for k, stand_in, master in stand_ins:
                    params, i = where[id(k)]
                    params[i] = stand_in
                    swapped.append((k, stand_in, master, params, i, k._version))
                    if k in state:
                        state[stand_in] = state.pop(k)
        yield
        # an optimizer that wrote the key itself did not step through its group's params
        wrote = [i for k, _, _, _, i, version in swapped if k._version != version]
    finally:
        with torch.no_grad():
            for k, stand_in, master, params, i, _ in swapped:
                params[i] = k
                # An optimizer that creates state at a key's first step has done so under
                # the stand-in; one that keeps none (SGD without momentum) gets an entry
                # holding only the master.
                state[k] = state.pop(stand_in, None) or {}
                state[k][MASTER] = master
                k.data.copy_(master)  # rounds to nearest even
            for _, stand_in, _ in stand_ins:
                stand_in.grad = None
            for k, g in scaled:
                k.grad = g
    if wrote:
        raise RuntimeError(
            f"master_weights=True: {type(optim).__name__}.step() wrote its parameters "
            "directly instead of the tensors in its param_groups' \"params\" lists (which "
            "hold the float32 masters during the step); its update is lost. Step the "
            "tensors of param_groups, or use master_weights=False")


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
