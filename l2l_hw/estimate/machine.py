"""This machine: this process's resident memory, the host's free memory (under a cgroup's limit
where one is set), free disk where the run writes, free device memory (available)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from l2l_hw.relay.device_share import device_free_bytes


# ---------------------------------------------------------------------------- this machine
def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory (or its peak, VmHWM), from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def meminfo_bytes(field: str = "MemTotal") -> int | None:
    """A /proc/meminfo figure (MemTotal, MemAvailable) in bytes; None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def free_disk_bytes(path) -> int | None:
    """Free bytes of the file system that holds `path` (or its nearest existing parent); None
    where it has no blocks (/proc, /sys: nothing is written there; the run says so itself)."""
    path = Path(path).expanduser().resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return None
    return usage.free if usage.total else None


def device_memory_bytes(device: str) -> int | None:
    """Memory free for the run on `device`: CUDA's free memory (the process's share of it
    where a fraction is set elsewhere); None for the CPU (the device is host memory)."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    return device_free_bytes(torch.device(device))


def available(cfg, baseline: int, host_memory: int | None = None, disk: int | None = None) -> dict[str, int | None]:
    """What this machine has for the run: host memory (MemAvailable, plus what this process holds
    now, which the run's baseline counts), free disk where it writes, free device memory; or, asked
    about another machine, its `host_memory` and `disk` (free bytes where the run writes)."""
    from l2l_hw.memory_limit import limits

    free_host = meminfo_bytes("MemAvailable")
    host = free_host + baseline if free_host is not None else None
    limited = limits()  # a cgroup's memory limit over this process: what is left under it, never more than it
    if limited is not None:
        host = min(limited[0], limited[1] + baseline, *([host] if host is not None else []))
    out = {"host": host_memory if host_memory is not None else host}
    if cfg.out is not None:
        out["disk"] = disk if disk is not None else free_disk_bytes(cfg.out)
    if cfg.state_dir is not None:
        out["state_dir_disk"] = disk if disk is not None else free_disk_bytes(cfg.state_dir)
    out["device"] = device_memory_bytes(cfg.device)
    return out


def available_disk(cfg, have: dict) -> dict:
    """The free disk at a state dir a way to fit adds (as where the run writes, if asked about
    another machine's disk)."""
    if cfg.state_dir is None or "state_dir_disk" in have:
        return {}
    return {"state_dir_disk": have["disk"] if have.get("disk") is not None else free_disk_bytes(cfg.state_dir)}
