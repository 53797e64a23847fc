"""Grads reduce-scattered to their owners during DDP's backward: ZeRO at DDP's bytes.

DDP all-reduces every grad to every rank (2(W-1)/W of the model's bytes per rank), and a
ZeRO step then sends every owner's updated params again ((W-1)/W more: 1.5x DDP). Yet a
rank's step reads only the grads of the elements it owns. `reduce_scatter_hook`, a DDP comm
hook, sends each bucket's grads only to their owners: every rank sends the elements others
own ((W-1)/W of the bytes), every owner sums what it receives. With the exchange after the
step, an iteration moves DDP's bytes.

- Ownership is the optimizer's own plan (whole params or flat ranges, any sharding mode),
  so nothing about the step, the state or checkpoints changes; a DDP bucket is cut by it
  (plan.py) and travels in one collective (in segments only above 32 MB: DDP's default
  buckets are 25 MB), each step of it one tensor op over all its runs: the host's cost is
  per bucket, as DDP's own.
- Transport (transport.py), per segment: on NCCL one reduce-scatter of W equal blocks where
  the owners' shares are near equal, elsewhere one `all_to_all_single` with split sizes and
  a local sum; in hybrid layouts each owned sum is then all-reduced over the replica group.
- A bucket that holds params of no zero_ext optimizer, or of several, is all-reduced as DDP
  does, over DDP's own group (hook.py, which finds the bucket's optimizer and DDP model);
  the first such bucket is logged once ("zero_ext" logger).
- The optimizer is reached only through its `hook_seam` (zero_ext/seam.py); this package
  keeps its own state per optimizer and registers its check before a step with the seam
  (checks.py).

After the hook, `.grad` holds the averaged grad only where this rank owns the elements;
elsewhere it is this rank's local grad. So a script that changes grads in place between
backward and step (torch.nn.utils.clip_grad_norm_ computes from partial grads) is caught:
every grad's version counter is read once DDP has written the grads back (record.py), and
the next step raises on every rank when one changed (GradScaler's own in-place inf check and
`unscale_`, a uniform scaling that commutes with the average, are allowed). `gather_grads`
makes the grads whole on every rank for a reader outside the optimizer.
"""
from .checks import gather_grads  # (importing it registers the check before every step)
from .hook import reduce_scatter_hook

__all__ = ["gather_grads", "reduce_scatter_hook"]
