"""torch.distributed helpers shared by the data-parallel relay and the sharded EPS."""
from __future__ import annotations

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
