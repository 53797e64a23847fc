"""docs/example.md's complete script (even sharding, reduce_scatter_hook, overlap_param_gather,
a schedule, checkpoints, resume), run as it stands on 2 gloo ranks under torchrun: 12 steps
straight, against 6 steps (checkpoint at 6) and a resume to 12. The resume restores the
step and the schedule (the loop continues at step 6, not 0), and ends bitwise where the
uninterrupted run ends."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADING = "## A complete script"


def _script() -> str:
    text = open(os.path.join(ROOT, "docs", "example.md")).read()
    after = text[text.index(HEADING):]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


def _run(tmp_path, *args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(tmp_path / "train.py"), *args]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_the_complete_example_resumes_bitwise(tmp_path):
    (tmp_path / "train.py").write_text(_script())
    _run(tmp_path, "--steps", "12", "--save-every", "100", "--ckpt", "straight",
         "--final", "straight.pt")
    _run(tmp_path, "--steps", "12", "--save-every", "6", "--stop-after", "6", "--ckpt", "ck")
    out = _run(tmp_path, "--steps", "12", "--save-every", "100", "--ckpt", "ck",
               "--final", "resumed.pt")
    assert "resumed at step 6" in out, out
    straight = torch.load(tmp_path / "straight.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert straight["lr"] == resumed["lr"]
    for k, v in straight["model"].items():
        assert torch.equal(v, resumed["model"][k]), k


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_usage_md_contents_cover_every_section():
    text = open(os.path.join(ROOT, "docs", "usage.md")).read()
    first = text.index("\n## ")
    contents = set(re.findall(r"\]\(#([^)]+)\)", text[:first]))
    sections = [line[3:] for line in text.splitlines() if line.startswith("## ")]
    assert [h for h in sections if _slug(h) not in contents] == []
    anchors = {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}
    assert contents <= anchors, contents - anchors


def test_dir_lists_the_lazily_loaded_names():
    import zero_ext

    names = dir(zero_ext)
    for name in zero_ext.__all__ + ["checkpoint", "hybrid", "integrations", "ddp_zero_hook",
                                    "__version__"]:
        assert name in names, name
        getattr(zero_ext, name)  # (each one loads)
