"""Typed wrappers over torch.ops.zero_ext.* with their pure-PyTorch references.

Each wrapper runs the compiled op when it exists for the inputs' device, else the reference
(the loader warns once). The references are also the test oracles.
"""
from ._loader import ensure_loaded, load_native, native_available, native_status  # noqa: F401
from .flatten import flatten_into, unflatten_from, aligned_offsets  # noqa: F401
from .partition import assign_params, flat_offsets, rank_pieces, torch_greedy  # noqa: F401
from .adamw import fused_adamw_  # noqa: F401
