"""What the framework scripts share: a tiny model, seeded data, nanoGPT-style param groups,
and the files they write for tests/test_integrations.py to compare."""
from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # a source checkout without `pip install`
    sys.path.insert(0, ROOT)

VOCAB, SEQ, WIDTH = 64, 16, 32


class TinyLM(torch.nn.Module):
    """Embedding, two layers with a norm, a head tied to the embedding (as nanoGPT)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.body = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                                        torch.nn.Linear(4 * WIDTH, WIDTH))
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        x = self.emb(ids)
        x = x + self.body(x)
        logits = self.head(self.norm(x))
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                                 ids[:, 1:].reshape(-1))


def sequences(n: int, seed: int = 0) -> torch.Tensor:
    """n arithmetic progressions mod VOCAB: learnable, seeded, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 5, (n, 1), generator=g)
    return (start + stride * torch.arange(SEQ)) % VOCAB


def param_groups(model: torch.nn.Module, wd: float = 0.1) -> list[dict]:
    """Weight decay on matrices, none on vectors (biases, norms)."""
    ps = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": wd},
            {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]


def write_result(out: str, rank: int, params, optimizer_state=None, extra=None) -> None:
    """Every rank's params (to compare replicas and runs) and rank 0's optimizer state."""
    os.makedirs(out, exist_ok=True)
    torch.save({"params": [p.detach().cpu().clone() for p in params],
                "optimizer": optimizer_state, **(extra or {})},
               os.path.join(out, f"result_{rank}.pt"))


def exit_now(rc: int = 0) -> None:
    """Leave without the interpreter's teardown, which with torch 2.14 + gloo aborts about
    one run in four ("terminate called without an active exception": gloo's worker threads
    meet the finalizing interpreter, with or without zero_ext). Everything is written and
    flushed by then; the test reads the files."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
