"""ZeroRedundancyOptimizer on CUDA tensors (skipped without a GPU).

One GPU cannot run multi-rank NCCL, so the multi-rank case uses gloo with CUDA tensors (both
ranks on cuda:0); world 1 exercises the CUDA fused kernel path alone. Parity is against a
single-process torch.optim.AdamW on the same device, fp32 atol/rtol 1e-5 after 10 steps (the
CUDA kernel and torch's may differ in the last ulp each step).

Hyperparameters changed between steps (tests/test_hparams_between_steps.py's cases: lr, betas,
eps, weight_decay, maximize, amsgrad, differentiable, all at once) through FusedAdamW and
ZeRO's fused step on CUDA params, where the compiled plan keeps its table on the GPU: the
params must equal torch.optim.AdamW's after every step (atol/rtol 1e-5).
"""
from __future__ import annotations

import pytest
import torch

from _dist import clones, fake_grads, gloo_available, make_params, run_specs, run_world
from test_hparams_between_steps import (CASES, CUDA_TOL, ZERO_SPECS, check_reuse, need_plan,
                                        train_with_changes, zero_case)

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with gloo"),
]

SHAPES = [(64, 32), (32,), (1000,), (3, 5, 7), (1,), (129, 3)]


def _cuda_grads(params, step):
    """The harness's seeded grads (made on CPU), moved to the params' GPU."""
    cpu = [torch.empty(p.shape, requires_grad=True) for p in params]
    fake_grads(cpu, step)
    for p, c in zip(params, cpu):
        p.grad = c.grad.to(p.device)


def _parity(rank, world, sharding, bucket_view):
    from zero_ext import ZeroRedundancyOptimizer

    torch.cuda.set_device(0)
    ps = [p.cuda().detach().requires_grad_() for p in make_params(SHAPES)]
    ref = clones(ps)

    def groups(xs):
        return [{"params": xs[:3], "weight_decay": 0.1, "lr": 2e-3},
                {"params": xs[3:], "weight_decay": 0.0}]

    opt = ZeroRedundancyOptimizer(groups(ps), torch.optim.AdamW, sharding=sharding,
                                  parameters_as_bucket_view=bucket_view, lr=1e-3)
    ropt = torch.optim.AdamW(groups(ref), lr=1e-3)
    for step in range(10):
        _cuda_grads(ps, step)
        _cuda_grads(ref, step)
        opt.step()
        ropt.step()
    torch.cuda.synchronize()
    err = max(((a - b).abs() - 1e-5 * b.abs()).max().item() for a, b in zip(ps, ref))
    return {"err": err, "sharding": opt.sharding, "fused": type(opt._stepper).__name__}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("sharding,bucket_view", [("param", False), ("param", True),
                                                  ("flat", False), ("flat", True)])
def test_cuda_parity_with_torch_adamw(world, sharding, bucket_view):
    for res in run_world(_parity, world, sharding, bucket_view):
        assert res["sharding"] == sharding
        assert res["fused"] == "FusedShardStep"  # the CUDA kernel ran, not the generic path
        assert res["err"] <= 1e-5, res


# ------------------------------------------------------------------ hyperparameters changed

@pytest.mark.parametrize("case", CASES)
def test_cuda_fused_adamw_follows_group_changes_between_steps(case):
    need_plan("cuda")
    torch.cuda.set_device(0)
    check_reuse(case, train_with_changes(case, "cuda", CUDA_TOL), "fused")


@pytest.fixture(scope="module")
def zero_cuda_world():
    need_plan("cuda")
    return run_specs(2, zero_case, [(c, s, "cuda") for c, s in ZERO_SPECS])


@pytest.mark.parametrize("case,sharding", ZERO_SPECS, ids=[f"{s}-{c}" for c, s in ZERO_SPECS])
def test_cuda_zero_fused_step_follows_group_changes_between_steps(zero_cuda_world, case,
                                                                   sharding):
    for res in zero_cuda_world.values(f"spec{ZERO_SPECS.index((case, sharding))}"):
        check_reuse(case, res, "zero")
