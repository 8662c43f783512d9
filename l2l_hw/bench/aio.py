"""DeepSpeed's aio handle, the disk tier's peer, tuned in DeepSpeed's own manner.

DeepSpeed tunes its aio handle for a disk with `ds_nvme_tune` (deepspeed/nvme/perf_run_sweep.py):
`ds_io` runs once per point of a grid over the handle's arguments (block size, queue depth,
single or batched submission, sequential or overlapped completion, intra-op threads), each
point writing or reading a file whole with one `pwrite` / `pread` of a page-locked buffer and a
`wait()`, and the fastest point is the setting to use. The same here, in process:

  grid      DeepSpeed's default sweep (1 and 8 MiB blocks, queue depth 32 and 128, both
            submissions, both completions, 1 / 2 / 4 / 8 threads) plus 16 MiB blocks and queue
            depth 8 (the tier's request size, and the setting this benchmark measured before)
  files     pre-allocated (posix_fallocate) and written once before anything is timed, as
            ds_io's warm-up loop writes its file: every timed write overwrites, as the tier's
            write-back does; O_DIRECT (the handle always opens with it), so no page cache
  buffer    page-locked by the handle (`new_cpu_locked_tensor`): a buffer it did not lock costs
            a locked bounce buffer and a copy per call, which ds_io never pays; then made of
            2 MiB pages (MADV_HUGEPAGE + MADV_COLLAPSE), as the tier's images are: on a virtio
            disk (254 pieces a request) 4 KiB pages cut each request under 1 MiB, and aio in
            DeepSpeed's own 4 KiB pages moved 0.6-0.7x the bytes a second (docs/DISK.md)
  checked   every read pass starts from a zeroed buffer and must end with the written bytes
            (crc32): a point that moved nothing cannot win

A sweep's maximum is the luckiest of many draws on a shared disk that drifts by tens of
percent within seconds; so the FINALISTS fastest points of each direction are timed again,
round robin (bench/timer.py), and the setting is the finalist with the highest median.
`l2l bench disk` then times that setting beside the tier, fio and dd on the tier's bytes.
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import os
import statistics
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from l2l_hw.bench.timer import round_robin

HUGE_PAGE, MADV_HUGEPAGE, MADV_COLLAPSE = 2 << 20, 14, 25  # <sys/mman.h>; MADV_COLLAPSE: Linux >= 6.1
FINALISTS = 3  # re-timed per direction; the sweep's ranks beyond the top few are within its noise
DIRECTIONS = ("write", "read")


@dataclass(frozen=True)
class AioSetting:
    """The arguments of DeepSpeed's `aio_handle`, in its order."""

    block_size: int
    queue_depth: int
    single_submit: bool
    overlap_events: bool
    threads: int  # intra_op_parallelism: the handle splits each call into this many slices

    def describe(self) -> str:
        return (f"{self.block_size >> 20} MiB blocks, queue depth {self.queue_depth}, {self.threads} "
                f"thread{'s' * (self.threads > 1)}, {'single' if self.single_submit else 'batched'} submission, "
                f"{'overlapped' if self.overlap_events else 'sequential'} completion")


# ds_nvme_tune's DEFAULT_SWEEP_CONFIG (deepspeed/nvme/perf_run_sweep.py), widened by the tier's
# 16 MiB request and queue depth 8
GRID = tuple(AioSetting(*point) for point in itertools.product(
    (1 << 20, 8 << 20, 16 << 20), (8, 32, 128), (False, True), (True, False), (1, 2, 4, 8)))


def load_op():
    """DeepSpeed's aio op (built on first use: minutes), or why not, as a string."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        from deepspeed.utils import logger

        logger.setLevel(logging.ERROR)  # its warnings go to stdout, into the report
        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            return "the aio op does not build here (it needs libaio-dev)"
        return builder.load(verbose=False)
    except Exception as e:  # an optional comparison: say why it is missing
        return f"unavailable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def huge_pages(buffer: torch.Tensor) -> bool:
    """Back the 2 MiB-aligned part of `buffer`'s memory with 2 MiB pages, its bytes kept
    (MADV_COLLAPSE works on pages already there, locked ones included); False where the kernel
    refuses (no transparent huge pages, Linux < 6.1): the buffer stays as it was."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = -(-buffer.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (buffer.data_ptr() + buffer.numel() * buffer.element_size()) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return False
    return all(libc.madvise(start, end - start, advice) == 0 for advice in (MADV_HUGEPAGE, MADV_COLLAPSE))


class AioFiles:
    """`count` files of `file_bytes` under `folder`, pre-allocated and written once, that aio
    handles write and read whole from one page-locked buffer holding a fixed pattern."""

    def __init__(self, op, folder: Path, count: int, file_bytes: int):
        self.op, self.folder, self.file_bytes = op, folder, file_bytes
        folder.mkdir(parents=True, exist_ok=True)
        self.paths = [str(folder / f"aio{i}") for i in range(count)]
        for path in self.paths:
            fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
            try:
                os.posix_fallocate(fd, 0, file_bytes)
            finally:
                os.close(fd)
        self._owner = op.aio_handle()  # the page-locked buffer's owner; any handle uses it unbounced
        self.buffer = self._owner.new_cpu_locked_tensor(file_bytes, torch.empty(0, dtype=torch.uint8))
        self.huge_pages = huge_pages(self.buffer)  # its best: the tier's images are of 2 MiB pages too
        words = self.buffer.view(torch.int64)  # each 8 bytes their own index: a block out of place shows
        torch.arange(words.numel(), out=words)
        self.crc = zlib.crc32(self.buffer.numpy())
        self.write(self._owner)  # untimed: ds_io's warm-up loop; every timed write overwrites

    def handle(self, setting: AioSetting):
        return self.op.aio_handle(setting.block_size, setting.queue_depth, setting.single_submit,
                                  setting.overlap_events, setting.threads)

    def _each_file(self, call, handle) -> float:
        t0 = time.perf_counter()
        for path in self.paths:
            if call(self.buffer, path, False, True) == -1 or handle.wait() != 1:  # ds_io: async, then wait
                raise OSError(f"DeepSpeed aio failed on {path}")
        return time.perf_counter() - t0

    def write(self, handle) -> float:
        """Seconds to write every file from the buffer."""
        return self._each_file(handle.pwrite, handle)

    def read(self, handle) -> float:
        """Seconds to read every file into the buffer, which must then hold what was written."""
        self.buffer.zero_()
        seconds = self._each_file(handle.pread, handle)
        if zlib.crc32(self.buffer.numpy()) != self.crc:
            raise OSError(f"DeepSpeed aio read back other bytes than it wrote under {self.folder}")
        return seconds

    def gbps(self, seconds: float) -> float:
        return len(self.paths) * self.file_bytes / seconds / 1e9

    def close(self) -> None:
        self._owner.free_cpu_locked_tensor(self.buffer)
        for path in self.paths:
            os.unlink(path)
        self.folder.rmdir()


def sweep(op, folder: Path, count: int, file_bytes: int, rounds: int, grid: tuple[AioSetting, ...] | None = None,
          finalists: int = FINALISTS) -> dict:
    """ds_nvme_tune's sweep over `grid` (default GRID) on `count` files of `file_bytes`, then its
    `finalists` fastest points per direction round robin: every point's GB/s, each finalist's
    runs, and the best setting per direction (the highest median)."""
    t0, grid = time.perf_counter(), GRID if grid is None else grid
    files = AioFiles(op, folder, count, file_bytes)
    try:
        points = []
        for setting in grid:
            handle = files.handle(setting)  # its threads end with it: one point's at a time
            points.append({"setting": setting, "write": files.gbps(files.write(handle)),
                           "read": files.gbps(files.read(handle))})
            del handle
        best, finals = {}, {}
        for rw in DIRECTIONS:
            top = sorted(points, key=lambda p: p[rw], reverse=True)[:finalists]
            handles = {p["setting"]: files.handle(p["setting"]) for p in top}
            times = round_robin({s: (lambda h=h: getattr(files, rw)(h)) for s, h in handles.items()},
                                rounds, warmup=1, self_timed=True)
            del handles
            finals[rw] = [{"setting": asdict(s), "gbps": [files.gbps(t) for t in ts],
                           "median_gbps": files.gbps(statistics.median(ts))} for s, ts in times.items()]
            best[rw] = max(times, key=lambda s: files.gbps(statistics.median(times[s])))
    finally:
        files.close()
    return {"points": [{**p, "setting": asdict(p["setting"])} for p in points], "finalists": finals,
            "best": {rw: asdict(s) for rw, s in best.items()},
            "best_named": {rw: s.describe() for rw, s in best.items()},
            "file_bytes": file_bytes, "files": count, "huge_pages": files.huge_pages,
            "seconds": time.perf_counter() - t0}


def at_best(op, best: dict[str, dict], folder: Path, count: int, file_bytes: int) -> dict:
    """One pass at the best settings (dicts of AioSetting's fields): write every file with the
    best write setting, then read them with the best read setting (GB/s); fresh pre-allocated
    files, as the tier's store is fresh in each of its passes."""
    files = AioFiles(op, folder, count, file_bytes)
    try:
        writer, reader = (files.handle(AioSetting(**best[rw])) for rw in DIRECTIONS)
        return {"write": files.gbps(files.write(writer)), "read": files.gbps(files.read(reader))}
    finally:
        files.close()
