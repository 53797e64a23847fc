"""FusedAdamW: ``torch.optim.AdamW`` with every param group updated by ONE fused op call.

- :func:`hparams_row` / :func:`fused_path_supported`: which optimizers and groups the fused
  kernel can run (``torch.optim.AdamW``, :class:`FusedAdamW`, ``torch.optim.Adam`` without
  L2 weight decay) and the kernel's 7 hyperparameter columns for a group.
- :class:`FusedAdamW`: a ``torch.optim.Optimizer`` with ``torch.optim.AdamW``'s signature,
  defaults, validation and state dict (cross-loadable both ways with ``torch.optim.AdamW``),
  stepped by the one AdamW engine (engine.py) that the ZeRO optimizer's fused path uses too.
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, Optional

import torch
from torch import Tensor

from . import grad_norm
from .engine import AdamWEngine, hparams_row, keep_loaded_state  # noqa: F401 (public here too)
from .precision import found_inf_flag, kernel_divisor

__all__ = ["FusedAdamW", "fused_path_supported", "hparams_row"]

# torch >= 2.7 implements AdamW as Adam(decoupled_weight_decay=True) and keeps that key in
# every group; FusedAdamW's groups carry it too where torch's do, so state dicts match.
_TORCH_HAS_DECOUPLED_KEY = "decoupled_weight_decay" in inspect.signature(
    torch.optim.Adam.__init__).parameters


def keep_step_eager(cls: type) -> None:
    """Put `cls.step` as torch.optim.Optimizer wrapped it (`_patch_step_function`: the
    profiler's record and the step pre/post hooks) out of dynamo's reach too, not only the
    step's body: a compiled caller breaks its graph once there and runs the whole step
    eagerly. The step is data-dependent Python (and collective for ZeRO) that dynamo would
    recompile every iteration or fail on, as torch keeps its own zero_grad and state dicts."""
    step = cls.step
    if not getattr(step, "_zero_ext_eager", False):
        cls.step = torch._disable_dynamo(step)  # (keeps torch's "hooked" mark: wrapped once)
        cls.step._zero_ext_eager = True


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


def _capturable_devices() -> list:
    """The device types torch.optim.AdamW's capturable step accepts (its own list)."""
    try:
        from torch.optim.optimizer import _get_capturable_supported_devices
        return _get_capturable_supported_devices()
    except ImportError:  # (a torch without the helper: its list as of 2.14)
        return ["cuda", "xpu", "hpu", "xla"]


def _refuse_unsupported_keys(param_groups, state) -> None:
    """Raise for a group key set since construction that the fused step cannot honour, as
    torch.optim.AdamW raises for it where it does, before anything is stepped (torch steps
    group after group, so it has stepped the groups before the one it raises for):

    - ``capturable=True``: torch's (single-tensor and foreach) step raises AssertionError
      for a param it steps whose device type is not capturable (CPU) or whose step count is
      on another device type (CUDA params of a group that started without it): the same,
      naming the key. Where torch would honour it (the step counts already on the CUDA
      device), FusedAdamW cannot (no CUDA graph capture): ValueError, as at construction.
      A capturable group with no grads this step steps nothing and raises nothing, in both.
    - ``decoupled_weight_decay=False``: torch honours it (L2 weight decay); the fused step is
      decoupled only: ValueError, as ``add_param_group`` raises for it.

    ``differentiable``, ``foreach`` and ``fused`` set on a group need nothing: FusedAdamW's
    step, like torch's unless built ``differentiable=True``, runs under no_grad, so a
    differentiable group gets the same update; foreach and fused are ignored throughout."""
    for gi, g in enumerate(param_groups):
        if g.get("capturable", False):
            _refuse_capturable(g, gi, state)
        if not g.get("decoupled_weight_decay", True):
            raise _coupled_decay_refused(gi)


def _coupled_decay_refused(gi: int) -> ValueError:
    return ValueError(f"FusedAdamW always decouples weight decay (param group {gi}: "
                      "decoupled_weight_decay=False was set after construction); use "
                      "torch.optim.Adam for L2 weight decay")


def _capturable_refused(gi: int) -> ValueError:
    return ValueError(f"FusedAdamW does not support capturable=True (CUDA graph capture): "
                      f"param group {gi} has it, set after construction; use "
                      "torch.optim.AdamW(capturable=True)")


def _capturable_assertion(devices, gi: int, where: str, step_type: Optional[str],
                          who: str = "FusedAdamW") -> AssertionError:
    """torch's AssertionError for a capturable step over params or counts it cannot take."""
    counts = f", their step counts on {step_type}" if step_type else ""
    return AssertionError(
        "If capturable=True, params and state_steps must be on supported devices: "
        f"{devices}. ({who}: param group {gi} has capturable=True, set after construction; "
        f"its params are on {where}{counts}"
        + ("; FusedAdamW does not support capturable=True)" if who == "FusedAdamW" else ")"))


def _step_type(key: Tensor, st) -> str:
    step = st.get("step") if st else None
    # a param's first step makes its count on its own device in a capturable group
    return key.device.type if step is None else (
        step.device.type if isinstance(step, Tensor) else "cpu")


def _refuse_capturable(group, gi: int, state) -> None:
    devices = _capturable_devices()
    for p in group["params"]:
        if p.grad is None:
            continue  # (torch checks the params it steps)
        step_type = _step_type(p, state.get(p))  # (no entry made: state is a defaultdict)
        if p.device.type not in devices or step_type != p.device.type:
            raise _capturable_assertion(devices, gi, p.device.type, step_type)
        raise _capturable_refused(gi)


def _is_fused_adamw_class(optimizer_class) -> bool:
    return isinstance(optimizer_class, type) and issubclass(optimizer_class, FusedAdamW)


def group_keys_to_check(optimizer_class, param_groups) -> bool:
    """Whether `sharded_step_refusal` has anything to look at (every rank answers alike)."""
    fused_class = _is_fused_adamw_class(optimizer_class)
    return any(g.get("capturable", False)
               or (fused_class and not g.get("decoupled_weight_decay", True))
               for g in param_groups)


def sharded_step_refusal(optimizer_class, param_groups, local_pieces, state
                         ) -> Optional[BaseException]:
    """ZeroRedundancyOptimizer: the error its local step would raise part-way through for a
    group key set since construction, found before any rank steps anything. Torch's step
    goes group after group, so a rank would step its share of the groups before the one it
    raises for, and the ranks that own none of that group would step all of theirs: the
    replicas would part. Decided from what every rank sees alike (the groups, every param's
    device and whether it has a grad) and from this rank's step counts (`local_pieces`:
    (group index, key, the param it stands for) of its share); the step agrees on it.

    - ``capturable=True``: torch's AssertionError where a param with a grad (or, for this
      rank's share, its key or step count) is on a device type the capturable step refuses;
      FusedAdamW's ValueError (it captures nothing) wherever a param of the group has a grad.
    - FusedAdamW with ``decoupled_weight_decay=False``: its ValueError.
    Returns None when nothing is refused (no group has either key: two dict lookups each)."""
    fused_class = _is_fused_adamw_class(optimizer_class)
    flagged = [gi for gi, g in enumerate(param_groups) if g.get("capturable", False)]
    if fused_class:
        for gi, g in enumerate(param_groups):
            if not g.get("decoupled_weight_decay", True):
                return _coupled_decay_refused(gi)
    if not flagged:
        return None
    devices = _capturable_devices()
    who = "FusedAdamW" if fused_class else "ZeroRedundancyOptimizer"
    stepping = set()
    for gi in flagged:
        for p in param_groups[gi]["params"]:
            if p.grad is None:
                continue  # (torch checks the params it steps)
            stepping.add(gi)
            if p.device.type not in devices:
                return _capturable_assertion(devices, gi, p.device.type, None, who)
    for gi, key, source in local_pieces:
        if gi in stepping and source.grad is not None:
            step_type = _step_type(key, state.get(key))
            if key.device.type not in devices or step_type != key.device.type:
                return _capturable_assertion(devices, gi, key.device.type, step_type, who)
    if fused_class and stepping:
        return _capturable_refused(min(stepping))
    return None


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


# --------------------------------------------------------------------------- optimizer

class FusedAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` with all param groups updated by one fused kernel call per device.

    Same signature, defaults, ``ValueError``\\ s and state-dict format as
    ``torch.optim.AdamW`` (state per param: ``step`` as a 0-d float32 tensor, ``exp_avg``,
    ``exp_avg_sq``, and ``max_exp_avg_sq`` with amsgrad), so checkpoints load both ways.
    Per-group hyperparameters are validated in ``add_param_group`` too. ``foreach`` and
    ``fused`` are accepted and ignored (kept in the groups for the state-dict format);
    ``capturable=True`` and ``differentiable=True`` are rejected at construction (the latter
    would have torch's step run with autograd on); ``add_param_group`` rejects a group with
    ``capturable=True`` and accepts ``differentiable=True`` as torch does. A group key
    set later that the fused step cannot honour (``capturable=True``,
    ``decoupled_weight_decay=False``) raises at the next step, before anything is stepped:
    the exception ``torch.optim.AdamW`` raises for it where it does, else ValueError, naming
    the key and the group. A tensor ``lr`` (from a
    scheduler) is read as a float each step. Works with ``torch.amp.GradScaler``: grads are
    unscaled inside the kernel and an inf/NaN step is skipped (the grads themselves are left
    scaled, unlike ``torch.optim.AdamW(fused=True)``).

    ``master_weights=True`` (mixed precision): every bfloat16/float16 param is stepped
    through a float32 master copy with float32 moments (state entries ``"master"``,
    ``"exp_avg"``, ``"exp_avg_sq"`` in float32); the param receives the master rounded to
    nearest even. The param stays the source of truth: elements changed from outside since
    the last step (weights loaded) reset their master. float32 params are unaffected.

    :meth:`clip_grad_norm_` computes the global grad norm like
    ``torch.nn.utils.clip_grad_norm_`` and applies the clip inside the next step.
    """

    _step_supports_amp_scaling = True
    # Whether step() and clip_grad_norm_ apply the clip factors that grads carry from a
    # step of another optimizer (grad_norm.with_carried). False where an owner has folded
    # them into the grad_scale it passes already: ZeroRedundancyOptimizer's local optimizer.
    reads_carried_clips = True

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
        master_weights: bool = False,
    ) -> None:
        _validate_hparams(lr, betas, eps, weight_decay)
        if not isinstance(master_weights, bool):
            raise TypeError(f"master_weights must be a bool, got {master_weights!r}")
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
        self.master_weights = master_weights
        self._engine = AdamWEngine(FusedAdamW, master_weights)
        self._clip: Optional[grad_norm.PendingClip] = None  # from clip_grad_norm_
        super().__init__(params, defaults)

    def _patch_step_function(self) -> None:
        super()._patch_step_function()
        keep_step_eager(type(self))

    @torch._disable_dynamo
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        where = f" (param group {len(getattr(self, 'param_groups', []))})"
        get = lambda k: param_group.get(k, self.defaults[k])  # noqa: E731
        _validate_hparams(get("lr"), get("betas"), get("eps"), get("weight_decay"), where)
        # differentiable=True in a group: accepted, as torch.optim.AdamW accepts it (its step
        # runs under no_grad unless built differentiable, which the constructor refuses):
        # the same update, as for the flag set between steps
        if get("capturable"):
            raise ValueError(f"FusedAdamW does not support capturable=True (CUDA graph "
                             f"capture){where}; use torch.optim.AdamW(capturable=True)")
        if not param_group.get("decoupled_weight_decay", True):
            raise ValueError(f"FusedAdamW always decouples weight decay{where}")
        super().add_param_group(param_group)
        self._engine.invalidate()

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        state["master_weights"] = self.master_weights  # (torch keeps only its own keys)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for k, v in (("amsgrad", False), ("maximize", False), ("foreach", None),
                         ("capturable", False), ("differentiable", False), ("fused", None)):
                group.setdefault(k, v)
            if _TORCH_HAS_DECOUPLED_KEY:
                group.setdefault("decoupled_weight_decay", True)
        self.__dict__.setdefault("master_weights", False)
        self.__dict__.setdefault("_clip", None)
        if not hasattr(self, "_engine"):
            self._engine = AdamWEngine(FusedAdamW, self.master_weights)
        self._engine.invalidate()

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # e.g. a torch.optim.AdamW(capturable=True) checkpoint
            group["capturable"] = False
            group["differentiable"] = False
            if "decoupled_weight_decay" in group:
                group["decoupled_weight_decay"] = True
        self._keep_float32_state(state_dict)
        self._engine.invalidate()

    def _keep_float32_state(self, state_dict: Dict[str, Any]) -> None:
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for sid, p in zip(saved_ids, params):
            if self.state.get(p):
                keep_loaded_state(self.state[p], p, state_dict["state"].get(sid, {}),
                                  self.master_weights, copy=True)

    @torch._disable_dynamo
    def zero_grad(self, set_to_none: bool = True) -> None:
        self._clip = None  # a clip computed from the old grads does not apply to new ones
        super().zero_grad(set_to_none)

    @torch._disable_dynamo  # its norm is read as a float
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this optimizer's params: returns the
        total norm of their grads (float32); the clip is applied inside the next
        :meth:`step` (the ``.grad`` tensors are not modified)."""
        max_norm, norm_type = grad_norm.validate(max_norm, norm_type)
        grads = [p.grad for p in self._params()]
        if self.reads_carried_clips:
            self._clip = grad_norm.with_carried(self._clip, grads)
        # a clip of some of these grads still pending counts, per grad (clipping twice)
        prior = self._clip.factors(grads, for_clip=True) if self._clip else None
        present = [i for i, g in enumerate(grads) if g is not None]
        term, count = grad_norm.local_terms(
            [grads[i] for i in present], norm_type,
            None if prior is None else [prior[i] for i in present])
        norm, _ = grad_norm.total_norm(term, count, norm_type, None, 1, 0)
        self._clip = grad_norm.clip(norm, max_norm, norm_type, error_if_nonfinite, grads,
                                    prior)
        device = grads[present[0]].device if present else torch.device("cpu")
        return torch.tensor(norm, dtype=torch.float32, device=device)

    def _params(self) -> list:
        return list(self._iter_params())

    def _iter_params(self):
        return (p for g in self.param_groups for p in g["params"])

    def _clip_after_step(self) -> None:
        """Clip factors stay with the grads that survive the step unchanged (see
        grad_norm.PendingClip)."""
        if self._clip:
            self._clip = self._clip.after_step([p.grad for p in self._params()])

    @torch._disable_dynamo  # (and keep_step_eager: its hooks too)
    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step for all groups; returns the closure's loss if one is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # keys set on a group since construction that this step cannot honour: raised before
        # anything (the clip's record included) changes
        _refuse_unsupported_keys(self.param_groups, self.state)
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and not isinstance(found_inf, Tensor):
            # GradScaler hands over a plain number when there were no grads to check
            if found_inf_flag(found_inf):
                self._clip_after_step()
                return loss
            found_inf = None
        # No list of params or grads unless a clip is pending or carried: with the engine's
        # compiled plans a step has no other Python work per param.
        if self.reads_carried_clips:  # (a generator: read only when some grad carries one)
            self._clip = grad_norm.with_carried(self._clip,
                                                (p.grad for p in self._iter_params()))
        pending = self._clip
        params, stepped = (), ()
        if pending:
            params = self._params()
            stepped = [i for i, p in enumerate(params) if p.grad is not None]
        with grad_norm.applied(pending, params, stepped) as clip:
            self._engine.step(self.param_groups, self.state,
                              grad_scale=kernel_divisor(grad_scale, clip), found_inf=found_inf)
        self._clip_after_step()
        return loss
