"""flatten_into / unflatten_from against torch's ways of doing the same copies.

Flatten baselines: ``torch.cat`` of flattened views (allocates, the usual idiom), the same with
``out=`` into a preallocated buffer, and ``torch._utils._flatten_dense_tensors`` (what DDP and
ZeRO bucketing use). Unflatten baselines: one ``copy_`` per tensor, and ``torch._foreach_copy_``.
Every number is a median over repeats taken in this run, so only the ratios mean anything on a
noisy machine. Layouts are packed (alignment 1) so that ``cat(out=)`` writes the same bytes.
The last lines say, for the large tensors (4 x 4M) and GPT-2 small, whether ours is at least
as fast as ``torch.cat`` and the ``copy_`` loop (the target on CUDA, where a tensor of 8 MiB
or more is one ``cudaMemcpyAsync``: ZERO_EXT_FLATTEN_MEMCPY_BYTES moves that bound).

    python benchmarks/bench_flatten.py [--threads 2] [--device cpu|cuda] [--repeats 15]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from zero_ext.kernels import flatten as F  # noqa: E402
from zero_ext.kernels._loader import native_available  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timeit(fn, device, repeats, min_time=0.02):
    """Median seconds per call; each sample loops long enough to dwarf the timer."""
    fn()
    _sync(device)
    inner = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        if time.perf_counter() - t0 >= min_time or inner >= 1 << 14:
            break
        inner *= 2
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


CASES = [  # name, list of shapes, dtype
    ("1000 x 1024 fp32", [(1024,)] * 1000, torch.float32),
    ("1000 x 32x32 bf16", [(32, 32)] * 1000, torch.bfloat16),
    ("1000 mixed small fp32", [((i * 37) % 4096 + 1,) for i in range(1000)], torch.float32),
    ("10000 x 256 fp32", [(256,)] * 10000, torch.float32),
    ("4 x 4M fp32", [(2048, 2048)] * 4, torch.float32),
    ("GPT-2 small fp32", None, torch.float32),
]


def shapes_of(case_shapes):
    if case_shapes is not None:
        return case_shapes
    import model_shapes

    return [s for _, s in model_shapes.gpt2_shapes("small")]


def fmt_us(seconds):
    return f"{seconds * 1e6:10.1f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--device", default="cpu", help="device of the tensors (cpu, cuda)")
    ap.add_argument("--repeats", type=int, default=15,
                    help="timed repetitions per case (median reported)")
    ap.add_argument("--skip-large", action="store_true", help="skip the GPT-2 case")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    native = native_available("flatten_into", device)
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
          f"native kernels: {native}, median of {args.repeats}")
    if not native:
        print("WARNING: native ops unavailable, timing the pure-PyTorch reference")

    print("\nflatten: many tensors -> one flat buffer (us per call; speedup = baseline / ours)")
    head = (f"{'case':24} {'MB':>7} {'ours':>10} {'cat':>10} {'cat(out=)':>10} "
            f"{'flat_dense':>10} {'x cat':>7} {'x cat(out)':>10} {'x dense':>8}")
    print(head)
    print("-" * len(head))
    rows_unflat, summary = [], {}
    for name, case_shapes, dtype in CASES:
        if case_shapes is None and args.skip_large:
            continue
        shapes = shapes_of(case_shapes)
        gen = torch.Generator().manual_seed(0)
        tensors = [torch.randn(s, generator=gen).to(dtype=dtype, device=device) for s in shapes]
        numels = [t.numel() for t in tensors]
        offsets, total = F.aligned_offsets(numels, 1)
        flat = torch.empty(total, dtype=dtype, device=device)
        mb = total * flat.element_size() / 1e6

        ours = timeit(lambda: F.flatten_into(tensors, flat, offsets), device, args.repeats)
        cat = timeit(lambda: torch.cat([t.view(-1) for t in tensors]), device, args.repeats)
        cat_out = timeit(lambda: torch.cat([t.view(-1) for t in tensors], out=flat), device,
                         args.repeats)
        dense = timeit(lambda: torch._utils._flatten_dense_tensors(tensors), device,
                       args.repeats)
        expected = torch.cat([t.view(-1) for t in tensors])
        F.flatten_into(tensors, flat, offsets)
        assert torch.equal(flat, expected), name
        print(f"{name:24} {mb:7.1f} {fmt_us(ours)} {fmt_us(cat)} {fmt_us(cat_out)} "
              f"{fmt_us(dense)} {cat / ours:7.2f} {cat_out / ours:10.2f} {dense / ours:8.2f}")
        summary[name] = [cat / ours]

        outs = [torch.empty_like(t) for t in tensors]
        views = [flat[o:o + n].view(t.shape) for o, n, t in zip(offsets, numels, tensors)]

        def per_tensor():
            for o, v in zip(outs, views):
                o.copy_(v)

        un_ours = timeit(lambda: F.unflatten_from(flat, outs, offsets), device, args.repeats)
        un_loop = timeit(per_tensor, device, args.repeats)
        un_foreach = timeit(lambda: torch._foreach_copy_(outs, views), device, args.repeats)
        rows_unflat.append((name, mb, un_ours, un_loop, un_foreach))
        summary[name].append(un_loop / un_ours)

    print("\nunflatten: one flat buffer -> many tensors (us per call; speedup = baseline / ours)")
    head = (f"{'case':24} {'MB':>7} {'ours':>10} {'copy_ loop':>10} {'foreach':>10} "
            f"{'x loop':>7} {'x foreach':>9}")
    print(head)
    print("-" * len(head))
    for name, mb, un_ours, un_loop, un_foreach in rows_unflat:
        print(f"{name:24} {mb:7.1f} {fmt_us(un_ours)} {fmt_us(un_loop)} {fmt_us(un_foreach)} "
              f"{un_loop / un_ours:7.2f} {un_foreach / un_ours:9.2f}")

    print("\nlarge tensors: ours against torch.cat (flatten) and the copy_ loop (unflatten)")
    for name in ("4 x 4M fp32", "GPT-2 small fp32"):
        if name in summary:
            x_cat, x_loop = summary[name]
            ok = "met" if min(x_cat, x_loop) >= 1.0 else "NOT met"
            print(f"  {name}: {x_cat:.2f}x cat, {x_loop:.2f}x copy_ loop (target >= 1.0: {ok})")


if __name__ == "__main__":
    main()
