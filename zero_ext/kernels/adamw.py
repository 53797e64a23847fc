"""One AdamW step over many segments of many param groups: ``torch.ops.zero_ext.fused_adamw_``.

A *segment* is a contiguous run of elements: a whole param, or a flat range (a 1-D view) of
a param or of a flat buffer. Segment ``i`` is ``params[i]`` with its ``grads[i]``,
``exp_avgs[i]``, ``exp_avg_sqs[i]`` (and ``max_exp_avg_sqs[i]`` when its group uses amsgrad),
all with the same numel and on one device. Every segment names its group
(``segment_groups[i]``), and ``group_hparams[g]`` holds that group's hyperparameters, so all
groups are updated by one kernel launch (CUDA) or one parallel loop (CPU).

- params: float32, bfloat16 or float16 (several dtypes may be mixed in one call); grads have
  their param's dtype; the moments have the param's dtype (as ``torch.optim.AdamW`` keeps
  them) or float32. The math runs in float32, scalars in float64 cast once (docs/design.md, "AdamW arithmetic").
- steps: float32 ``[S]`` on the CPU or the params' device: each segment's step count *after*
  the caller incremented it.
- segment_groups: int64 ``[S]`` on the CPU. group_hparams: float64 ``[G, 7]`` on the CPU with
  columns :data:`HPARAM_COLUMNS`; :func:`group_hparams_table` builds it from group dicts.
- max_exp_avg_sqs: empty when no group uses amsgrad, else ``S`` entries (entries of segments
  whose group has no amsgrad may be empty tensors).
- grad_scale (optional float32, one element): grads are divided by it. found_inf (optional
  float32, one element): when nonzero the whole call is a no-op (the caller reverts steps).
  On CUDA both live on the params' device and are read there (no host sync).

- masters (mixed precision): empty, or one entry per segment: an empty tensor, or the float32
  master copy of a bfloat16/float16 param segment (same numel, same device; its moments must
  be float32). Such a segment is computed on the master: the grad (in the param's dtype) is
  upcast, master and moments are updated in float32, and the param receives the master
  rounded to nearest even. The param is the source of truth: an element whose bits differ
  from its master's rounding (the param was written by someone else since the last step:
  weights loaded, surgery) first takes its master from the param.

Non-contiguous tensors, and dtypes the kernels do not cover (float64), are accepted by the
wrapper :func:`fused_adamw_`: contiguous copies are staged and written back, float64 segments
run the reference. :func:`fused_adamw_reference_` is the pure-PyTorch oracle of the tests.

:func:`make_plan` keeps one such call in the compiled library from step to step
(:class:`FusedAdamWPlan`): the lists are converted and checked once, on CUDA the kernel's
table of pointers and chunks stays on the GPU, and a step reads the grads from their sources,
checks that every tensor kept its storage (a few loads per tensor, in C++), copies the step's
hyperparameters and steps, and launches once.
Unlike ``torch._fused_adamw_`` the op never writes the grads (they are not mutable in the
schema), so grads keep their scaled values after a step with ``grad_scale``.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Iterable, Optional, Sequence

import weakref

import torch
from torch import Tensor

from ._loader import ensure_loaded, native_available

__all__ = [
    "HPARAM_COLUMNS",
    "NATIVE_DTYPES",
    "FusedAdamWPlan",
    "fused_adamw_",
    "fused_adamw_reference_",
    "group_hparams_table",
    "make_plan",
]

HPARAM_COLUMNS = ("lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad", "maximize")
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_OP = "fused_adamw_"


def group_hparams_table(groups: Iterable) -> Tensor:
    """float64 ``[G, 7]`` CPU table of :data:`HPARAM_COLUMNS`, one row per group.

    Each group is a torch-style dict (``lr``, ``betas``, ``eps``, ``weight_decay`` and
    optionally ``amsgrad``, ``maximize``; tensor values are read with ``float()``), or a
    sequence of the 7 numbers.
    """
    rows = []
    for i, g in enumerate(groups):
        if isinstance(g, Mapping):
            try:
                beta1, beta2 = g["betas"]
                row = [float(g["lr"]), float(beta1), float(beta2), float(g["eps"]),
                       float(g["weight_decay"]), float(bool(g.get("amsgrad", False))),
                       float(bool(g.get("maximize", False)))]
            except KeyError as exc:
                raise KeyError(f"group_hparams_table: group {i} has no {exc.args[0]!r}") from None
        else:
            row = [float(x) for x in g]
            if len(row) != len(HPARAM_COLUMNS):
                raise ValueError(f"group_hparams_table: row {i} has {len(row)} values, "
                                 f"expected {len(HPARAM_COLUMNS)} {HPARAM_COLUMNS}")
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64).reshape(-1, len(HPARAM_COLUMNS))


# --------------------------------------------------------------------------- reference

def fused_adamw_reference_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Sequence[Tensor],
    steps: Tensor,
    segment_groups: Tensor,
    group_hparams: Tensor,
    grad_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    masters: Sequence[Tensor] = (),
) -> None:
    """Pure-PyTorch :func:`fused_adamw_`: the same arithmetic as ``torch.optim.AdamW``'s
    for-loop, in float32 (float64 for float64 params), state written back in its own dtype;
    a segment with a master is computed on the master (see the module docstring)."""
    S = len(params)
    _check_lengths(S, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, segment_groups)
    if len(masters) not in (0, S):
        raise ValueError(f"fused_adamw_: masters must be empty or have one entry per segment "
                         f"({S}), got {len(masters)}")
    for i, w in enumerate(masters):  # every check before anything is written
        if w.numel():
            _check_master(i, params[i], w, exp_avgs[i], exp_avg_sqs[i])
    if S == 0:
        return
    if found_inf is not None and float(found_inf.reshape(-1)[0]) != 0.0:
        return
    table = group_hparams.tolist()
    step_values = steps.tolist()
    groups = segment_groups.tolist()
    with torch.no_grad():
        for i in range(S):
            p = params[i]
            if p.numel() == 0:
                continue
            lr, beta1, beta2, eps, wd, amsgrad, maximize = table[groups[i]]
            step = step_values[i]
            cdt = torch.float64 if p.dtype == torch.float64 else torch.float32
            master = masters[i] if masters and masters[i].numel() else None
            g = grads[i].to(cdt, copy=True)
            if maximize:
                g.neg_()
            if grad_scale is not None:
                g.div_(grad_scale.to(device=g.device, dtype=cdt))
            if master is None:
                p32 = p.to(cdt, copy=True)
            else:  # the master, unless the param no longer holds its rounding
                w = master.reshape(p.shape).to(torch.float32, copy=True)
                stale = w.to(p.dtype).view(torch.int16) != p.view(torch.int16)
                p32 = torch.where(stale, p.to(torch.float32), w)
            m = exp_avgs[i].to(cdt, copy=True)
            v = exp_avg_sqs[i].to(cdt, copy=True)
            p32.mul_(1 - lr * wd)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            bias_correction1 = 1 - beta1 ** step
            bias_correction2 = 1 - beta2 ** step
            step_size = lr / bias_correction1
            bias_correction2_sqrt = bias_correction2 ** 0.5
            if amsgrad:
                if not max_exp_avg_sqs or max_exp_avg_sqs[i].numel() != p.numel():
                    raise ValueError(f"fused_adamw_: segment {i} uses amsgrad but "
                                     "max_exp_avg_sqs has no matching entry")
                vmax = max_exp_avg_sqs[i].to(cdt, copy=True)
                torch.maximum(vmax, v, out=vmax)
                denom = (vmax.sqrt() / bias_correction2_sqrt).add_(eps)
                max_exp_avg_sqs[i].copy_(vmax)
            else:
                denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
            p32.addcdiv_(m, denom, value=-step_size)
            if master is not None:
                master.copy_(p32.reshape(master.shape))
            p.copy_(p32)  # rounds to nearest even for bfloat16 / float16
            exp_avgs[i].copy_(m)
            exp_avg_sqs[i].copy_(v)


def _check_master(i: int, p: Tensor, master: Tensor, m: Tensor, v: Tensor) -> None:
    if p.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fused_adamw_: masters[{i}] is given but params[{i}] is {p.dtype} "
                         "(masters are for bfloat16 / float16 params)")
    if master.dtype != torch.float32 or master.numel() != p.numel() \
            or master.device != p.device:
        raise ValueError(f"fused_adamw_: masters[{i}] must be float32 with {p.numel()} "
                         f"elements on {p.device}, got {master.dtype} with {master.numel()} "
                         f"on {master.device}")
    if m.dtype != torch.float32 or v.dtype != torch.float32:
        raise ValueError(f"fused_adamw_: segment {i} has a master, so its exp_avgs and "
                         "exp_avg_sqs must be float32")


def _check_lengths(S, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, segment_groups):
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == S):
        raise ValueError("fused_adamw_: params, grads, exp_avgs and exp_avg_sqs must have the "
                         f"same length, got {S}, {len(grads)}, {len(exp_avgs)}, "
                         f"{len(exp_avg_sqs)}")
    if len(max_exp_avg_sqs) not in (0, S):
        raise ValueError("fused_adamw_: max_exp_avg_sqs must be empty or have one entry per "
                         f"segment ({S}), got {len(max_exp_avg_sqs)}")
    if steps.numel() != S or segment_groups.numel() != S:
        raise ValueError(f"fused_adamw_: steps and segment_groups need {S} entries, got "
                         f"{steps.numel()} and {segment_groups.numel()}")


# --------------------------------------------------------------------------- wrapper

def fused_adamw_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Optional[Sequence[Tensor]],
    steps: Tensor,
    segment_groups: Tensor,
    group_hparams: Tensor,
    grad_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    masters: Optional[Sequence[Tensor]] = None,
) -> None:
    """One fused AdamW step over all segments (see the module docstring).

    Calls ``torch.ops.zero_ext.fused_adamw_``: the dispatcher runs the compiled kernel when
    one is registered for the params' device, else the reference (the op's default kernel).
    The compiled kernels take contiguous segments of float32 / bfloat16 / float16 only; whether
    some segments must be staged (contiguous copies written back) or run by the reference
    (float64) is decided here, before the call, from the inputs: see :func:`_takes_as_is`.
    Errors of the op (bad inputs, out of memory) propagate; nothing is retried.
    """
    # the caller's containers identify the call for _takes_as_is's cache (before any copy)
    key = (id(params), id(exp_avgs), id(exp_avg_sqs), id(max_exp_avg_sqs), id(masters))
    params, grads, exp_avgs, exp_avg_sqs = (
        x if isinstance(x, list) else list(x) for x in (params, grads, exp_avgs, exp_avg_sqs))
    max_exp_avg_sqs, masters = ([] if x is None else x if isinstance(x, list) else list(x)
                                for x in (max_exp_avg_sqs, masters))
    ensure_loaded()
    plan = None
    if not _takes_as_is(key, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters):
        plan = _staging_plan(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters,
                             segment_groups, group_hparams)
    # no_grad: with grad mode on, the autograd fallback of a mutating op walks every
    # tensor that requires grad (measured +70% call time at 20000 params).
    with torch.no_grad():
        if plan is None:
            torch.ops.zero_ext.fused_adamw_(params, grads, exp_avgs, exp_avg_sqs,
                                            max_exp_avg_sqs, steps, segment_groups,
                                            group_hparams, grad_scale, found_inf, masters)
        else:
            _run_staged(plan, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters,
                        steps, segment_groups, group_hparams, grad_scale, found_inf)


# Decisions of _takes_as_is for the lists a caller passes again and again (the AdamW engine
# keeps its params / state lists for as long as the layout holds): key = the identities of
# the caller's params / state containers and the length; value = (weak references to the
# first and last param, verdict). Only weak references are held, so no tensor is kept
# alive; an entry is used only while its first and last params are still the same tensors
# (a recycled id of a dead list with other ends misses). Lists passed again are assumed not
# to have been edited in place. A stale "as is" can only make the kernel reject the call (it
# checks every segment before writing anything); it can never produce a wrong result.
_AS_IS_CACHE: dict = {}
_AS_IS_CACHE_MAX = 256
_NATIVE_DEVICE_TYPES: dict = {}
_is_contiguous = Tensor.is_contiguous


def _has_native_kernel(device: torch.device) -> bool:
    """Whether the dispatcher holds a compiled fused_adamw_ kernel for this device type
    (staging only matters then: the reference takes any layout and dtype)."""
    known = _NATIVE_DEVICE_TYPES.get(device.type)
    if known is None:
        known = _NATIVE_DEVICE_TYPES[device.type] = native_available(_OP, device)
    return known


def _takes_as_is(key, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters) -> bool:
    """True when the op can be called on the lists as they are: no compiled kernel for the
    device (the reference takes everything), or every tensor contiguous and every param of a
    dtype the kernels cover. Grads are checked only on the first call with a given set of
    lists: autograd gives a contiguous param a contiguous grad (a non-contiguous grad set by
    hand on a later call makes the kernel raise, it is never silently mis-read)."""
    if not params or not _has_native_kernel(params[0].device):
        return True
    key = key + (len(params),)
    hit = _AS_IS_CACHE.get(key)
    first, last = params[0], params[-1]
    if hit is not None and hit[0]() is first and hit[1]() is last:
        return hit[2]
    ok = (all(map(_is_contiguous, params)) and all(map(_is_contiguous, grads))
          and all(map(_is_contiguous, exp_avgs)) and all(map(_is_contiguous, exp_avg_sqs))
          and all(map(_is_contiguous, max_exp_avg_sqs)) and all(map(_is_contiguous, masters))
          and all(map(_native_ok, params, exp_avgs, exp_avg_sqs,
                      max_exp_avg_sqs or [None] * len(params),
                      masters or [None] * len(params))))
    if len(_AS_IS_CACHE) >= _AS_IS_CACHE_MAX:
        _AS_IS_CACHE.clear()
    _AS_IS_CACHE[key] = (weakref.ref(first), weakref.ref(last), ok)
    return ok


def _native_ok(p: Tensor, m: Tensor, v: Tensor, x: Optional[Tensor],
               w: Optional[Tensor] = None) -> bool:
    if p.dtype not in NATIVE_DTYPES or m.dtype != v.dtype:
        return False
    if w is not None and w.numel() and (p.dtype == torch.float32 or w.dtype != torch.float32
                                        or m.dtype != torch.float32):
        return False  # the reference raises the clear error
    if m.dtype != p.dtype and m.dtype != torch.float32:
        return False
    return x is None or x.numel() == 0 or x.dtype == m.dtype


def _master_ok(p: Tensor, w: Tensor, m: Tensor, v: Tensor) -> bool:
    return (p.dtype in (torch.bfloat16, torch.float16) and w.dtype == torch.float32
            and m.dtype == torch.float32 and v.dtype == torch.float32
            and w.device == p.device)


def _staging_plan(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters,
                  segment_groups, group_hparams):
    """Which segments need contiguous copies / the reference; None when none do."""
    S = len(params)
    if (len(grads) != S or len(exp_avgs) != S or len(exp_avg_sqs) != S
            or len(max_exp_avg_sqs) not in (0, S) or len(masters) not in (0, S)
            or segment_groups.numel() != S
            or group_hparams.dim() != 2 or group_hparams.size(1) != len(HPARAM_COLUMNS)):
        return None
    groups = segment_groups.tolist()
    table = group_hparams.tolist()
    if any(not 0 <= g < len(table) for g in groups):
        return None
    native, reference, staged = [], [], []
    for i in range(S):
        ams = table[groups[i]][5] != 0.0
        x = max_exp_avg_sqs[i] if ams and max_exp_avg_sqs else None
        w = masters[i] if masters and masters[i].numel() else None
        seg = [params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]] + ([x] if x is not None else [])
        seg += [w] if w is not None else []
        if any(t.numel() != params[i].numel() for t in seg):
            return None
        if w is not None and not _master_ok(params[i], w, exp_avgs[i], exp_avg_sqs[i]):
            return None  # the op raises for it, before writing anything
        if not _native_ok(params[i], exp_avgs[i], exp_avg_sqs[i], x, w):
            reference.append(i)
            continue
        native.append(i)
        if not all(t.is_contiguous() for t in seg):
            staged.append(i)
    if not reference and not staged:
        return None
    return native, reference, staged


def _run_staged(plan, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps,
                segment_groups, group_hparams, grad_scale, found_inf):
    native, reference, staged = plan
    any_ams = bool(max_exp_avg_sqs)
    any_masters = bool(masters)
    writeback = []  # (original, contiguous copy)

    def contig(t: Tensor, mutable: bool) -> Tensor:
        if t.is_contiguous():
            return t
        c = t.contiguous()
        if mutable:
            writeback.append((t, c))
        return c

    if native:
        stage = set(staged)
        P, Gr, M, V, X, W = [], [], [], [], [], []
        for i in native:
            s = i in stage
            P.append(contig(params[i], True) if s else params[i])
            Gr.append(contig(grads[i], False) if s else grads[i])
            M.append(contig(exp_avgs[i], True) if s else exp_avgs[i])
            V.append(contig(exp_avg_sqs[i], True) if s else exp_avg_sqs[i])
            if any_ams:
                x = max_exp_avg_sqs[i]
                X.append(contig(x, True) if s and x.numel() else x)
            if any_masters:
                w = masters[i]
                W.append(contig(w, True) if s and w.numel() else w)
        idx = torch.tensor(native, dtype=torch.long)
        sub_steps = steps.index_select(0, idx.to(steps.device))
        sub_groups = segment_groups.index_select(0, idx)
        torch.ops.zero_ext.fused_adamw_(P, Gr, M, V, X, sub_steps, sub_groups, group_hparams,
                                        grad_scale, found_inf, W)
        for orig, c in writeback:
            orig.copy_(c)
    if reference:
        idx = torch.tensor(reference, dtype=torch.long)
        fused_adamw_reference_(
            [params[i] for i in reference], [grads[i] for i in reference],
            [exp_avgs[i] for i in reference], [exp_avg_sqs[i] for i in reference],
            [max_exp_avg_sqs[i] for i in reference] if any_ams else [],
            steps.index_select(0, idx.to(steps.device)), segment_groups.index_select(0, idx),
            group_hparams, grad_scale, found_inf,
            [masters[i] for i in reference] if any_masters else [])


# --------------------------------------------------------------------------- plan

class FusedAdamWPlan:
    """One :func:`fused_adamw_` call kept from step to step by the compiled library
    (``torch.classes.zero_ext.AdamWPlan``, csrc/fused_adamw_plan.cpp); made by
    :func:`make_plan`.

    - :meth:`ready`: whether a step may run on the lists as built: every source has a grad
      (every ``no_grad_sources`` entry still none) of the dtype, numel and device seen at
      build, contiguous, aligned as at build; every param (but those made with
      ``fixed_params``) and state tensor has the storage it had (``p.data = t``, a moment's
      ``.data`` replaced: False), every param its numel, and every step count given to
      :func:`make_plan` (``steps``) the storage it had (``step.data = t``, ``step.set_(t)``:
      False).
      It also takes this step's grad pointers. False changes nothing: the caller rebuilds
      its lists.
    - :meth:`run`: the step, right after a :meth:`ready` that returned True, with this
      step's ``steps`` (float32 ``[S]``, on the CPU or the params' device), ``group_hparams``
      (every step: an lr from a scheduler is taken), ``grad_scale`` and ``found_inf``.

    Replacing a state tensor in its dict (``st["exp_avg"] = t``) is not seen here: the
    caller (the AdamW engine) watches its state dicts.
    """

    __slots__ = ("_native", "num_segments", "device")

    def __init__(self, native, num_segments: int, device: torch.device):
        self._native = native
        self.num_segments = num_segments
        self.device = device

    def ready(self, hold: bool = False) -> bool:
        """``hold``: keep the grads alive until :meth:`run` (for a caller that runs other
        code in between)."""
        return bool(self._native.ready(hold))

    def run(self, steps: Tensor, group_hparams: Tensor, grad_scale: Optional[Tensor] = None,
            found_inf: Optional[Tensor] = None) -> None:
        self._native.run(steps, group_hparams, grad_scale, found_inf)

    @property
    def num_runs(self) -> int:
        """CPU: the runs of segments contiguous in every tensor's memory (the grads'
        included) that a step takes as one segment each when their steps are equal; the
        segments themselves where 0 (CUDA: one table entry per segment)."""
        return int(self._native.num_runs())

    def __reduce__(self):
        raise TypeError("FusedAdamWPlan holds pointers into its tensors; it cannot be copied "
                        "or pickled (build a new one with make_plan)")


def _plan_class(device: torch.device):
    """torch.classes.zero_ext.AdamWPlan when the loaded library has it and a compiled
    fused_adamw_ kernel for this device, else None."""
    if not _has_native_kernel(device):
        return None
    try:
        return torch.classes.zero_ext.AdamWPlan
    except (RuntimeError, AttributeError):  # a library built before the plan existed
        return None


def make_plan(params: Sequence[Tensor], exp_avgs: Sequence[Tensor],
              exp_avg_sqs: Sequence[Tensor], max_exp_avg_sqs: Sequence[Tensor],
              masters: Sequence[Tensor], sources: Sequence[Tensor],
              seg_source: Sequence[int], seg_grad_offset: Sequence[int],
              no_grad_sources: Sequence[Tensor], segment_groups: Tensor,
              group_hparams: Tensor, hold: bool = False,
              fixed_params: Optional[Sequence[bool]] = None,
              steps: Optional[Sequence[Tensor]] = None) -> Optional[FusedAdamWPlan]:
    """A :class:`FusedAdamWPlan` for these lists, or None where :func:`fused_adamw_` must
    serve them instead: no compiled plan for the device (CPU-only build, references), a
    segment the kernels do not take as it is (non-contiguous, float64, complex: staged or
    run by the reference), a grad that is missing, sparse or non-contiguous, or any input
    the op would reject (its checks raise, here that means None; the op then reports it).

    Segment ``i`` is ``params[i]`` (with its state entries as in :func:`fused_adamw_`) and
    its grad is elements ``[seg_grad_offset[i], + numel)`` of ``sources[seg_source[i]].grad``
    flattened. Not ready when built is None too (``hold``: as in :meth:`FusedAdamWPlan.ready`,
    for the run that follows).

    ``fixed_params[i]`` True: the caller owns param ``i``'s memory and never moves it while
    the plan lives (offload_optimizer's host keys), so :meth:`FusedAdamWPlan.ready` does not
    check its storage (its state tensors' it does).

    ``steps``: one tensor per segment, whose value the caller passes to
    :meth:`FusedAdamWPlan.run` (the AdamW engine's per-param ``state["step"]``, 0-d views into
    the buffer it passes): :meth:`FusedAdamWPlan.ready` also checks that each still has the
    storage it had, so a count whose memory was replaced (``.data = t``, ``set_``) is seen."""
    ensure_loaded()
    if not params:
        return None
    device = params[0].device
    cls = _plan_class(device)
    if cls is None:
        return None
    try:
        native = cls(list(params), list(exp_avgs), list(exp_avg_sqs), list(max_exp_avg_sqs),
                     list(masters), list(sources),
                     torch.tensor(list(seg_source), dtype=torch.int64),
                     torch.tensor(list(seg_grad_offset), dtype=torch.int64),
                     list(no_grad_sources), segment_groups, group_hparams,
                     torch.tensor(list(fixed_params), dtype=torch.bool)
                     if fixed_params is not None else None,
                     list(steps) if steps is not None else None)
    except RuntimeError:
        return None
    plan = FusedAdamWPlan(native, len(params), device)
    return plan if plan.ready(hold) else None
