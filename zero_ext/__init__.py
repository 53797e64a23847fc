"""zero_ext: a faster, balanced drop-in for torch.distributed.optim.ZeroRedundancyOptimizer."""

__all__ = ["ZeroRedundancyOptimizer", "FusedAdamW", "hybrid_groups", "native_status",
           "load_native"]
__version__ = "0.1.0"

from .torch_support import check_torch as _check_torch  # noqa: E402

_check_torch()  # torch >= 2.6 (zero_ext/torch_support.py): a clear ImportError before
#                 anything else meets an older torch


def native_status(load=None):
    """Which ops (torch.ops.zero_ext.*) run compiled code on CPU / CUDA, and why not where they
    don't (no compiler, build failed, ZERO_EXT_REFERENCE=1, no CUDA in this build, ...); before
    the first use, what that first use will do. Returns a dict that prints as a report.

    It builds nothing by default (load=None): it loads the native ops if they are already built
    (setup.py's zero_ext._C, or a JIT build cached for the current sources: well under a
    second); otherwise it says that the first use or zero_ext.load_native() will build them
    (with which compiler, into which directory, about how long), or that no compiler was found
    and the references will run. load=True loads them now, building if needed (minutes on an
    empty cache), and never raises; load=False only reports, loading nothing."""
    from .kernels._loader import native_status as _status

    return _status(load)


def load_native():
    """Load (building on first use) the native ops now, so torch.ops.zero_ext.* exist. They
    load lazily otherwise: at the first optimizer step / kernel call, not at `import zero_ext`.
    Returns native_status(); raises under ZERO_EXT_REQUIRE_NATIVE=1 when they cannot load."""
    from .kernels._loader import load_native as _load

    return _load()


_LAZY = ("ZeroRedundancyOptimizer", "FusedAdamW", "hybrid_groups")
_SUBMODULES = ("checkpoint", "hybrid", "integrations", "ddp_zero_hook")


def __dir__():  # the lazily loaded names too (tab completion, dir(zero_ext))
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


def __getattr__(name):  # lazy, so `import zero_ext.kernels` does not pull in the optimizer
    if name == "ZeroRedundancyOptimizer":
        from .zero import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer
    if name == "FusedAdamW":
        from .fused_adamw import FusedAdamW

        return FusedAdamW
    if name == "hybrid_groups":
        from .hybrid import hybrid_groups

        return hybrid_groups
    # submodules as attributes: zero_ext.checkpoint.save(...), zero_ext.ddp_zero_hook...
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'zero_ext' has no attribute {name!r}")
