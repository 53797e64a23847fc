"""A two-node launch on one machine: two torchrun "nodes" of 2 ranks each (c10d rendezvous
on localhost, LOCAL_WORLD_SIZE=2, WORLD_SIZE=4) train examples/train_gpt.py with the
optimizer state sharded within each node and replicated across nodes
(--shard-within-node: zero_ext.hybrid_groups(), DDP over the whole job), checkpointing at
step 6 and 12. A second job on ONE node of 4 ranks resumes from the step-6 checkpoint (the
state now sharded over 4 ranks, in the other sharding mode too) and must end where the
uninterrupted two-node run ended (params within fp32 rounding, the same losses after the
resume); so must a third, on two nodes again. (Not bitwise: at 4 ranks the sum of gloo's
all-reduce depends on where an element sits in DDP's buckets, and DDP rebuilds its buckets
after its first iteration, which a resumed job runs again.)
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_gpt.py")
TIMEOUT_S = 300
STEPS = ["--steps", "12", "--log-every", "6", "--d-model", "32", "--batch-size", "8"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _torchrun_args(nnodes: int, nproc: int, node_rank: int, port: int) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
            "--nproc_per_node", str(nproc), "--node_rank", str(node_rank),
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
            "--rdzv_id", f"zero_ext_test_{port}"]


def _two_nodes(*args: str) -> None:
    """Both "nodes" at once; each is a torchrun agent of 2 ranks."""
    port = _free_port()
    procs = [subprocess.Popen(_torchrun_args(2, 2, n, port) + [EXAMPLE, *args], env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in (0, 1)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for n, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {n} failed ({p.returncode}):\n{out[-6000:]}"


def _one_node(*args: str) -> str:
    res = subprocess.run(_torchrun_args(1, 4, 0, _free_port()) + [EXAMPLE, *args],
                         env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert res.returncode == 0, f"one node of 4 failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    return res.stdout


@pytest.fixture(scope="module")
def runs():
    tmp = tempfile.mkdtemp(prefix="zero_ext_multinode_")
    try:
        ck = os.path.join(tmp, "ckpt")
        _two_nodes(*STEPS, "--shard-within-node", "--sharding", "flat", "--ckpt", ck,
                   "--save-every", "6", "--final", os.path.join(tmp, "two_nodes.pt"))
        one = _one_node(*STEPS, "--shard-within-node", "--sharding", "param", "--resume-from",
                        os.path.join(ck, "step-6"), "--final", os.path.join(tmp, "one_node.pt"))
        _two_nodes(*STEPS, "--shard-within-node", "--sharding", "flat", "--resume-from",
                   os.path.join(ck, "step-6"), "--final", os.path.join(tmp, "two_again.pt"))
        load = lambda n: torch.load(os.path.join(tmp, n), weights_only=True)  # noqa: E731
        meta = torch.load(os.path.join(ck, "step-6", "optimizer", "zero_ext_meta.pt"),
                          weights_only=True)
        yield {"two": load("two_nodes.pt"), "one": load("one_node.pt"),
               "again": load("two_again.pt"), "meta": meta, "one_log": one,
               "saved": sorted(os.listdir(ck))}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_two_nodes_checkpoint_once_per_shard(runs):
    assert runs["saved"] == ["step-12", "step-6"]
    meta = runs["meta"]
    assert meta["world_size"] == 2 and meta["replicas"] == 2  # sharded per node, 2 nodes


def _same_run(two, other):
    for name, w in two["model"].items():
        torch.testing.assert_close(other["model"][name], w, atol=1e-6, rtol=1e-6,
                                   msg=lambda m: f"{name}: {m}")
    assert len(other["losses"]) == 6
    for a, b in zip(two["losses"][6:], other["losses"]):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (two["losses"][6:], other["losses"])


def test_resume_on_one_node_of_four_matches_the_two_node_run(runs):
    assert "resumed from" in runs["one_log"] and "step-6" in runs["one_log"]
    _same_run(runs["two"], runs["one"])


def test_resume_on_two_nodes_matches(runs):
    _same_run(runs["two"], runs["again"])
