"""Parameter shapes shared by the benchmarks (no torch import: plain lists of tuples).

- ``gpt2_shapes("small" | "medium", width_div=1)``: (name, shape) of GPT-2 (HF names, tied
  LM head so no separate lm_head), optionally with the width divided for quick runs.
- ``decay_groups(shapes)``: numels and group ids in the order an optimizer sees them with the
  usual two groups (matrices with weight decay first, then biases / norms without).
- ``random_numels(n, seed)``: n log-uniform sizes (1 .. 2**16) for scale tests (1M params).
- ``uneven_model(n, seed)``: n log-uniform sizes (2**10 .. 2**22) in two interleaved groups,
  a model without one dominant tensor, where the whole-param plan has room to improve.
"""
from __future__ import annotations

import random
from typing import List, Sequence, Tuple

Shape = Tuple[int, ...]

GPT2 = {  # hidden size, layers; vocab 50257 and context 1024 for all
    "small": (768, 12),
    "medium": (1024, 24),
    "large": (1280, 36),
}
VOCAB, CONTEXT = 50257, 1024


def gpt2_shapes(model: str = "small", width_div: int = 1) -> List[Tuple[str, Shape]]:
    """(name, shape) of every parameter of GPT-2 ``model``, in module order."""
    if model not in GPT2:
        raise ValueError(f"unknown model {model!r}; choose from {sorted(GPT2)}")
    hidden, layers = GPT2[model]
    d = hidden // int(width_div)
    out: List[Tuple[str, Shape]] = [("wte.weight", (VOCAB, d)), ("wpe.weight", (CONTEXT, d))]
    for i in range(layers):
        h = f"h.{i}."
        out += [
            (h + "ln_1.weight", (d,)), (h + "ln_1.bias", (d,)),
            (h + "attn.c_attn.weight", (d, 3 * d)), (h + "attn.c_attn.bias", (3 * d,)),
            (h + "attn.c_proj.weight", (d, d)), (h + "attn.c_proj.bias", (d,)),
            (h + "ln_2.weight", (d,)), (h + "ln_2.bias", (d,)),
            (h + "mlp.c_fc.weight", (d, 4 * d)), (h + "mlp.c_fc.bias", (4 * d,)),
            (h + "mlp.c_proj.weight", (4 * d, d)), (h + "mlp.c_proj.bias", (d,)),
        ]
    out += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return out


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def decay_groups(shapes: Sequence[Tuple[str, Shape]]) -> Tuple[List[int], List[int]]:
    """(numels, group ids): 2-D+ params (group 0, weight decay) first, then the rest (group 1)."""
    decay = [numel(s) for _, s in shapes if len(s) >= 2]
    rest = [numel(s) for _, s in shapes if len(s) < 2]
    return decay + rest, [0] * len(decay) + [1] * len(rest)


def random_numels(n: int, seed: int = 0, max_log2: float = 16.0,
                  min_log2: float = 0.0) -> List[int]:
    """n log-uniform sizes in [2**min_log2, 2**max_log2]: a stand-in for many-tensor models."""
    rng = random.Random(seed)
    return [int(2 ** rng.uniform(min_log2, max_log2)) for _ in range(n)]


def uneven_model(n: int = 100, seed: int = 1) -> Tuple[List[int], List[int]]:
    """(numels, group ids): n sizes in [2**10, 2**22], about 70% in group 0, interleaved."""
    rng = random.Random(seed)
    numels = [int(2 ** rng.uniform(10, 22)) for _ in range(n)]
    groups = [0 if rng.random() < 0.7 else 1 for _ in range(n)]
    return numels, groups
