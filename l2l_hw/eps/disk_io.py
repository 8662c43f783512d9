"""The disk tier's direct I/O: page-aligned buffers, and the threads that move a section of a
region between its image in memory and its file (l2l_hw/eps/disk_store.py holds the regions).

A section moves as a `Transfer`: cut into requests of `chunk_bytes` (os.preadv/os.pwritev on a
file opened with O_DIRECT), served by `DirectIo`'s threads in the order the sections are needed
(a read a caller waits on first, then the order asked: a pool in the order asked would serve
the read-aheads asked before a demand first, and share the disk among them all until the
last). The crc32 of each request is computed on the section's own thread as the request lands,
never on an I/O thread (DirectIo.transfer): a read's checked against what was written, a
write's kept for the next read. A section is done, a read's bytes usable, only once every
request has landed and every checksum matched.

Buffers (aligned_buffer) are in 2 MiB pages where the kernel has them: with 4 KiB pages a
virtio disk's request is cut under 1 MiB (docs/DISK.md).
"""
from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from zlib_ng.zlib_ng import crc32  # zlib's crc32, the same values, ~10x the speed

# O_DIRECT: offsets, lengths and buffer addresses a multiple of the logical block (512 here, 4096 on 4Kn disks)
ALIGN = 4096
HUGE_PAGE = 2 << 20  # a large buffer starts at one (aligned_buffer)


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 host tensor of `nbytes` whose address is a multiple of ALIGN: from its own anonymous
    mapping, in 2 MiB pages where the kernel has them (MADV_HUGEPAGE; transparent huge pages are
    "madvise" by default). A direct request then names a few physically contiguous pieces, not one
    per 4 KiB page: a virtio disk takes 254 pieces a request, so 4 KiB pages cut every request to
    under 1 MiB (docs/DISK.md: 1.9x the write and 1.7x the read of the same requests).
    Freed, the mapping goes back to the system, not to the allocator's arenas."""
    if nbytes < HUGE_PAGE:
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
        start = -raw.data_ptr() % ALIGN
        return raw[start:start + nbytes]
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no THP here: 4 KiB pages, the same bytes
        mapping.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping until the last view goes
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + nbytes]


@dataclass
class Transfer:
    """One section between its image and its file (DirectIo.transfer), and where its requests stand."""

    key: str  # the region's group
    region: str  # the region as errors name it
    section: str
    fd: int
    start: int  # the section's first byte in the file
    data: memoryview  # the section's bytes in the image
    write: bool
    wrote: list[int] | None  # a read's: the crc32 of each request as last written
    waited_on: Callable[[], bool]  # whether a caller waits for this read now
    seq: int = field(default=0, init=False)  # the order it was asked in
    parts: list[memoryview] = field(default_factory=list, init=False)  # its requests' bytes, in file order
    landed: queue.SimpleQueue = field(default_factory=queue.SimpleQueue, init=False)  # (chunk, its error or None)
    taken: int = field(default=0, init=False)  # requests an I/O thread has taken, in file order

    def urgency(self) -> tuple[bool, int]:
        """Needed sooner first: a read a caller waits on, then the transfer asked first."""
        return self.write or not self.waited_on(), self.seq


class DirectIo:
    """`threads` I/O threads serving the requests of the transfers queued, `chunk_bytes` each,
    the transfer needed soonest first (module docstring)."""

    def __init__(self, threads: int, chunk_bytes: int, fail: Callable[..., Exception]):
        self.chunk_bytes = chunk_bytes
        self.fail = fail  # fail(what, oserror=None): the error to raise, naming the folder
        self._queued: list[Transfer] = []  # transfers with requests no I/O thread has taken yet
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="l2l-disk-io")

    def transfer(self, transfer: Transfer) -> list[int]:
        """Move `transfer` in requests on the I/O threads (taken in the order the sections are
        needed: _serve), the crc32 of each computed here, on the section's own thread, as its
        request lands, while the others are in flight (a write's: the bytes it sent, unless the
        section changed meanwhile: then it is dirty and written again; a read's: checked against
        what was written). An I/O thread goes straight on to its next request, never held by a
        checksum, and no checksum runs before the requests are under way (on 2 shared cores a
        burst of them delayed the first requests by 10-40 ms). Returns, a read's bytes usable,
        only once every request has landed and every checksum matched: no byte is used
        unverified. The checksums of a write."""
        data, size = transfer.data, self.chunk_bytes
        transfer.parts = parts = [data[offset:offset + size] for offset in range(0, len(data), size)]
        if parts:
            with self._lock:
                transfer.seq = next(self._seq)
                self._queued.append(transfer)
            for _ in parts:
                self._threads.submit(self._serve)
        crcs, errors = [None] * len(parts), []
        for _ in parts:  # every request, even after an error: none may touch the buffer once it is reused
            chunk, error = transfer.landed.get()
            if error is not None:
                errors.append((chunk, error))
            else:
                crcs[chunk] = crc32(parts[chunk])
        if errors:
            raise min(errors, key=lambda e: e[0])[1]  # the first in the file
        for chunk, (crc, wrote) in enumerate(zip(crcs, crcs if transfer.write else transfer.wrote)):
            if crc != wrote:  # a read's bytes against what was written
                offset = transfer.start + chunk * size
                raise self.fail(f"checksum mismatch in {transfer.region}, {transfer.section} section, bytes "
                                f"{offset:,} to {offset + len(parts[chunk]):,}: the file changed since it was "
                                "written")
        return crcs

    def queued(self) -> list[str]:
        """The groups whose transfers wait for an I/O thread, in the order they will be served
        (a group once per transfer)."""
        with self._lock:
            return [t.key for t in sorted(self._queued, key=Transfer.urgency)]

    def _serve(self) -> None:
        """On an I/O thread: the next request of the transfer needed soonest (Transfer.urgency), not
        the oldest. One such task is submitted per request, so one is always there to take."""
        with self._lock:
            transfer = min(self._queued, key=Transfer.urgency)
            chunk, transfer.taken = transfer.taken, transfer.taken + 1
            if transfer.taken == len(transfer.parts):
                self._queued.remove(transfer)
        try:
            self._request(transfer, chunk)
        except BaseException as e:  # the transfer's thread raises it, after its other requests
            transfer.landed.put((chunk, e))
        else:
            transfer.landed.put((chunk, None))

    def _request(self, transfer: Transfer, chunk: int) -> None:
        """One request of `transfer` to or from its file."""
        part, offset, write = transfer.parts[chunk], transfer.start + chunk * self.chunk_bytes, transfer.write
        try:
            done = (os.pwritev if write else os.preadv)(transfer.fd, [part], offset)
        except OSError as e:
            raise self.fail(f"{'writing' if write else 'reading'} {transfer.region} failed at byte {offset:,}",
                            e) from None
        if done != len(part):
            raise self.fail(f"short {'write' if write else 'read'} in {transfer.region} at byte {offset:,}: "
                            f"{done:,} of {len(part):,} bytes")

    def close(self) -> None:
        """Finish the requests under way."""
        self._threads.shutdown(wait=True)
