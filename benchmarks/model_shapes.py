"""Parameter shapes shared by the benchmarks (no torch import: plain lists of tuples).

- ``gpt2_shapes("small" | "medium", width_div=1)``: (name, shape) of GPT-2 (HF names, tied
  LM head so no separate lm_head), optionally with the width divided for quick runs.
- ``llama_shapes("7b" | "70b", width_div=1)``: (name, shape) of Llama-2 (HF names: untied
  embed_tokens / lm_head of 32000 x d, per layer q/k/v/o and gate/up/down projections and two
  RMSNorm weights; 70B's grouped-query k/v have 8 heads of 128), optionally narrower.
- ``model_shapes(name)``: either family by one name ("gpt2-small", "llama2-7b", ...).
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


LLAMA2 = {  # hidden, layers, attention heads, key/value heads, MLP width; vocab 32000
    "7b": (4096, 32, 32, 32, 11008),
    "13b": (5120, 40, 40, 40, 13824),
    "70b": (8192, 80, 64, 8, 28672),
}
LLAMA_VOCAB = 32000


def llama_shapes(model: str = "7b", width_div: int = 1) -> List[Tuple[str, Shape]]:
    """(name, shape) of every parameter of Llama-2 ``model`` (HF module order, nn.Linear
    weights as (out, in), no biases), optionally with every width divided by ``width_div``."""
    if model not in LLAMA2:
        raise ValueError(f"unknown model {model!r}; choose from {sorted(LLAMA2)}")
    hidden, layers, heads, kv_heads, ffn = LLAMA2[model]
    div = int(width_div)
    d, f, kv = hidden // div, ffn // div, (hidden // heads) * kv_heads // div
    out: List[Tuple[str, Shape]] = [("model.embed_tokens.weight", (LLAMA_VOCAB, d))]
    for i in range(layers):
        h = f"model.layers.{i}."
        out += [
            (h + "self_attn.q_proj.weight", (d, d)), (h + "self_attn.k_proj.weight", (kv, d)),
            (h + "self_attn.v_proj.weight", (kv, d)), (h + "self_attn.o_proj.weight", (d, d)),
            (h + "mlp.gate_proj.weight", (f, d)), (h + "mlp.up_proj.weight", (f, d)),
            (h + "mlp.down_proj.weight", (d, f)),
            (h + "input_layernorm.weight", (d,)), (h + "post_attention_layernorm.weight", (d,)),
        ]
    out += [("model.norm.weight", (d,)), ("lm_head.weight", (LLAMA_VOCAB, d))]
    return out


MODELS = ["gpt2-small", "gpt2-medium", "gpt2-large", "llama2-7b", "llama2-13b", "llama2-70b"]


def model_shapes(name: str, width_div: int = 1) -> List[Tuple[str, Shape]]:
    """Shapes of a model named as in MODELS ("gpt2-small", "llama2-70b", ...)."""
    family, _, size = name.partition("-")
    if family == "gpt2":
        return gpt2_shapes(size, width_div)
    if family == "llama2":
        return llama_shapes(size, width_div)
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


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
