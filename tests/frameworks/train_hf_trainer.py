"""Hugging Face Trainer on CPU ranks (run under torchrun): a tiny GPT-2 built from a config
(no downloads), the ZeRO optimizer through optimizer_cls_and_kwargs (Trainer builds its
decay / no-decay groups and its own LR schedule), max_grad_norm clipping, checkpoints every
--save-at steps with zero_ext.integrations.transformers.ZeroCheckpointCallback, and with
--resume, train(resume_from_checkpoint=<run A's checkpoint-save_at>). Writes every rank's
final params and the final checkpoint's optimizer state (rank 0) to --out.

Two ways to get it wrong, each recorded per rank in --out: --no-callback (the error, the
step it came at, the checkpoint folders left behind) and --optimizer-before-args (the
optimizer built before TrainingArguments, which creates the process group, then after)."""
from __future__ import annotations

import argparse
import os
import traceback

import torch
from common import exit_now, sequences, write_result  # noqa: I001


class Data(torch.utils.data.Dataset):
    def __init__(self, n):
        self.ids = sequences(n, seed=1)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--run-dir", required=True, help="the Trainer's output_dir")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-at", type=int, default=4)
    ap.add_argument("--resume-from", default=None)
    ap.add_argument("--sharding", default="param")
    ap.add_argument("--no-callback", action="store_true",
                    help="leave ZeroCheckpointCallback out (training must then fail clearly)")
    ap.add_argument("--optimizer-before-args", action="store_true",
                    help="build the optimizer before TrainingArguments, then after it")
    args = ap.parse_args()

    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.integrations import unwrap
    from zero_ext.integrations.transformers import ZeroCheckpointCallback

    set_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    if args.optimizer_before_args:
        try:  # no process group yet: torchrun's WORLD_SIZE says there will be one
            ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-3)
            early = None
        except ValueError as exc:
            early = str(exc)
    targs = TrainingArguments(
        output_dir=args.run_dir, use_cpu=True, per_device_train_batch_size=4,
        max_steps=args.steps, save_strategy="steps", save_steps=args.save_at,
        logging_steps=1, report_to="none", disable_tqdm=True, seed=0, learning_rate=3e-3,
        weight_decay=0.1, max_grad_norm=0.5, dataloader_num_workers=0)
    if args.optimizer_before_args:
        after = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-3)
        write_result(args.out, targs.process_index, model.parameters(), None,
                     {"early_error": early, "world_size_after": after.world_size})
        return
    trainer = Trainer(
        model=model, args=targs, train_dataset=Data(256),
        optimizer_cls_and_kwargs=(ZeroRedundancyOptimizer, {
            "optimizer_class": torch.optim.AdamW, "lr": 3e-3, "sharding": args.sharding}),
        callbacks=[] if args.no_callback else [ZeroCheckpointCallback()])
    try:
        trainer.train(resume_from_checkpoint=args.resume_from)
    except RuntimeError as exc:
        if not args.no_callback:
            raise
        traceback.print_exc()
        ckpts = sorted(n for n in os.listdir(args.run_dir) if n.startswith("checkpoint-"))
        write_result(args.out, trainer.args.process_index, trainer.model.parameters(), None,
                     {"error": str(exc), "global_step": trainer.state.global_step,
                      "checkpoints": ckpts})
        exit_now(3)
    final = os.path.join(args.run_dir, f"checkpoint-{args.steps}", "optimizer.pt")
    rank = trainer.args.process_index
    sd = torch.load(final, weights_only=True) if rank == 0 else None
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    write_result(args.out, rank, trainer.model.parameters(), sd,
                 {"losses": losses, "sharding": unwrap(trainer.optimizer).sharding})


if __name__ == "__main__":
    main()
    exit_now(0)
