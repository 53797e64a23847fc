"""zero_ext inside the training frameworks, on 2 CPU ranks under torchrun (gloo).

Each framework trains a tiny language model for 8 steps with the ZeRO optimizer, checkpoints
through the framework's own mechanism at step 4 (mid-epoch), and a second job resumes from
that checkpoint: its final params (every rank) and optimizer state must equal the
uninterrupted run's bitwise. The scripts are in tests/frameworks/; the versions are pinned
in requirements-test.txt.

- accelerate: prepare(model, opt, dataloader, scheduler) with default arguments,
  clip_grad_norm_, save_state / load_state (no zero_ext-specific line);
- Hugging Face Trainer: optimizer_cls_and_kwargs, max_grad_norm, save_steps, plus
  ZeroCheckpointCallback; without it every rank's first step names the callback (no hang,
  no checkpoint folder); an optimizer built before TrainingArguments (no process group
  yet) raises ValueError instead of quietly not sharding;
- PyTorch Lightning: DDP strategy, gradient_clip_val, ModelCheckpoint(every_n_train_steps),
  bucket views (no zero_ext-specific line).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "frameworks")
TIMEOUT_S = 300


def _torchrun(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", os.path.join(SCRIPTS, script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=TIMEOUT_S)


def _run_ok(script: str, *args: str) -> None:
    res = _torchrun(script, *args)
    if res.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} failed ({res.returncode}):\n"
                             f"{res.stdout[-3000:]}\n{res.stderr[-6000:]}")


def _load(out: str, rank: int) -> dict:
    return torch.load(os.path.join(out, f"result_{rank}.pt"), weights_only=False)


def _assert_resumed_exactly(a_dir: str, b_dir: str) -> None:
    a = [_load(a_dir, r) for r in range(2)]
    b = [_load(b_dir, r) for r in range(2)]
    for r in range(2):
        for i, (x, y) in enumerate(zip(a[r]["params"], b[r]["params"])):
            assert torch.equal(x, y), f"rank {r} param {i}: resumed run differs"
        for i, (x, y) in enumerate(zip(a[0]["params"], a[r]["params"])):
            assert torch.equal(x, y), f"param {i} differs between rank 0 and rank {r}"
    sa, sb = a[0]["optimizer"], b[0]["optimizer"]
    assert sa is not None and len(sa["state"]) > 0, "no optimizer state was saved"
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        for name, v in sa["state"][k].items():
            w = sb["state"][k][name]
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(w)), (k, name)
    assert [g["lr"] for g in sa["param_groups"]] == [g["lr"] for g in sb["param_groups"]]


@pytest.fixture
def tmp():
    path = tempfile.mkdtemp(prefix="zero_ext_frameworks_")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("hook", [False, True], ids=["ddp-allreduce", "reduce-scatter-hook"])
def test_accelerate_prepare_save_state_load_state(tmp, hook):
    """(reduce-scatter-hook: zero_ext's hook on the prepared model, the optimizer's clip)"""
    pytest.importorskip("accelerate")
    ckpt = os.path.join(tmp, "state")
    common = ["--ckpt", ckpt, "--sharding", "flat"] + (["--reduce-scatter"] if hook else [])
    _run_ok("train_accelerate.py", "--out", os.path.join(tmp, "a"), *common)
    assert os.path.isfile(os.path.join(ckpt, "optimizer.bin"))
    saved = torch.load(os.path.join(ckpt, "optimizer.bin"), weights_only=True)
    assert set(saved) == {"state", "param_groups"} and len(saved["state"]) > 0
    _run_ok("train_accelerate.py", "--out", os.path.join(tmp, "b"), *common, "--resume")
    _assert_resumed_exactly(os.path.join(tmp, "a"), os.path.join(tmp, "b"))
    assert _load(os.path.join(tmp, "a"), 0)["sharding"] == "flat"
    assert _load(os.path.join(tmp, "a"), 1)["hook_ran"] == hook


def test_hf_trainer_checkpoint_and_resume(tmp):
    pytest.importorskip("transformers")
    run_a = os.path.join(tmp, "run_a")
    _run_ok("train_hf_trainer.py", "--out", os.path.join(tmp, "a"), "--run-dir", run_a)
    _run_ok("train_hf_trainer.py", "--out", os.path.join(tmp, "b"), "--run-dir",
            os.path.join(tmp, "run_b"), "--resume-from", os.path.join(run_a, "checkpoint-4"))
    _assert_resumed_exactly(os.path.join(tmp, "a"), os.path.join(tmp, "b"))


def test_hf_trainer_without_the_callback_fails_at_the_first_step(tmp):
    """Trainer saves from the main process only: without the callback, rank 0's
    state_dict() would wait for ranks that never come, with checkpoint-4 half-written.
    Every rank raises at its first step instead, naming the callback, before any
    checkpoint folder exists. (The short rendezvous timeout only bounds a regression: the
    late state_dict()-time error then arrives at step 4, and this test fails.)"""
    pytest.importorskip("transformers")
    out, run_dir = os.path.join(tmp, "a"), os.path.join(tmp, "r")
    res = _torchrun("train_hf_trainer.py", "--out", out, "--run-dir", run_dir, "--no-callback",
                    env={"ZERO_EXT_RENDEZVOUS_TIMEOUT_S": "5", "ZERO_EXT_RENDEZVOUS_WARN_S": "2"})
    assert res.returncode != 0
    assert "ZeroCheckpointCallback" in res.stderr, res.stderr[-4000:]
    for r in range(2):
        assert os.path.isfile(os.path.join(out, f"result_{r}.pt")), \
            f"rank {r} recorded no error:\n{res.stderr[-4000:]}"
        rec = _load(out, r)
        assert "ZeroCheckpointCallback" in rec["error"], (r, rec["error"])
        assert rec["global_step"] == 0, (r, rec["global_step"], rec["error"])
        assert rec["checkpoints"] == [], (r, rec["checkpoints"])
    assert not any(n.startswith("checkpoint-") for n in os.listdir(run_dir))


def test_trainer_check_decides_from_the_trainer_on_the_stack():
    """The first-step check, in one process: a sharded optimizer stepped from inside a
    Trainer that saves optimizer state without the callback raises; with the callback, with
    nothing saved (save_strategy='no', save_only_model), for a world of one (state_dict()
    then needs no other rank) or with no Trainer on the stack, it passes."""
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from transformers import Trainer

    from zero_ext.integrations.transformers import ZeroCheckpointCallback
    from zero_ext.launcher import FirstStepCheck

    class Driving(Trainer):
        def loop(self, opt, check):  # the Trainer's loop calling the optimizer's step
            check(opt, (), {})

    def trainer(callbacks, **args):
        t = Driving.__new__(Driving)  # only what the check reads
        t.args = SimpleNamespace(**{"save_strategy": "steps", "save_only_model": False, **args})
        t.callback_handler = SimpleNamespace(callbacks=callbacks)
        return t

    sharded, single = SimpleNamespace(world_size=2), SimpleNamespace(world_size=1)
    check = FirstStepCheck()
    for _ in range(2):  # not marked done by a failure: the next step raises again
        with pytest.raises(RuntimeError, match="ZeroCheckpointCallback"):
            trainer([]).loop(sharded, check)
    trainer([ZeroCheckpointCallback()]).loop(sharded, FirstStepCheck())
    trainer([], save_strategy="no").loop(sharded, FirstStepCheck())
    trainer([], save_only_model=True).loop(sharded, FirstStepCheck())
    trainer([]).loop(single, FirstStepCheck())
    FirstStepCheck()(sharded, (), {})
    check(sharded, (), {})  # passed once: done, the Trainer is not looked for again
    trainer([]).loop(sharded, check)


def test_hf_trainer_optimizer_built_before_training_arguments(tmp):
    """Under torchrun, TrainingArguments creates the process group: a ZeRO optimizer built
    before it raises ValueError (as torch's does) naming both fixes, on every rank; built
    after it, it shards over the 2 ranks."""
    pytest.importorskip("transformers")
    out = os.path.join(tmp, "a")
    _run_ok("train_hf_trainer.py", "--out", out, "--run-dir", os.path.join(tmp, "r"),
            "--optimizer-before-args")
    for r in range(2):
        rec = _load(out, r)
        err = rec["early_error"]
        assert err is not None and "init_process_group" in err, (r, err)
        assert "optimizer_cls_and_kwargs" in err and "TrainingArguments" in err, (r, err)
        assert rec["world_size_after"] == 2, (r, rec["world_size_after"])


def _lightning_run_and_resume(tmp, *flags):
    """Run A (checkpoints every 4 steps), run B resumed from A's step 4: equal bitwise."""
    pytest.importorskip("pytorch_lightning")
    ck_a = os.path.join(tmp, "ck_a")
    _run_ok("train_lightning.py", "--out", os.path.join(tmp, "a"), "--ckpt-dir", ck_a, *flags)
    _run_ok("train_lightning.py", "--out", os.path.join(tmp, "b"), "--ckpt-dir",
            os.path.join(tmp, "ck_b"), "--resume-from", os.path.join(ck_a, "step=4.ckpt"),
            *flags)
    _assert_resumed_exactly(os.path.join(tmp, "a"), os.path.join(tmp, "b"))


def test_lightning_ddp_checkpoint_and_resume(tmp):
    _lightning_run_and_resume(tmp, "--bucket-view")


def test_lightning_reduce_scatter_hook(tmp):
    """reduce_scatter_hook on Lightning's DDP model (registered in on_fit_start: Lightning
    registers DDPStrategy(ddp_comm_hook=...) on CUDA only) with the optimizer's own clip: the
    same params as Lightning's default DDP run (to fp32 rounding: the clip's norm is summed
    in another order), and a bitwise resume; Lightning's default clip (torch's) with the
    hook is an error naming opt.clip_grad_norm_ on every rank."""
    _lightning_run_and_resume(tmp, "--reduce-scatter")
    assert _load(os.path.join(tmp, "a"), 0)["hook_ran"] and _load(os.path.join(tmp, "b"),
                                                                   1)["hook_ran"]
    _run_ok("train_lightning.py", "--out", os.path.join(tmp, "plain"), "--ckpt-dir",
            os.path.join(tmp, "ck_plain"))
    assert not _load(os.path.join(tmp, "plain"), 0)["hook_ran"]
    for x, y in zip(_load(os.path.join(tmp, "a"), 0)["params"],
                    _load(os.path.join(tmp, "plain"), 0)["params"]):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    res = _torchrun("train_lightning.py", "--out", os.path.join(tmp, "c"), "--ckpt-dir",
                    os.path.join(tmp, "ck_c"), "--reduce-scatter", "--torch-clip")
    assert res.returncode != 0
    assert res.stderr.count("opt.clip_grad_norm_") >= 2, res.stderr[-4000:]  # both ranks
