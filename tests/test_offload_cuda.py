"""offload_optimizer with the params on a GPU: what only a GPU has (pinned host buffers, the
copies' streams and events, the hook's copies on a side stream while the backward goes
on, the host step running while the device part's kernel runs). Skipped without CUDA;
benchmarks/gpu_check.sh runs this file (section "offload").

Each case trains two copies of one model on the GPU through DDP (gloo, world 1, in a
spawned process): the reference DDP + torch.optim.AdamW (and torch's clip, GradScaler), and
the candidate with offload_optimizer; after every step the params must agree with the
reference (float32: atol = rtol = 1e-5, torch's CUDA AdamW against zero_ext's CPU kernel;
bf16 params with master weights: 4e-2, as tests/test_offload.py) and with a twin without
the option (1e-6 / 4e-2: the same math on the device's kernel).
"""
from __future__ import annotations

import pytest
import torch

from _dist import gloo_available, run_world

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with gloo"),
]

HP = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99))


def _net(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                               torch.nn.LayerNorm(256), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 8)).to("cuda", dtype)


def _case(rank, world, cfg):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    dtype = cfg.get("dtype", torch.float32)
    low = dtype != torch.float32
    kw = dict(device_ids=[0], bucket_cap_mb=0.05)
    ref = DDP(_net(torch.float32), **kw)
    models = [DDP(_net(dtype), **kw), DDP(_net(dtype), **kw)]  # candidate, twin
    o_ref = torch.optim.AdamW(ref.parameters(), **HP)
    opts = [ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, sharding=cfg["sharding"],
                                    master_weights=low, offload_optimizer=off, **HP)
            for m, off in zip(models, (cfg["offload"], False))]
    if cfg.get("hook"):
        for m, o in zip(models, opts):
            m.register_comm_hook(o, reduce_scatter_hook)
    scalers = [torch.amp.GradScaler("cuda", init_scale=2.0 ** 10) if cfg.get("scaler")
               else None for _ in range(3)]
    tol = dict(atol=4e-2, rtol=2e-2) if low else dict(atol=1e-5, rtol=1e-5)
    twin_tol = dict(atol=4e-2, rtol=2e-2) if low else dict(atol=1e-6, rtol=1e-6)
    g = torch.Generator().manual_seed(5)
    for it in range(6):
        x = torch.randn(32, 64, generator=g).cuda()
        for m, o, sc, is_ref in ((ref, o_ref, scalers[0], True), (models[0], opts[0], scalers[1],
                                 False), (models[1], opts[1], scalers[2], False)):
            loss = m(x.to(torch.float32 if is_ref else dtype)).float().square().mean()
            if cfg.get("inf_at") == it and not is_ref:
                loss = loss + float("inf") * m.module[-1].bias.float().sum()
            elif cfg.get("inf_at") == it:
                loss = loss + float("inf") * m.module[-1].bias.sum()
            (sc.scale(loss) if sc else loss).backward()
            if cfg.get("data_mul"):  # (fairseq's multiply_grads: moves no version counter)
                for p in m.parameters():
                    p.grad.data.mul_(0.5)
            if sc is not None:
                sc.unscale_(o)
            if is_ref:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            else:
                o.clip_grad_norm_(0.5)
            if sc is not None:
                sc.step(o)
                sc.update()
            else:
                o.step()
            o.zero_grad()
        for a, b, c in zip(ref.parameters(), models[0].parameters(), models[1].parameters()):
            torch.testing.assert_close(b.float(), a, **tol)
            torch.testing.assert_close(b.float(), c.float(), **twin_tol)
    host = opts[0]._offload
    assert all(b.params.is_pinned() and b.grads.is_pinned() for b in host.buffers)
    assert host.numel > 0 and (host.numel == opts[0].local_numel) == (cfg["offload"] is True)
    if cfg.get("hook") and not cfg.get("scaler"):
        assert host.pulled_early > 0  # (the buckets' copies, on the side stream)
    if cfg.get("data_mul"):  # (the .data edits seen by the fingerprints: sent again)
        assert host.sent_again > 0
    elif cfg.get("hook") and not cfg.get("scaler"):  # (unchanged: no window sent twice)
        assert host.sent_again == 0
    state_on_gpu = sum(v.numel() for lp in opts[0].plan.local if lp.host
                       for v in opts[0].optim.state[lp.key].values()
                       if isinstance(v, torch.Tensor) and v.is_cuda)
    assert state_on_gpu == 0
    if cfg.get("scaler"):
        assert scalers[0].get_scale() == scalers[1].get_scale()
    return True


CASES = {
    "flat-whole-hook": dict(sharding="flat", offload=True, hook=True),
    "flat-half-hook": dict(sharding="flat", offload=0.5, hook=True),
    "flat-half-hook-data-mul": dict(sharding="flat", offload=0.5, hook=True, data_mul=True),
    "param-whole": dict(sharding="param", offload=True),
    "even-half-bf16-masters-hook": dict(sharding="even", offload=0.5, hook=True,
                                        dtype=torch.bfloat16),
    "flat-whole-scaler-unscale-inf-hook": dict(sharding="flat", offload=True, hook=True,
                                               scaler=True, inf_at=3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_offload_matches_ddp_and_torch_adamw(case):
    assert run_world(_case, 1, CASES[case]) == [True]
