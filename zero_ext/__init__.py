"""zero_ext: a faster, balanced drop-in for torch.distributed.optim.ZeroRedundancyOptimizer."""

__all__ = ["ZeroRedundancyOptimizer", "FusedAdamW", "native_status", "load_native"]
__version__ = "0.1.0"


def native_status(load: bool = True):
    """Which ops (torch.ops.zero_ext.*) run compiled code on CPU / CUDA, and why not where they
    don't (no compiler, build failed, ZERO_EXT_REFERENCE=1, no CUDA in this build, ...).

    Returns a dict that prints as a table. With load=True (default) it first loads the native
    ops (building them on the very first use: about a minute); load=False only reports."""
    from .kernels._loader import native_status as _status

    return _status(load)


def load_native():
    """Load (building on first use) the native ops now, so torch.ops.zero_ext.* exist. They
    load lazily otherwise: at the first optimizer step / kernel call, not at `import zero_ext`.
    Returns native_status(); raises under ZERO_EXT_REQUIRE_NATIVE=1 when they cannot load."""
    from .kernels._loader import load_native as _load

    return _load()


def __getattr__(name):  # lazy, so `import zero_ext.kernels` does not pull in the optimizer
    if name == "ZeroRedundancyOptimizer":
        from .zero import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer
    if name == "FusedAdamW":
        from .fused_adamw import FusedAdamW

        return FusedAdamW
    raise AttributeError(f"module 'zero_ext' has no attribute {name!r}")
