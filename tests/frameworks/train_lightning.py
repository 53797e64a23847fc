"""PyTorch Lightning on CPU ranks (run under torchrun): the DDP strategy, the ZeRO optimizer
from configure_optimizers (nanoGPT groups, a LambdaLR stepped every step),
gradient_clip_val, ModelCheckpoint every --save-at steps (in the middle of an epoch: the
batches come from a resumable iterable) and, with --resume,
fit(ckpt_path=<run A's checkpoint at save_at>). Nothing zero_ext-specific: Lightning's DDP
strategy consolidates the optimizer state itself. Writes every rank's final params and the
final checkpoint's optimizer state (rank 0) to --out.

--reduce-scatter: zero_ext's reduce_scatter_hook on Lightning's DDP model, with state None
(it finds the optimizer by the params). Lightning 2.6 registers DDPStrategy(ddp_comm_hook=...)
only on CUDA devices and ignores it on CPU, so on CPU the module registers it itself in
on_fit_start (after the DDP wrap, before the first backward). configure_gradient_clipping
calls the optimizer's own clip_grad_norm_ (Lightning's default clip is torch's, which the
hook's grads do not allow; --torch-clip keeps it, to see the error)."""
from __future__ import annotations

import argparse
import os

import torch
from common import exit_now, param_groups, sequences, TinyLM, write_result  # noqa: I001


class ResumableBatches:
    """This rank's batches of a seeded per-epoch shuffle, with state_dict/load_state_dict:
    Lightning saves the position in its checkpoints and restores it, so a run resumed in
    the middle of an epoch sees the batches the uninterrupted run saw (a plain DataLoader
    restarts the epoch: Lightning warns that the results are then unreliable)."""

    def __init__(self, data: torch.Tensor, batch: int, rank: int, world: int):
        self.data, self.batch, self.rank, self.world = data, batch, rank, world
        self.epoch = self.pos = self._resume_at = 0

    def __len__(self) -> int:
        return len(self.data) // (self.batch * self.world)

    def __iter__(self):
        perm = torch.randperm(len(self.data), generator=torch.Generator().manual_seed(
            1000 + self.epoch))
        start, self._resume_at = self._resume_at, 0
        for k in range(start, len(self)):
            first = (k * self.world + self.rank) * self.batch
            self.pos = k + 1
            yield (self.data[perm[first:first + self.batch]],)
        self.epoch, self.pos = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self._resume_at = sd["epoch"], sd["pos"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-at", type=int, default=4)
    ap.add_argument("--resume-from", default=None)
    ap.add_argument("--sharding", default="flat")
    ap.add_argument("--bucket-view", action="store_true")
    ap.add_argument("--reduce-scatter", action="store_true")
    ap.add_argument("--torch-clip", action="store_true")
    args = ap.parse_args()

    import pytorch_lightning as pl

    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.reduce_scatter.hook import _REDUCERS

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = TinyLM()
            self.losses: list = []

        def training_step(self, batch, _):
            loss = self.net(batch[0])
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            opt = ZeroRedundancyOptimizer(param_groups(self.net), torch.optim.AdamW,
                                          lr=3e-3, sharding=args.sharding,
                                          parameters_as_bucket_view=args.bucket_view)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def on_fit_start(self):
            if args.reduce_scatter:  # on CPU Lightning does not register DDPStrategy's hook
                from zero_ext.ddp_zero_hook import reduce_scatter_hook

                self.trainer.strategy.model.register_comm_hook(None, reduce_scatter_hook)

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                        gradient_clip_algorithm=None):
            if args.reduce_scatter and not args.torch_clip:
                optimizer.clip_grad_norm_(gradient_clip_val)
            else:
                super().configure_gradient_clipping(optimizer, gradient_clip_val,
                                                    gradient_clip_algorithm)

    pl.seed_everything(0)
    module = Module()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dl = ResumableBatches(sequences(256, seed=2), 8, rank, world)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.save_at,
                                        save_top_k=-1, filename="{step}")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps,
                         gradient_clip_val=0.5, callbacks=[ckpt], logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         deterministic=True, use_distributed_sampler=False)
    trainer.fit(module, dl, ckpt_path=args.resume_from)
    final = os.path.join(args.ckpt_dir, f"step={args.steps}.ckpt")
    sd = (torch.load(final, weights_only=False)["optimizer_states"][0] if rank == 0
          else None)
    write_result(args.out, rank, module.net.parameters(), sd,
                 {"losses": module.losses,
                  "sharding": trainer.optimizers[0].sharding,
                  "hook_ran": trainer.optimizers[0] in _REDUCERS})


if __name__ == "__main__":
    main()
    exit_now(0)
