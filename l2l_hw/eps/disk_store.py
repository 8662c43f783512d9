"""Regions of EPS state in files under a state_dir, read and written with direct I/O.

Each EPS group owns one region, one file: `regions/NNNNN.region` (NNNNN: the group's
registration index). A region has two sections, each a multiple of ALIGN bytes:

    fetched    what fetch() reads: the working copy (and, with double buffering, its spare
               and previous versions). The forward sweep reads only this section.
    state      the fp32 master, m, v and their block scales: the update reads and writes it.

A region's image in host memory mirrors the file byte for byte, so a tensor is a view
at the same offset in both. `RegionStore` keeps at most `groups_in_flight` images
(their buffers reused, page-aligned for O_DIRECT); everything else is on disk. Callers
`use()` a group's sections (pinned while held: never evicted), `read_ahead()` the
groups they will use next (loaded in the background if an image is free, skipped
otherwise: a read-ahead never waits), and `write_back()` a group they changed (written
in the background; the image stays until it is evicted, clean). Evicting a changed image
first waits for its write. The crc32 of every request of every section is kept for what
was last written and checked on every read before the section counts as loaded (no
`use()` block runs on bytes that failed); an I/O error, a short transfer or a checksum
mismatch raises StateDirError naming the region, to the caller waiting on it and then,
as a failed write does, to every later call.

I/O (l2l_hw/eps/disk_io.py): os.preadv/os.pwritev on a file opened with O_DIRECT (no page
cache: the images are the only copy in memory and the disk's real speed is what is
measured), each section cut into CHUNK_BYTES requests run by IO_THREADS threads (512 MiB in
flight), from images in 2 MiB pages (aligned_buffer: with 4 KiB pages a virtio disk's
request is cut under 1 MiB). The threads take the requests in the order the sections are
needed (a read a caller waits on first, then the order asked: the read-aheads asked before
a demand do not go first); each request's crc32 is computed on its section's thread as it
lands, never on an I/O thread (DirectIo.transfer). Measured: docs/BENCHMARKS.md,
`l2l bench disk`.

The folder also holds `manifest.json` (what the folder holds: the rule, every group's
key, tensors and section sizes; written atomically) and `lock` (flock'd by the process
using the folder). A folder whose manifest names another model or rule is refused
before anything of its state is written.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from l2l_hw.eps.disk_io import ALIGN, DirectIo, Transfer, aligned_buffer
from l2l_hw.eps.worker import UpdateError

PIECE_ALIGN = 64  # a tensor's start inside a section: a cache line, more than any element needs
CHUNK_BYTES = 16 << 20  # one request; 1 MiB requests reached 2.3 GB/s read on one thread, 16 MiB 2.9
IO_THREADS = 32  # requests in flight: 512 MiB, about what aio at its best keeps in flight (docs/DISK.md)
SECTIONS = ("fetched", "state")
IN_MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")  # direct I/O may work there (Linux >= 6.6 tmpfs), but the bytes are RAM
MANIFEST, LOCK, REGIONS = "manifest.json", "lock", "regions"
FORMAT = 1


class StateDirError(UpdateError, ValueError):
    """The state_dir cannot be used, or a region's I/O failed; the message names the folder
    and, for I/O, the region. (A ValueError: the command line says it in one line, exit 2.)"""


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem `path` is on (the longest mount point above it), None if unknown."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return None
    path = str(path.resolve())
    above = [(point, kind) for point, kind in mounts
             if path == point or path.startswith(point.rstrip("/") + "/")]
    return max(above, key=lambda m: len(m[0]))[1] if above else None


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Slice:
    """One tensor in a group's region: `section`, byte `offset` inside it, shape and dtype."""

    key: str
    section: str
    offset: int
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


class RegionLayout:
    """The sections of one region as its tensors are laid out, one after another."""

    def __init__(self, key: str):
        self.key = key
        self.used = dict.fromkeys(SECTIONS, 0)

    def add(self, shape: torch.Size, dtype: torch.dtype, section: str) -> Slice:
        s = Slice(self.key, section, self.used[section], torch.Size(shape), dtype)
        self.used[section] = _round_up(s.offset + s.nbytes, PIECE_ALIGN)
        return s

    def sizes(self) -> dict[str, int]:
        return {s: _round_up(n, ALIGN) for s, n in self.used.items()}


@dataclass
class Region:
    index: int
    key: str
    path: Path
    fd: int
    sizes: dict[str, int]
    # per section, the crc32 of each CHUNK_BYTES request as last written; None: never written
    crc: dict[str, list[int] | None] = field(default_factory=lambda: dict.fromkeys(SECTIONS))

    def start(self, section: str) -> int:
        return 0 if section == "fetched" else self.sizes["fetched"]

    @property
    def nbytes(self) -> int:
        return sum(self.sizes.values())

    def name(self) -> str:
        return f"region {self.index} (group {self.key}, {self.path.name})"


@dataclass
class Image:
    """A region's bytes in host memory."""

    region: Region
    buffer: torch.Tensor
    loaded: set = field(default_factory=set)  # sections whose bytes are here
    loading: dict = field(default_factory=dict)  # section -> Future of its read
    dirty: set = field(default_factory=set)  # sections changed since their last write
    writing: Future | None = None
    waiting: Counter = field(default_factory=Counter)  # section -> callers of use() waiting for its read
    pins: int = 0
    last_use: int = 0

    def view(self, s: Slice) -> torch.Tensor:
        start = self.region.start(s.section) + s.offset
        return self.buffer[start:start + s.nbytes].view(s.dtype).view(s.shape)

    def bytes(self, section: str) -> memoryview:
        start = self.region.start(section)
        return memoryview(self.buffer.numpy())[start:start + self.region.sizes[section]]

    @property
    def idle(self) -> bool:
        return not self.pins and not self.loading and not self.dirty and self.writing is None


class RegionStore:
    """The state_dir: its regions, the images in memory and the I/O threads (module docstring)."""

    def __init__(self, path, groups_in_flight: int):
        if isinstance(groups_in_flight, bool) or not isinstance(groups_in_flight, int) or groups_in_flight < 2:
            raise ValueError(f"groups_in_flight must be an integer >= 2 (one computed, one read ahead), "
                             f"got {groups_in_flight!r}")
        self.path = Path(path).expanduser()
        self.groups_in_flight = groups_in_flight
        self.regions: dict[str, Region] = {}
        self.images: dict[str, Image] = {}
        self.spare_buffers: list[torch.Tensor] = []
        self.queued_updates: set[str] = set()  # groups whose image read-aheads leave alone
        self.error: StateDirError | None = None  # a failed write-back: raised by every later call
        self.waited: dict[str, float] = {}  # seconds each thread blocked on the disk, by thread name
        self.bytes_read = self.bytes_written = 0
        self._cond = threading.Condition()
        self._tick = 0
        self._lock_fd = None
        self.expected: list[dict] | None = None  # the whole model's groups, where expect() was told them
        self._made: list[Path] = []  # what this store created (folders, lock, manifest, regions), oldest first
        self._open()
        self.io = DirectIo(IO_THREADS, CHUNK_BYTES, self._fail)
        # one per transfer an image may have under way (a read per section, a write): none waits for a thread
        self._tasks = ThreadPoolExecutor(self.groups_in_flight * (len(SECTIONS) + 1),
                                         thread_name_prefix="l2l-disk-region")

    # -- the folder --------------------------------------------------------------------
    def _fail(self, what: str, e: OSError | None = None) -> StateDirError:
        reason = f": {e.strerror or e}" if e is not None else ""
        return StateDirError(f"state_dir {self.path}: {what}{reason}")

    def _open(self) -> None:
        """Create or check the folder: writable, direct I/O, not in use. Refused, it is left as it
        was: what this store made of it is removed (refuse())."""
        if self.path.exists() and not self.path.is_dir():
            raise self._fail("is a file, not a folder")
        try:
            missing = [p for p in (*reversed((self.path / REGIONS).parents), self.path / REGIONS) if not p.exists()]
            (self.path / REGIONS).mkdir(parents=True, exist_ok=True)
            self._made += missing
        except FileExistsError as e:
            raise self._fail("is not a folder", e) from None
        except OSError as e:
            raise self._fail("cannot be created or written (a read-only filesystem or folder?)", e) from None
        try:
            if not (self.path / LOCK).exists():
                self._made.append(self.path / LOCK)
            self._lock_fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise self.refuse("cannot be written (a read-only filesystem or folder?)", e) from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise self._fail("is in use by another EPS (its lock file is held); give each run its own "
                             "state_dir") from None  # another's: nothing of it is ours to remove
        for stale in [*self.path.glob(".probe-*"), self.path / f".{MANIFEST}.tmp"]:  # a killed run's; the lock is ours
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        self._probe_direct_io()
        self.manifest = self._read_manifest()

    def _probe_direct_io(self) -> None:
        kind = filesystem_type(self.path)
        if kind in IN_MEMORY_FILESYSTEMS:
            raise self.refuse(f"is on {kind}, a filesystem in memory: the state would take RAM, and tmpfs has no "
                              "direct I/O before Linux 6.6; put the state on a disk filesystem (ext4, xfs)")
        probe = self.path / f".probe-{os.getpid()}"
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
        except OSError as e:
            if e.errno == errno.EINVAL:
                raise self.refuse("its filesystem has no direct I/O (O_DIRECT; tmpfs, for one): put the state on "
                                  "a disk filesystem (ext4, xfs)") from None
            raise self.refuse("cannot be written (a read-only filesystem or folder?)", e) from None
        try:
            buf = aligned_buffer(ALIGN)
            if os.pwritev(fd, [memoryview(buf.numpy())], 0) != ALIGN:
                raise OSError(errno.EIO, "short write")
        except OSError as e:
            os.close(fd)
            with contextlib.suppress(OSError):
                probe.unlink()
            raise self.refuse("cannot be written", e) from None
        os.close(fd)
        with contextlib.suppress(OSError):
            probe.unlink()

    def _read_manifest(self) -> dict:
        path = self.path / MANIFEST
        if not path.exists():
            return {}
        try:
            manifest = json.loads(path.read_text())
            if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
                raise ValueError(f"format {manifest.get('format') if isinstance(manifest, dict) else '?'}")
        except (ValueError, OSError) as e:
            raise self.refuse(f"its {MANIFEST} is not one this version wrote ({e}); give an empty folder") from None
        return manifest

    def refuse(self, what: str, e: OSError | None = None) -> StateDirError:
        """The folder cannot be used: close it and remove what this store made of it (folders,
        lock, manifest, regions: nothing that was there before), so a refusal leaves nothing
        behind. The error to raise."""
        self.close()
        for path in reversed(self._made):
            with contextlib.suppress(OSError):
                path.rmdir() if path.is_dir() else path.unlink()  # a folder the user filled meanwhile stays
        self._made = []
        return self._fail(what, e)

    def expect(self, groups: list[dict], rule: dict) -> None:
        """The whole model's groups (each {"key", "tensors", "sizes"}, in registration order) and
        the rule, checked against the folder before any region is written: a folder holding
        another model's or another rule's state is refused unchanged, and so is one whose disk
        cannot take the regions still to be made."""
        held = self.manifest.get("groups", [])
        if self.manifest.get("rule", rule) != rule:
            raise self.refuse(f"holds the state of another run (rule {self.manifest['rule']}; this EPS: {rule}); "
                              "give an empty folder (nothing in it was changed)")
        if held and held != groups:
            k = next((k for k, (a, b) in enumerate(zip(held, groups)) if a != b), min(len(held), len(groups)))
            which = (f"its group {k} is {held[k]['key']} {held[k]['tensors']}, this model's is {groups[k]['key']} "
                     f"{groups[k]['tensors']}" if k < min(len(held), len(groups)) else "")
            raise self.refuse(f"holds the state of another model ({len(held)} groups; this one has {len(groups)}"
                              f"{'; ' + which if which else ''}); give an empty folder (nothing in it was changed)")
        need = sum(sum(g["sizes"].values()) for g in groups) - sum(
            self._allocated(self.path / REGIONS / f"{k:05d}.region") for k in range(len(groups)))
        free = self._free_bytes()
        if free is not None and need > free:
            raise self.refuse(f"no space for the state: its regions need {need:,} more bytes, {free:,} are free "
                              "(nothing was written)")
        self.expected = groups

    @staticmethod
    def _allocated(path: Path) -> int:
        try:
            return path.stat().st_blocks * 512
        except OSError:
            return 0

    def _free_bytes(self) -> int | None:
        try:
            free = os.statvfs(self.path)
        except OSError:
            return None
        return free.f_bavail * free.f_frsize

    def _write_manifest(self) -> None:
        path, tmp = self.path / MANIFEST, self.path / f".{MANIFEST}.tmp"
        if not path.exists() and path not in self._made:
            self._made.append(path)
        try:
            with open(tmp, "w") as f:
                json.dump(self.manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise self._fail(f"writing {MANIFEST} failed", e) from None

    def add_region(self, key: str, tensors: dict[str, list[int]], sizes: dict[str, int], rule: dict) -> Region:
        """Create (or take over, for the same model and rule) group `key`'s region, its space
        reserved on disk. `rule`: what else the bytes depend on (optimizer, formats)."""
        index = len(self.regions)
        entry = {"key": key, "tensors": tensors, "sizes": sizes}
        if self.expected is not None and (index >= len(self.expected) or self.expected[index] != entry):
            raise StateDirError(f"state_dir {self.path}: group {index} registered as {key} {tensors}, not as the "
                                "EPS was told to expect (a bug: expect() and registration disagree)")
        if index == 0:
            held = self.manifest.get("rule", rule)
            if held != rule:
                raise self._fail(f"holds the state of another run (rule {held}; this EPS: {rule}); give an empty "
                                 f"folder (nothing in it was changed)")
            self.manifest = {"format": FORMAT, "rule": rule, "groups": self.manifest.get("groups", [])}
        groups = self.manifest["groups"]
        if index < len(groups) and groups[index] != entry:
            raise self._fail(f"holds the state of another model: its group {index} is {groups[index]['key']} "
                             f"{groups[index]['tensors']}, this model's is {key} {tensors}; give an empty folder "
                             f"(nothing of group {index} onwards was changed)")
        path = self.path / REGIONS / f"{index:05d}.region"
        made = not path.exists()
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
        except OSError as e:
            raise self._fail(f"cannot create {path.name}", e) from None
        if made:
            self._made.append(path)
        region = Region(index, key, path, fd, sizes)
        try:
            os.posix_fallocate(fd, 0, region.nbytes)
        except OSError as e:
            os.close(fd)
            free = self._free_bytes()
            raise self.refuse(f"no space for {region.name()}: it needs {region.nbytes:,} bytes, {free or 0:,} are "
                              "free (the regions this run made are removed)", e) from None
        self.regions[key] = region
        if index >= len(groups):
            groups.append(entry)
            self._write_manifest()
        return region

    def check_complete(self) -> None:
        """After the last group: the folder held no more groups than this model has."""
        if len(self.manifest["groups"]) != len(self.regions):
            raise self._fail(f"holds the state of another model with {len(self.manifest['groups'])} groups; this "
                             f"one has {len(self.regions)}; give an empty folder")

    # -- images --------------------------------------------------------------------------
    def _take_buffer(self, nbytes: int) -> torch.Tensor:
        """A spare buffer that fits, else a new one (the spares too small let go first, so
        images and spares together stay within groups_in_flight buffers)."""
        fits = [b for b in self.spare_buffers if b.numel() >= nbytes]
        if fits:
            buf = min(fits, key=torch.Tensor.numel)
            self.spare_buffers.remove(buf)
            return buf
        while self.spare_buffers and len(self.spare_buffers) + len(self.images) >= self.groups_in_flight:
            self.spare_buffers.remove(min(self.spare_buffers, key=torch.Tensor.numel))
        return aligned_buffer(nbytes)

    def _claim(self, key: str, wait: bool) -> Image | None:
        """An image for group `key` (under the lock): a new one while fewer than groups_in_flight
        exist, else the least recently used idle one's buffer; with `wait`, waiting for a changed
        image's write. None (read-ahead) where that would wait."""
        region = self.regions[key]
        while True:
            if key in self.images:  # claimed by another thread while this one waited: one image per region
                return self.images[key]
            if len(self.images) < self.groups_in_flight:
                break
            idle = [im for im in self.images.values() if im.idle and (wait or im.region.key not in self.queued_updates)]
            if idle:  # the least recently used, a group whose update is queued last
                victim = min(idle, key=lambda im: (im.region.key in self.queued_updates, im.last_use))
                del self.images[victim.region.key]
                self.spare_buffers.append(victim.buffer)
                break
            if not wait:
                return None
            for im in sorted(self.images.values(), key=lambda im: im.last_use):
                if not im.pins and not im.loading and im.dirty:
                    self._start_write(im)
            self._wait_cond()
        image = Image(region, self._take_buffer(region.nbytes))
        self.images[key] = image
        return image

    def _wait_cond(self) -> None:
        start = time.perf_counter()
        self._cond.wait()
        self._waited(start)
        self._raise_error()

    def _waited(self, start: float) -> None:
        name = threading.current_thread().name
        self.waited[name] = self.waited.get(name, 0.0) + time.perf_counter() - start

    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def _start_load(self, image: Image, section: str) -> Future | None:
        """The read of `section` into `image` (under the lock); None when its bytes are here."""
        if section in image.loaded:
            return None
        if section in image.loading:
            return image.loading[section]
        if image.region.crc[section] is None:  # never written: nothing on disk to read
            image.loaded.add(section)
            return None
        future = self._tasks.submit(self._load, image, section)
        image.loading[section] = future
        return future

    def _load(self, image: Image, section: str) -> None:
        region = image.region
        try:
            self._transfer(image, section, write=False)
        except BaseException as e:
            with self._cond:  # its image never becomes idle: a thread waiting for an image would wait forever
                self.error = self.error or (e if isinstance(e, StateDirError) else StateDirError(
                    f"state_dir {self.path}: reading {region.name()} failed: {e}"))
                self._cond.notify_all()  # as a failed write: every later call raises it
            raise
        with self._cond:
            image.loaded.add(section)
            del image.loading[section]
            self._cond.notify_all()

    def _transfer(self, image: Image, section: str, write: bool) -> list[int]:
        """One section between the image and the file (DirectIo.transfer: a read's bytes are here
        only once every checksum matched). The checksums of a write."""
        region, data = image.region, image.bytes(section)
        crcs = self.io.transfer(Transfer(region.key, region.name(), section, region.fd, region.start(section), data,
                                         write, None if write else region.crc[section],
                                         waited_on=lambda: image.waiting[section] > 0))
        with self._cond:
            if write:
                self.bytes_written += len(data)
            else:
                self.bytes_read += len(data)
        return crcs

    def _start_write(self, image: Image) -> None:
        """Write the changed sections of `image` in the background (under the lock)."""
        if image.writing is None and image.dirty:
            image.writing = self._tasks.submit(self._write, image)

    def _write(self, image: Image) -> None:
        """Write changed sections until none is left (a section changed while it was written is
        written again, so the file and its checksum end as the image)."""
        region = image.region
        while True:
            with self._cond:
                sections, image.dirty = image.dirty & image.loaded, set()
                if not sections:
                    image.writing = None
                    self._cond.notify_all()
                    return
            try:
                for section in sorted(sections):
                    region.crc[section] = None  # torn while it is written: never read back
                    region.crc[section] = self._transfer(image, section, write=True)
            except BaseException as e:
                with self._cond:
                    image.dirty |= sections
                    image.writing = None
                    self.error = self.error or (e if isinstance(e, StateDirError) else StateDirError(
                        f"state_dir {self.path}: writing {region.name()} failed: {e}"))
                    self._cond.notify_all()
                raise

    # -- what the EPS calls --------------------------------------------------------------
    @contextlib.contextmanager
    def use(self, key: str, sections=SECTIONS, writes=(), replaces=()):
        """Group `key`'s image with `sections` loaded, pinned inside the block; `writes`: the
        sections the block changes (written back by write_back or on eviction); `replaces`:
        sections it rewrites whole, not read first."""
        with self._cond:
            self._raise_error()
            image = self.images.get(key) or self._claim(key, wait=True)
            image.pins += 1
            self._tick += 1
            image.last_use = self._tick
            if not any(s in image.loading for s in replaces):
                image.loaded |= set(replaces)
            writes = {*writes, *replaces}
            pending = [f for f in (self._start_load(image, s) for s in sections) if f is not None]
            waiting = [s for s in sections if s in image.loading]
            image.waiting.update(waiting)  # their requests go before read-aheads' (Transfer.urgency)
        held = False
        try:
            if pending:
                start = time.perf_counter()
                try:
                    for f in pending:
                        f.result()
                finally:
                    with self._cond:
                        image.waiting.subtract(waiting)
                self._waited(start)
            with self._cond:  # only once loaded: a write-back never writes bytes that are not here yet
                image.dirty |= set(writes)
            held = True
            yield image
        finally:
            with self._cond:
                image.pins -= 1
                if held:
                    image.dirty |= set(writes)  # again: a write-back that began inside the block writes it again
                self._cond.notify_all()

    def read_ahead(self, key: str, sections=SECTIONS) -> None:
        """Start loading group `key`'s sections if an image is free; never waits."""
        with self._cond:
            if self.error is not None:
                return
            image = self.images.get(key) or self._claim(key, wait=False)
            if image is None:
                return
            self._tick += 1
            image.last_use = self._tick
            for s in sections:
                self._start_load(image, s)

    def update_queued(self, key: str) -> None:
        """Group `key`'s update is queued: no read-ahead evicts its image until update_done(key)
        (a demand still may: pinning it could starve an update queued before it)."""
        with self._cond:
            self.queued_updates.add(key)

    def update_done(self, key: str) -> None:
        with self._cond:
            self.queued_updates.discard(key)

    def write_back(self, key: str) -> None:
        """Start writing group `key`'s changed sections."""
        with self._cond:
            self._raise_error()
            image = self.images.get(key)
            if image is not None:
                self._start_write(image)

    def flush(self) -> None:
        """Write every changed image and wait."""
        with self._cond:
            for image in self.images.values():
                self._start_write(image)
            while any(im.writing is not None for im in self.images.values()) and self.error is None:
                self._wait_cond()
            self._raise_error()

    def evict(self) -> None:
        """Write every changed image, then let every image go (the next use reads the file)."""
        self.flush()
        with self._cond:
            for key in [k for k, im in self.images.items() if im.idle]:
                self.spare_buffers.append(self.images.pop(key).buffer)

    def memory_bound(self) -> int:
        """The host memory the images may take: the groups_in_flight largest regions."""
        return sum(sorted(r.nbytes for r in self.regions.values())[-self.groups_in_flight:])

    def disk_bytes(self) -> int:
        return sum(r.nbytes for r in self.regions.values())

    def close(self) -> None:
        """Finish the I/O under way, close the files and release the folder (its files stay)."""
        if getattr(self, "_tasks", None) is not None:
            self._tasks.shutdown(wait=True)
        if getattr(self, "io", None) is not None:
            self.io.close()
        for region in self.regions.values():
            with contextlib.suppress(OSError):
                os.close(region.fd)
        self.regions, self.images, self.spare_buffers = {}, {}, []
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None


def held_state(path) -> list[Path]:
    """The state folders under `path` (itself, or torchrun ranks' rankR folders) whose manifest
    names groups: an earlier run's state, which a new run would overwrite."""
    path = Path(path).expanduser()
    found = []
    for folder in (path, *sorted(path.glob("rank*"))):
        with contextlib.suppress(OSError, ValueError):
            if json.loads((folder / MANIFEST).read_text()).get("groups"):
                found.append(folder)
    return found


def state_bytes(path) -> int:
    """Bytes the files under `path` take on disk (allocated blocks, as du counts them)."""
    path = Path(path).expanduser()
    return sum(p.lstat().st_blocks * 512 for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def remove_state(path) -> None:
    """Remove what a RegionStore keeps in the folder `path` (its regions, manifest, lock, probes),
    then the folder where that leaves it empty; anything else in it stays. The store must be
    closed."""
    path = Path(path).expanduser()
    regions = path / REGIONS
    for p in [*regions.glob("[0-9]*.region"), regions, path / MANIFEST, path / LOCK, *path.glob(".probe-*"), path]:
        with contextlib.suppress(OSError):  # gone already, or a folder that holds something else
            p.rmdir() if p.is_dir() else p.unlink()
