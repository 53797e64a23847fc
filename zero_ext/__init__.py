"""zero_ext: a faster, balanced drop-in for torch.distributed.optim.ZeroRedundancyOptimizer."""

__all__ = ["ZeroRedundancyOptimizer", "FusedAdamW"]
__version__ = "0.1.0"


def __getattr__(name):  # lazy, so `import zero_ext.kernels` does not pull in the optimizer
    if name == "ZeroRedundancyOptimizer":
        from .zero import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer
    if name == "FusedAdamW":
        from .fused_adamw import FusedAdamW

        return FusedAdamW
    raise AttributeError(f"module 'zero_ext' has no attribute {name!r}")
