"""examples/train_gpt.py with bf16 params and master weights, end to end.

One quick run of the example on 2 gloo ranks (torchrun, tiny model, few steps) with
``--dtype bf16 --master-weights``: it must exit 0 (the loss fell), print a finite loss, and
print per rank the bytes per param it holds, which for bf16 params and grads with fp32
masters + fp32 AdamW state sharded over 2 ranks is 2 + 2 + 12/2 = 10 (a few 0-d step tensors
add a hair).
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_gpt.py")


def test_example_bf16_master_weights_two_ranks(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", EXAMPLE, "--dtype", "bf16", "--master-weights", "--steps", "30",
           "--warmup", "5", "--d-model", "32", "--layers", "1", "--heads", "2",
           "--batch-size", "8", "--seq-len", "16", "--log-every", "10"]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out

    per_rank = re.findall(r"rank (\d+): ([0-9.]+) bytes per param held", proc.stdout)
    assert sorted(r for r, _ in per_rank) == ["0", "1"], out
    for _, b in per_rank:  # 2 (bf16 weights) + 2 (bf16 grads) + 12 / world (fp32 state)
        assert abs(float(b) - 10.0) < 0.2, out

    losses = [float(x) for x in re.findall(r"step +\d+  loss +(\S+)", proc.stdout)]
    assert len(losses) >= 3, out
    assert all(math.isfinite(x) for x in losses), out
    m = re.search(r"loss (\S+) -> (\S+)", proc.stdout)
    assert m and math.isfinite(float(m.group(2))) and float(m.group(2)) < float(m.group(1)), out
