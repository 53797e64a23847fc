"""accelerate on CPU ranks (run under torchrun): Accelerator(cpu=True), prepare(model, opt,
dataloader, scheduler) with default arguments (device_placement=True: the optimizer's state
dict round trip on every rank), accelerator.clip_grad_norm_, save_state() at --save-at and,
with --resume, load_state() and skip_first_batches. Writes the final params of every rank
and the consolidated optimizer state (rank 0) to --out.

--reduce-scatter: zero_ext's reduce_scatter_hook registered on the prepared (DDP) model, and
the optimizer's own clip_grad_norm_ in place of accelerator.clip_grad_norm_ (which is torch's
clip over all grads: an error with the hook)."""
from __future__ import annotations

import argparse

import torch
from common import exit_now, param_groups, sequences, TinyLM, write_result  # noqa: I001


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", required=True, help="save_state / load_state directory")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-at", type=int, default=4)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--sharding", default="flat")
    ap.add_argument("--bucket-view", action="store_true")
    ap.add_argument("--reduce-scatter", action="store_true")
    args = ap.parse_args()

    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.integrations import unwrap
    from zero_ext.reduce_scatter.hook import _REDUCERS

    acc = Accelerator(cpu=True)
    set_seed(0)
    model = TinyLM()
    data = torch.utils.data.TensorDataset(sequences(256))
    dl = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    opt = ZeroRedundancyOptimizer(param_groups(model), torch.optim.AdamW, lr=3e-3,
                                  sharding=args.sharding,
                                  parameters_as_bucket_view=args.bucket_view)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    if args.reduce_scatter:
        from zero_ext.ddp_zero_hook import reduce_scatter_hook

        model.register_comm_hook(unwrap(opt), reduce_scatter_hook)
    step, losses = 0, []
    batches = dl
    if args.resume:
        acc.load_state(args.ckpt)
        step = args.save_at
        batches = acc.skip_first_batches(dl, args.save_at)
    for (ids,) in batches:
        if step == args.steps:
            break
        loss = model(ids)
        acc.backward(loss)
        if args.reduce_scatter:
            unwrap(opt).clip_grad_norm_(0.5)
        else:
            acc.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        opt.zero_grad()
        step += 1
        losses.append(float(loss.detach()))
        if not args.resume and step == args.save_at:
            acc.save_state(args.ckpt)
    zero = unwrap(opt)
    zero.consolidate_state_dict(0)
    sd = zero.state_dict() if acc.process_index == 0 else None
    write_result(args.out, acc.process_index, acc.unwrap_model(model).parameters(), sd,
                 {"losses": losses, "sharding": zero.sharding,
                  "hook_ran": zero in _REDUCERS})
    acc.wait_for_everyone()


if __name__ == "__main__":
    main()
    exit_now(0)
