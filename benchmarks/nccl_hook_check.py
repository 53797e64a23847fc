"""reduce_scatter_hook on NCCL: parity with DDP + AdamW, then a timed iteration per mode.

Run under torchrun with one process per GPU (world = the GPUs; 1 GPU runs world 1, which
still takes every code path but moves nothing between GPUs):

    torchrun --nproc-per-node=$(nvidia-smi -L | wc -l) benchmarks/nccl_hook_check.py --out DIR

``--device cpu`` runs the same on gloo (what CI can check; the hook's transport is then
forced to NCCL's form, reduce_scatter_tensor, with ZERO_EXT_HOOK_TRANSPORT unless set).

1. Parity. Per sharding mode ("param", "flat", "even") and dtype (fp32; bf16 and fp16 params
   with master weights), a DDP model with reduce_scatter_hook and zero_ext's AdamW trains 6
   steps (clipped by opt.clip_grad_norm_) beside DDP's all-reduce + torch.optim.AdamW
   (clipped by torch's clip_grad_norm_) on the same per-rank batches; every param must match
   (fp32 atol and rtol 1e-5; bf16/fp16 2e-2) on every rank. The hook's collectives are
   counted: every reduce_scatter_tensor must be of W equal blocks, and in "even" mode (equal
   shares) the hook must use nothing else (param and flat segments that one rank owns take
   all_to_all_single).
   The same with ``overlap_param_gather=True`` (fp32 and bf16, every mode): the params'
   exchange left in flight after each step, read back through ``model.state_dict()`` (which
   waits for it) and the next forward; on NCCL its collectives were issued at the step and
   the forward's stream waits on their events. The seconds the host waited
   (``last_step_timings["param_wait"]``) are reported.
2. Timing. An MLP (8 x Linear(2048, 2048), 33.6M params, batch 16), ms per iteration
   (forward, backward, clip, step; median of --iters after 3 warm-up iterations, CUDA
   synchronised) and peak allocated GPU memory per rank, for DDP + AdamW(fused=True), zero_ext
   (even), zero_ext + hook (even, flat) and zero_ext + hook + overlap_param_gather (even), as
   ratios to DDP measured in the same run.

Writes ``nccl_hook_check.json`` and ``nccl_hook_check.md`` to --out (rank 0); exits 1 when a
parity check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from zero_ext.sync import REDUCE_SCATTER  # noqa: E402  (torch 2.14: reduce_scatter_single)

HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CLIP = 0.5


def _mlp(width: int, depth: int, dtype, device, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).to(device=device, dtype=dtype)


def _groups(model):
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


def _ddp(model, device):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=ids, bucket_cap_mb=0.02)  # several buckets


def _count_hook_collectives():
    """Wrap the collectives the hook may issue; returns (calls, restore)."""
    calls = []
    saved = {n: getattr(dist, n) for n in (REDUCE_SCATTER, "all_to_all_single")}

    def spy(name):
        def call(out, inp, *args, **kw):
            if inp.dtype not in (torch.int64, torch.float64):  # (not an agreement's)
                calls.append((name, inp.numel(), out.numel()))
            return saved[name](out, inp, *args, **kw)
        return call

    for n in saved:
        setattr(dist, n, spy(n))
    return calls, lambda: [setattr(dist, n, f) for n, f in saved.items()]


def parity(sharding: str, dtype, device, world: int, rank: int, overlap: bool = False) -> dict:
    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    low = dtype != torch.float32
    ref = _ddp(_mlp(64, 4, torch.float32, device), device)
    ours = _ddp(_mlp(64, 4, dtype, device), device)
    o_ref = torch.optim.AdamW(_groups(ref.module), **HP)
    o_ours = ZeroRedundancyOptimizer(_groups(ours.module), torch.optim.AdamW,
                                     sharding=sharding, master_weights=low,
                                     overlap_param_gather=overlap, **HP)
    ours.register_comm_hook(o_ours, reduce_scatter_hook)
    tol = dict(atol=2e-2, rtol=2e-2) if low else dict(atol=1e-5, rtol=1e-5)
    worst, calls, restore, waited = 0.0, [], None, []
    for it in range(6):
        g = torch.Generator().manual_seed(1000 * it + rank)
        x = torch.randn(8 + rank, 64, generator=g).to(device)
        if it == 3:
            calls, restore = _count_hook_collectives()
        try:
            ref(x).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
            o_ref.step()
            o_ref.zero_grad()
            ours(x.to(dtype)).float().square().mean().backward()
            o_ours.clip_grad_norm_(CLIP)
            o_ours.step()
            o_ours.zero_grad()
        finally:
            if restore is not None:
                restore()
                restore = None
        if overlap:  # (model.state_dict() waits for the exchange left in flight)
            ours_now = list(ours.module.state_dict().values())
            waited.append(o_ours.last_step_timings.get("param_wait", 0.0))
        else:
            ours_now = list(ours.parameters())
        for a, b in zip(ref.parameters(), ours_now):
            torch.testing.assert_close(b.detach().float(), a.detach(), **tol,
                                       msg=lambda m, it=it: f"{sharding} {dtype} iter {it}: {m}")
            worst = max(worst, (b.detach().float() - a.detach()).abs().max().item())
    names = sorted({n for n, _, _ in calls})
    even_blocks = all(i == world * o for n, i, o in calls if n == REDUCE_SCATTER)
    rec = {"max_abs_diff": worst, "hook_collectives": names, "calls": len(calls),
           "equal_blocks": even_blocks}
    if overlap:
        # the params' exchange is what overlap_param_gather leaves in flight; the host's wait
        rec["param_wait_ms"] = 1e3 * max(waited[1:], default=0.0)
    return rec


def timing(device, iters: int, world: int) -> dict:
    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    out = {}
    modes = [("ddp", None, False, False), ("zero_ext (even)", "even", False, False),
             ("zero_ext + hook (even)", "even", True, False),
             ("zero_ext + hook (flat)", "flat", True, False),
             ("zero_ext + hook + overlap_param_gather (even)", "even", True, True)]
    for label, sharding, hook, overlap in modes:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = _mlp(2048, 8, torch.float32, device)
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        if sharding is None:
            opt = torch.optim.AdamW(_groups(model), fused=True, **HP)
        else:
            opt = ZeroRedundancyOptimizer(_groups(model), torch.optim.AdamW, sharding=sharding,
                                          overlap_param_gather=overlap, **HP)
        if hook:
            ddp.register_comm_hook(opt, reduce_scatter_hook)
        x = torch.randn(16, 2048, device=device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for it in range(iters + 3):
            sync()
            t0 = time.perf_counter()
            ddp(x).square().mean().backward()
            if sharding is None:
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP)
            else:
                opt.clip_grad_norm_(CLIP)
            opt.step()
            opt.zero_grad()
            sync()
            if it >= 3:
                times.append(time.perf_counter() - t0)
        med = torch.tensor([statistics.median(times)], device=device)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the slowest rank's median
        peak = (torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda"
                else float("nan"))
        out[label] = {"ms": med.item() * 1e3, "peak_mb": peak}
        del ddp, opt, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = out["ddp"]["ms"]
    for rec in out.values():
        rec["x_ddp"] = rec["ms"] / base
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("ZERO_EXT_HOOK_TRANSPORT", "reduce_scatter")
        # the overlapped exchange in NCCL's form: issued at the step, waited for per module
        os.environ.setdefault("ZERO_EXT_GATHER_FORM", "nccl")
    backend = "nccl" if args.device == "cuda" else "gloo"
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
              if args.device == "cuda" else torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the NCCL group: its communicator's device
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"world": world, "backend": backend, "parity": {}, "failures": []}
    cases = [(s, d, False) for s in ("param", "flat", "even")
             for d in (torch.float32, torch.bfloat16, torch.float16)]
    cases += [(s, d, True) for s in ("param", "flat", "even")
              for d in (torch.float32, torch.bfloat16)]
    for sharding, dtype, overlap in cases:
        key = f"{sharding} {str(dtype).split('.')[-1]}" + (" overlap" if overlap else "")
        try:
            rec = parity(sharding, dtype, device, world, rank, overlap)
            forced = os.environ.get("ZERO_EXT_HOOK_TRANSPORT") == "reduce_scatter"
            if world > 1 and (forced or sharding == "even") and \
                    rec["hook_collectives"] != [REDUCE_SCATTER]:
                raise AssertionError(f"the hook ran {rec['hook_collectives']}")
            if not rec["equal_blocks"]:
                raise AssertionError("a reduce_scatter_tensor of unequal blocks")
        except Exception as exc:  # noqa: BLE001 - reported, then the exit code
            rec = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            result["failures"].append(key)
        result["parity"][key] = rec
        if rank == 0:
            print(key, rec, flush=True)
    if not args.no_timing:
        result["timing"] = timing(device, args.iters, world)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "nccl_hook_check.json"), "w") as f:
            json.dump(result, f, indent=1)
        lines = [f"reduce_scatter_hook, {backend}, world {world}", "",
                 "| parity | max abs diff vs DDP + AdamW | hook's collectives | host's param "
                 "wait, ms (overlap) |",
                 "|---|---|---|---|"]
        for key, rec in result["parity"].items():
            lines.append(f"| {key} | {rec.get('max_abs_diff', rec.get('error'))} | "
                         f"{rec.get('hook_collectives', '')} | {rec.get('param_wait_ms', '-')} |")
        if "timing" in result:
            lines += ["", "| mode (MLP 33.6M) | ms/iter | x DDP | peak MB |", "|---|---|---|---|"]
            for label, rec in result["timing"].items():
                lines.append(f"| {label} | {rec['ms']:.1f} | {rec['x_ddp']:.2f}x | "
                             f"{rec['peak_mb']:.0f} |")
        text = "\n".join(lines) + "\n"
        with open(os.path.join(args.out, "nccl_hook_check.md"), "w") as f:
            f.write(text)
        print(text)
    dist.destroy_process_group()
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    from common import exit_without_teardown

    exit_without_teardown(main())
