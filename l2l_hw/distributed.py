"""torch.distributed helpers shared by the data-parallel relay, the sharded EPS and the training loop."""
from __future__ import annotations

import contextlib
import datetime
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
# torch.distributed.nn's collectives take `group=group.WORLD` as a default argument, bound when the
# module is first imported (torch._dynamo imports it: FakeTensorMode in l2l_hw.estimate, selective
# recompute). Imported after a process group exists, ten functions hold that group for the life of
# the interpreter: destroy_process_group cannot free it, and its gloo worker threads release their
# last collective's tensors while Python finalizes, which aborts the process now and then
# ("terminate called without an active exception"). Imported here, before any group, they bind
# None; a program that joins its group before importing l2l_hw is left as it is (importing the
# module now would bind that group), so such a program imports l2l_hw first.
if not dist.is_initialized():
    import torch.distributed.nn  # noqa: F401


FAILURE_KEY = "l2l/failure"  # in the process group's store: the first failure of a rank, "rank R of N: what"


class DataParallelError(RuntimeError):
    """A collective failed: another rank died or stopped answering."""


def rank_shard(batch, rank: int, world: int):
    """This rank's part of a minibatch: every tensor in `batch` (a tensor, or tuples and lists of
    them, e.g. (inputs, targets)) cut along dim 0 as torch.tensor_split does; the whole of it alone."""
    if isinstance(batch, torch.Tensor):
        return batch.tensor_split(world)[rank] if world > 1 else batch
    if isinstance(batch, (tuple, list)):
        return type(batch)(rank_shard(t, rank, world) for t in batch)
    raise TypeError(f"a batch holds tensors, or tuples and lists of them; got {type(batch).__name__}")


@dataclass
class Ranks:
    """This process's place in a data-parallel run (torchrun); one rank when run alone."""

    rank: int = 0
    world: int = 1
    device: str | None = None  # under torchrun on CUDA: this rank's GPU
    joined: bool = False  # the process group was set up here (and is torn down by leave_torchrun)

    @property
    def lead(self) -> bool:
        return self.rank == 0


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world's size: the process group's, else torchrun's environment
    (before the group is joined), else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def failed_ranks(failure: str | None, what: str) -> dict[int, str]:
    """Every rank's failure in `what` (its message; None where it went well), gathered on every
    rank (a collective): a rank that did not fail learns which did and why."""
    messages = [None] * dist.get_world_size()
    guarded(None, what, dist.all_gather_object, messages, failure)
    return {rank: message for rank, message in enumerate(messages) if message is not None}


def join_torchrun(device: str, timeout_s: float) -> Ranks:
    """Under torchrun (WORLD_SIZE > 1): join the process group, gloo on CPU, NCCL on CUDA
    (each rank on its LOCAL_RANK's GPU). An initialized group is used as it is."""
    if dist.is_initialized():  # joined by the caller (l2l finetune, a user's script): left by it too
        nccl = dist.get_backend() == "nccl"
        return Ranks(dist.get_rank(), dist.get_world_size(), f"cuda:{torch.cuda.current_device()}" if nccl else None)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Ranks()
    cuda = device.startswith("cuda")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return Ranks(dist.get_rank(), dist.get_world_size(), f"cuda:{local}" if cuda else None, joined=True)


def stage_groups(stages: int) -> tuple:
    """A pipeline of `stages` stages replicated over the world, rank = replica * stages + stage:
    this rank's pipeline group (its replica's stages) and replica group (its stage's ranks across
    the replicas), made on every rank in one order (new_group is collective). (None, None) where
    the world is a single pipeline."""
    world, rank = dist.get_world_size(), dist.get_rank()
    replicas = world // stages
    if replicas == 1:
        return None, None
    pipes = [dist.new_group([r * stages + s for s in range(stages)]) for r in range(replicas)]
    replica_groups = [dist.new_group([r * stages + s for r in range(replicas)]) for s in range(stages)]
    return pipes[rank // stages], replica_groups[rank % stages]


def leave_torchrun(ranks: Ranks) -> None:
    if ranks.joined:
        dist.destroy_process_group()


@contextlib.contextmanager
def rank_body(ranks: Ranks):
    """Run a rank's body: `with rank_body(ranks) as owned: ... owned.append(relay)`. What stops
    it is told to the other ranks (report_failure: their next collective names it). What the
    body put in `owned` (relays, EPSs: anything with close()) is closed, last first, before the
    process group is left: always on failure, and on success where the group was joined here
    (it ends with the body, so nothing may outlive it holding its transfers or threads).
    Then the group is left where it was joined here."""
    owned: list = []
    try:
        yield owned
    except BaseException as e:
        if ranks.world > 1:
            report_failure(" ".join(str(e).split()) or type(e).__name__)
        close_all(owned, e)
        raise
    else:
        if ranks.joined:
            close_all(owned)
    finally:
        leave_torchrun(ranks)


def close_all(owned: list, failure: BaseException | None = None) -> None:
    """Close every object of `owned`, last first, once each; where the body failed, an error
    in closing is a note on its error (the first error stays the one raised)."""
    while owned:
        try:
            owned.pop().close()
        except Exception as e:
            if failure is None:
                raise
            failure.add_note(f"while closing: {e}")


def comm_device(group, device: str | torch.device | None = None) -> torch.device:
    """Where a collective's tensors must be: NCCL moves CUDA tensors (on the relay's `device`
    where it is a CUDA device, else the current one), gloo CPU tensors."""
    if dist.get_backend(group) == "nccl":
        if device is not None and torch.device(device).type == "cuda":
            return torch.device(device)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def guarded(process_group, what: str, fn, /, *args, **kwargs):
    """Run a collective (or wait for one); a failure names this rank, what it was doing, and the
    rank that failed first where it said so (report_failure)."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
        peer = reported_failure()
        cause = (f"{peer}" if peer else "another rank has probably died or stopped answering within the process "
                 f"group's timeout ({short_cause(exc)})")
        raise DataParallelError(f"rank {rank} of {world}: {what} failed; {cause}") from exc


def short_cause(exc: BaseException) -> str:
    """A torch.distributed error in a few words: gloo's and the store's messages carry a source
    location, advice and sometimes a C++ stack ("[.../pair.cc:537] Read error [127.0.0.1]:7089:
    Connection reset by peer. This is typically caused by ...")."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|hpp|h):\d+\]\s*", "", text)
    return re.split(r"\.\s+(This is typically|Check the logs|Did the remote)", text)[0].rstrip(".")


def report_failure(message: str) -> None:
    """Say in the process group's store why this rank stops (the first report stays), so that the
    other ranks, whose next collective fails, name it. Best effort: the store may be gone."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        store = dist.distributed_c10d._get_default_store()
        if store.add(f"{FAILURE_KEY}/count", 1) == 1:
            store.set(FAILURE_KEY, f"rank {dist.get_rank()} of {dist.get_world_size()} stopped: {message}")
    except Exception:
        pass


def reported_failure() -> str | None:
    """What a rank reported with report_failure; None if none did, or the store does not answer
    (it lives in rank 0's process, or torchrun's agent)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        if store.check([FAILURE_KEY]):
            return store.get(FAILURE_KEY).decode()
    except Exception:
        pass
    return None


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


class LaunchFailed(RuntimeError):
    """A rank of a launch() ended with an error (it said why on stderr); `code` is its exit status."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def launch(argv: list[str], nproc: int) -> None:
    """Run `python argv...` as `nproc` ranks of one process group on this machine, through
    torch.distributed's elastic launch API (what `torchrun --standalone --nproc-per-node N`
    does, as `accelerate launch` and the `deepspeed` launcher do): each rank gets RANK,
    WORLD_SIZE, LOCAL_RANK and the rendezvous address. Returns when every rank has exited 0.
    A rank that fails raises LaunchFailed with its exit status (the rank printed its own line); a
    SIGINT or SIGTERM to the launcher is passed on to the ranks, which stop at a step boundary and
    say so, then KeyboardInterrupt (SIGINT) or LaunchFailed (128 + signal) is raised: no traceback
    of the launcher's own."""
    import logging
    import signal
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in list(logging.Logger.manager.loggerDict):  # the agent's INFO and WARNING lines: launcher chatter
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1)
    try:
        elastic_launch(config, sys.executable)(*argv)
    except SignalException as e:
        if e.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise LaunchFailed(f"stopped by {e.sigval.name}", 128 + e.sigval) from None
    except ChildFailedError as e:
        rank, failure = min(e.failures.items())
        code = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode  # -N: killed by signal N
        raise LaunchFailed(f"rank {rank} of {nproc} exited with status {code}", code) from None
