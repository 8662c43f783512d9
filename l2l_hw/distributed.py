"""torch.distributed helpers shared by the data-parallel relay and the sharded EPS."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist


class DataParallelError(RuntimeError):
    """A collective failed: another rank died or stopped answering."""


def comm_device(group) -> torch.device:
    """Where a collective's tensors must be: NCCL moves CUDA tensors, gloo CPU tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def guarded(process_group, what: str, fn, /, *args, **kwargs):
    """Run a collective (or wait for one); a failure names this rank and what it was doing."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
        raise DataParallelError(f"rank {rank} of {world}: {what} failed; another rank has probably died or "
                                f"stopped answering within the process group's timeout ({exc})") from exc


def free_port() -> int:
    """A TCP port free on this machine now, for a local process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local_ranks(argv: list[str], world: int, timeout_s: float | None = None, threads: int = 1,
                    **popen) -> list[subprocess.CompletedProcess]:
    """Run `python argv...` as ranks 0..world-1 of one gloo process group on this machine
    (RANK, WORLD_SIZE, MASTER_ADDR/PORT set, as torchrun would); their results once all have
    exited. A rank still running after `timeout_s` is killed with the others (TimeoutExpired)."""
    env = dict(popen.pop("env", os.environ), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS=str(threads))
    procs = [subprocess.Popen([sys.executable, *argv], env=dict(env, RANK=str(r)), text=True, **popen)
             for r in range(world)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout_s)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise
    return results
