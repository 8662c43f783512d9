"""The CPU EPS with its state on disk: `make_eps("cpu", ..., state_dir=PATH)`.

The same engine and host kernel as the CPU EPS (l2l_hw/eps/cpu.py); only where the
buffers live changes. Every buffer of a group (fp32 master, m and v in the state format,
the working copy, and with double buffering the spares and the previous version) is a
`Slice` of the group's region, one file under PATH (l2l_hw/eps/disk_store.py). A buffer
is read or written through the group's image in host memory, which the store loads on
first use and writes back after the group's update:

    forward   fetch(i) reads group i's `fetched` section (the working copy) and reads
              ahead the working copies of the next two groups in registration order
    backward  fetch(i) reads ahead the whole region of group i-1 (its update comes next);
              the update runs the host kernel on views of the image and then writes the
              region back in the background

The direction is the one of the last two fetches (registration order is the relay's
forward order). No read-ahead evicts a group between its push and its update. The host memory the
state takes is bounded: `groups_in_flight` region images (memory_bound(): the largest
`groups_in_flight` regions); the rest is on disk. The default, 4: the group the relay
computes with, the group being updated, one being written back, one read ahead.

Fetch returns copies of the working copy (the image may be reused once the fetch
returns). Bytes and numerics are those of the CPU EPS: training with state_dir equals
training in RAM bit for bit (tests/test_disk_tier.py).
"""
from __future__ import annotations

import weakref

import torch

from l2l_hw.eps import golden
from l2l_hw.eps.base import OptimConfig
from l2l_hw.eps.cpu import CpuEps
from l2l_hw.eps.disk_store import SECTIONS, RegionLayout, RegionStore, Slice
from l2l_hw.eps.registry import register_backend

GROUPS_IN_FLIGHT = 4  # computed, updated, written back, read ahead
READ_AHEAD = {1: 2, -1: 1}  # groups read ahead in the forward (working copies) and the backward (regions)
ENCODE_CHUNK = golden.QUANT_BLOCK << 14  # elements encoded at a time (whole blocks: the same codes in pieces)


@register_backend("cpu", state_dir=True)
class DiskEps(CpuEps):
    computes_on_host = False  # an update waits on the disk: on its thread, the relay computes meanwhile
    def __init__(self, config: OptimConfig, working_dtype: str = "fp32", double_buffer: bool = False,
                 threads: int | None = None, isa: str | None = None, state: str = "fp32", *, state_dir,
                 groups_in_flight: int = GROUPS_IN_FLIGHT):
        super().__init__(config, working_dtype, double_buffer, threads=threads, isa=isa, state=state)
        self.store = RegionStore(state_dir, groups_in_flight)
        self._close_store = weakref.finalize(self, self.store.close)
        self._layout: RegionLayout | None = None  # the region being laid out by _register
        self._order: dict[str, int] = {}  # group -> registration index (the relay's forward order)
        self._last_fetch, self._direction = None, 1
        self._complete = False

    @property
    def state_dir(self):
        return self.store.path

    def memory_bound(self) -> int:
        """Bytes of host memory the state may take (the region images in flight)."""
        return self.store.memory_bound()

    def disk_bytes(self) -> int:
        """Bytes of the state in files."""
        return self.store.disk_bytes()

    def _rule(self) -> dict:
        """What the bytes of a region depend on besides the model."""
        return {"optimizer": self.config.optimizer, "state": self.state_format, "working_dtype": self.working_dtype,
                "double_buffer": self.double_buffer}

    # -- buffers are slices of regions ----------------------------------------------------
    def _allocate(self, shape, dtype, fetched):
        if self._layout is None:  # scratch of a conversion: host memory
            return super()._allocate(shape, dtype, fetched)
        return self._layout.add(shape, dtype, "fetched" if fetched else "state")

    def _laid_out(self, key: str, shapes: dict[str, torch.Size]) -> tuple[dict, RegionLayout]:
        """Group `key`'s buffers as slices of its region, and the region's layout."""
        layout = self._layout = RegionLayout(key)
        try:
            return {name: self._new_tensor(torch.Size(shape)) for name, shape in shapes.items()}, layout
        finally:
            self._layout = None

    def expect(self, groups):
        """The whole model's groups, checked against the state_dir's manifest, its rule and its free
        space before the first region is written (RegionStore.expect)."""
        entries = []
        for key, shapes in groups.items():
            _, layout = self._laid_out(key, shapes)
            entries.append({"key": key, "tensors": {n: list(s) for n, s in shapes.items()}, "sizes": layout.sizes()})
        self.store.expect(entries, self._rule())

    def _register(self, key, params):
        group, layout = self._laid_out(key, {name: p.shape for name, p in params.items()})
        self.store.add_region(key, {n: list(p.shape) for n, p in params.items()}, layout.sizes(), self._rule())
        self.buffers[key] = group
        self._order[key] = len(self._order)
        super()._register(key, params)
        self.store.write_back(key)

    def _stored_values(self, slot, given, shape):
        """The engine's encoding of fp32 state, in chunks of whole blocks (the golden encoder's
        temporaries take ~70 B per element: 9 GB for a 131 M-element embedding at once), and
        a missing slot's zeros encoded once (every all-zero block encodes alike)."""
        pieces = self._pieces(slot, shape)
        if slot == "param" or self.state_format == "fp32" or all(
                p in given and given[p].dtype == dtype for p, (_, dtype) in pieces.items()):
            return super()._stored_values(slot, given, shape)
        values = given.get(slot)
        if values is None:
            block = super()._stored_values(slot, {}, torch.Size([min(shape.numel(), golden.QUANT_BLOCK)]))
            return {p: torch.full(s, block[p].reshape(-1)[0].item(), dtype=dtype) for p, (s, dtype) in pieces.items()}
        flat = values.reshape(-1)
        parts = [super(DiskEps, self)._stored_values(slot, {slot: chunk}, chunk.shape)
                 for chunk in flat.split(ENCODE_CHUNK)]
        return {p: torch.cat([part[p].reshape(-1) for part in parts]).reshape(s) for p, (s, _) in pieces.items()}

    def _write(self, buf, values):
        if isinstance(buf, torch.Tensor):
            buf.copy_(values)
            return
        with self.store.use(buf.key, (buf.section,), writes=(buf.section,)) as image:
            image.view(buf).copy_(values.reshape(buf.shape))

    def _read(self, buf, shape, dtype):
        if isinstance(buf, torch.Tensor):
            return buf
        out = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=self.pin_fetched and buf.section == "fetched")
        with self.store.use(buf.key, (buf.section,)) as image:
            out.copy_(image.view(buf))
        return out

    def _run(self, key, name, optimizer, s, grad, src, dst):
        writes = {b.section for b in dst.values() if isinstance(b, Slice)}
        with self.store.use(key, SECTIONS, writes) as image:
            def host(buffers):
                return {slot: image.view(b) if isinstance(b, Slice) else b for slot, b in buffers.items()}
            return super()._run(key, name, optimizer, s, grad, host(src), host(dst))

    def _free(self, buf):
        pass

    # -- the relay's order ------------------------------------------------------------------
    def _update(self, key, grads, scalars):
        try:
            with self.store.use(key):  # the whole group stays in memory while its tensors update
                found = super()._update(key, grads, scalars)
        finally:
            self.store.update_done(key)
        self.store.write_back(key)
        return found

    def _check_complete(self) -> None:
        if not self._complete:
            self.store.check_complete()
            self._complete = True

    def _push(self, key, grads, inv_scale):
        """Queue the update; no read-ahead evicts the group's image (fetched for this backward)
        before the update has run: the update would read it again."""
        self._check_complete()
        self.store.update_queued(key)
        super()._push(key, grads, inv_scale)

    def _fetch(self, key, previous=False):
        self._check_complete()
        self._read_ahead(key)
        return super()._fetch(key, previous)

    def _read_ahead(self, key: str) -> None:
        """Start loading what the relay uses after group `key`: forward, the next two working
        copies; backward, the whole region of the group before (its update follows)."""
        i, last = self._order[key], len(self._order) - 1
        if i in (0, last):
            self._direction = 1 if i == 0 else -1
        elif self._last_fetch is not None and abs(i - self._last_fetch) == 1:
            self._direction = i - self._last_fetch
        self._last_fetch = i
        keys = list(self._order)
        sections = ("fetched",) if self._direction > 0 else SECTIONS
        step = self._direction
        for j in range(i + step, i + step * (READ_AHEAD[step] + 1), step):
            if 0 <= j <= last:
                self.store.read_ahead(keys[j], sections)

    def close(self) -> None:
        super().close()
        self._close_store()
