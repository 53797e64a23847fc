"""offload_optimizer's host step and its device-host copies, against DeepSpeedCPUAdam (the
step of DeepSpeed's ZeRO-Offload) and torch's fused CPU AdamW, on one rank's share.

    python benchmarks/bench_offload.py                    # the three sets, CPU, 2 threads
    python benchmarks/bench_offload.py --quick            # smaller sets, a smoke run
    python benchmarks/bench_offload.py --device cuda      # params on a GPU (gpu_check.sh)

Sets (float32, weight decay 0.1; the share of one rank at world 1, i.e. the whole set):
  "4 x 16M"            four tensors of 16M elements
  "GPT-2 small, 4 layers"  GPT-2 small's shapes at depth 4 (52 tensors, 67.7M elements)
  "20000 x 1024"       many small tensors

Part "step" (ms per step, every variant in turns in one process, median): the host step of
``ZeroRedundancyOptimizer(..., offload_optimizer=True)`` alone (its fused C++ AdamW over the
host keys and the packed host state, after one full step made and packed the state; the
copies are timed apart, below), zero_ext's FusedAdamW on the set's own tensors (the same
kernel on state scattered over as many allocations as there are tensors), DeepSpeedCPUAdam
(adamw_mode) on the set's tensors and on one flat tensor (how ZeRO-Offload lays out a
rank's partition), torch.optim.AdamW(fused=True) likewise, and a copy moving the same 28
bytes per element (AdamW reads param, grad, exp_avg, exp_avg_sq and writes three of them).
DeepSpeed is an optional peer: without it (``pip install --no-deps deepspeed`` plus hjson
py-cpuinfo msgpack einops; its cpu_adam op JIT-builds at first use, 5-11 min on 2 cores)
its rows are skipped with a line. The table's ratios are to the offload host step; the
last table gives, per set, the host step's GB/s and that over the "4 x 16M" set's (the
target: 20000 x 1024 at >= 80% of it; the first set's host step is timed again in the
rounds of every later set, so that the load's changes between sets do not enter the ratio)
and the ratios of DeepSpeedCPUAdam's time on the same
tensors (the target: >= 1.0 on every set) and on one flat tensor to it.

Part "copies": the offload's device-host copies of one step, apart: the pull (the share's
grads and param values device -> host, packed through the staging) and the push (the
updated params host -> device), each against a plain ``copy_`` of the same bytes between
the same kinds of memory (on the CPU both are memory copies; on a GPU pinned host memory
over the link). Machines are noisy: compare ratios from one run only.

Part "hook": what reduce_scatter_hook's early copies of the grads cost, with the
fingerprints that let the step notice grads changed since (through ``.data``: no version
counter moves) and without them (the copies trusted, as before the check; wrong after such
an edit). "hook": the copies of every host piece's grad as the hook makes them (one bucket
of the whole share), with and without the fingerprint of each window; "hook + step": those
copies and then the step's pull (the params' values device -> host, and the step's check of
the early copies: every window fingerprinted again from the grads and compared), with and
without; and the pull without early copies (every grad copied at the step) for scale.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from common import print_table, time_interleaved  # noqa: E402
from model_shapes import gpt2_shapes  # noqa: E402

BYTES = 28  # fp32 AdamW per element
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
HOST = "zero_ext offload host step"


def sets(quick: bool):
    div = 16 if quick else 1
    gpt = [s for _, s in gpt2_shapes("small", width_div=4 if quick else 1)[:2 + 4 * 12]]
    gpt += [s for _, s in gpt2_shapes("small", width_div=4 if quick else 1)[-2:]]
    return [("4 x 16M" if not quick else "4 x 1M", [((16 << 20) // div,)] * 4),
            ("GPT-2 small, 4 layers" + (" (width / 4)" if quick else ""), gpt),
            (f"{20000 // div} x 1024", [(1024,)] * (20000 // div))]


def deepspeed_adam():
    """DeepSpeedCPUAdam, or the reason it is not usable here."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # noqa: BLE001 - an optional peer
        return None, f"{type(exc).__name__}: {exc}"
    return DeepSpeedCPUAdam, None


def _params(shapes, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in shapes:
        p = torch.nn.Parameter(torch.empty(s).uniform_(-1, 1, generator=g).to(device))
        p.grad = torch.empty(s).normal_(0, 1e-2, generator=g).to(device)
        out.append(p)
    return out


def _flat(params):
    flat = torch.nn.Parameter(torch.cat([p.detach().reshape(-1).cpu() for p in params]))
    flat.grad = torch.cat([p.grad.reshape(-1).cpu() for p in params])
    return flat


def offload_optimizer(params):
    """ZeroRedundancyOptimizer(offload_optimizer=True) at world 1 over `params`, one full
    step taken (state made, then packed at the second pull), the host keys' grads set."""
    from zero_ext import ZeroRedundancyOptimizer

    opt = ZeroRedundancyOptimizer([dict(params=params, **HP)], torch.optim.AdamW,
                                  offload_optimizer=True)
    opt.step()
    opt.step()  # (the state made by the first step is packed by the second)
    host = opt._offload
    assert host.numel == sum(p.numel() for p in params)
    opt._host_pull()
    host.wait()
    return opt


def host_step_fn(opt):
    """The offload's host step alone (the fused engine's run; torch's step where there is no
    compiled CPU kernel)."""
    if opt._fused_kernel_usable is False:
        return lambda: opt.optim.step()
    stepper = opt._fused_step()
    return lambda: stepper.run()


def bench_step(title, shapes, device, args, DS, reference=None):
    """`reference`: (name, fn, numel) of the first set's host step, timed in the same rounds
    (its GB/s is the bandwidth the set's is compared with, whatever the load does between
    sets)."""
    params = _params(shapes, device)
    total = sum(p.numel() for p in params)
    cpu_params = params if device == "cpu" else _params(shapes, "cpu")
    opt = offload_optimizer(params)
    fns = {HOST: host_step_fn(opt)}
    from zero_ext import FusedAdamW

    ours_sep = FusedAdamW(cpu_params, **HP)
    fns["zero_ext FusedAdamW (separate tensors)"] = ours_sep.step
    flat = _flat(cpu_params)
    torch_sep = torch.optim.AdamW(cpu_params, fused=True, **HP)
    torch_flat = torch.optim.AdamW([flat], fused=True, **HP)
    fns["torch AdamW fused (separate tensors)"] = torch_sep.step
    fns["torch AdamW fused (one flat tensor)"] = torch_flat.step
    if DS is not None:
        ds_sep = DS(cpu_params, adamw_mode=True, **HP)
        ds_flat = DS([flat], adamw_mode=True, **HP)
        fns["DeepSpeedCPUAdam (separate tensors)"] = ds_sep.step
        fns["DeepSpeedCPUAdam (one flat tensor)"] = ds_flat.step
    src = torch.ones(total * BYTES // 8)
    dst = torch.empty_like(src)
    fns["memory copy, same bytes"] = lambda: dst.copy_(src)
    if reference is not None:
        fns[reference[0]] = reference[1]
    res = time_interleaved(fns, reps=args.reps, warmup=1, max_seconds={k: args.max_seconds
                                                                      for k in fns})
    t = {k: r[args.stat] for k, r in res.items()}
    elems = {k: reference[2] if reference is not None and k == reference[0] else total
             for k in t}
    rows = [[k, f"{1e3 * res[k]['median']:.1f}", f"{1e3 * res[k]['min']:.1f}",
             f"{v / t[HOST]:.2f}x" if elems[k] == total else "-",
             f"{BYTES * elems[k] / v / 1e9:.1f}"] for k, v in t.items()]
    text = print_table(f"{title}: {total / 1e6:.1f}M fp32 elements in {len(shapes)} tensors, "
                       f"{torch.get_num_threads()} threads (ms per step; ratios and GB/s from "
                       f"the {args.stat}; time / the offload host step's: above 1 is slower)",
                       ["variant", "ms median", "ms min", "x offload host step",
                        "GB/s at 28 B/elem"], rows)
    del opt, fns, params, cpu_params, flat, src, dst
    gc.collect()
    return t, total, text


def bench_copies(title, shapes, device, args):
    """The pull and the push of one step, against a plain copy_ of the same bytes."""
    params = _params(shapes, device)
    opt = offload_optimizer(params)
    host = opt._offload
    total = sum(p.numel() for p in params)
    nb = device == "cuda"
    dev_src = torch.ones(2 * total, device=device)  # grads + params, fp32
    host_dst = torch.empty(2 * total, pin_memory=nb)
    host_src = torch.ones(total, pin_memory=nb)
    dev_dst = torch.empty(total, device=device)

    def pull():
        host.pull(set())
        host.wait()

    fns = {"offload pull (grads + params, device -> host)": pull,
           "plain copy_, same bytes, device -> host":
               lambda: host_dst.copy_(dev_src, non_blocking=nb),
           "offload push (params, host -> device)": host.push,
           "plain copy_, same bytes, host -> device":
               lambda: dev_dst.copy_(host_src, non_blocking=nb)}
    res = time_interleaved(fns, reps=args.reps, warmup=1, device=device,
                           max_seconds={k: args.max_seconds for k in fns})
    t = {k: r[args.stat] for k, r in res.items()}
    keys = list(t)
    rows = []
    for k in keys:
        nbytes = 8 * total if "device -> host" in k else 4 * total
        plain = t[keys[1]] if "device -> host" in k else t[keys[3]]
        rows.append([k, f"{1e3 * t[k]:.2f}", f"{nbytes / t[k] / 1e9:.1f}", f"{t[k] / plain:.2f}x"])
    text = print_table(f"{title}: device-host copies of one step ({device})",
                       ["copy", "ms", "GB/s", "x plain copy_"], rows)
    opt._offload.detach_grads()
    del opt, params
    gc.collect()
    return text


def bench_hook(title, shapes, device, args):
    """The hook's early grad copies and the step's pull after them, with and without the
    fingerprints (see the module docstring, part "hook")."""
    from zero_ext import kernels, offload

    params = _params(shapes, device)
    opt = offload_optimizer(params)
    host = opt._offload
    mine = [(s, params[s.param_id].grad) for s in host.slots]
    early_valid = {s.param_id for s in host.slots}
    real_fp, real_check = offload._fingerprint_window, offload.HostShard._check_early

    def no_fp(b, w, srcs, out):  # (what _to_host then needs of it: the packed flatten)
        if not w.direct:
            kernels.flatten.flatten_into(srcs, offload._staging(b, True), w.rel)

    def no_check(self, early, grads):
        self._hook_windows = []
        return early

    def variant(fn, check: bool):
        def run():
            offload._fingerprint_window = real_fp if check else no_fp
            offload.HostShard._check_early = real_check if check else no_check
            try:
                fn()
            finally:
                offload._fingerprint_window, offload.HostShard._check_early = \
                    real_fp, real_check
        return run

    def hook():
        host.end_step()
        host._copy_bucket(list(mine))
        host.wait()

    def hook_and_step():
        hook()
        host.pull(early_valid)
        host.wait()

    def step_only():
        host.end_step()
        host.pull(set())
        host.wait()

    fns = {"hook's copies, with fingerprints": variant(hook, True),
           "hook's copies, without": variant(hook, False),
           "hook + step's pull, with the check": variant(hook_and_step, True),
           "hook + step's pull, without": variant(hook_and_step, False),
           "step's pull alone, no early copies": step_only}
    res = time_interleaved(fns, reps=args.reps, warmup=1, device=device,
                           max_seconds={k: args.max_seconds for k in fns})
    host.end_step()
    assert host.sent_again == 0  # (nothing changed the grads: no window sent twice)
    t = {k: r[args.stat] for k, r in res.items()}
    keys = list(t)
    rows = [[k, f"{1e3 * t[k]:.2f}",
             f"{t[k] / t[keys[i + 1]]:.2f}x" if i in (0, 2) else ""]
            for i, k in enumerate(keys)]
    text = print_table(f"{title}: the hook's early grad copies and the step's pull after "
                       f"them, with and without the fingerprints ({device})",
                       ["variant", "ms", "with / without"], rows)
    opt._offload.detach_grads()
    del opt, params
    gc.collect()
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the params (and their grads) live")
    ap.add_argument("--parts", default="step,copies,hook")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--max-seconds", type=float, default=20.0,
                    help="per variant and set: it drops out after that (3 calls at least)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--stat", default="min", choices=["min", "median"],
                    help="what the ratios use: the min resists other processes' load on a "
                    "shared machine, the median shows it")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    parts = args.parts.split(",")
    DS, why = deepspeed_adam() if "step" in parts else (None, "")
    texts = []
    if "step" in parts and DS is None:
        line = f"# DeepSpeedCPUAdam skipped (not usable here: {why})"
        print(line, flush=True)
        texts.append(line)
    summary = []
    reference = None  # the first set's host step, kept for the next sets' rounds
    for title, shapes in sets(args.quick):
        if "step" in parts:
            t, total, text = bench_step(title, shapes, args.device, args, DS, reference)
            texts.append(text)
            gbs = BYTES * total / t[HOST] / 1e9
            if reference is None:
                base = gbs
                ref_params = _params(shapes, args.device)
                ref_opt = offload_optimizer(ref_params)
                reference = (f"reference: the host step of {title}, per element",
                             host_step_fn(ref_opt), sum(p.numel() for p in ref_params))
            else:
                base = BYTES * reference[2] / t[reference[0]] / 1e9
            ds_sep = t.get("DeepSpeedCPUAdam (separate tensors)")
            ds_flat = t.get("DeepSpeedCPUAdam (one flat tensor)")
            torch_best = min(v for k, v in t.items() if k.startswith("torch"))
            summary.append([title, f"{gbs:.1f}", f"{100 * gbs / base:.0f}%",
                            f"{ds_sep / t[HOST]:.2f}x" if ds_sep else "-",
                            f"{ds_flat / t[HOST]:.2f}x" if ds_flat else "-",
                            f"{torch_best / t[HOST]:.2f}x"])
        if "copies" in parts:
            texts.append(bench_copies(title, shapes, args.device, args))
        if "hook" in parts:
            texts.append(bench_hook(title, shapes, args.device, args))
    if summary:
        texts.append(print_table(
            "The offload host step per set: GB/s at 28 B/element, that over the first set's "
            "host step timed in the same rounds (target for many small tensors: >= 80%), "
            "DeepSpeedCPUAdam's time on the set's "
            "tensors over the host step's (target: >= 1.0x) and on one flat tensor of the "
            "same elements (how ZeRO-Offload lays out a partition), and the best of torch's "
            "fused AdamW (separate or flat)",
            ["set", "host step GB/s", "of the first set's", "DeepSpeedCPUAdam same tensors / host",
             "DeepSpeedCPUAdam one flat tensor / host", "torch fused best / host"], summary))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n\n".join(texts) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
