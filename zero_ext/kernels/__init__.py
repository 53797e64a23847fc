"""The zero_ext ops, torch.ops.zero_ext.*, with typed wrappers and pure-PyTorch references.

_ops.py defines every schema in Python and registers the references as the default kernels;
the compiled library (loaded on first use by _loader) registers CPU / CUDA kernels, which the
dispatcher prefers for tensors of their device. The references are also the test oracles.
"""
from ._loader import ensure_loaded, load_native, native_available, native_status  # noqa: F401
from .flatten import flatten_into, unflatten_from, aligned_offsets  # noqa: F401
from .partition import assign_params, flat_offsets, rank_pieces, torch_greedy  # noqa: F401
from .adamw import fused_adamw_  # noqa: F401
from . import _ops  # noqa: F401,E402  defines torch.ops.zero_ext.* (schemas, defaults, fakes)
