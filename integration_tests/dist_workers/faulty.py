"""A rank that fails on purpose: ``MODE PIDFILE``. Every rank starts a child (a sleeping process, to
check that stopping a rank stops what it started), appends both pids to PIDFILE, joins the "mpi"
group, and then rank 1 is killed (kill), raises (raise), hangs before a collective (hang), or all
ranks wait to be stopped (wait)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import blutrain.dist as dist
import blutrain.tensor as bt

mode, pidfile = sys.argv[1], sys.argv[2]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
group = dist.init_process_group("mpi")
with open(pidfile, "a") as f:
    f.write(f"{os.getpid()} {child.pid}\n")
group.barrier()
if mode == "wait":
    time.sleep(600)
if group.rank == 1:
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "raise":
        raise ValueError("rank 1 is broken")
    if mode == "hang":
        time.sleep(600)
x = bt.ones(4)
for _ in range(3):
    group.all_reduce(x)
