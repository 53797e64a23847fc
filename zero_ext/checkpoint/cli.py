"""python -m zero_ext.checkpoint: convert a sharded checkpoint to the plain torch format,
or describe one."""
from __future__ import annotations

import argparse
import os
import sys

from . import convert
from .format import read_meta

def _info(path: str) -> str:
    meta = read_meta(path)
    n = sum(1 for _ in meta["params"])
    numel = 0
    for shape, _, _ in meta["params"]:
        k = 1
        for d in shape:
            k *= int(d)
        numel += k
    lines = [f"zero_ext optimizer checkpoint {os.path.abspath(path)}",
             f"  saved by {meta['optimizer_class']} at world size {meta['world_size']}"
             + (f" x {meta['replicas']} replicas" if meta.get("replicas", 1) > 1 else "")
             + f", sharding={meta['sharding']!r}",
             f"  {n} params ({numel:,} elements) in {len(meta['param_groups'])} groups, "
             f"state for {len(meta['state'])} params"]
    for gi, g in enumerate(meta["param_groups"]):
        hyper = {k: v for k, v in g.items() if k != "params"}
        lines.append(f"  group {gi}: {len(g['params'])} params, {hyper}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(
        prog="python -m zero_ext.checkpoint", formatter_class=fmt,
        description="Tools for zero_ext sharded optimizer checkpoints. "
                    "`python -m zero_ext.checkpoint COMMAND --help` describes a command.")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    c = sub.add_parser("convert", formatter_class=fmt,
                       help="sharded checkpoint -> plain torch optimizer state dict "
                            "(torch.save file)",
                       description="Gather a sharded checkpoint into one plain torch optimizer "
                                   "state dict (loadable by torch.optim.AdamW and by "
                                   "zero_ext) and torch.save it.")
    c.add_argument("path", help="checkpoint directory written by zero_ext.checkpoint.save")
    c.add_argument("out", help="output file, e.g. optim.pt")
    i = sub.add_parser("info", formatter_class=fmt, help="describe a checkpoint",
                       description="Print a checkpoint's world size, sharding mode, params "
                                   "and param groups.")
    i.add_argument("path", help="checkpoint directory written by zero_ext.checkpoint.save")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "convert":
            sd = convert(args.path, args.out)
            print(f"wrote {args.out}: state for {len(sd['state'])} params, "
                  f"{len(sd['param_groups'])} param groups")
        else:
            print(_info(args.path))
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
