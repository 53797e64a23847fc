"""Multi-tensor flattening: copy many tensors into one flat buffer and back, in one pass.

- ``flatten_into(tensors, flat, offsets)``: ``flat[offsets[i] : offsets[i] + numel_i] = tensors[i]``
- ``unflatten_from(flat, tensors, offsets)``: the inverse, written into ``tensors``.

Tensors may have any strides (element order is the logical row-major order, as ``reshape(-1)``)
and must share ``flat``'s dtype and device; ``flat`` is 1-D contiguous. Ranges must fit in
``flat``; overlapping ranges are not checked (their result is unspecified). The CPU kernel runs one
parallel loop over all tensors, the CUDA kernel one launch; a tensor that is already the view
of ``flat`` at its offset is skipped. Both run under ``torch.no_grad()``: they manage buffers
and are not differentiable (params that require grad are valid destinations).

``alignment_elems`` and ``aligned_offsets`` give 16-byte aligned layouts, which keep the vector
loads of the kernels on their fast path.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from ._loader import ensure_loaded

__all__ = [
    "flatten_into",
    "unflatten_from",
    "flatten_into_reference",
    "unflatten_from_reference",
    "alignment_elems",
    "aligned_offsets",
]

ALIGN_BYTES = 16


def alignment_elems(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in 16 bytes (at least 1)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return max(1, ALIGN_BYTES // itemsize)


def aligned_offsets(numels: Sequence[int], alignment: int) -> Tuple[List[int], int]:
    """Packed offsets, each a multiple of ``alignment``; total rounded up to ``alignment``."""
    alignment = int(alignment)
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}")
    offsets = []
    cursor = 0
    for n in numels:
        n = int(n)
        if n < 0:
            raise ValueError(f"numels must be >= 0, got {n}")
        start = -(-cursor // alignment) * alignment
        offsets.append(start)
        cursor = start + n
    return offsets, -(-cursor // alignment) * alignment


# --------------------------------------------------------------------------- validation

def _check(op: str, tensors: Sequence[torch.Tensor], flat: torch.Tensor, offsets: Sequence[int]) -> None:
    """Same checks, same words, as the C++ host code (so tests see one behaviour)."""
    if flat.dim() != 1:
        raise RuntimeError(f"{op}: flat must be 1-D, got {flat.dim()}-D")
    if not flat.is_contiguous():
        raise RuntimeError(f"{op}: flat must be contiguous")
    if len(tensors) != len(offsets):
        raise RuntimeError(
            f"{op}: got {len(tensors)} tensors but {len(offsets)} offsets")
    total = flat.numel()
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        if t.dtype != flat.dtype:
            raise RuntimeError(
                f"{op}: tensors[{i}] has dtype {t.dtype} but flat has dtype {flat.dtype}")
        if t.device != flat.device:
            raise RuntimeError(
                f"{op}: tensors[{i}] is on {t.device} but flat is on {flat.device}")
        if off < 0 or off + t.numel() > total:
            raise RuntimeError(
                f"{op}: tensors[{i}] ({t.numel()} elements at offset {off}) does not fit in "
                f"flat of {total} elements")


# --------------------------------------------------------------------------- references

def flatten_into_reference(tensors: Sequence[torch.Tensor], flat: torch.Tensor,
                           offsets: Sequence[int]) -> None:
    """Pure-PyTorch ``flatten_into`` (test oracle and fallback)."""
    tensors, offsets = list(tensors), list(map(int, offsets))
    _check("flatten_into", tensors, flat, offsets)
    with torch.no_grad():
        for t, off in zip(tensors, offsets):
            if t.numel():
                flat[off:off + t.numel()].view(t.shape).copy_(t)


def unflatten_from_reference(flat: torch.Tensor, tensors: Sequence[torch.Tensor],
                             offsets: Sequence[int]) -> None:
    """Pure-PyTorch ``unflatten_from`` (test oracle and fallback)."""
    tensors, offsets = list(tensors), list(map(int, offsets))
    _check("unflatten_from", tensors, flat, offsets)
    with torch.no_grad():
        for t, off in zip(tensors, offsets):
            if t.numel():
                t.copy_(flat[off:off + t.numel()].view(t.shape))


# --------------------------------------------------------------------------- wrappers
# torch.ops.zero_ext.* (zero_ext/kernels/_ops.py): the dispatcher runs the compiled kernel of
# flat's device when the native library registered one, else the reference above.

def flatten_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor, offsets: Sequence[int]) -> None:
    """Copy ``tensors[i]`` into ``flat[offsets[i] : offsets[i] + tensors[i].numel()]``."""
    tensors, offsets = list(tensors), list(map(int, offsets))
    if not tensors and not offsets:
        return
    ensure_loaded()
    with torch.no_grad():
        torch.ops.zero_ext.flatten_into(tensors, flat, offsets)


def unflatten_from(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """Copy ``flat[offsets[i] : offsets[i] + tensors[i].numel()]`` into ``tensors[i]``."""
    tensors, offsets = list(tensors), list(map(int, offsets))
    if not tensors and not offsets:
        return
    ensure_loaded()
    with torch.no_grad():
        torch.ops.zero_ext.unflatten_from(flat, tensors, offsets)
