"""flatten_into / unflatten_from: compiled kernels against the pure-PyTorch references.

Copies are exact, so every comparison is bitwise (tolerance 0) for every dtype.
"""
import os

import pytest
import torch

from zero_ext.kernels import flatten as F
from zero_ext.kernels._loader import native_available

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SENTINEL = 7


def _native(device):
    return native_available("flatten_into", device)


def _make(shape, dtype, device, gen):
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    low = 0 if dtype == torch.uint8 else -1000
    return torch.randint(low, 250, shape, generator=gen).to(dtype=dtype, device=device)


def _case(name, dtype, device):
    """(tensors, offsets, flat size) of a named test case."""
    gen = torch.Generator().manual_seed(CASES.index(name))
    align = F.alignment_elems(dtype)
    if name == "empty_list":
        return [], [], 8
    if name == "zero_numel":
        ts = [_make((0,), dtype, device, gen), _make((3, 0), dtype, device, gen)]
    elif name == "one":
        ts = [_make((1,), dtype, device, gen)]
    elif name == "scalar":
        ts = [_make((), dtype, device, gen), _make((2,), dtype, device, gen)]
    elif name == "4097":
        ts = [_make((4097,), dtype, device, gen)]
    elif name == "many":
        sizes = torch.randint(0, 300, (257,), generator=gen).tolist()
        ts = [_make((s,), dtype, device, gen) for s in sizes]
    elif name == "large_and_small":  # spans several parallel chunks / CUDA blocks
        ts = [_make((3,), dtype, device, gen), _make((300_001,), dtype, device, gen),
              _make((5, 7), dtype, device, gen), _make((70_000,), dtype, device, gen)]
    elif name == "noncontiguous":
        base = _make((9, 12), dtype, device, gen)
        ts = [base.t(), base[:, ::3], _make((4,), dtype, device, gen),
              _make((5,), dtype, device, gen).expand(3, 5), base[2:5, 1:4]]
    elif name == "gaps":  # unaligned offsets with holes between the ranges
        ts = [_make((s,), dtype, device, gen) for s in (5, 1, 17, 0, 33)]
        offsets = [3, 11, 13, 40, 41]
        return ts, offsets, 80
    else:
        raise KeyError(name)
    offsets, total = F.aligned_offsets([t.numel() for t in ts], align)
    return ts, offsets, total + 2 * align  # a tail that must stay untouched


CASES = ["empty_list", "zero_numel", "one", "scalar", "4097", "many", "large_and_small",
         "noncontiguous", "gaps"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("case", CASES)
def test_flatten_unflatten_match_reference(case, dtype, device):
    ts, offsets, size = _case(case, dtype, device)
    flat = torch.full((size,), SENTINEL, dtype=dtype, device=device)
    expected = flat.clone()
    F.flatten_into(ts, flat, offsets)
    F.flatten_into_reference(ts, expected, offsets)
    assert torch.equal(flat, expected)
    covered = torch.zeros(size, dtype=torch.bool)
    for t, off in zip(ts, offsets):
        covered[off:off + t.numel()] = True
    assert bool((flat.cpu()[~covered] == SENTINEL).all()), "bytes outside the ranges changed"

    # Back: into fresh destinations, strided ones included (not for expanded sources).
    outs = []
    for t in ts:
        if t.dim() == 2 and t.stride(0) != 0 and not t.is_contiguous():
            outs.append(torch.zeros(t.shape[::-1], dtype=dtype, device=device).t())
        else:
            outs.append(torch.zeros(t.shape, dtype=dtype, device=device))
    outs_ref = [o.clone() for o in outs]
    F.unflatten_from(flat, outs, offsets)
    F.unflatten_from_reference(flat, outs_ref, offsets)
    for t, o, r in zip(ts, outs, outs_ref):
        assert torch.equal(o, r)
        assert torch.equal(o, t.contiguous())


@pytest.mark.parametrize("device", DEVICES)
def test_views_of_flat_and_params_that_require_grad(device):
    # Params already turned into views of flat are skipped; leaves requiring grad are fine.
    flat = torch.arange(64, dtype=torch.float32, device=device)
    views = [flat[0:8].view(2, 4), flat[8:24]]
    F.flatten_into(views, flat, [0, 8])
    assert torch.equal(flat, torch.arange(64, dtype=torch.float32, device=device))
    params = [torch.zeros(2, 4, device=device, requires_grad=True),
              torch.zeros(16, device=device, requires_grad=True)]
    F.unflatten_from(flat, params, [0, 8])
    assert torch.equal(params[1].detach(), flat[8:24])
    F.flatten_into(params, flat, [40, 48])
    assert torch.equal(flat[40:64], torch.arange(24, dtype=torch.float32, device=device))


BAD = {
    "dtype": (lambda d: ([torch.zeros(4, dtype=torch.float64, device=d)], [0]), "has dtype"),
    "offset_past_end": (lambda d: ([torch.zeros(4, device=d)], [14]), "does not fit in flat"),
    "negative_offset": (lambda d: ([torch.zeros(4, device=d)], [-1]), "does not fit in flat"),
    "count_mismatch": (lambda d: ([torch.zeros(4, device=d)], [0, 4]), "1 tensors but 2 offsets"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["wrapper", "reference"])
@pytest.mark.parametrize("bad", sorted(BAD))
def test_bad_input_messages(bad, impl, device):
    make, message = BAD[bad]
    ts, offsets = make(device)
    flat = torch.zeros(16, device=device)
    flatten = F.flatten_into if impl == "wrapper" else F.flatten_into_reference
    unflatten = F.unflatten_from if impl == "wrapper" else F.unflatten_from_reference
    with pytest.raises(RuntimeError, match=f"flatten_into: .*{message}"):
        flatten(ts, flat, offsets)
    with pytest.raises(RuntimeError, match=f"unflatten_from: .*{message}"):
        unflatten(flat, ts, offsets)


@pytest.mark.parametrize("impl", ["wrapper", "reference"])
def test_bad_flat(impl):
    flatten = F.flatten_into if impl == "wrapper" else F.flatten_into_reference
    ts = [torch.zeros(2)]
    with pytest.raises(RuntimeError, match="flat must be 1-D"):
        flatten(ts, torch.zeros(4, 4), [0])
    with pytest.raises(RuntimeError, match="flat must be contiguous"):
        flatten(ts, torch.zeros(8)[::2], [0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_side_stream():
    # The kernel and its metadata copy run on the current stream, not the default one.
    gen = torch.Generator().manual_seed(1)
    ts = [torch.randn(n, generator=gen).cuda() for n in (5, 40_000, 1, 333)]
    offsets, total = F.aligned_offsets([t.numel() for t in ts], 4)
    flat = torch.zeros(total, device="cuda")
    outs = [torch.empty_like(t) for t in ts]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            F.flatten_into(ts, flat, offsets)
            F.unflatten_from(flat, outs, offsets)
    stream.synchronize()
    for t, o in zip(ts, outs):
        assert torch.equal(t, o)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("memcpy_from", [None, "0", "4096", str(1 << 62)],
                         ids=["default", "all-memcpy", "4KiB", "no-memcpy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8],
                         ids=lambda d: str(d).replace("torch.", ""))
def test_cuda_large_tensors_one_copy_each(memcpy_from, dtype, monkeypatch):
    """Tensors from ZERO_EXT_FLATTEN_MEMCPY_BYTES bytes on (8 MiB by default) are one
    cudaMemcpyAsync each, the others one kernel: mixed in one call, at odd offsets, with
    non-contiguous ones and a tail that must stay untouched, on a side stream."""
    if memcpy_from is None:
        monkeypatch.delenv("ZERO_EXT_FLATTEN_MEMCPY_BYTES", raising=False)
    else:
        monkeypatch.setenv("ZERO_EXT_FLATTEN_MEMCPY_BYTES", memcpy_from)
    gen = torch.Generator().manual_seed(5)
    big = (9 << 20) // torch.empty((), dtype=dtype).element_size() + 3  # > 8 MiB
    ts = [_make((s,), dtype, "cuda", gen) for s in (5, big, 1, 4099, 300_001)]
    ts.append(_make((40, 30), dtype, "cuda", gen).t())
    offsets, total = [], 1
    for t in ts:  # odd offsets: every pointer unaligned
        offsets.append(total)
        total += t.numel() + 1
    flat = torch.full((total + 5,), SENTINEL, dtype=dtype, device="cuda")
    expected = flat.clone()
    outs = [torch.zeros(t.shape, dtype=dtype, device="cuda") for t in ts]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        F.flatten_into(ts, flat, offsets)
        F.unflatten_from(flat, outs, offsets)
    stream.synchronize()
    F.flatten_into_reference(ts, expected, offsets)
    assert torch.equal(flat, expected)
    for t, o in zip(ts, outs):
        assert torch.equal(o, t)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_device_mismatch_message():
    with pytest.raises(RuntimeError, match="is on cpu but flat is on cuda"):
        F.flatten_into([torch.zeros(2)], torch.zeros(4, device="cuda"), [0])


def test_reference_is_the_default_kernel(tmp_path):
    """Without the native library (ZERO_EXT_REFERENCE=1 never loads it) torch.ops.zero_ext.*
    still exist and run the references, registered as the ops' default kernels."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import torch
        from zero_ext.kernels import flatten as F, native_status
        assert not native_status()["native"]
        assert not torch._C._dispatch_has_kernel_for_dispatch_key("zero_ext::flatten_into", "CPU")
        ts = [torch.randn(3, 2), torch.randn(5)]
        flat = torch.zeros(16)
        F.flatten_into(ts, flat, [0, 8])
        assert torch.equal(flat[0:6], ts[0].reshape(-1)) and torch.equal(flat[8:13], ts[1])
        out = [torch.empty(3, 2), torch.empty(5)]
        torch.ops.zero_ext.unflatten_from(flat, out, [0, 8])
        assert torch.equal(out[0], ts[0]) and torch.equal(out[1], ts[1])
        print("OK")
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, ZERO_EXT_REFERENCE="1", PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


def test_fake_kernels_check_inputs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        flat = torch.empty(8)
        torch.ops.zero_ext.flatten_into([torch.empty(2, 2)], flat, [4])  # fits
        with pytest.raises(RuntimeError, match="dtype"):
            torch.ops.zero_ext.flatten_into([torch.empty(2, dtype=torch.float64)], flat, [0])
        with pytest.raises(RuntimeError, match="offsets"):
            torch.ops.zero_ext.unflatten_from(flat, [torch.empty(2)], [0, 2])
        with pytest.raises(RuntimeError, match="does not fit"):
            torch.ops.zero_ext.flatten_into([torch.empty(5)], flat, [4])


@pytest.mark.parametrize("dtype,expected", [(torch.float32, 4), (torch.bfloat16, 8),
                                            (torch.float16, 8), (torch.float64, 2),
                                            (torch.int64, 2), (torch.uint8, 16),
                                            (torch.complex128, 1)])
def test_alignment_elems(dtype, expected):
    assert F.alignment_elems(dtype) == expected


def test_aligned_offsets():
    assert F.aligned_offsets([], 4) == ([], 0)
    assert F.aligned_offsets([0], 4) == ([0], 0)
    assert F.aligned_offsets([3, 0, 5, 4, 1], 4) == ([0, 4, 4, 12, 16], 20)
    assert F.aligned_offsets([3, 5], 1) == ([0, 3], 8)
    with pytest.raises(ValueError):
        F.aligned_offsets([3], 0)
    with pytest.raises(ValueError):
        F.aligned_offsets([-1], 4)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    if not _native(device):
        pytest.skip(f"native zero_ext ops unavailable on {device}")
    gen = torch.Generator().manual_seed(0)
    ts = [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen).expand(2, 5),
          torch.randn(7, generator=gen)]
    ts = [t.to(device) for t in ts]
    offsets, total = F.aligned_offsets([t.numel() for t in ts], 4)
    flat = torch.zeros(total, device=device)
    torch.library.opcheck(torch.ops.zero_ext.flatten_into.default, (ts, flat, offsets))
    outs = [torch.empty(3, 4, device=device), torch.empty(10, device=device),
            torch.empty(7, device=device)]
    torch.library.opcheck(torch.ops.zero_ext.unflatten_from.default, (flat, outs, offsets))
