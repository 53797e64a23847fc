"""The one AdamW engine: a fused multi-group AdamW step over torch-format state.

Used by `FusedAdamW` (whole params, one chunk) and by the ZeRO optimizer's fused path (this
rank's share: whole params or runs of a param's elements, in chunks whose exchange overlaps
the next chunk's compute). Everything AdamW-specific around the kernel lives here, once:

- lazy state init in `torch.optim.AdamW`'s format (``step`` a 0-d float32 tensor, on the
  param's device for ``fused``/``capturable`` groups as torch does, else on the CPU);
- step counting: params whose grad is None are skipped and their step is not advanced;
  the step VALUES are read from the state at every step (never cached), so a step taken by
  another path (torch's own optimizer, a loaded state dict) is always counted;
- one kernel call per (chunk, device), every group in it (`kernels.fused_adamw_`);
- complex params as real pairs (``view_as_real``), as torch's AdamW does;
- ``grad_scale``/``found_inf`` (GradScaler): unscale inside the kernel, skip on inf;
- mixed precision (``master_weights=True``): every bfloat16/float16 key gets a float32
  master copy, kept as the extra state entry ``"master"``, and float32 moments; the kernel
  steps the master and writes its rounding into the param (see ``kernels.adamw``). A state
  without a master (a state dict from torch's AdamW) gets one from the param, and its
  moments are upcast, at the next step.

Host cost per step does not grow with tensor ops per param: the lists handed to the kernel
are cached (rebuilt when the structure changes: groups, their params, the state dict or its
size, which params have grads, amsgrad flags, a state entry replaced), and every ``"step"``
is a 0-d view into one float32 buffer per device, so one ``add_`` advances all of them
(distinct elements, so a state dict loaded into ``torch.optim.AdamW`` keeps working). A view
whose memory is replaced (``st["step"].data = t``, ``st["step"].set_(t)``: the dict still
holds the same tensor, cut off from the buffer) is seen at the next step like a moment's:
the compiled plan checks every step's storage with the others, the Python path each pack's
views; the buffer is then rebuilt from the values the state holds (torch's count goes on
from the new value, so does ours).
Where the compiled library can, each kernel call is kept in it as a plan
(``kernels.adamw.make_plan``): a step then takes no Python work per tensor at all (the grads
are read and every tensor's storage checked in C++; the state dicts are checked at C speed,
by identity), and on CUDA the kernel's tables stay on the GPU: one launch per call.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from .kernels.adamw import fused_adamw_, make_plan
from .tracked_state import generation_of


@dataclass(frozen=True)
class Segment:
    """Elements [offset, offset+length) of `key` (flattened): the local optimizer's param,
    whose state they update. Their grad is elements [grad_offset, grad_offset+length) of
    ``sources[source].grad``. `fixed`: the caller owns the key's memory and never moves it
    while the layout holds (offload_optimizer's host keys): the compiled plan does not
    check its storage at each step (its state tensors' it does)."""

    key: Tensor
    offset: int
    length: int
    group: int
    source: int
    grad_offset: int
    fixed: bool = False


@dataclass(frozen=True)
class StepLayout:
    """What one step covers: the tensors whose grads feed it, and its segments per chunk."""

    sources: Sequence[Tensor]
    chunks: Sequence[Sequence[Segment]]


def hparams_row(optimizer_class, group: Dict[str, Any]) -> List[float]:
    """The kernel's 7 columns (lr, beta1, beta2, eps, weight_decay, amsgrad, maximize) for a
    group of ``optimizer_class``; tensor lr is read with ``float()``. Raises ValueError for a
    group the fused kernel cannot compute (see fused_adamw.fused_path_supported)."""
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


LOW_PRECISION = (torch.bfloat16, torch.float16)
MASTER = "master"  # the state entry of a key's float32 master


def has_master(key: Tensor) -> bool:
    """Whether a key gets a float32 master under ``master_weights=True``."""
    return key.dtype in LOW_PRECISION


def ensure_master_state(st: Dict[str, Any], key: Tensor) -> None:
    """Make a bf16/fp16 key's existing state a master-weights state (the fused engine's and
    the generic path's alike): a float32 ``"master"`` of the key's shape (taken from the
    param when missing or mis-shaped) and float32 per-element state (a state dict of a bf16
    run of torch's optimizers holds it in the param's dtype)."""
    w = st.get(MASTER)
    if not (isinstance(w, Tensor) and w.dtype == torch.float32 and w.shape == key.shape
            and w.device == key.device):
        st[MASTER] = (key.detach().to(torch.float32, copy=True) if w is None
                      or not isinstance(w, Tensor) or w.numel() != key.numel()
                      else w.detach().to(key.device, torch.float32).reshape(key.shape))
    for name, t in list(st.items()):
        if (name != MASTER and isinstance(t, Tensor) and t.is_floating_point()
                and t.dim() > 0 and t.numel() == key.numel() and t.dtype != torch.float32):
            st[name] = t.to(torch.float32)


def memory_of(key: Tensor) -> tuple:
    """Which elements a key is: two keys with equal values are the same memory (params
    tied with ``b.data = a.data``)."""
    return (key.untyped_storage().data_ptr(), key.storage_offset(), tuple(key.shape),
            key.stride(), key.dtype, key.device)


def _share_masters(keys: Dict[int, Tensor], stepping: Dict[int, dict]) -> None:
    """Keys over one memory share one master, as they share the param: each is stepped
    in turn on the same float32 values (a master per key would see the other's update
    as a write from outside and drop its own sub-ulp precision)."""
    first: Dict[tuple, Tensor] = {}
    for kid, st in stepping.items():
        w = st.get(MASTER)
        if w is not None:
            w0 = first.setdefault(memory_of(keys[kid]), w)
            if w0 is not w:
                st[MASTER] = w0


def _alias_free_runs(segs: List[Segment]) -> List[List[Segment]]:
    """`segs` cut, in order, into runs in which no two segments touch the same memory:
    one kernel call updates its segments in parallel, while torch steps params over one
    memory one after the other."""
    runs: List[List[Segment]] = [[]]
    seen: set = set()
    for s in segs:
        m = memory_of(s.key)
        if m in seen:
            runs.append([])
            seen = set()
        seen.add(m)
        runs[-1].append(s)
    return runs


def keep_loaded_state(st: Dict[str, Any], key: Tensor, saved: Dict[str, Any],
                      master_weights: bool, copy: bool) -> None:
    """After torch's ``Optimizer.load_state_dict``, which casts every floating state tensor
    to its param's dtype: a master-weights key (bf16/fp16) takes back the `saved` float32
    values (master and moments); without master weights a loaded master is dropped (nothing
    would keep it current). `copy`: copy the saved tensors (they belong to the caller)."""
    if not (master_weights and has_master(key)):
        st.pop(MASTER, None)
        return
    for name, v in saved.items():
        if (name != "step" and isinstance(v, Tensor) and v.is_floating_point()
                and v.dim() > 0 and v.numel() == key.numel()):
            st[name] = v.detach().to(key.device, torch.float32, copy=copy).view(key.shape)


def whole_params_layout(param_groups: Sequence[Dict[str, Any]]) -> StepLayout:
    """Every param of every group as one segment of one chunk (a plain optimizer)."""
    params = [p for g in param_groups for p in g["params"]]
    segs, i = [], 0
    for gi, g in enumerate(param_groups):
        for p in g["params"]:
            segs.append(Segment(p, 0, p.numel(), gi, i, 0))
            i += 1
    return StepLayout(params, [segs])


# State entries the kernel lists point at (a replaced one must be seen at the next step).
_STEPPED = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", MASTER)


class _StateSnapshot:
    """The state as a plan's lists view it, checked at every step at C speed (identity
    only: values written in place need nothing, the lists view them): every key still maps
    to the same dict, in the same order, and every stepped dict still holds the same
    tensors in `_STEPPED` (a user resetting a moment with ``st["exp_avg"] = torch.zeros_like
    (...)``, a replaced dict or step means a rebuild).

    A tracked state (tracked_state.py: offload_optimizer's local optimizer) counts its own
    changes: while its generation has not moved since the last check that passed, nothing
    was replaced, and the check costs nothing per tensor (about 50 ns per tensor otherwise:
    a step's worth of 20000 small tensors)."""

    __slots__ = ("keys", "dicts", "entries", "generation", "seen")

    def __init__(self, state: Dict[Tensor, Dict[str, Any]], stepping: Dict[int, dict]):
        self.keys = list(state.keys())
        self.dicts = list(state.values())
        self.entries = []
        for name in _STEPPED:
            dicts = [st for st in stepping.values() if name in st]
            if dicts:
                self.entries.append((operator.itemgetter(name), dicts,
                                     [st[name] for st in dicts]))
        # (None where some change would go uncounted: a plain state, a plain dict in it)
        self.generation = generation_of(state)
        self.seen = None if self.generation is None else self.generation.value

    def same(self, state: Dict[Tensor, Dict[str, Any]]) -> bool:
        gen = self.generation
        if gen is not None and gen.value == self.seen \
                and getattr(state, "generation", None) is gen:
            return True
        is_ = operator.is_
        if len(state) != len(self.dicts) or not all(map(is_, state.values(), self.dicts)) \
                or not all(map(is_, state.keys(), self.keys)):
            return False
        try:
            ok = all(all(map(is_, map(get, dicts), tensors))
                     for get, dicts, tensors in self.entries)
        except KeyError:  # an entry removed
            return False
        if ok and gen is not None:  # (the same dicts, so all still tracked)
            self.seen = gen.value
        return ok


class _StepPack:
    """float32 buffer on one device whose 0-d views are the params' ``state["step"]``.
    `ptrs`: where each view's element is (:meth:`intact`)."""

    __slots__ = ("flat", "views", "index", "ptrs")

    def __init__(self, values: List[float], device: torch.device):
        self.flat = torch.tensor(values, dtype=torch.float32, device=device)
        self.views = list(self.flat.unbind(0)) if values else []
        self.index: Dict[int, int] = {id(v): i for i, v in enumerate(self.views)}
        base = self.flat.data_ptr()
        self.ptrs = [base + 4 * i for i in range(len(self.views))]

    def intact(self) -> bool:
        """Whether every view is still its element of `flat`: a view whose memory was
        replaced (``.data = t``, ``set_``) is the same tensor object, no longer advanced by
        ``flat.add_`` nor read by the kernel (about 50 ns per view)."""
        return list(map(_data_ptr, self.views)) == self.ptrs


_data_ptr = Tensor.data_ptr


class _Call:
    """One kernel call: one chunk, one device; everything but the per-step grads (and the
    real views of complex params, taken at each step: `p.data = t` must not go stale).
    `native`: the same call kept by the compiled library (kernels.adamw.FusedAdamWPlan)."""

    __slots__ = ("device", "params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs",
                 "segment_groups", "grads", "pack", "step_index", "complex_params", "masters",
                 "native", "fixed", "steps")


class _Plan:
    # native: every call has its compiled plan (the per-step path without Python per tensor)
    __slots__ = ("key", "none", "chunks", "increments", "refs", "layout", "auto", "snapshot",
                 "native", "packs")

    def steps_intact(self) -> bool:
        """Every step pack's views still its elements (the Python path's check; the
        compiled plans check the steps of their segments in ready())."""
        return all(pk.intact() for pk in self.packs)

    def ready(self) -> bool:
        """Every call's compiled plan finds its grads and storages as built (and takes this
        step's grad pointers; with several calls, each keeps its grads alive until it runs:
        other calls and after_chunk run in between)."""
        calls = [c for cs in self.chunks for c in cs]
        hold = len(calls) > 1
        return all(c.native.ready(hold) for c in calls)


def _to(t: Optional[Tensor], device: torch.device) -> Optional[Tensor]:
    """`t` on `device` for a kernel call there. Onto the CPU the copy blocks: the CPU kernel
    reads it at once (a non-blocking copy from a GPU would hand it memory not yet written:
    the GradScaler's scale or a clip factor for offload_optimizer's host step)."""
    if t is None or t.device == device:
        return t
    return t.to(device, non_blocking=device.type != "cpu")


def _elements(t: Tensor, offset: int, length: int, real: bool) -> Tensor:
    """Elements of `t` as the kernel sees them: `t` itself when whole (its shape kept),
    else a 1-D view; complex tensors as (re, im) float pairs."""
    if real:
        t = torch.view_as_real(t)
        offset, length = 2 * offset, 2 * length
        if offset == 0 and length == t.numel():
            return t
    elif offset == 0 and length == t.numel():
        return t
    flat = t.view(-1) if t.is_contiguous() else t.reshape(-1)
    return flat[offset:offset + length]


class AdamWEngine:
    """``step(param_groups, state, layout=None, ...)`` follows ``torch.optim.AdamW.step``
    (or ``torch.optim.Adam`` without L2 decay) on any torch-format ``param_groups``/``state``
    (FusedAdamW's own, or the local optimizer of the ZeRO optimizer). ``hparams_row`` maps a
    group to the kernel's 7 columns for ``optimizer_class``."""

    def __init__(self, optimizer_class=None, master_weights: bool = False):
        self.optimizer_class = optimizer_class or torch.optim.AdamW
        self.master_weights = bool(master_weights)
        self._plan: Optional[_Plan] = None
        # state_alloc(key, name, dtype): the memory of a new per-element state tensor of
        # `key` (zeroed, the key's shape), or None for a tensor of its own
        # (offload_optimizer's host part: views into flat host buffers)
        self.state_alloc: Optional[Callable[[Tensor, str, torch.dtype], Optional[Tensor]]] = None

    def invalidate(self) -> None:
        """Forget the cached lists (call after replacing state tensors behind our back)."""
        self._plan = None

    @torch.no_grad()
    def step(self, param_groups: Sequence[Dict[str, Any]], state: Dict[Tensor, Dict[str, Any]],
             layout: Optional[StepLayout] = None, grad_scale: Optional[Tensor] = None,
             found_inf: Optional[Tensor] = None,
             after_chunk: Optional[Callable[[int], None]] = None,
             before_host: Optional[Callable[[], None]] = None) -> None:
        """One step of `layout` (every param whole when None). `after_chunk(k)` runs once
        chunk k is stepped; `before_host()` once, before the first call on the CPU."""
        plan = self._plan
        key = self._key(param_groups, state)
        auto = layout is None
        if auto:  # a plain optimizer: every param whole, the layout kept while nothing changes
            layout = plan.layout if plan is not None and plan.auto and plan.key == key \
                else whole_params_layout(param_groups)
        # The compiled plans' path: no Python work per tensor (their ready() reads the grads
        # and checks every tensor's storage in C++; the state dicts are checked by identity).
        native = (plan is not None and plan.native and plan.layout is layout
                  and plan.key == key and plan.snapshot.same(state) and plan.ready())
        if not native:
            grads = [s.grad for s in layout.sources]
            none = ()
            if any(g is None for g in grads):
                none = tuple(i for i, g in enumerate(grads) if g is None)
            if plan is None or plan.native or plan.layout is not layout or plan.none != none \
                    or plan.key != key or not plan.snapshot.same(state) \
                    or not plan.steps_intact():
                plan = self._plan = self._build(param_groups, state, layout, grads, none)
                plan.auto = auto
                native = plan.native  # (their ready() ran in _build)
        table = self._hparams_table(param_groups)
        for pack, mask in plan.increments:
            pack.flat.add_(1 if mask is None else mask)
        for k, calls in enumerate(plan.chunks):
            for call in calls:
                if before_host is not None and call.device.type == "cpu":
                    before_host()
                    before_host = None
                if native:
                    call.native.run(self._steps(call), table,
                                    _to(grad_scale, call.device), _to(found_inf, call.device))
                    continue
                for j, seg in call.complex_params:
                    call.params[j] = _elements(seg.key, seg.offset, seg.length, True)
                g_list = [grads[src] if whole else _elements(grads[src], off, n, real)
                          for src, off, n, real, whole in call.grads]
                fused_adamw_(call.params, g_list, call.exp_avgs, call.exp_avg_sqs,
                             call.max_exp_avg_sqs, self._steps(call), call.segment_groups,
                             table, _to(grad_scale, call.device), _to(found_inf, call.device),
                             call.masters)
            if after_chunk is not None:
                after_chunk(k)
        if found_inf is not None:  # a skipped step does not count
            for pack, mask in plan.increments:
                fi = found_inf.to(pack.flat.device).reshape(())
                pack.flat.sub_(fi if mask is None else mask * fi)

    def _hparams_table(self, param_groups) -> Tensor:
        """Each group's hyperparameters as the kernel reads them (float64 [G, 7])."""
        return torch.tensor([hparams_row(self.optimizer_class, g) for g in param_groups],
                            dtype=torch.float64)

    @staticmethod
    def _steps(call: _Call) -> Tensor:
        """The steps of a call's segments, in order (already advanced)."""
        if call.step_index is None:
            return call.pack.flat
        if isinstance(call.step_index, Tensor):
            return call.pack.flat.index_select(0, call.step_index)
        # steps spread over several packs: gather them on the CPU
        return torch.stack([pk.flat[i].cpu() for pk, i in call.step_index])

    def __getstate__(self) -> Dict[str, Any]:
        # the cached lists and compiled plans are rebuilt at the next step (a plan holds
        # pointers into its tensors: it is neither copied nor pickled)
        return {**self.__dict__, "_plan": None}

    # -- cache ----------------------------------------------------------------------------
    @staticmethod
    def _key(param_groups, state) -> tuple:
        # Identity of the containers (kept alive by the plan so ids cannot be reused), their
        # sizes, and the flags that shape the lists.
        return (id(state), len(state), len(param_groups),
                tuple((id(g["params"]), len(g["params"]), bool(g.get("amsgrad", False)),
                       bool(g.get("fused") or g.get("capturable"))) for g in param_groups))

    def _build(self, param_groups, state, layout: StepLayout, grads, none) -> _Plan:
        skipped = set(none)
        ams = [bool(g.get("amsgrad", False)) for g in param_groups]
        on_device = [bool(g.get("fused") or g.get("capturable")) for g in param_groups]
        # 1. lazy state init for the keys that step (their source has a grad).
        stepping: Dict[int, dict] = {}
        for chunk in layout.chunks:
            for s in chunk:
                if s.source in skipped or id(s.key) in stepping:
                    continue
                if grads[s.source].is_sparse:
                    raise RuntimeError("AdamW's fused step does not support sparse gradients")
                stepping[id(s.key)] = self._init_state(state, s.key, ams[s.group],
                                                       on_device[s.group],
                                                       self.master_weights, self.state_alloc)
        keys = {id(seg.key): seg.key for chunk in layout.chunks for seg in chunk}
        if self.master_weights:
            _share_masters(keys, stepping)
        # 2. steps: every state's "step" a view into one buffer per device.
        packs = self._pack_steps(state)
        # 3. one call per (chunk, device); keys over one memory in separate calls, in order.
        chunks = []
        for chunk in layout.chunks:
            by_dev: Dict[torch.device, list] = {}
            for s in chunk:
                if id(s.key) in stepping:
                    by_dev.setdefault(s.key.device, []).append(s)
            chunks.append([self._call(dev, run, stepping, ams, packs, layout.sources)
                           for dev, segs in by_dev.items() for run in _alias_free_runs(segs)])
        # 4. increments: which elements of each pack step this time.
        step_ids = {id(st["step"]) for st in stepping.values()}
        increments = []
        for pk in packs:
            sel = [id(v) in step_ids for v in pk.views]
            if any(sel):
                increments.append((pk, None if all(sel) else torch.tensor(
                    sel, dtype=torch.float32, device=pk.flat.device)))
        plan = _Plan()
        plan.none, plan.chunks, plan.increments = none, chunks, increments
        plan.packs = packs
        plan.refs = (state, [g["params"] for g in param_groups])
        plan.snapshot = _StateSnapshot(state, stepping)
        plan.layout, plan.auto = layout, False
        plan.key = self._key(param_groups, state)  # after the lazy init grew the state
        plan.native = self._native_plans(chunks, layout.sources, none, param_groups)
        return plan

    def _native_plans(self, chunks, sources, none, param_groups) -> bool:
        """Give every call its compiled plan (kernels.adamw.make_plan); True when all of
        them have one (and found their grads: ready), else none keeps one."""
        calls = [c for cs in chunks for c in cs]
        for c in calls:
            c.native = None
        if not calls:
            return False
        table = self._hparams_table(param_groups)
        # the sources without a grad: one plan checks that they still have none
        no_grad = [sources[i] for i in none]
        for c in calls:
            if c.complex_params or isinstance(c.step_index, list):
                break  # real views taken per step; steps gathered from several packs
            srcs = sorted({src for src, *_ in c.grads})
            local = {src: j for j, src in enumerate(srcs)}
            c.native = make_plan(
                c.params, c.exp_avgs, c.exp_avg_sqs, c.max_exp_avg_sqs, c.masters,
                [sources[j] for j in srcs], [local[g[0]] for g in c.grads],
                [g[1] for g in c.grads], no_grad, c.segment_groups, table,
                hold=len(calls) > 1, fixed_params=c.fixed if any(c.fixed) else None,
                steps=c.steps)
            if c.native is None:
                break
            no_grad = []
        if any(c.native is None for c in calls):
            for c in calls:
                c.native = None
            return False
        return True

    @staticmethod
    def _init_state(state, key: Tensor, amsgrad: bool, on_device: bool,
                    master_weights: bool = False, alloc=None) -> dict:
        """torch.optim.AdamW's per-param state, created at the param's first grad; with
        master weights, float32 moments and a float32 master for a bf16/fp16 key.
        `alloc`: AdamWEngine.state_alloc."""
        st = state[key]
        master = master_weights and has_master(key)
        dtype = torch.float32 if master else key.dtype

        def zeros(name):
            t = None if alloc is None else alloc(key, name, dtype)
            return t if t is not None else torch.zeros_like(
                key, dtype=dtype, memory_format=torch.preserve_format)

        if len(st) == 0:
            st["step"] = torch.zeros((), dtype=torch.float32,
                                     device=key.device if on_device else "cpu")
            st["exp_avg"] = zeros("exp_avg")
            st["exp_avg_sq"] = zeros("exp_avg_sq")
        if amsgrad and "max_exp_avg_sq" not in st:
            st["max_exp_avg_sq"] = zeros("max_exp_avg_sq")
        if master:
            fresh = MASTER not in st
            ensure_master_state(st, key)
            t = alloc(key, MASTER, torch.float32) if fresh and alloc is not None else None
            if t is not None:
                st[MASTER] = t.copy_(st[MASTER])
        return st

    def _call(self, dev, segs: List[Segment], stepping, ams, packs, sources) -> _Call:
        c = _Call()
        c.device = dev
        use_max = any(ams[s.group] for s in segs)
        c.params, c.exp_avgs, c.exp_avg_sqs, c.max_exp_avg_sqs, c.grads = [], [], [], [], []
        c.complex_params = []
        masters = []
        for s in segs:
            st = stepping[id(s.key)]
            real = s.key.is_complex()
            if real:
                c.complex_params.append((len(c.params), s))
            view = lambda t: _elements(t, s.offset, s.length, real)  # noqa: E731
            c.params.append(view(s.key))
            c.exp_avgs.append(view(st["exp_avg"]))
            c.exp_avg_sqs.append(view(st["exp_avg_sq"]))
            w = st.get(MASTER) if self.master_weights and has_master(s.key) else None
            masters.append(None if w is None else view(w))
            if use_max:
                x = st.get("max_exp_avg_sq") if ams[s.group] else None
                c.max_exp_avg_sqs.append(view(x) if x is not None else torch.empty(
                    0, dtype=c.exp_avgs[-1].dtype, device=dev))
            # the grad is passed whole (no view op per step) when it matches the key
            whole = (s.grad_offset == 0 and s.offset == 0 and s.length == s.key.numel()
                     and not real and sources[s.source].shape == s.key.shape)
            c.grads.append((s.source, s.grad_offset, s.length, real, whole))
        c.masters = [] if all(w is None for w in masters) else [
            torch.empty(0, dtype=torch.float32, device=dev) if w is None else w
            for w in masters]
        c.segment_groups = torch.tensor([s.group for s in segs], dtype=torch.int64)
        c.fixed = [s.fixed for s in segs]
        # steps of this call: one pack, in order (no copy), or an index into one pack.
        c.steps = [stepping[id(s.key)]["step"] for s in segs]  # (the plan checks them)
        locs = [self._locate(packs, step) for step in c.steps]
        pk0 = locs[0][0]
        if all(pk is pk0 for pk, _ in locs) and (pk0.flat.device.type == "cpu"
                                                 or pk0.flat.device == dev):
            idx = [i for _, i in locs]
            c.pack = pk0
            c.step_index = None if idx == list(range(len(pk0.views))) else \
                torch.tensor(idx, dtype=torch.int64, device=pk0.flat.device)
        else:
            c.pack, c.step_index = None, locs
        return c

    @staticmethod
    def _locate(packs, step):
        for pk in packs:
            i = pk.index.get(id(step))
            if i is not None and pk.views[i] is step:
                return pk, i
        raise RuntimeError("AdamWEngine: a state 'step' is not packed (internal error)")

    def _pack_steps(self, state) -> List[_StepPack]:
        """Reuse the current packs when every state's step is one of their views, each still
        its element (:meth:`_StepPack.intact`), else copy all step values into fresh packs
        (one per device the steps live on)."""
        old = self._packs()
        steps = [st["step"] for st in state.values() if isinstance(st, dict) and "step" in st]
        if old and len(steps) == sum(len(pk.views) for pk in old) and all(
                pk.intact() for pk in old) and all(
                any(pk.index.get(id(s)) is not None and pk.views[pk.index[id(s)]] is s
                    for pk in old) for s in steps):
            return old
        by_dev: Dict[torch.device, list] = {}
        owners: Dict[torch.device, list] = {}
        for st in state.values():
            if not isinstance(st, dict) or "step" not in st:
                continue
            s = st["step"]
            dev = s.device if isinstance(s, Tensor) else torch.device("cpu")
            by_dev.setdefault(dev, []).append(float(s))  # a plain number in old checkpoints
            owners.setdefault(dev, []).append(st)
        packs = []
        for dev, vals in by_dev.items():
            pk = _StepPack(vals, dev)
            for st, view in zip(owners[dev], pk.views):
                st["step"] = view
            packs.append(pk)
        return packs

    def _packs(self) -> List[_StepPack]:
        if self._plan is None:
            return []
        seen = {}
        for calls in self._plan.chunks:
            for c in calls:
                for pk in ([c.pack] if c.pack is not None else [pk for pk, _ in c.step_index]):
                    seen[id(pk)] = pk
        for pk, _ in self._plan.increments:
            seen[id(pk)] = pk
        return list(seen.values())
