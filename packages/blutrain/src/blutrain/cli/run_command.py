"""``blutrain run -n N [--nnodes M --node-rank R --master ADDR:PORT] -- SCRIPT|blutrain train ...``:
start N local ranks of a distributed job (see :mod:`blutrain.dist.launcher`)."""

from __future__ import annotations

import argparse
from typing import Any


def add_command(sub: Any) -> None:
    p = sub.add_parser(
        "run", help="start the ranks of a distributed job on this node; stop them all if one fails",
        description="Start N ranks of COMMAND with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set, host the "
                    "job's store and MPI bootstrap (node 0), forward SIGINT/SIGTERM, and if one rank dies stop the "
                    "others and exit non-zero naming it. COMMAND is a script (run with this Python), "
                    "'blutrain ...', '-m module', or any program.")
    p.add_argument("-n", "--nproc", type=int, required=True, help="ranks to start on this node")
    p.add_argument("--nnodes", type=int, default=1, help="nodes in the job (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index, 0..nnodes-1 (default 0)")
    p.add_argument("--master", default=None,
                   help="ADDR:PORT of node 0's store (required with --nnodes > 1; default a free local port)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds after which a collective raises on every rank instead of hanging "
                        "(sets BLUTRAIN_DIST_TIMEOUT; default 1800)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds ranks get between SIGTERM and SIGKILL when stopped (default 5)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # imported here, not with the parser: blutrain.dist needs blutrain-autograd, and a `blutrain train` without it
    # must reach the CLI's one-line message for a missing package
    from blutrain.dist import launcher

    return launcher.run(args.command, args.nproc, nnodes=args.nnodes, node_rank=args.node_rank, master=args.master,
                        timeout=args.timeout, grace=args.grace)
