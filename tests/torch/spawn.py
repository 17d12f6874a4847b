"""Two-process runs for the DDP and FSDP2 tests: a free port, the end of a worker, and mp.spawn that tells a
failure of the work from an abort in torch's own teardown."""
import os
import socket
import warnings

import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _marker(out_dir, rank):
    return os.path.join(out_dir, f"rank{rank}.done")


def finish(rank, out_dir):
    """End a worker whose results are written: wait for every rank, record that this rank's work is complete, leave
    the process group, and exit without the interpreter's teardown (torch's gloo threads have aborted processes there:
    'terminate called without an active exception' on a 2-core CI machine)."""
    dist.barrier()  # every rank's results are written
    open(_marker(out_dir, rank), "w").close()
    dist.destroy_process_group()
    os._exit(0)


def run(worker, out_dir, *args):
    """mp.spawn(worker, (port, out_dir, *args)) on WORLD processes. A process that dies before finish() is a
    failure; one killed after every rank finished its work (a teardown abort) only warns."""
    try:
        mp.spawn(worker, args=(_free_port(), out_dir, *args), nprocs=WORLD, join=True)
    except mp.ProcessExitedException as e:
        if not all(os.path.exists(_marker(out_dir, r)) for r in range(WORLD)):
            raise
        warnings.warn(f"a worker was killed after every rank had finished its work: {e}")
