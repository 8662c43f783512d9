"""The disk tier (make_eps("cpu", state_dir=...)): training with the state in files equals
training with it in RAM bit for bit (the in-RAM CPU EPS is verified against golden and
PyTorch elsewhere); only the groups in flight are in memory; checkpoints stream both ways;
a killed run resumes bit-exactly; every bad state_dir and every I/O fault is one clear
error naming the folder or the region."""
import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import l2l_hw
from l2l_hw.checkpoint import open_checkpoint, save_checkpoint
from l2l_hw.eps import disk_io, disk_store
from l2l_hw.eps.disk_store import StateDirError
from l2l_hw.models import GPTConfig, build_gpt
from l2l_hw.models.gpt import lm_loss
from tests.helpers import DEVICES, mlp_layers
from tests.test_cli_errors import CKPT, ROOT, SMALL, assert_one_clear_line, assert_same_runs, run_cli
from tests.test_relay_equivalence import gpt, gpt_batches

pytestmark = pytest.mark.usefixtures("one_thread")
FLIGHT = 2  # fewer images than the GPT's groups: every step evicts, reads and writes regions
KILLS = 3  # kill -9 moments of the crash test (docs/BENCHMARKS.md has a run with 20)


def disk_eps(path, name="cpu", **options):
    return l2l_hw.make_eps(name, lr=3e-3, state_dir=path, groups_in_flight=FLIGHT, **options)


def train(eps, steps=3, data=None, **relay_options):
    relay = l2l_hw.Relay(gpt(), lm_loss, eps=eps, micro_batches=2, **relay_options)
    losses = [relay.train_step(x, y) for x, y in (data or gpt_batches(steps))]
    return relay, losses


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("state", ["fp32", "bf16", "8bit"])
def test_training_with_state_dir_equals_training_in_ram_bit_for_bit(state, precision, tmp_path):
    ram, ram_losses = train(l2l_hw.make_eps("cpu", lr=3e-3, state=state), precision=precision)
    disk, disk_losses = train(disk_eps(tmp_path / "state", state=state), precision=precision)
    assert disk_losses == ram_losses
    assert_same_state(ram.eps, disk.eps)
    for key in ram.eps.shapes:
        for name, t in ram.eps.fetch(key).items():
            assert torch.equal(t, disk.eps.fetch(key)[name]), (key, name)
    store = disk.eps.storage.store
    assert store.bytes_read > 0 and store.bytes_written > 0  # the state went through the files
    assert len(store.images) + len(store.spare_buffers) <= FLIGHT
    disk.eps.close()


@pytest.mark.parametrize("precision, relay_options", [("fp32", {}), ("bf16", {}), ("fp16", {}),
                                                      ("fp32", {"pipedream_2bw": True})])
def test_golden_eps_with_state_dir_equals_the_golden_eps_in_ram_bit_for_bit(precision, relay_options, tmp_path):
    """The golden rule on region files: the disk tier composed with another kernel, no code of its own."""
    ram, ram_losses = train(l2l_hw.make_eps("golden", lr=3e-3, state="8bit"), precision=precision, **relay_options)
    disk, disk_losses = train(disk_eps(tmp_path / "state", name="golden", state="8bit"), precision=precision,
                              **relay_options)
    assert disk_losses == ram_losses
    assert_same_state(ram.eps, disk.eps)
    for key in ram.eps.shapes:
        for previous in (False, True) if ram.eps.double_buffer else (False,):
            for name, t in ram.eps.fetch(key, previous=previous).items():
                assert torch.equal(t, disk.eps.fetch(key, previous=previous)[name]), (key, name)
    assert disk.eps.storage.store.bytes_read > 0  # the state went through the files
    disk.close()


@pytest.mark.parametrize("device", DEVICES)
def test_state_dir_equals_ram_on_every_device(device, tmp_path):
    """The relay's transport (gradients landing asynchronously on cpu-async and cuda) feeds
    the disk tier's updates as it feeds the RAM EPS's."""
    ram, ram_losses = train(l2l_hw.make_eps("cpu", lr=3e-3, state="8bit"), precision="bf16", device=device)
    disk, disk_losses = train(disk_eps(tmp_path / "state", state="8bit"), precision="bf16", device=device)
    assert disk_losses == ram_losses
    assert_same_state(ram.eps, disk.eps)
    disk.eps.close()


@pytest.mark.parametrize("relay_options", [dict(precision="fp16"), dict(pipedream_2bw=True)],
                         ids=["fp16-loss-scaling", "pipedream-2bw"])
def test_double_buffered_training_with_state_dir_equals_ram(relay_options, tmp_path):
    ram, ram_losses = train(l2l_hw.make_eps("cpu", lr=3e-3, state="8bit"), steps=4, **relay_options)
    disk, disk_losses = train(disk_eps(tmp_path / "state", state="8bit"), steps=4, **relay_options)
    assert disk.eps.double_buffer and disk_losses == ram_losses
    assert_same_state(ram.eps, disk.eps)
    for key in ram.eps.shapes:
        for name, t in ram.eps.fetch(key, previous=True).items():
            assert torch.equal(t, disk.eps.fetch(key, previous=True)[name]), (key, name)
    disk.eps.close()


class Recorder:
    """What the relay did with a disk EPS, in order: each fetch, each update's hold of its group,
    and each read-ahead the storage was asked for (with the sections it would load)."""

    def __init__(self, eps):
        self.events = []
        storage, fetch = eps.storage, eps.fetch
        read_ahead, hold = storage.read_ahead, storage.hold
        eps.fetch = lambda key, previous=False: self.events.append(("fetch", key)) or fetch(key, previous)
        storage.read_ahead = lambda key, buffers: self.events.append(
            ("ahead", key, {b.section for b in buffers})) or read_ahead(key, buffers)
        storage.hold = lambda key, write_back=False: (self.events.append(("update", key)) if write_back else None,
                                                     hold(key, write_back))[1]

    def used(self, kind: str) -> list[str]:
        return [e[1] for e in self.events if e[0] == kind]

    def read_ahead_before(self, kind: str, sections: set[str]) -> list[str]:
        """The groups used for `kind` that were read ahead (at least `sections`) before that use."""
        out, ahead = [], set()
        for e in self.events:
            if e[0] == "ahead" and e[2] >= sections:
                ahead.add(e[1])
            elif e[0] == kind and e[1] in ahead:
                out.append(e[1])
                ahead.discard(e[1])
        return out


@pytest.mark.parametrize("recompute", ["full", "none"])
def test_read_ahead_follows_the_order_the_relay_told_with_layers_dropped(recompute, tmp_path):
    """Layer drop: the step uses layers 0, 2, 5 and the last of 8 (GPT of 6 blocks). Every group the
    step fetches after its first, and every group it updates, was read ahead before its use (the
    whole region for an update), and nothing else was: the order is the relay's, told at the start
    of the step, not guessed from the fetches before."""
    eps = disk_eps(tmp_path / "state", state="8bit")
    eps_groups = 8
    torch.manual_seed(0)
    relay = l2l_hw.Relay(build_gpt(GPTConfig(n_layer=eps_groups - 2, n_embd=32, n_head=4, block_size=16)), lm_loss,
                         eps=eps, micro_batches=2, recompute=recompute)
    steps = gpt_batches(2)
    relay.train_step(*steps[0])  # a whole step first: every group updated once
    eps.wait()
    seen = Recorder(eps)
    used = [0, 2, 5, eps_groups - 1]
    relay.train_step(*steps[1], layers=used)
    eps.wait()
    groups = [f"layer{i}" for i in used]
    assert seen.used("fetch")[:len(groups)] == groups  # the forward
    assert seen.used("update") == groups[::-1]
    assert {e[1] for e in seen.events if e[0] == "ahead"} <= set(groups)
    assert seen.read_ahead_before("fetch", {"fetched"})[:len(groups) - 1] == groups[1:]
    assert seen.read_ahead_before("update", {"fetched", "state"}) == groups[::-1]  # the first during the forward
    relay.close()


def test_memory_bound_is_the_groups_in_flight_largest_regions(tmp_path):
    relay, _ = train(disk_eps(tmp_path / "state", state="8bit"), steps=1)
    store = relay.eps.storage.store
    regions = sorted((tmp_path / "state" / "regions").iterdir())
    assert len(regions) == len(relay.eps.shapes) > FLIGHT
    assert [p.stat().st_size for p in regions] == [r.nbytes for r in store.regions.values()]
    assert relay.eps.storage.memory_bound() == sum(sorted(p.stat().st_size for p in regions)[-FLIGHT:])
    assert sum(b.numel() for b in [*(im.buffer for im in store.images.values()), *store.spare_buffers]) \
        <= relay.eps.storage.memory_bound()
    relay.eps.close()


def test_checkpoints_stream_between_ram_and_disk_tier_and_resume_bit_exact(tmp_path):
    data = gpt_batches(4)
    straight, _ = train(l2l_hw.make_eps("cpu", lr=3e-3, state="8bit"), data=data)
    ram, _ = train(l2l_hw.make_eps("cpu", lr=3e-3, state="8bit"), data=data[:2])
    save_checkpoint(tmp_path / "ram.safetensors", ram.eps.state_entries(), {})
    disk = disk_eps(tmp_path / "state", state="8bit")
    resumed = l2l_hw.Relay(gpt(seed=9), lm_loss, eps=disk, micro_batches=2)  # other weights: the checkpoint rules
    disk.load_state_dict(open_checkpoint(tmp_path / "ram.safetensors"))
    assert len(disk.storage.store.images) <= FLIGHT  # loaded region by region
    for x, y in data[2:]:
        resumed.train_step(x, y)
    assert_same_state(straight.eps, disk)
    save_checkpoint(tmp_path / "disk.safetensors", disk.state_entries(), {})  # a normal checkpoint, streamed
    back = l2l_hw.make_eps("cpu", lr=3e-3, state="8bit")
    l2l_hw.Relay(gpt(seed=9), lm_loss, eps=back, micro_batches=2)
    back.load_state_dict(open_checkpoint(tmp_path / "disk.safetensors"))
    assert_same_state(straight.eps, back)
    disk.close()


def test_cli_state_dir_resume_equals_one_run(tmp_path, capsys):
    argv = [*SMALL, "--steps", "4", "--optimizer-state", "8bit"]
    rc, err = run_cli(capsys, *argv, "--out", str(tmp_path / "ram"))
    assert rc == 0, err
    rc, err = run_cli(capsys, *argv, "--out", str(tmp_path / "disk"), "--stop-after", "2",
                      "--state-dir", str(tmp_path / "state"))
    assert rc == 0, err
    rc, err = run_cli(capsys, "--resume", "--out", str(tmp_path / "disk"), "--state-dir", str(tmp_path / "state"))
    assert rc == 0, err
    assert_same_runs(tmp_path / "ram", tmp_path / "disk")


def test_resume_keeps_the_state_dir_of_the_checkpoint_s_run_unless_given_another(tmp_path, capsys):
    from l2l_hw.cli import main

    state, out = tmp_path / "state", tmp_path / "run"
    assert main(["train", *SMALL, "--steps", "3", "--stop-after", "1", "--out", str(out), "--state-dir",
                 str(state)]) == 0
    regions = lambda: {p.name: p.stat().st_mtime_ns for p in (state / "regions").iterdir()}
    first = regions()
    capsys.readouterr()
    assert main(["train", "--resume", "--stop-after", "2", "--out", str(out)]) == 0  # no --state-dir: the same
    assert f"state in {state}" in capsys.readouterr().out
    second = regions()
    assert all(second[name] > first[name] for name in first)  # its regions were written by the resumed run
    assert main(["train", "--resume", "--out", str(out), "--state-dir", str(tmp_path / "other")]) == 0
    assert f"state in {tmp_path / 'other'}" in capsys.readouterr().out
    assert regions() == second  # and not by the run given another folder


def test_a_training_run_that_fails_closes_the_eps_it_built_and_releases_its_state_dir(tmp_path):
    from l2l_hw.train import TrainConfig

    def data():
        yield torch.randn(8, 11), torch.randn(8, 7)
        raise OSError("the data went away")

    cfg = TrainConfig(steps=4, out=None, verbose=False, micro_batches=2, state_dir=str(tmp_path / "state"))
    with pytest.raises(OSError, match="the data went away") as failed:
        l2l_hw.train(cfg, layers=mlp_layers(), loss_fn=torch.nn.functional.mse_loss, data=data())
    assert failed.value.__traceback__ is not None  # its frames (and the relay in them) are still alive here
    disk_eps(tmp_path / "state").close()  # yet the folder is free: the run closed its EPS


def test_sigkill_at_random_moments_resumes_bit_identical_and_leaves_no_stray_file(tmp_path, capsys):
    argv = [*SMALL, "--steps", "4", "--eval-every", "1", "--optimizer-state", "8bit"]
    t0 = time.monotonic()
    rc, err = run_cli(capsys, *argv, "--out", str(tmp_path / "straight"), "--state-dir", str(tmp_path / "s0"))
    assert rc == 0, err
    span = time.monotonic() - t0
    rng = random.Random(7)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    landed = {"while running": 0, "with a checkpoint to resume": 0}
    for k in range(KILLS):
        out, state = tmp_path / f"killed{k}", tmp_path / f"state{k}"
        flags = [*argv, "--out", str(out), "--state-dir", str(state)]
        proc = subprocess.Popen([sys.executable, "-m", "l2l_hw.cli", "train", *flags], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        proc.stdout.readline()  # the banner: training starts
        time.sleep(rng.uniform(0, span))
        landed["while running"] += proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stdout.close()
        landed["with a checkpoint to resume"] += (out / CKPT).exists()
        resume = ["--resume", "--out", str(out), "--state-dir", str(state)] if (out / CKPT).exists() else \
            [*flags, "--overwrite"]
        rc, err = run_cli(capsys, *resume)
        assert rc == 0, err
        assert_same_runs(tmp_path / "straight", out)
        assert sorted(p.name for p in state.iterdir()) == ["lock", "manifest.json", "regions"]
        assert all(p.suffix == ".region" for p in (state / "regions").iterdir())
    print(landed)  # where the kills landed (pytest -s): the property above holds for each


# ------------------------------------------------------------------------------ bad input and faults

def test_state_dir_on_tmpfs_is_refused(capsys):
    shm = Path("/dev/shm")
    if disk_store.filesystem_type(shm) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    folder = shm / f"l2l-test-{os.getpid()}"
    try:
        with pytest.raises(StateDirError, match="on tmpfs, a filesystem in memory"):
            disk_eps(folder)
        rc, err = run_cli(capsys, *SMALL, "--steps", "1", "--out", str(folder / "out"), "--state-dir", str(folder))
        assert rc == 2
        assert_one_clear_line(err, str(folder), "tmpfs", "disk filesystem")
    finally:
        subprocess.run(["rm", "-rf", str(folder)], check=False)


def test_a_filesystem_without_direct_io_is_refused(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct_io(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(disk_store.os, "open", no_direct_io)
    with pytest.raises(StateDirError, match=r"no direct I/O \(O_DIRECT"):
        disk_eps(tmp_path / "state")


def test_read_only_state_dir_is_refused(tmp_path, monkeypatch, capsys):
    real_open = os.open

    def read_only(path, flags, *args):
        if flags & (os.O_CREAT | os.O_RDWR | os.O_WRONLY) and str(tmp_path / "state") in str(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args)

    (tmp_path / "state").mkdir()
    monkeypatch.setattr(disk_store.os, "open", read_only)
    rc, err = run_cli(capsys, *SMALL, "--steps", "1", "--out", str(tmp_path / "out"), "--state-dir",
                      str(tmp_path / "state"))
    assert rc == 2
    assert_one_clear_line(err, "state_dir", "read-only")


def test_full_disk_at_registration_names_the_region_and_exits_2(tmp_path, monkeypatch, capsys):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk_store.os, "posix_fallocate", full)
    rc, err = run_cli(capsys, *SMALL, "--steps", "1", "--out", str(tmp_path / "out"), "--state-dir",
                      str(tmp_path / "state"))
    assert rc == 2
    assert_one_clear_line(err, "no space for region 0", "No space left on device")


@pytest.mark.parametrize("fault", ["error", "short"])
def test_a_failed_or_short_write_back_stops_training_naming_the_region(fault, tmp_path, monkeypatch):
    eps = disk_eps(tmp_path / "state")
    relay = l2l_hw.Relay(gpt(), lm_loss, eps=eps, micro_batches=2)
    real = os.pwritev

    def failing(fd, buffers, offset):
        if fault == "error":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, buffers, offset) - disk_io.ALIGN

    monkeypatch.setattr(disk_io.os, "pwritev", failing)
    with pytest.raises(StateDirError, match=r"region \d+ \(group \S+, \d+\.region\)") as e:
        for x, y in gpt_batches(2):
            relay.train_step(x, y)
    assert ("No space left on device" if fault == "error" else "short write") in str(e.value)
    monkeypatch.undo()
    eps.close()


def test_a_changed_region_file_is_a_checksum_mismatch_naming_the_region(tmp_path):
    eps = disk_eps(tmp_path / "state")
    relay, _ = train(eps, steps=1)
    eps.wait()
    eps.storage.store.flush()
    key = next(k for k in eps.shapes if k not in eps.storage.store.images)  # on disk only: a fetch reads the file
    region = eps.storage.store.regions[key]
    with open(region.path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(StateDirError, match=rf"checksum mismatch in region {region.index} \(group {key}"):
        eps.fetch(key)
    eps.close()


@pytest.mark.parametrize("how", ["demand", "read_ahead"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_byte_fails_its_read_before_the_block_runs_however_late_its_checksum(where, how, tmp_path,
                                                                                       monkeypatch):
    """A read's checksums are computed off the I/O threads, as its requests land: a byte flipped
    on disk in any request of a section, read on demand or ahead, raises StateDirError naming
    the region and the bytes, and the block that would use the section never runs, even when
    the checksum of that request is the last to finish. The store then stops: every later call
    raises the same error, a healthy region's too."""
    import threading

    monkeypatch.setattr(disk_store, "CHUNK_BYTES", 64 << 10)  # 8 requests a section
    store = disk_store.RegionStore(tmp_path / "state", groups_in_flight=2)
    size = 8 * disk_store.CHUNK_BYTES
    for key in ("a", "b"):
        store.add_region(key, {"x": [size]}, {"fetched": 0, "state": size}, rule={})
        with store.use(key, replaces=("state",)) as image:
            image.buffer[:size].fill_(7)
        store.write_back(key)
    store.evict()
    chunk = {"first": 0, "middle": 3, "last": 7}[where]
    flipped = chunk * disk_store.CHUNK_BYTES + 12345
    with open(store.regions["a"].path, "r+b") as f:
        f.seek(flipped)
        f.write(b"\x06")
    real, late = disk_io.crc32, threading.Event()

    def slow(data, *value):  # the corrupted request's checksum finishes after all the others
        if data.nbytes == disk_store.CHUNK_BYTES and bytes(data[12345:12346]) != b"\x07":
            late.wait(0.2)
        return real(data, *value)

    monkeypatch.setattr(disk_io, "crc32", slow)
    if how == "read_ahead":
        store.read_ahead("a", ("state",))
    message = (rf"checksum mismatch in region 0 \(group a, 00000\.region\), state section, bytes "
               rf"{chunk * disk_store.CHUNK_BYTES:,} to {(chunk + 1) * disk_store.CHUNK_BYTES:,}")
    for key in ("a", "b"):
        ran = False
        with pytest.raises(StateDirError, match=message):
            with store.use(key, ("state",)):
                ran = True
        assert not ran, key
    store.close()


def test_a_read_waited_on_is_served_before_the_read_aheads_asked_before_it(tmp_path, monkeypatch):
    """The I/O threads take the requests of a section a caller waits on before those of the
    read-aheads asked earlier (a pool in the order asked would read those first): with one I/O
    thread, busy with a read-ahead's first request when the demand comes, the demanded region's
    requests are the next ones read, then the read-aheads' in the order asked."""
    import threading

    monkeypatch.setattr(disk_store, "CHUNK_BYTES", 64 << 10)
    monkeypatch.setattr(disk_store, "IO_THREADS", 1)
    store = disk_store.RegionStore(tmp_path / "state", groups_in_flight=3)
    size = 4 * disk_store.CHUNK_BYTES
    for key in "abc":
        store.add_region(key, {"x": [size]}, {"fetched": 0, "state": size}, rule={})
        with store.use(key, replaces=("state",)) as image:
            image.buffer[:size].fill_(ord(key))
        store.write_back(key)
    store.evict()
    keys = {store.regions[k].fd: k for k in "abc"}
    real, entered, gate, read = os.preadv, threading.Event(), threading.Event(), []

    def preadv(fd, buffers, offset):
        if not read:
            entered.set()
            gate.wait(10)  # the first request holds the only I/O thread until the demand is queued
        read.append((keys[fd], offset // disk_store.CHUNK_BYTES))
        return real(fd, buffers, offset)

    def use(key):
        with store.use(key, ("state",)) as image:
            assert bool((image.buffer[:size] == ord(key)).all()), key

    monkeypatch.setattr(disk_io.os, "preadv", preadv)
    store.read_ahead("a", ("state",))
    assert entered.wait(10)
    store.read_ahead("b", ("state",))
    demand = threading.Thread(target=use, args=("c",))
    demand.start()
    deadline = time.monotonic() + 10
    while store.io.queued() != ["c", "a", "b"] and time.monotonic() < deadline:  # c waited on: first
        time.sleep(0.001)
    gate.set()
    demand.join()
    use("a")
    use("b")
    assert read == [("a", 0), *[("c", i) for i in range(4)], *[("a", i) for i in range(1, 4)],
                    *[("b", i) for i in range(4)]]
    store.close()


def test_a_flipped_state_byte_stops_training_before_its_update_writes(tmp_path):
    """On the update's path: a byte flipped in a group's state section on disk raises
    StateDirError naming the region when the update reads it, and no update wrote over it."""
    eps = disk_eps(tmp_path / "state")
    relay, _ = train(eps, steps=1)
    eps.wait()
    store = eps.storage.store
    store.flush()
    flipped = {}
    for key in [k for k in eps.shapes if k not in store.images]:  # on disk only: an update reads the file
        region = store.regions[key]
        with open(region.path, "r+b") as f:
            f.seek(region.start("state") + 100)
            flipped[key] = bytes([f.read(1)[0] ^ 0x40])
            f.seek(region.start("state") + 100)
            f.write(flipped[key])
    with pytest.raises(StateDirError, match=r"checksum mismatch in region \d+ \(group \S+, \d+\.region\), state "
                                            r"section"):
        for x, y in gpt_batches(2):
            relay.train_step(x, y)
    for key, byte in flipped.items():  # still the flipped byte: nothing computed from it was written back
        region = store.regions[key]
        with open(region.path, "rb") as f:
            f.seek(region.start("state") + 100)
            assert f.read(1) == byte, key
    eps.close()


def test_a_state_dir_of_another_model_is_refused_and_left_as_it_was(tmp_path, capsys):
    relay, _ = train(disk_eps(tmp_path / "state"), steps=1)
    relay.eps.storage.store.flush()
    relay.eps.close()
    before = {p: p.read_bytes() for p in (tmp_path / "state").rglob("*") if p.is_file()}
    with pytest.raises(StateDirError, match="holds the state of another model"):
        l2l_hw.Relay(mlp_layers(), torch.nn.functional.mse_loss, eps=disk_eps(tmp_path / "state"), micro_batches=2)
    with pytest.raises(StateDirError, match="holds the state of another run"):
        l2l_hw.Relay(gpt(), lm_loss, eps=disk_eps(tmp_path / "state", state="8bit"), micro_batches=2)
    assert {p: p.read_bytes() for p in (tmp_path / "state").rglob("*") if p.is_file()} == before
    rc, err = run_cli(capsys, *SMALL, "--steps", "1", "--out", str(tmp_path / "out"), "--state-dir",
                      str(tmp_path / "state"), "--overwrite")  # overwrite: of the same model's state only
    assert rc == 2
    assert_one_clear_line(err, "holds the state of another")
    assert {p: p.read_bytes() for p in (tmp_path / "state").rglob("*") if p.is_file()} == before


def test_a_state_dir_of_an_earlier_run_is_refused_unless_resumed_or_overwritten(tmp_path, capsys):
    state = tmp_path / "state"
    rc, err = run_cli(capsys, *SMALL, "--steps", "1", "--out", str(tmp_path / "a"), "--state-dir", str(state))
    assert rc == 0, err
    before = files_of(state)
    rc, err = run_cli(capsys, *SMALL, "--steps", "1", "--out", str(tmp_path / "b"), "--state-dir", str(state))
    assert rc == 2
    assert_one_clear_line(err, f"--state-dir {state}", "another run, an earlier one", "--resume", "--overwrite",
                          "nothing in it was changed")
    assert files_of(state) == before and not (tmp_path / "b").exists()
    rc, err = run_cli(capsys, "--resume", "--steps", "2", "--out", str(tmp_path / "a"), "--state-dir", str(state))
    assert rc == 0, err
    rc, err = run_cli(capsys, *SMALL, "--steps", "1", "--out", str(tmp_path / "b"), "--state-dir", str(state),
                      "--overwrite")
    assert rc == 0, err


def test_the_end_line_names_the_state_dir_its_size_and_whether_it_may_go(tmp_path, capsys):
    from l2l_hw.cli import main

    state, out = tmp_path / "state", tmp_path / "a"
    capsys.readouterr()
    assert main(["train", *SMALL, "--steps", "1", "--out", str(out), "--state-dir", str(state)]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    du = sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, files in os.walk(state) for f in files)
    assert last.startswith(f"state dir {state}: ") and "the final checkpoint holds all of it: it may be deleted" in last
    mib = float(last.split(": ")[1].split(" MiB")[0])
    assert abs(mib - du / 2**20) <= 0.05 + 0.001 * du / 2**20, (mib, du)
    assert main(["train", "--resume", "--steps", "2", "--out", str(out), "--state-dir", str(state),
                 "--remove-state-dir"]) == 0
    assert "removed as the run closes" in capsys.readouterr().out.splitlines()[-1]
    assert not state.exists()  # the folder it made, gone with its files
    assert main(["train", "--resume", "--steps", "3", "--out", str(out), "--state-dir", str(tmp_path / "s2")]) == 0


def test_a_state_dir_in_use_is_refused(tmp_path):
    eps = disk_eps(tmp_path / "state")
    with pytest.raises(StateDirError, match="in use by another EPS"):
        disk_eps(tmp_path / "state")
    eps.close()
    disk_eps(tmp_path / "state").close()  # released with its EPS


def test_state_dir_is_for_backends_computing_on_host_memory_unsharded(tmp_path, capsys):
    with pytest.raises(ValueError, match="state_dir keeps the state of the unsharded cpu or golden EPS on disk, not of "
                                         "the fpga-sim EPS"):
        l2l_hw.make_eps("fpga-sim", state_dir=tmp_path)
    rc, err = run_cli(capsys, *SMALL, "--steps", "1", "--eps", "fpga-sim", "--state-dir", str(tmp_path))
    assert rc == 2
    assert_one_clear_line(err, "--state-dir", "cpu or golden EPS")
    assert list(tmp_path.iterdir()) == []  # refused before anything was made


@pytest.mark.parametrize("state", ["bf16", "8bit"])
def test_state_encoded_in_chunks_equals_the_golden_encoding_at_once(state, tmp_path, monkeypatch):
    from l2l_hw.eps import engine, golden

    monkeypatch.setattr(engine, "ENCODE_CHUNK", 2 * golden.QUANT_BLOCK)  # several chunks, a short last block
    shape = torch.Size([5, golden.QUANT_BLOCK - 3])
    params = {"w": torch.randn(shape)}
    fp32 = {"param": params["w"], "m": torch.randn(shape) * 1e-3, "v": torch.rand(shape) * 1e-6}

    def at_once(values: dict) -> dict:  # the golden rule's stored form of the whole tensors
        out = {"param": values["param"]}
        for slot in ("m", "v"):
            stored = golden.encode_state(values.get(slot, torch.zeros(shape)).numpy(), state, slot)
            out.update({k: t.reshape(shape) if k == slot else t for k, t in golden.state_tensors(stored).items()})
        return out

    ram, on_disk = l2l_hw.make_eps("cpu", state=state), disk_eps(tmp_path / "state", state=state)
    for eps in (ram, on_disk):
        eps.register("g", params)
    for values in ({"param": params["w"]}, fp32):  # zeros encoded once; fp32 values in chunks
        for eps in (ram, on_disk):
            eps.load_tensor("g", "w", values)  # fp32 state (another EPS's checkpoint) in this one's format
            got = eps.state_dict()
            for piece, want in at_once(values).items():
                assert torch.equal(got[f"g/w/{piece}"], want), (state, piece)
    on_disk.close()


def test_threads_using_the_store_at_once_lose_no_write(tmp_path):
    """Four threads, five regions, two images: every increment each thread made to its own
    counter in a region's bytes is there after the images were evicted and read back."""
    import collections
    import threading

    store = disk_store.RegionStore(tmp_path / "state", groups_in_flight=2)
    keys = [f"g{i}" for i in range(5)]
    for key in keys:
        store.add_region(key, {"x": [1024]}, {"fetched": 4096, "state": 4096}, rule={})
    rng = random.Random(3)
    plans = [[rng.choice(keys) for _ in range(300)] for _ in range(4)]

    def work(thread: int):
        for key in plans[thread]:
            with store.use(key, writes=("state",)) as image:
                counter = image.buffer[4096 + 8 * thread: 4096 + 8 * thread + 8].view(torch.int64)
                counter += 1
            store.write_back(key)

    for key in keys:  # zeros to count from (a fresh region's bytes are whatever its buffer held)
        with store.use(key, replaces=disk_store.SECTIONS) as image:
            image.buffer.zero_()
    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.evict()
    for key in keys:
        with store.use(key) as image:
            got = image.buffer[4096:4096 + 32].view(torch.int64).tolist()
        assert got == [collections.Counter(plan)[key] for plan in plans], key
    store.close()


def test_bench_disk_reports_the_tier_against_the_raw_disk_and_the_state_in_ram(tmp_path, monkeypatch, capsys):
    from l2l_hw.bench import disk as bench_disk
    from l2l_hw.cli import main
    from l2l_hw.models import GPTConfig

    monkeypatch.setattr(bench_disk, "MODEL", GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    monkeypatch.setattr(bench_disk, "load_aio", lambda: "not measured here")  # its first build takes minutes
    assert main(["bench", "disk", "--dir", str(tmp_path), "--size-gib", "0.03125", "--region-mib", "16",
                 "--rounds", "1", "--batches", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["bytes"] == 32 << 20 and r["tier"]["write"]["median"] > 0 and r["tier"]["read"]["median"] > 0
    assert r["dd"]["read"]["median"] > 0 and r["tier_vs_dd"]["read"]["median"] > 0
    assert r["deepspeed_aio"] == "not measured here" and "tier_vs_deepspeed_aio" not in r
    step = r["steps"][0]
    assert step["ram_step_s"] > 0 and step["disk_step_s"] > 0 and 0 <= step["wait_share"] < 1
    assert step["disk_bytes_per_step"] >= step["state_bytes"]  # every region written back each step
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_bench_disk_llama_run_resumes_from_its_checkpoint_bit_exact(tmp_path, monkeypatch):
    from l2l_hw.bench import disk as bench_disk

    small = dict(bench_disk.LLAMA_7B, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=300)
    monkeypatch.setattr(bench_disk, "LLAMA_7B", small)
    monkeypatch.setattr(bench_disk, "LLAMA_CONTEXT", 16)
    trained = bench_disk.llama_train(tmp_path, layers=2)
    resumed = bench_disk.llama_resume(tmp_path, layers=2)
    assert len(trained["steps"]) == bench_disk.LLAMA_STEPS and trained["checkpoint_bytes"] > 0
    assert resumed["crcs"] == trained["crcs"] and resumed["next"]["loss"] == trained["next"]["loss"]
    # the state goes through the disk: a step's updates are written back in the background, so under load
    # a step's bytes may land in the next step's window (the last step's in none): summed over the run
    assert sum(s["disk_bytes"] for s in (*trained["steps"], trained["next"])) > 0 and trained["peak_rss_bytes"] > 0


def test_read_ahead_spares_a_group_whose_update_is_queued_and_a_demand_does_not_wait_on_it(tmp_path):
    store = disk_store.RegionStore(tmp_path / "state", groups_in_flight=2)
    for key in ("a", "b", "c", "d"):
        store.add_region(key, {"x": [8]}, {"fetched": 4096, "state": 4096}, rule={})
    for key in ("a", "b"):
        with store.use(key):
            pass
        store.update_queued(key)
    store.read_ahead("c")
    assert sorted(store.images) == ["a", "b"]  # no read-ahead evicts a group before its update
    with store.use("d"):  # a demand takes one (never waits for updates queued behind its caller)
        assert "d" in store.images and len(store.images) == 2
    store.close()


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("layers", ["1", "3", "4"])
def test_a_state_dir_of_a_model_with_other_layers_is_refused_before_any_region_is_written(tmp_path, capsys,
                                                                                          layers):
    # Same width: the embedding and the first blocks match; the check runs on the whole manifest
    # before the first registration, so none of those regions is overwritten (issue 46, case 4).
    state = tmp_path / "state"
    rc, err = run_cli(capsys, *SMALL, "--steps", "1", "--out", str(tmp_path / "a"), "--state-dir", str(state))
    assert rc == 0, err
    before = files_of(state)
    flags = dict(zip(SMALL[::2], SMALL[1::2]), **{"--layers": layers})
    rc, err = run_cli(capsys, *[x for kv in flags.items() for x in kv], "--steps", "1", "--out", str(tmp_path / "b"),
                      "--state-dir", str(state), "--overwrite")
    assert rc == 2
    assert_one_clear_line(err, str(state), "another model", f"this one has {int(layers) + 2}", "nothing in it was changed")
    assert files_of(state) == before
    with pytest.raises(StateDirError, match="holds the state of another model"):  # the Python API alike
        l2l_hw.Relay(gpt(), lm_loss, eps=disk_eps(state), micro_batches=2)
    assert files_of(state) == before


def test_a_state_dir_refused_for_lack_of_space_leaves_nothing_behind(tmp_path, monkeypatch, capsys):
    user = tmp_path / "user"  # a folder of the user's: it and its file stay, nothing of the EPS's does
    user.mkdir()
    (user / "notes.txt").write_text("mine")

    class Statvfs:
        f_bavail, f_frsize = 1, 4096  # 4 KiB free: less than one region (two sections of 4 KiB at least)

    monkeypatch.setattr(disk_store.os, "statvfs", lambda path: Statvfs())
    for state in (tmp_path / "new" / "state", user):
        with pytest.raises(StateDirError, match=r"no space for the state: its regions need [\d,]+ more bytes, "
                                                r"4,096 are free \(nothing was written\)"):
            l2l_hw.Relay(gpt(), lm_loss, eps=disk_eps(state), micro_batches=2)
    assert not (tmp_path / "new").exists() and files_of(user) == {"notes.txt": b"mine"}
    assert sorted(p.name for p in user.iterdir()) == ["notes.txt"]
    monkeypatch.undo()

    calls = []

    def full_at_the_third(fd, offset, length):  # the space went while the regions were made
        calls.append(fd)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, offset, length)

    real = os.posix_fallocate
    monkeypatch.setattr(disk_store.os, "posix_fallocate", full_at_the_third)
    rc, err = run_cli(capsys, *SMALL, "--steps", "1", "--out", str(tmp_path / "out"), "--state-dir", str(user))
    assert rc == 2
    assert_one_clear_line(err, str(user), "no space for region 2", "regions this run made are removed")
    assert sorted(p.name for p in user.iterdir()) == ["notes.txt"]


def test_large_images_are_huge_page_aligned_mappings_and_come_back_exact(tmp_path, monkeypatch):
    """Images of regions of 2 MiB and more are their own mappings starting at a 2 MiB boundary
    (huge pages where the kernel has them); smaller ones at ALIGN. Written in many requests while
    another thread keeps changing the bytes, every region reads back as last changed, its checksums
    verified (each computed after its request: a section changed meanwhile is written again)."""
    import threading

    monkeypatch.setattr(disk_store, "CHUNK_BYTES", 64 << 10)  # 48 requests a region
    store = disk_store.RegionStore(tmp_path / "state", groups_in_flight=2)
    keys = ["small", "big0", "big1", "big2"]
    sizes = {"small": 8192, "big0": 3 << 20, "big1": 3 << 20, "big2": 3 << 20}
    for key in keys:
        store.add_region(key, {"x": [sizes[key]]}, {"fetched": 0, "state": sizes[key]}, rule={})
    final = {}

    def change(key, value):
        with store.use(key, ("state",), writes=("state",)) as image:
            address = image.buffer.data_ptr()
            assert address % (disk_io.HUGE_PAGE if sizes[key] >= disk_io.HUGE_PAGE else disk_io.ALIGN) == 0
            image.buffer[:sizes[key]].view(torch.int64).fill_(value)
        final[key] = value
        store.write_back(key)

    for key in keys:
        with store.use(key, replaces=("state",)) as image:
            image.buffer.zero_()
        store.write_back(key)
    writer = threading.Thread(target=lambda: [change("big0", v) for v in range(1, 40)])
    writer.start()
    for v in range(1, 20):
        for key in ("small", "big1", "big2"):
            change(key, 100 * v + len(key))
    writer.join()
    store.evict()
    for key in keys:
        with store.use(key, ("state",)) as image:
            assert torch.equal(image.buffer[:sizes[key]].view(torch.int64),
                               torch.full((sizes[key] // 8,), final[key], dtype=torch.int64)), key
    assert disk_io.aligned_buffer(5 << 20)[-1:].add_(1).item() == 1  # a view past the tensor's start, usable
    store.close()
