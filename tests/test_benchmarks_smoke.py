"""Smoke run of benchmarks/bench_iteration.py (--quick, world 2, the MLP): every mode is in its
table, and the counted bytes, which are deterministic, are what each mode should send:
DDP a ring all-reduce of the model, torch's ZeRO 1.5x that, and the reduce-scatter mode
DDP's bulk bytes (its all_to_all + the exchange) plus only a few scalar all-reduces (the
clip's norm, the step's agreement). Wall-clock times are printed, never asserted."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _dist import gloo_available

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with gloo")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("ddp", "torch_zero", "zero_ext", "zero_ext_rs", "zero_ext_overlap")
CONTROL_BYTES = 1024  # scalar all-reduces (norm, agreement) of a few numbers per iteration


def _table_rows(markdown: str, header_start: str) -> dict[str, list[str]]:
    """First-column -> cells of the markdown table whose header starts with header_start."""
    rows, inside = {}, False
    for line in markdown.splitlines():
        if line.startswith("| " + header_start):
            inside = True
            continue
        if inside and line.startswith("|-"):
            continue
        if inside and line.startswith("| "):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells
        elif inside:
            break
    return rows


def test_bench_iteration_quick(tmp_path):
    out, js = tmp_path / "table.md", tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_iteration.py"), "--quick",
         "--world", "2", "--model", "mlp", "--out", str(out), "--json", str(js)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _table_rows(out.read_text(), "mode ")
    labels = {label.split(" (")[0]: cells for label, cells in rows.items()}
    assert set(labels) == set(MODES), rows.keys()
    assert labels["ddp"][2] == "1.00x"  # the baseline's own ratio
    assert float(labels["zero_ext_rs"][4].rstrip("x")) <= 1.0, labels["zero_ext_rs"]

    (summary,) = json.loads(js.read_text())
    world, numel = summary["world"], summary["numel"]
    sent = {label.split(" (")[0]: r for label, r in summary["rows"].items()}
    ddp = sent["ddp"]["sent_mean"]
    assert ddp == 2 * (world - 1) / world * numel * 4  # allreduce_hook counted DDP's reduce
    assert sent["torch_zero"]["sent_mean"] == 1.5 * ddp
    rs = sent["zero_ext_rs"]
    assert "all_to_all_single" in rs["calls"], rs["calls"]  # the grads went through the hook
    bulk = sum(rs["calls"][k][1] for k in ("all_to_all_single", "broadcast"))
    assert bulk <= ddp, (bulk, ddp)
    assert rs["sent_max"] - bulk <= CONTROL_BYTES, rs["calls"]
    assert rs["sent_mean"] <= ddp + CONTROL_BYTES
    # the modes that step the same batches agree with DDP + AdamW
    for mode in ("torch_zero", "zero_ext", "zero_ext_rs"):
        assert sent[mode]["max_abs_diff"] <= 1e-5, (mode, sent[mode]["max_abs_diff"])


def test_bench_scale_reduce_scatter_bytes(tmp_path):
    """bench_scale.py's reduce-scatter rows at world 8 and 64 (fake process group): the
    hook's all_to_all sends (W-1)/W of the model per rank on average, every rank the same in
    flat mode, and with the exchange the iteration costs DDP's bytes (to a few scalars)."""
    js = tmp_path / "scale.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_scale.py"), "--quick",
         "--models", "gpt2-small", "--worlds", "8", "64", "--no-torch", "--no-checkpoint",
         "--json", str(js)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [r for r in json.loads(js.read_text()) if "a2a_calls" in r]
    assert {(r["world"], r["sharding"]) for r in rows} == {
        (w, s) for w in (8, 64) for s in ("param", "flat")}
    for r in rows:
        world, model_bytes = r["world"], r["elements"] * 4
        assert r["a2a_mean"] == (world - 1) / world * model_bytes, r
        assert r["a2a_calls"] > 1  # one per DDP bucket
        if r["sharding"] == "flat":
            assert r["a2a_max"] == r["a2a_mean"], r
        assert r["sent_mean"] <= r["ddp"] + CONTROL_BYTES * world, r
