"""FusedAdamW: ``torch.optim.AdamW`` with every param group updated by ONE fused op call.

Three layers:

- :func:`hparams_row` / :func:`fused_path_supported`: which optimizers and groups the fused
  kernel can run (``torch.optim.AdamW``, :class:`FusedAdamW`, ``torch.optim.Adam`` without
  L2 weight decay) and the kernel's 7 hyperparameter columns for a group.
- :class:`MultiGroupAdamW`: the stepping engine. ``step(param_groups, state)`` works on any
  torch-format ``param_groups`` list and ``state`` dict (``FusedAdamW``'s own, or the local
  ``torch.optim.AdamW`` of the ZeRO optimizer), keeping ``torch.optim.AdamW``'s state format.
- :class:`FusedAdamW`: a ``torch.optim.Optimizer`` with ``torch.optim.AdamW``'s signature,
  defaults, validation and state dict (cross-loadable both ways with ``torch.optim.AdamW``).

Host overhead per step does not grow with tensor ops per param: the lists handed to the op
are cached, and every param's ``"step"`` is a 0-d view into one float32 buffer per device,
so a single ``add_`` increments all of them (the views are distinct elements, so a state dict
loaded into ``torch.optim.AdamW`` keeps working). The cache is rebuilt when the structure
changes (groups, their param lists, the state dict object or its size, which params have
grads, amsgrad flags); code that replaces state tensors in place of the optimizer should call
:meth:`MultiGroupAdamW.invalidate`.
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch
from torch import Tensor

from .kernels.adamw import fused_adamw_

__all__ = ["FusedAdamW", "MultiGroupAdamW", "fused_path_supported", "hparams_row"]

# torch >= 2.7 implements AdamW as Adam(decoupled_weight_decay=True) and keeps that key in
# every group; FusedAdamW's groups carry it too where torch's do, so state dicts match.
_TORCH_HAS_DECOUPLED_KEY = "decoupled_weight_decay" in inspect.signature(
    torch.optim.Adam.__init__).parameters


# --------------------------------------------------------------------------- hyperparameters

def _defaults_for(optimizer_class) -> Dict[str, Any]:
    if optimizer_class is torch.optim.Adam:
        return {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                "amsgrad": False, "maximize": False, "decoupled_weight_decay": False}
    return {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2,
            "amsgrad": False, "maximize": False, "decoupled_weight_decay": True}


def _is_fused_class(optimizer_class) -> bool:
    return optimizer_class in (torch.optim.AdamW, FusedAdamW, torch.optim.Adam)


def fused_path_supported(optimizer_class, defaults_or_group: Dict[str, Any]) -> bool:
    """True when ``optimizer_class`` with these hyperparameters (a group dict or the
    constructor's defaults; missing keys take the class defaults) is exactly what the fused
    kernel computes: ``torch.optim.AdamW``, :class:`FusedAdamW`, or ``torch.optim.Adam``
    with ``weight_decay == 0`` or ``decoupled_weight_decay=True``; without ``capturable``,
    ``differentiable``, or tensor betas. Subclasses are not assumed to keep AdamW's math."""
    if not _is_fused_class(optimizer_class):
        return False
    d = dict(_defaults_for(optimizer_class))
    d.update(defaults_or_group)
    if d.get("capturable", False) or d.get("differentiable", False):
        return False
    betas = d.get("betas", (0.9, 0.999))
    try:
        if len(betas) != 2 or any(isinstance(b, Tensor) for b in betas):
            return False
    except TypeError:
        return False
    for key in ("eps", "weight_decay"):
        if isinstance(d.get(key), Tensor):
            return False
    lr = d.get("lr")
    if isinstance(lr, Tensor) and (lr.numel() != 1 or lr.requires_grad):
        return False
    if optimizer_class is torch.optim.Adam:
        wd = d.get("weight_decay", 0.0)
        if wd != 0 and not d.get("decoupled_weight_decay", False):
            return False
    elif not d.get("decoupled_weight_decay", True):
        return False  # an AdamW group edited into L2 mode
    return True


def hparams_row(optimizer_class, group: Dict[str, Any]) -> List[float]:
    """The kernel's 7 columns (lr, beta1, beta2, eps, weight_decay, amsgrad, maximize) for a
    group of ``optimizer_class``; tensor lr is read with ``float()``. Raises ValueError for a
    group the fused kernel cannot compute (see :func:`fused_path_supported`)."""
    if optimizer_class is torch.optim.Adam:
        wd = float(group.get("weight_decay", 0.0))
        if wd != 0 and not group.get("decoupled_weight_decay", False):
            raise ValueError("Adam with L2 weight_decay (decoupled_weight_decay=False) is not "
                             "the fused AdamW update; use weight_decay=0 or AdamW")
    else:
        wd = float(group.get("weight_decay", 1e-2))
    beta1, beta2 = group.get("betas", (0.9, 0.999))
    return [float(group.get("lr", 1e-3)), float(beta1), float(beta2),
            float(group.get("eps", 1e-8)), wd, float(bool(group.get("amsgrad", False))),
            float(bool(group.get("maximize", False)))]


def _validate_hparams(lr, betas, eps, weight_decay, where: str = "") -> None:
    """torch.optim.AdamW's checks and messages (plus the group index, for groups)."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(f"Tensor lr must be 1-element{where}")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}{where}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}{where}")
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a pair of numbers, got {betas!r}{where}") from None
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {beta1}{where}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {beta2}{where}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}{where}")
    for i, b in enumerate((beta1, beta2)):
        if isinstance(b, Tensor) and b.numel() != 1:
            raise ValueError(f"Tensor betas[{i}] must be 1-element{where}")


# --------------------------------------------------------------------------- engine

class _StepPack:
    """float32 buffer on one device whose 0-d views are the params' ``state["step"]``."""

    __slots__ = ("flat", "views", "index")

    def __init__(self, values: List[float], device: torch.device):
        self.flat = torch.tensor(values, dtype=torch.float32, device=device)
        self.views = list(self.flat.unbind(0)) if values else []
        self.index: Dict[int, int] = {id(v): i for i, v in enumerate(self.views)}


class _Call:
    """Everything one op call (one device) needs, except the per-step grads and steps."""

    __slots__ = ("device", "params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs",
                 "segment_groups", "grad_pos", "complex_pos", "pack", "step_index")


class _Plan:
    __slots__ = ("key", "none", "all_params", "calls", "increments")


class MultiGroupAdamW:
    """One fused AdamW step over all param groups of a torch-format optimizer.

    ``step(param_groups, state, grad_scale=None, found_inf=None)`` follows
    ``torch.optim.AdamW.step`` exactly (lazy state init, params without ``.grad`` skipped and
    their step not incremented, ``found_inf`` skips the update and reverts the steps), with
    one ``fused_adamw_`` call per device for all groups. ``optimizer_class`` selects the
    hyperparameter mapping (:func:`hparams_row`).
    """

    def __init__(self, optimizer_class=None):
        self.optimizer_class = optimizer_class or torch.optim.AdamW
        self._plan: Optional[_Plan] = None
        self._refs: tuple = ()

    def invalidate(self) -> None:
        """Forget the cached lists (call after replacing state tensors behind our back)."""
        self._plan = None
        self._refs = ()

    # -- public step --------------------------------------------------------------------
    @torch.no_grad()
    def step(self, param_groups: Sequence[Dict[str, Any]], state: Dict[Tensor, Dict[str, Any]],
             grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None) -> None:
        plan = self._plan
        key = self._key(param_groups, state)
        if plan is None or plan.key != key:
            plan = None
            all_params = [p for g in param_groups for p in g["params"]]
        else:
            all_params = plan.all_params
        grads = [p.grad for p in all_params]
        none = ()
        if any(g is None for g in grads):
            none = tuple(i for i, g in enumerate(grads) if g is None)
        if plan is None or plan.none != none:
            plan = self._build(param_groups, state, all_params, grads, none)
            self._plan = plan
        if not plan.calls:
            return
        table = torch.tensor([hparams_row(self.optimizer_class, g) for g in param_groups],
                             dtype=torch.float64)
        for pack, mask in plan.increments:
            if mask is None:
                pack.flat.add_(1)
            else:
                pack.flat.add_(mask)
        for call in plan.calls:
            if call.grad_pos is None:
                g_list = grads
            else:
                g_list = [grads[i] for i in call.grad_pos]
            if call.complex_pos:
                g_list = list(g_list)
                for j in call.complex_pos:
                    g_list[j] = torch.view_as_real(g_list[j])
            if call.step_index is None:
                steps = call.pack.flat
            elif isinstance(call.step_index, Tensor):
                steps = call.pack.flat.index_select(0, call.step_index)
            else:  # steps spread over several packs (devices): gather them on the CPU
                steps = torch.stack([pk.flat[i].cpu() for pk, i in call.step_index])
            gs = grad_scale.to(call.device, non_blocking=True) if grad_scale is not None else None
            fi = found_inf.to(call.device, non_blocking=True) if found_inf is not None else None
            fused_adamw_(call.params, g_list, call.exp_avgs, call.exp_avg_sqs,
                         call.max_exp_avg_sqs, steps, call.segment_groups, table, gs, fi)
        if found_inf is not None:
            for pack, mask in plan.increments:
                fi = found_inf.to(pack.flat.device).reshape(())
                if mask is None:
                    pack.flat.sub_(fi)
                else:
                    pack.flat.sub_(mask * fi)

    # -- cache --------------------------------------------------------------------------
    def _key(self, param_groups, state) -> tuple:
        # Identity of the containers (kept alive in self._refs so ids cannot be reused),
        # their sizes, and the flags that shape the lists.
        return (id(state), len(state), len(param_groups),
                tuple((id(g["params"]), len(g["params"]), bool(g.get("amsgrad", False)),
                       bool(g.get("fused") or g.get("capturable"))) for g in param_groups))

    def _build(self, param_groups, state, all_params, grads, none) -> _Plan:
        active = set(range(len(all_params))) - set(none)
        # 1. lazy state init (torch.optim.AdamW's format), gather the segments per device.
        entries = []  # (position, group index, param, state dict)
        pos = 0
        for gi, group in enumerate(param_groups):
            ams = bool(group.get("amsgrad", False))
            on_device = bool(group.get("fused") or group.get("capturable"))
            for p in group["params"]:
                if pos in active:
                    g = grads[pos]
                    if g.is_sparse:
                        raise RuntimeError("FusedAdamW does not support sparse gradients")
                    st = state[p]
                    if len(st) == 0:
                        st["step"] = torch.zeros((), dtype=torch.float32,
                                                 device=p.device if on_device else "cpu")
                        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        if ams:
                            st["max_exp_avg_sq"] = torch.zeros_like(
                                p, memory_format=torch.preserve_format)
                    elif ams and "max_exp_avg_sq" not in st:
                        st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    entries.append((pos, gi, p, st))
                pos += 1
        # 2. steps: every state's "step" a view into one buffer per device.
        packs = self._pack_steps(state)
        # 3. one call per param device.
        by_dev: Dict[torch.device, list] = {}
        for e in entries:
            by_dev.setdefault(e[2].device, []).append(e)
        any_ams = [bool(g.get("amsgrad", False)) for g in param_groups]
        calls = []
        for dev, es in by_dev.items():
            c = _Call()
            c.device = dev
            use_max = any(any_ams[gi] for _, gi, _, _ in es)
            c.params, c.exp_avgs, c.exp_avg_sqs, c.max_exp_avg_sqs = [], [], [], []
            c.complex_pos = []
            empty = None
            for j, (_, gi, p, st) in enumerate(es):
                m, v = st["exp_avg"], st["exp_avg_sq"]
                x = st.get("max_exp_avg_sq") if any_ams[gi] else None
                if p.is_complex():
                    c.complex_pos.append(j)
                    p, m, v = (torch.view_as_real(t) for t in (p, m, v))
                    x = torch.view_as_real(x) if x is not None else None
                c.params.append(p)
                c.exp_avgs.append(m)
                c.exp_avg_sqs.append(v)
                if use_max:
                    if x is None:
                        if empty is None:
                            empty = torch.empty(0, dtype=m.dtype, device=dev)
                        x = empty if empty.dtype == m.dtype else torch.empty(0, dtype=m.dtype, device=dev)
                    c.max_exp_avg_sqs.append(x)
            c.segment_groups = torch.tensor([gi for _, gi, _, _ in es], dtype=torch.int64)
            positions = [pos for pos, _, _, _ in es]
            c.grad_pos = None if positions == list(range(len(all_params))) else positions
            # steps of this call: one pack, in order (no copy), or an index into one pack.
            locs = [self._locate(packs, st["step"]) for _, _, _, st in es]
            pk0 = locs[0][0]
            if all(pk is pk0 for pk, _ in locs) and (pk0.flat.device.type == "cpu"
                                                     or pk0.flat.device == dev):
                idx = [i for _, i in locs]
                c.pack = pk0
                c.step_index = None if idx == list(range(len(pk0.views))) else \
                    torch.tensor(idx, dtype=torch.int64, device=pk0.flat.device)
            else:
                c.pack = None
                c.step_index = locs
            calls.append(c)
        # 4. increments: which elements of each pack step this time.
        increments = []
        stepping = {id(st["step"]) for _, _, _, st in entries}
        for pk in packs:
            sel = [id(v) in stepping for v in pk.views]
            if not any(sel):
                continue
            mask = None if all(sel) else torch.tensor(sel, dtype=torch.float32,
                                                      device=pk.flat.device)
            increments.append((pk, mask))
        plan = _Plan()
        plan.all_params = all_params
        plan.none = none
        plan.calls = calls
        plan.increments = increments
        plan.key = self._key(param_groups, state)  # after the lazy init grew the state
        self._refs = (state, [g["params"] for g in param_groups])
        return plan

    @staticmethod
    def _locate(packs, step):
        for pk in packs:
            i = pk.index.get(id(step))
            if i is not None and pk.views[i] is step:
                return pk, i
        raise RuntimeError("FusedAdamW: a state 'step' is not packed (internal error)")

    def _pack_steps(self, state) -> List[_StepPack]:
        """Reuse the current packs when every state's step is one of their views, else copy
        all step values into fresh packs (one per device the steps live on)."""
        old = [] if self._plan is None else self._plan_packs(self._plan)
        steps = [st["step"] for st in state.values() if isinstance(st, dict) and "step" in st]
        if old and all(any(pk.index.get(id(s)) is not None and pk.views[pk.index[id(s)]] is s
                           for pk in old) for s in steps):
            covered = sum(len(pk.views) for pk in old)
            if covered == len(steps):
                return old
        by_dev: Dict[torch.device, list] = {}
        owners: Dict[torch.device, list] = {}
        for st in state.values():
            if not isinstance(st, dict) or "step" not in st:
                continue
            s = st["step"]
            if isinstance(s, Tensor):
                dev, val = s.device, float(s)
            else:  # a plain number (old checkpoints)
                dev, val = torch.device("cpu"), float(s)
            by_dev.setdefault(dev, []).append(val)
            owners.setdefault(dev, []).append(st)
        packs = []
        for dev, vals in by_dev.items():
            pk = _StepPack(vals, dev)
            for st, view in zip(owners[dev], pk.views):
                st["step"] = view
            packs.append(pk)
        return packs

    @staticmethod
    def _plan_packs(plan: _Plan) -> List[_StepPack]:
        seen = {}
        for c in plan.calls:
            if c.pack is not None:
                seen[id(c.pack)] = c.pack
            else:
                for pk, _ in c.step_index:
                    seen[id(pk)] = pk
        for pk, _ in plan.increments:
            seen[id(pk)] = pk
        return list(seen.values())


# --------------------------------------------------------------------------- optimizer

class FusedAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` with all param groups updated by one fused kernel call per device.

    Same signature, defaults, ``ValueError``\\ s and state-dict format as
    ``torch.optim.AdamW`` (state per param: ``step`` as a 0-d float32 tensor, ``exp_avg``,
    ``exp_avg_sq``, and ``max_exp_avg_sq`` with amsgrad), so checkpoints load both ways.
    Per-group hyperparameters are validated in ``add_param_group`` too. ``foreach`` and
    ``fused`` are accepted and ignored (kept in the groups for the state-dict format);
    ``capturable=True`` and ``differentiable=True`` are rejected. A tensor ``lr`` (from a
    scheduler) is read as a float each step. Works with ``torch.amp.GradScaler``: grads are
    unscaled inside the kernel and an inf/NaN step is skipped (the grads themselves are left
    scaled, unlike ``torch.optim.AdamW(fused=True)``).
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        params,
        lr: float | Tensor = 1e-3,
        betas: tuple = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
    ) -> None:
        _validate_hparams(lr, betas, eps, weight_decay)
        if capturable:
            raise ValueError("FusedAdamW does not support capturable=True (CUDA graph capture); "
                             "use torch.optim.AdamW(capturable=True)")
        if differentiable:
            raise ValueError("FusedAdamW does not support differentiable=True; use "
                             "torch.optim.AdamW(differentiable=True)")
        if fused and foreach:
            raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
        defaults = {
            "lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
            "amsgrad": amsgrad, "maximize": maximize, "foreach": foreach,
            "capturable": capturable, "differentiable": differentiable, "fused": fused,
        }
        if _TORCH_HAS_DECOUPLED_KEY:
            defaults["decoupled_weight_decay"] = True
        self._engine = MultiGroupAdamW(FusedAdamW)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        where = f" (param group {len(getattr(self, 'param_groups', []))})"
        get = lambda k: param_group.get(k, self.defaults[k])  # noqa: E731
        _validate_hparams(get("lr"), get("betas"), get("eps"), get("weight_decay"), where)
        if get("capturable") or get("differentiable"):
            raise ValueError(f"FusedAdamW does not support capturable/differentiable{where}")
        if not param_group.get("decoupled_weight_decay", True):
            raise ValueError(f"FusedAdamW always decouples weight decay{where}")
        super().add_param_group(param_group)
        self._engine.invalidate()

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for k, v in (("amsgrad", False), ("maximize", False), ("foreach", None),
                         ("capturable", False), ("differentiable", False), ("fused", None)):
                group.setdefault(k, v)
            if _TORCH_HAS_DECOUPLED_KEY:
                group.setdefault("decoupled_weight_decay", True)
        if not hasattr(self, "_engine"):
            self._engine = MultiGroupAdamW(FusedAdamW)
        self._engine.invalidate()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # e.g. a torch.optim.AdamW(capturable=True) checkpoint
            group["capturable"] = False
            group["differentiable"] = False
            if "decoupled_weight_decay" in group:
                group["decoupled_weight_decay"] = True
        self._engine.invalidate()

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step for all groups; returns the closure's loss if one is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._engine.step(self.param_groups, self.state,
                          grad_scale=getattr(self, "grad_scale", None),
                          found_inf=getattr(self, "found_inf", None))
        return loss
