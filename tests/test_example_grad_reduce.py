"""examples/train_gpt.py --grad-reduce-scatter, end to end on 2 gloo ranks (torchrun).

40 steps with clipping (--clip-norm) of a tiny GPT, four runs:
- the hook (checkpoint at step 20), then a resume from step 20 to 40: the final weights
  and the losses of steps 21-40 are bitwise those of the uninterrupted run;
- zero_ext with DDP's own all-reduce: bitwise equal to the hook's run (with 2 ranks the
  average (a + b) / 2 is exact whichever way it is summed), so the hook changes nothing but
  the bytes;
- DDP + torch.optim.AdamW, unsharded, with torch's clip_grad_norm_: the same losses to
  1e-5 and weights to 1e-4 (two AdamW implementations drift apart in elements whose grads
  are ~0, where Adam divides rounding by ~sqrt(v): torch's own fused and foreach AdamW
  differ by 1.2e-5 on this run).
"""
from __future__ import annotations

import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_gpt.py")
ARGS = ["--steps", "40", "--warmup", "5", "--d-model", "32", "--layers", "1", "--heads", "2",
        "--batch-size", "8", "--seq-len", "16", "--log-every", "20", "--clip-norm", "0.5"]


def _run(tmp_path, *extra, ok=(0,)):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", EXAMPLE, *ARGS, *extra]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode in ok, proc.stdout + proc.stderr
    return proc.stdout


def _load(path):
    return torch.load(path, weights_only=False)


def test_example_grad_reduce_scatter_matches_ddp_adamw_and_resumes_exactly(tmp_path):
    ck = tmp_path / "ck"
    out = _run(tmp_path, "--grad-reduce-scatter", "--ckpt", str(ck), "--save-every", "20",
               "--final", str(tmp_path / "hook.pt"))
    assert "reduce_scatter_hook" in out
    _run(tmp_path, "--grad-reduce-scatter", "--resume-from", str(ck / "step-20"),
         "--final", str(tmp_path / "resumed.pt"), ok=(0, 1))  # 1: the loss of steps 21-40 did
    # not fall (the example's exit status); the weights are compared below
    _run(tmp_path, "--final", str(tmp_path / "allreduce.pt"))
    _run(tmp_path, "--plain-adamw", "--final", str(tmp_path / "plain.pt"))

    hook, resumed = _load(tmp_path / "hook.pt"), _load(tmp_path / "resumed.pt")
    allreduce, plain = _load(tmp_path / "allreduce.pt"), _load(tmp_path / "plain.pt")
    for k, v in hook["model"].items():
        assert torch.equal(v, resumed["model"][k]), f"resume: {k}"
        assert torch.equal(v, allreduce["model"][k]), f"DDP's all-reduce vs the hook: {k}"
        torch.testing.assert_close(v, plain["model"][k], atol=1e-4, rtol=1e-4)
    assert resumed["losses"] == hook["losses"][20:]
    assert len(hook["losses"]) == 40
    for a, b in zip(hook["losses"], plain["losses"]):
        assert abs(a - b) <= 1e-5, (a, b)
