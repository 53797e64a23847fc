"""The torch versions zero_ext supports, and what differs between them.

Supported: torch >= 2.6 (MIN_TORCH; setup.py declares the same). 2.6 is the oldest release
the project tests (CI runs a core subset of the suite on it, the whole suite on the pinned
torch of requirements.txt); older ones were never tried. Between 2.6 and the newest release
zero_ext adapts to two differences, both decided where they are used:

- `torch.distributed.checkpoint.save` / `load` take `no_dist` on newer torch only
  (zero_ext/checkpoint/_dcp.py detects it from the signature);
- before torch 2.8 a process group's destructor holds the GIL, and a gloo worker thread
  that still frees a finished collective's tensors needs it: destroy_process_group can hang
  forever (zero_ext/group_release.py, GIL_HELD_BY_GROUP_DESTRUCTOR).

`import zero_ext` on an older torch raises ImportError saying so (check_torch), rather than a
TypeError from deep inside torch later.
"""
from __future__ import annotations

import re

MIN_TORCH = (2, 6)


def version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: "2.6.0+cu124" -> (2, 6),
    "2.16.0a0+git1234" -> (2, 16)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(m.group(1)), int(m.group(2))


def torch_version() -> tuple[int, int]:
    import torch

    return version_tuple(torch.__version__)


def check_torch() -> None:
    """ImportError where the installed torch is older than MIN_TORCH."""
    import torch

    if version_tuple(torch.__version__) < MIN_TORCH:
        want = ".".join(map(str, MIN_TORCH))
        raise ImportError(
            f"zero_ext needs torch >= {want}; this environment has torch {torch.__version__}. "
            f"Install a newer torch (pip install 'torch>={want}') or use requirements.txt's "
            "(docs/build.md, 'Supported torch versions').")
