"""Normalise and validate the optimizer's `params` argument into param-group dicts.

Everything here is local and raises TypeError/ValueError naming the problem; the optimizer
then compares a fingerprint across ranks so that one rank's bad input cannot leave the
others waiting in a collective.
"""
from __future__ import annotations

import hashlib
import numbers
import types
from typing import Any, Iterable

import torch

from .fused_adamw import FusedAdamW

_SET_TYPES = (set, frozenset)


def _type_name(obj: Any) -> str:
    return torch.typename(obj) if isinstance(obj, torch.Tensor) else type(obj).__name__


def _as_param_list(params: Any, where: str) -> list:
    """Turn one group's "params" (a Tensor, list, tuple or generator) into a list of tensors."""
    if isinstance(params, torch.Tensor):
        return [params]  # one tensor is one param (torch would iterate its rows)
    if isinstance(params, _SET_TYPES):
        raise TypeError(
            f"{where} is a set; its iteration order differs between processes, so ranks "
            "would partition differently. Pass a list (e.g. sorted by name).")
    if isinstance(params, (dict, str, bytes)) or not isinstance(params, Iterable):
        raise TypeError(f"{where} should be an iterable of Tensors, but got {_type_name(params)}")
    out = list(params)  # generators are consumed exactly once, here
    for i, p in enumerate(out):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{where}[{i}] should be a Tensor, but got {_type_name(p)}")
    return out


def normalize_param_groups(params: Any) -> list[dict]:
    """Return a new list of group dicts, each with "params" as a list of tensors.

    The caller's dicts are copied, never modified.
    """
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params argument given to the optimizer should be an iterable of Tensors or "
            f"dicts, but got {torch.typename(params)}")
    if isinstance(params, _SET_TYPES):
        raise TypeError(
            "params is a set; its iteration order differs between processes, so ranks would "
            "partition differently. Pass a list (e.g. model.parameters() or a sorted list).")
    if isinstance(params, (dict, str, bytes)) or not isinstance(params, Iterable):
        raise TypeError(
            "params argument given to the optimizer should be an iterable of Tensors or "
            f"dicts, but got {_type_name(params)}")
    items = list(params)
    if not items:
        raise ValueError("optimizer got an empty parameter list")

    if all(isinstance(x, dict) for x in items):
        groups = []
        for gi, g in enumerate(items):
            if "params" not in g:
                raise ValueError(f"param group {gi} has no 'params' key")
            group = dict(g)
            group["params"] = _as_param_list(g["params"], f"param group {gi} 'params'")
            groups.append(group)
    elif any(isinstance(x, dict) for x in items):
        raise TypeError("params mixes dicts and other items; pass only Tensors or only dicts")
    else:
        groups = [{"params": _as_param_list(items, "params")}]

    seen: dict[int, tuple[int, int]] = {}
    for gi, g in enumerate(groups):
        for pi, p in enumerate(g["params"]):
            if not p.is_leaf:
                raise ValueError(
                    f"can't optimize a non-leaf Tensor (param group {gi}, index {pi}); "
                    "pass the leaf parameter, e.g. via .detach().requires_grad_()")
            where = seen.get(id(p))
            if where is not None:
                raise ValueError(
                    f"a parameter appears more than once: param group {gi} index {pi} is the "
                    f"same tensor as param group {where[0]} index {where[1]}")
            seen[id(p)] = (gi, pi)
    if not seen:
        raise ValueError("optimizer got an empty parameter list (every group is empty)")
    return groups


# ------------------------------------------------------------------ hyperparameters

def _known_optimizer(optimizer_class: type) -> bool:
    if optimizer_class.__module__.startswith("torch.optim"):
        return True
    return issubclass(optimizer_class, FusedAdamW)


def _number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def validate_hyperparameters(optimizer_class: type, groups: list[dict], defaults: dict) -> None:
    """Check per-group values the way torch checks defaults (torch never checks groups).

    Only for torch.optim optimizers and FusedAdamW, whose constraints are known; for other
    classes nothing is assumed.
    """
    if not _known_optimizer(optimizer_class):
        return
    for gi, g in enumerate(groups):
        merged = {**defaults, **{k: v for k, v in g.items() if k != "params"}}
        where = f"param group {gi}"
        for key in ("lr", "eps", "weight_decay", "momentum", "lr_decay", "alpha"):
            if key not in merged or merged[key] is None:
                continue
            val = _number(merged[key])
            if val is None:
                if key == "lr":
                    raise TypeError(f"Invalid lr in {where}: expected a number, got "
                                    f"{_type_name(merged[key])}")
                continue
            if val != val or val < 0.0:  # NaN or negative
                raise ValueError(f"Invalid {key} value in {where}: {merged[key]}")
        if "betas" in merged and merged["betas"] is not None:
            betas = merged["betas"]
            if not isinstance(betas, (tuple, list)) or len(betas) != 2:
                raise ValueError(f"Invalid betas in {where}: expected a pair, got {betas!r}")
            for i, b in enumerate(betas):
                val = _number(b)
                if val is None or not 0.0 <= val < 1.0:
                    raise ValueError(f"Invalid betas in {where}: beta parameter at index {i} "
                                     f"must be in [0, 1), got {b}")


# ------------------------------------------------------------------ cross-rank fingerprint

def _value_repr(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor({value.tolist()!r}, {value.dtype})"
    if isinstance(value, types.FunctionType):
        return f"function {value.__qualname__}"
    return repr(value)


def plain_value(v: Any) -> Any:
    """A hyperparameter as plain data, equal on two ranks exactly when the values are: a
    tensor by dtype, shape and bytes (not its device, class or requires_grad, which its
    repr shows: a CUDA tensor lr prints cuda:0 on one rank, cuda:1 on the next; nor its
    repr's 4 printed digits, which hide a real difference), Python scalars by repr (exact
    for floats), containers element by element, other objects by type name only (their
    repr may hold a memory address, which differs between processes); numpy scalars and
    arrays by dtype, shape and bytes."""
    if isinstance(v, torch.Tensor):
        t = v.detach()
        if t.device.type == "meta":
            return ("tensor", str(t.dtype), tuple(t.shape), None)
        if t.layout != torch.strided:
            t = t.to_dense()
        data = t.to("cpu").resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
        return ("tensor", str(t.dtype), tuple(t.shape),
                hashlib.sha256(data.numpy().tobytes()).hexdigest())
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        return (type(v).__name__, repr(v))
    if type(v).__module__ == "numpy" and hasattr(v, "tobytes") and hasattr(v, "dtype"):
        # a numpy scalar or array: by dtype, shape and bytes (np.float32(1e-3) and
        # np.float32(2e-3) are different values of one type)
        return ("numpy", str(v.dtype), tuple(getattr(v, "shape", ())),
                hashlib.sha256(v.tobytes()).hexdigest())
    if isinstance(v, (tuple, list)):
        return ("sequence", tuple(plain_value(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple(sorted(((repr(k), plain_value(x)) for k, x in v.items()),
                                     key=lambda kv: kv[0])))
    return ("object", f"{type(v).__module__}.{type(v).__qualname__}")


def hyperparameters(group: dict) -> dict:
    """A param group's entries other than its params."""
    return {k: v for k, v in group.items() if k != "params"}


def copy_hyperparameters(src: list[dict], dst: list[dict]) -> None:
    """Every non-params entry of each group of `src` into the matching group of `dst`."""
    for s, d in zip(src, dst):
        d.update(hyperparameters(s))


def describe(groups: list[dict], extra: dict) -> list[str]:
    """One line per fact that must agree on every rank (structure, shapes, hyperparameters)."""
    lines = [f"{k} = {_value_repr(v)}" for k, v in sorted(extra.items())]
    lines.append(f"number of param groups = {len(groups)}")
    for gi, g in enumerate(groups):
        lines.append(f"param group {gi}: {len(g['params'])} params")
        for k in sorted(k for k in g if k != "params"):
            lines.append(f"param group {gi} {k} = {_value_repr(g[k])}")
        for pi, p in enumerate(g["params"]):
            lines.append(f"param group {gi} param {pi}: shape {tuple(p.shape)}, {p.dtype}, "
                         f"{p.device.type}, requires_grad={p.requires_grad}")
    return lines


def digest(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def first_difference(mine: list[str], theirs: list[str]) -> str:
    for a, b in zip(mine, theirs):
        if a != b:
            return f"'{b}' instead of '{a}'"
    if len(mine) != len(theirs):
        longer, which = (mine, "is missing") if len(mine) > len(theirs) else (theirs, "adds")
        return f"it {which} '{longer[min(len(mine), len(theirs))]}'"
    return "no line differs (hash collision?)"
