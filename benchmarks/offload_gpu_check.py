"""offload_optimizer on a GPU (gpu_check.sh, section "offload"): GPT-2 small and medium at
world 1 (NCCL), bf16 autocast, fp32 params, nanoGPT's two groups, AdamW lr 6e-4, betas
(0.9, 0.95), weight decay 0.1, reduce_scatter_hook (world 1: each bucket's grads go to the
host as DDP finishes it, on a side stream, while the backward goes on).

    python benchmarks/offload_gpu_check.py --models small,medium --out /tmp/out

Per model, each mode in turn on a fresh copy of the same seeded model (peak memory reset
before it is built): DDP + torch.optim.AdamW(fused=True); zero_ext without the option;
with offload_optimizer=True; at fractions 0.5 and 0.25; and offload_optimizer=True without
the hook (the grads copied at the step). It prints ms per iteration (median, synchronised),
the ratio to DDP's, peak device memory (torch.cuda.max_memory_allocated) and the device
bytes of optimizer state + masters counted from the tensors, the host part's size, and
parity: the max abs difference of the params from DDP's and from zero_ext's without the
option after the same iterations (the host step's CPU kernel and the device's CUDA kernel
round alike up to the last bit of some elements; Adam magnifies that where grads are tiny,
so this is a sanity check, the CPU tests hold the exact ones). Also checked: the host
buffers are pinned, the hook's copies ran on the side stream (copies counted per step).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table  # noqa: E402

SIZES = {"small": (768, 12, 12), "medium": (1024, 24, 16)}  # width, layers, heads
VOCAB, CONTEXT = 50257, 1024
HP = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8)
MODES = ("ddp", "zero_ext", "offload", "offload_0.5", "offload_0.25", "offload_no_hook")


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.c_attn, self.c_proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.c_attn(self.ln_1(x)).chunk(3, dim=-1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc(self.ln_2(x))))


class GPT(torch.nn.Module):
    def __init__(self, d: int, layers: int, heads: int):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(VOCAB, d), torch.nn.Embedding(CONTEXT, d)
        self.h = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()  # tied LM head
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                 idx.roll(-1, 1).flatten())


def _groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _state_device_bytes(opt) -> int:
    inner = getattr(opt, "optim", opt)
    seen, total = set(), 0
    for st in inner.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.is_cuda:
                s = v.untyped_storage()
                if s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    total += s.nbytes()
    return total


def run_mode(mode, size, args, batches):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    dev = torch.device("cuda", 0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    torch.manual_seed(0)
    model = GPT(*SIZES[size]).to(dev)
    ddp = DDP(model, device_ids=[0])
    if mode == "ddp":
        opt = torch.optim.AdamW(_groups(model), fused=True, **HP)
    else:
        frac = {"zero_ext": False, "offload": True, "offload_no_hook": True,
                "offload_0.5": 0.5, "offload_0.25": 0.25}[mode]
        opt = ZeroRedundancyOptimizer(_groups(model), torch.optim.AdamW, sharding="flat",
                                      offload_optimizer=frac, **HP)
        if mode != "offload_no_hook":
            ddp.register_comm_hook(opt, reduce_scatter_hook)
    times = []
    for it, idx in enumerate(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", torch.bfloat16):
            loss = ddp(idx)
        loss.backward()
        if mode == "ddp":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if it >= args.warmup:
            times.append(time.perf_counter() - t0)
    out = {"mode": mode, "ms": 1e3 * statistics.median(times),
           "peak_mb": torch.cuda.max_memory_allocated(dev) / 1e6,
           "state_device_mb": _state_device_bytes(opt) / 1e6,
           "params": [p.detach().float().cpu() for p in model.parameters()]}
    host = getattr(opt, "_offload", None)
    if host is not None:
        out["host_numel"] = host.numel
        out["local_numel"] = opt.local_numel
        out["pinned"] = all(b.params.is_pinned() and b.grads.is_pinned() for b in host.buffers)
        out["early"] = host.pulled_early
        out["at_step"] = host.pulled_at_step
        out["staging_mb"] = host.device_bytes() / 1e6
    del ddp, model, opt
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="small,medium")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("offload_gpu_check: no GPU")
        return 1
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    dist.init_process_group("nccl", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=300))
    torch.cuda.set_device(0)
    results = {}
    for size in args.models.split(","):
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, VOCAB, (args.batch, args.seq), generator=g).cuda()
                   for _ in range(args.warmup + args.iters)]
        runs = {}
        for mode in args.modes.split(","):
            try:
                runs[mode] = run_mode(mode, size, args, batches)
            except Exception as exc:  # noqa: BLE001 - reported, the others go on
                print(f"# {size} {mode}: FAILED {type(exc).__name__}: {exc}", flush=True)
        base = runs.get("ddp", {}).get("ms")
        ref, twin = runs.get("ddp", {}).get("params"), runs.get("zero_ext", {}).get("params")
        rows = []
        for mode, r in runs.items():
            def diff(other):
                if other is None or mode in ("ddp",):
                    return "-"
                return f"{max(float((a - b).abs().max()) for a, b in zip(r['params'], other)):.2e}"
            rows.append([mode, f"{r['ms']:.1f}", f"{r['ms'] / base:.2f}x" if base else "-",
                         f"{r['peak_mb']:.0f}", f"{r['state_device_mb']:.0f}",
                         f"{r.get('host_numel', 0) / max(1, r.get('local_numel', 1)):.2f}"
                         if "host_numel" in r else "-",
                         str(r.get("pinned", "-")), f"{r.get('early', '-')}/{r.get('at_step', '-')}",
                         f"{r.get('staging_mb', 0):.1f}", diff(ref),
                         diff(twin) if mode != "zero_ext" else "-"])
        n = sum(p.numel() for p in next(iter(runs.values()))["params"]) if runs else 0
        print_table(f"GPT-2 {size} ({n / 1e6:.0f}M params) on {torch.cuda.get_device_name()}, "
                    f"world 1, bf16 autocast, {args.batch} x {args.seq} tokens, "
                    f"{torch.get_num_threads()} host threads: ms per iteration (median of "
                    f"{args.iters}), peak device memory, device state + masters from the "
                    "tensors, host part of the share, pinned host buffers, pieces whose grads "
                    "went to the host from the hook's buckets / at the step (cumulative), "
                    "device staging, max abs param difference to DDP and to zero_ext without "
                    "the option",
                    ["mode", "ms/iter", "x DDP", "peak MB", "state+masters on device MB",
                     "host part", "pinned", "grads early/at step", "staging MB",
                     "vs DDP", "vs zero_ext"], rows)
        results[size] = {m: {k: v for k, v in r.items() if k != "params"}
                         for m, r in runs.items()}
    if args.out:
        with open(os.path.join(args.out, "offload_gpu_check.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
