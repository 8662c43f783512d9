"""The disk tier's storage: EPS state in region files under a state_dir.

`make_eps("cpu" | "golden", ..., state_dir=PATH)` puts the engine (l2l_hw/eps/engine.py) and
the backend's own kernel on this storage instead of host memory; nothing else changes, so
training with state_dir equals training in RAM bit for bit (tests/test_disk_tier.py).
Every buffer of a group (fp32 master, m and v in the state format, the working copy, and
with double buffering the spares and the previous version) is a `Slice` of the group's
region, one file under PATH (l2l_hw/eps/disk_store.py). A buffer is read or written
through the group's image in host memory, which the store loads on first use and writes
back after the group's update; a kernel runs on views of the image (`hold`).

Read-ahead is the engine's, along the order the relay told (EPS.expect_step): a fetch
reads ahead the working copies (`fetched` sections) of the groups fetched next, an update
the whole region of the group updated next. No read-ahead evicts a group whose update is
queued. The host memory the state takes is bounded: `groups_in_flight` region images
(memory_bound(): the largest `groups_in_flight` regions); the rest is on disk. The
default, 4: the group the relay computes with, the group being updated, one being written
back, one read ahead.

Reads return copies (the image may be reused once a read returns); a fetched one is pinned
for a CUDA relay.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from l2l_hw.eps.disk_store import SECTIONS, RegionLayout, RegionStore, Slice
from l2l_hw.eps.storage import Storage

GROUPS_IN_FLIGHT = 4  # computed, updated, written back, read ahead


class RegionFiles(Storage):
    """The groups' buffers as slices of region files under `state_dir` (module docstring)."""

    waits_on_io = True  # an update may wait on the disk: on its thread, the relay computes meanwhile

    def __init__(self, state_dir, groups_in_flight: int = GROUPS_IN_FLIGHT):
        self.store = RegionStore(state_dir, groups_in_flight)
        # an EPS dropped unclosed still lets its folder go (its lock, its files) when collected
        self._close_store = weakref.finalize(self, self.store.close)
        self._complete = False
        self.pin_fetched = False  # the working copies cross to a CUDA device: read them into pinned memory

    @property
    def state_dir(self):
        return self.store.path

    def memory_bound(self) -> int:
        """Bytes of host memory the state may take (the region images in flight)."""
        return self.store.memory_bound()

    def disk_bytes(self) -> int:
        """Bytes of the state in files."""
        return self.store.disk_bytes()

    # -- layout ---------------------------------------------------------------------------
    @staticmethod
    def _laid_out(group) -> tuple[list[Slice], RegionLayout]:
        layout = RegionLayout(group.key)
        return [layout.add(s.shape, s.dtype, "fetched" if s.fetched else "state") for s in group.specs], layout

    @staticmethod
    def _entry(group, layout: RegionLayout) -> dict:
        return {"key": group.key, "tensors": {n: list(s) for n, s in group.shapes.items()}, "sizes": layout.sizes()}

    def expect(self, groups, rule):
        """The whole model's groups, checked against the state_dir's manifest, its rule and its free
        space before the first region is written (RegionStore.expect)."""
        self.store.expect([self._entry(group, self._laid_out(group)[1]) for group in groups], rule)

    def allocate(self, group, rule):
        slices, layout = self._laid_out(group)
        entry = self._entry(group, layout)
        self.store.add_region(group.key, entry["tensors"], entry["sizes"], rule)
        self.pin_fetched |= any(spec.pinned for spec in group.specs)
        return slices

    def registered(self):
        """The folder held no more groups than were registered."""
        if not self._complete:
            self.store.check_complete()
            self._complete = True

    # -- bytes --------------------------------------------------------------------------------
    def scratch(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)  # host memory: a kernel's throw-away output

    def write(self, buf, values):
        with self.store.use(buf.key, (buf.section,), writes=(buf.section,)) as image:
            image.view(buf).copy_(values.reshape(buf.shape))

    def read(self, buf, shape, dtype):
        out = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=self.pin_fetched and buf.section == "fetched")
        with self.store.use(buf.key, (buf.section,)) as image:
            out.copy_(image.view(buf))
        return out

    @contextlib.contextmanager
    def hold(self, key, write_back=False):
        try:
            with self.store.use(key, SECTIONS, writes=SECTIONS) as image:
                yield lambda buf: image.view(buf) if isinstance(buf, Slice) else buf  # a scratch: host memory
        finally:
            if write_back:
                self.store.update_done(key)
        if write_back:
            self.store.write_back(key)

    # -- the relay's order ----------------------------------------------------------------------
    def read_ahead(self, key, buffers):
        self.store.read_ahead(key, tuple(s for s in SECTIONS if any(b.section == s for b in buffers)))

    def update_queued(self, key):
        self.store.update_queued(key)

    def close(self) -> None:
        self._close_store()
