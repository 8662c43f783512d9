"""`l2l bench disk`'s peer (l2l_hw/bench/aio.py): DeepSpeed's aio handle is tuned in its own
manner and then timed beside the tier at the setting its sweep named; what it writes is on
disk byte for byte (read back with plain Python), and a read that brings back other bytes
fails loudly rather than counting as fast."""
import json
import os
import statistics
import time
from dataclasses import asdict

import pytest
import torch

from l2l_hw.bench import aio
from l2l_hw.models import GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")
SMALL_GRID = (aio.AioSetting(1 << 20, 8, False, True, 1), aio.AioSetting(1 << 20, 32, True, False, 2),
              aio.AioSetting(4 << 20, 8, False, True, 4))


class PlainFileHandle:
    """A stand-in for DeepSpeed's aio_handle that moves the bytes with plain file I/O, recording
    which setting each call ran with (the bench's plumbing, without the op's minutes of build)."""

    def __init__(self, calls, *setting):
        self.calls, self.setting = calls, setting

    def new_cpu_locked_tensor(self, nbytes, example):
        return torch.empty(nbytes, dtype=example.dtype)

    def free_cpu_locked_tensor(self, tensor):
        return True

    def pwrite(self, buffer, path, validate, asynchronous):
        self.calls.append(("write", path, self.setting))
        with open(path, "r+b") as f:
            f.write(buffer.numpy().tobytes())
        return 0

    def pread(self, buffer, path, validate, asynchronous):
        self.calls.append(("read", path, self.setting))
        with open(path, "rb") as f:
            buffer.copy_(torch.frombuffer(bytearray(f.read()), dtype=torch.uint8))
        return 0

    def wait(self):
        time.sleep(0.001)  # a measurable time, never zero
        return 1


class PlainFileOp:
    def __init__(self):
        self.calls = []

    def aio_handle(self, *setting):
        return PlainFileHandle(self.calls, *setting)


def real_op():
    op = aio.load_op()
    if isinstance(op, str):
        pytest.skip(op)
    return op


def test_bench_disk_times_aio_at_the_setting_its_sweep_named_and_restates_the_ratio(tmp_path, monkeypatch, capsys):
    from l2l_hw.bench import disk as bench_disk
    from l2l_hw.cli import main

    op = PlainFileOp()
    monkeypatch.setattr(bench_disk, "MODEL", GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    monkeypatch.setattr(bench_disk, "load_aio", lambda: op)
    monkeypatch.setattr(aio, "GRID", SMALL_GRID)
    assert main(["bench", "disk", "--dir", str(tmp_path), "--size-gib", "0.015625", "--region-mib", "8",
                 "--rounds", "1", "--batches", "2", "--aio-sweep-mib", "16", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    sweep = r["deepspeed_aio_sweep"]
    assert [p["setting"] for p in sweep["points"]] == [asdict(s) for s in SMALL_GRID]
    for rw in aio.DIRECTIONS:
        finalists = sweep["finalists"][rw]
        assert len(finalists) == aio.FINALISTS
        fastest = max(finalists, key=lambda f: statistics.median(f["gbps"]))
        assert sweep["best"][rw] == fastest["setting"]
        assert sweep["best_named"][rw] == aio.AioSetting(**fastest["setting"]).describe()
        # the comparison's aio pass ran every call of this direction at that setting, on the tier's bytes
        timed = [setting for kind, path, setting in op.calls  # () is the files' untimed first write
                 if kind == rw and "/aio/" in path and setting != ()]
        assert len(timed) == 2 and set(timed) == {tuple(sweep["best"][rw].values())}
        spread = r["deepspeed_aio"][rw]
        assert 0 < spread["min"] <= spread["median"] <= spread["max"]
        ratio = r["tier_vs_deepspeed_aio"][rw]
        assert 0 < ratio["min"] <= ratio["median"] <= ratio["max"]
    assert list(tmp_path.iterdir()) == []  # nothing left behind


@pytest.mark.slow  # DeepSpeed's aio op: built on first use, minutes
def test_aio_writes_the_buffer_to_disk_byte_for_byte_and_a_changed_file_fails_the_read(tmp_path):
    files = aio.AioFiles(real_op(), tmp_path / "aio", count=2, file_bytes=4 << 20)
    expected = files.buffer.numpy().tobytes()
    for setting in SMALL_GRID:
        handle = files.handle(setting)
        with open(files.paths[1], "r+b") as f:
            f.write(bytes(4 << 20))  # so that this setting's write is what the check sees
        assert files.write(handle) > 0
        for path in files.paths:
            with open(path, "rb") as f:
                assert f.read() == expected, setting
        assert files.read(handle) > 0 and files.buffer.numpy().tobytes() == expected
    with open(files.paths[-1], "r+b") as f:
        f.seek(1 << 20)
        f.write(b"\x00" * 4096)
    with pytest.raises(OSError, match="other bytes than it wrote"):
        files.read(files.handle(SMALL_GRID[0]))
    files.close()
    assert not (tmp_path / "aio").exists()


@pytest.mark.slow  # DeepSpeed's aio op: built on first use, minutes
def test_the_real_aio_sweep_names_its_finalist_with_the_highest_median(tmp_path):
    report = aio.sweep(real_op(), tmp_path / "sweep", count=2, file_bytes=4 << 20, rounds=3, grid=SMALL_GRID)
    assert len(report["points"]) == len(SMALL_GRID) and all(p[rw] > 0 for p in report["points"]
                                                            for rw in aio.DIRECTIONS)
    for rw in aio.DIRECTIONS:
        best = max(report["finalists"][rw], key=lambda f: statistics.median(f["gbps"]))
        assert report["best"][rw] == best["setting"]
    assert os.listdir(tmp_path) == []
