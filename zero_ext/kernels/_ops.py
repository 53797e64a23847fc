"""The zero_ext op library: every schema of ``torch.ops.zero_ext.*``, defined once, here.

Imported by ``zero_ext.kernels``, so the ops exist as soon as the package is imported:

- the schemas (with their mutation annotations) are defined in Python
  (``torch.library.Library("zero_ext", "DEF")``);
- the pure-PyTorch references are registered as the default kernel
  (``CompositeExplicitAutograd``), so ``torch.ops.zero_ext.X`` works on any device with or
  without the compiled library;
- the fake (meta) kernels check lengths, numels, dtypes and devices with ``torch._check``;
- the compiled library (csrc/, loaded by ``_loader``) only registers CPU / CUDA kernels
  (``TORCH_LIBRARY_IMPL(zero_ext, CPU|CUDA, m)``), which the dispatcher prefers to the default
  for tensors of that device. That is the one place where native vs reference is decided.
"""
from __future__ import annotations

import torch

from .adamw import HPARAM_COLUMNS, fused_adamw_reference_
from .flatten import flatten_into_reference, unflatten_from_reference
from .partition import assign_params_reference, flat_offsets_reference

NAMESPACE = "zero_ext"

# name -> schema; zero_ext.kernels._loader.OPS and native_status() list these.
SCHEMAS = {
    # Copy each tensor into flat[offsets[i] : offsets[i] + tensors[i].numel()].
    "flatten_into": "flatten_into(Tensor[] tensors, Tensor(a!) flat, int[] offsets) -> ()",
    # Inverse of flatten_into: copy flat[offsets[i] : ...] back into each tensor.
    "unflatten_from": "unflatten_from(Tensor flat, Tensor(a!)[] tensors, int[] offsets) -> ()",
    # Whole-parameter ownership: rank of every param (int64 [n]); never worse than torch's
    # per-group sorted greedy. numels, groups: int64 [n] on CPU.
    "assign_params": "assign_params(Tensor numels, Tensor groups, int world_size) -> Tensor",
    # Element-level layout: aligned start offset of each param, then the padded total,
    # a multiple of world_size * alignment (int64 [n + 1]).
    "flat_offsets": "flat_offsets(Tensor numels, int world_size, int alignment) -> Tensor",
    # One AdamW step over S segments of any param groups. steps: float32 [S] (already
    # incremented), segment_groups: int64 [S] on CPU, group_hparams: float64 [G, 7] on CPU
    # with columns (lr, beta1, beta2, eps, weight_decay, amsgrad, maximize). masters: empty,
    # or one entry per segment (empty, or the float32 master of a bf16/fp16 param segment).
    "fused_adamw_": (
        "fused_adamw_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor steps, "
        "Tensor segment_groups, Tensor group_hparams, Tensor? grad_scale, "
        "Tensor? found_inf, Tensor(e!)[] masters) -> ()"),
}

_lib = torch.library.Library(NAMESPACE, "DEF")  # noqa: TOR901 (kept for the process's life)
for _schema in SCHEMAS.values():
    _lib.define(_schema)

_DEFAULT = "CompositeExplicitAutograd"


# --------------------------------------------------------------------------- default kernels

def _int64_out(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _assign_params_default(numels, groups, world_size):
    return _int64_out(assign_params_reference(numels, groups, world_size))


def _flat_offsets_default(numels, world_size, alignment):
    return _int64_out(flat_offsets_reference(numels, world_size, alignment))


_lib.impl("flatten_into", flatten_into_reference, _DEFAULT)
_lib.impl("unflatten_from", unflatten_from_reference, _DEFAULT)
_lib.impl("assign_params", _assign_params_default, _DEFAULT)
_lib.impl("flat_offsets", _flat_offsets_default, _DEFAULT)
_lib.impl("fused_adamw_", fused_adamw_reference_, _DEFAULT)


# --------------------------------------------------------------------------- fake kernels

def _check_flat_ranges(op, tensors, flat, offsets):
    torch._check(flat.dim() == 1, lambda: f"{op}: flat must be 1-D, got {flat.dim()}-D")
    torch._check(len(tensors) == len(offsets),
                 lambda: f"{op}: got {len(tensors)} tensors but {len(offsets)} offsets")
    total = flat.numel()
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        torch._check(t.dtype == flat.dtype, lambda: f"{op}: tensors[{i}] has dtype {t.dtype} "
                     f"but flat has dtype {flat.dtype}")
        torch._check(t.device == flat.device,
                     lambda: f"{op}: tensors[{i}] is on {t.device} but flat is on {flat.device}")
        torch._check(off >= 0, lambda: f"{op}: offsets[{i}] = {off} is negative")
        torch._check(off + t.numel() <= total, lambda: f"{op}: tensors[{i}] does not fit in flat")


@torch.library.register_fake(f"{NAMESPACE}::flatten_into", lib=_lib)
def _flatten_into_fake(tensors, flat, offsets):
    _check_flat_ranges("flatten_into", tensors, flat, offsets)


@torch.library.register_fake(f"{NAMESPACE}::unflatten_from", lib=_lib)
def _unflatten_from_fake(flat, tensors, offsets):
    _check_flat_ranges("unflatten_from", tensors, flat, offsets)


def _check_int64_cpu_1d(op, name, t):
    torch._check(t.dtype == torch.int64, lambda: f"{op}: {name} must be int64, got {t.dtype}")
    torch._check(t.dim() == 1, lambda: f"{op}: {name} must be 1-D, got {t.dim()}-D")
    torch._check(t.device.type == "cpu", lambda: f"{op}: {name} must be a CPU tensor")


@torch.library.register_fake(f"{NAMESPACE}::assign_params", lib=_lib)
def _assign_params_fake(numels, groups, world_size):
    _check_int64_cpu_1d("assign_params", "numels", numels)
    _check_int64_cpu_1d("assign_params", "groups", groups)
    torch._check(numels.numel() == groups.numel(),
                 lambda: "assign_params: numels and groups must have the same length")
    torch._check(world_size >= 1, lambda: "assign_params: world_size must be >= 1")
    return numels.new_empty(numels.shape)


@torch.library.register_fake(f"{NAMESPACE}::flat_offsets", lib=_lib)
def _flat_offsets_fake(numels, world_size, alignment):
    _check_int64_cpu_1d("flat_offsets", "numels", numels)
    torch._check(world_size >= 1, lambda: "flat_offsets: world_size must be >= 1")
    torch._check(alignment >= 1, lambda: "flat_offsets: alignment must be >= 1")
    return numels.new_empty((numels.shape[0] + 1,))


_ADAMW_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@torch.library.register_fake(f"{NAMESPACE}::fused_adamw_", lib=_lib)
def _fused_adamw_fake(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                      segment_groups, group_hparams, grad_scale=None, found_inf=None,
                      masters=()):
    op = "fused_adamw_"
    S = len(params)
    torch._check(len(grads) == S and len(exp_avgs) == S and len(exp_avg_sqs) == S,
                 lambda: f"{op}: params, grads, exp_avgs and exp_avg_sqs must have the same "
                 f"length, got {S}, {len(grads)}, {len(exp_avgs)}, {len(exp_avg_sqs)}")
    torch._check(len(max_exp_avg_sqs) in (0, S),
                 lambda: f"{op}: max_exp_avg_sqs must be empty or have {S} entries")
    torch._check(len(masters) in (0, S),
                 lambda: f"{op}: masters must be empty or have {S} entries")
    torch._check(steps.dim() == 1 and steps.numel() == S and steps.dtype == torch.float32,
                 lambda: f"{op}: steps must be float32 [{S}]")
    torch._check(segment_groups.dim() == 1 and segment_groups.numel() == S
                 and segment_groups.dtype == torch.int64,
                 lambda: f"{op}: segment_groups must be int64 [{S}]")
    torch._check(group_hparams.dim() == 2 and group_hparams.size(1) == len(HPARAM_COLUMNS)
                 and group_hparams.dtype == torch.float64,
                 lambda: f"{op}: group_hparams must be float64 [G, {len(HPARAM_COLUMNS)}]")
    for name, t in (("grad_scale", grad_scale), ("found_inf", found_inf)):
        if t is not None:
            torch._check(t.numel() == 1 and t.dtype == torch.float32,
                         lambda: f"{op}: {name} must be a float32 tensor with one element")
    if S == 0:
        return
    device = params[0].device
    for i in range(S):
        p, g, m, v = params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]
        n = p.numel()
        torch._check(p.dtype in _ADAMW_DTYPES,
                     lambda: f"{op}: params[{i}] has unsupported dtype {p.dtype}")
        torch._check(g.dtype == p.dtype,
                     lambda: f"{op}: grads[{i}] has dtype {g.dtype} but params[{i}] {p.dtype}")
        torch._check(m.dtype == v.dtype and m.dtype in (p.dtype, torch.float32),
                     lambda: f"{op}: exp_avgs[{i}] and exp_avg_sqs[{i}] must both have the "
                     f"param's dtype or float32, got {m.dtype} and {v.dtype}")
        torch._check(g.numel() == n and m.numel() == n and v.numel() == n,
                     lambda: f"{op}: segment {i} has mismatched numel")
        torch._check(p.device == device and g.device == device and m.device == device
                     and v.device == device,
                     lambda: f"{op}: segment {i} has a tensor that is not on {device}")
        if max_exp_avg_sqs:
            x = max_exp_avg_sqs[i]
            torch._check(x.numel() in (0, n),
                         lambda: f"{op}: max_exp_avg_sqs[{i}] must be empty or have {n} elements")
            if x.numel():
                torch._check(x.dtype == m.dtype and x.device == device,
                             lambda: f"{op}: max_exp_avg_sqs[{i}] must match exp_avgs[{i}]")
        if masters and masters[i].numel():
            w = masters[i]
            torch._check(p.dtype in (torch.bfloat16, torch.float16),
                         lambda: f"{op}: masters[{i}] is given but params[{i}] is {p.dtype} "
                         "(masters are for bfloat16 / float16 params)")
            torch._check(w.dtype == torch.float32 and w.numel() == n and w.device == device,
                         lambda: f"{op}: masters[{i}] must be float32 with {n} elements on "
                         f"{device}")
            torch._check(m.dtype == torch.float32,
                         lambda: f"{op}: segment {i} has a master, so its exp_avgs and "
                         "exp_avg_sqs must be float32")
