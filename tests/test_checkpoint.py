"""Checkpoints: exact round trip, atomic writes, and clear errors for bad files."""
import json
import os
import resource
import signal

import pytest
import safetensors.torch
import torch

import l2l_hw.checkpoint as ckpt
from l2l_hw.checkpoint import CheckpointError, load_checkpoint, open_checkpoint, save_checkpoint
from l2l_hw.eps.base import StateEntry


def _tensors():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 16, generator=g)
    return {
        "w": w,
        "tied": w,  # shares storage with "w", as tied weights do
        "half": torch.randn(5, generator=g).to(torch.bfloat16),
        "step": torch.tensor(42, dtype=torch.int64),
        "rng.torch": torch.get_rng_state(),
        "odd": torch.tensor([float("nan"), float("inf"), -0.0, 1e-45]),
    }


def _saved(tmp_path, name="c.safetensors"):
    path = tmp_path / name
    save_checkpoint(path, _tensors(), {"step": 42, "config": {"layers": 2}})
    return path


def test_round_trip_is_bit_exact_for_every_dtype_and_keeps_meta(tmp_path):
    path = _saved(tmp_path)
    tensors, meta = load_checkpoint(path)
    want = _tensors()
    assert set(tensors) == set(want)
    for name, t in want.items():
        assert tensors[name].dtype == t.dtype and tensors[name].shape == t.shape
        assert tensors[name].reshape(-1).view(torch.uint8).equal(t.reshape(-1).view(torch.uint8)), name  # bitwise, NaN included
    assert meta == {"step": 42, "config": {"layers": 2}}


def test_file_is_plain_safetensors_with_l2l_hw_metadata_no_pickle(tmp_path):
    path = _saved(tmp_path)
    with safetensors.safe_open(str(path), "pt") as f:
        assert json.loads(f.metadata()["l2l_hw"])["step"] == 42
    assert b"pickle" not in path.read_bytes()[:64] and path.read_bytes()[8:9] == b"{"


def test_missing_file_raises_checkpoint_error_naming_the_path(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint file") as e:
        load_checkpoint(tmp_path / "nope.safetensors")
    assert "nope.safetensors" in str(e.value)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("keep", [0, 5, 100, -1])  # empty, inside the length field, inside the header, last byte gone
def test_truncated_file_raises_checkpoint_error_saying_truncated(tmp_path, keep):
    path = _saved(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[:keep] if keep >= 0 else raw[:-1])
    with pytest.raises(CheckpointError, match="truncated") as e:
        load_checkpoint(path)
    assert str(path) in str(e.value)


def test_flipped_byte_in_tensor_data_raises_checkpoint_error_saying_corrupted(tmp_path):
    path = _saved(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # inside the last tensor's data: safetensors alone would load it
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="corrupted bytes: tensor .* crc32"):
        load_checkpoint(path)


def test_garbage_header_and_foreign_file_raise_checkpoint_error(tmp_path):
    path = _saved(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[8:12] = b"\xff\xfe\x00!"  # the JSON header no longer parses
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="corrupted bytes or not a safetensors file"):
        load_checkpoint(path)
    other = tmp_path / "notes.txt"
    other.write_text("this is a text file, not a checkpoint\n" * 10)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        load_checkpoint(other)


def test_safetensors_without_l2l_hw_metadata_raises_checkpoint_error(tmp_path):
    path = tmp_path / "foreign.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(CheckpointError, match="missing l2l_hw metadata"):
        load_checkpoint(path)


def test_other_format_version_raises_checkpoint_error_naming_both_versions(tmp_path):
    path = tmp_path / "future.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(2)}, str(path),
                                metadata={"l2l_hw": "{}", "l2l_hw_format": "999", "l2l_hw_crc32": "{}"})
    with pytest.raises(CheckpointError, match="format version mismatch.*'999'.*version 2"):
        load_checkpoint(path)


@pytest.mark.parametrize("fail_in", ["write", "fsync"])
def test_failed_save_leaves_no_partial_file_and_keeps_previous_checkpoint(tmp_path, monkeypatch, fail_in):
    path = _saved(tmp_path)
    before = path.read_bytes()

    def no_fsync(fd):
        raise OSError(5, "Input/output error")

    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG
    try:
        if fail_in == "write":  # a real short write: the file system takes 4 KiB, the checkpoint is larger
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
        else:
            monkeypatch.setattr(ckpt.os, "fsync", no_fsync)
        with pytest.raises(OSError):
            save_checkpoint(path, {"w": torch.ones(10_000)}, {"step": 43})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert os.listdir(tmp_path) == [path.name]  # no temporary file left behind
    assert path.read_bytes() == before
    assert load_checkpoint(path)[1]["step"] == 42


def test_streamed_save_reads_each_entry_once_and_open_reads_lazily(tmp_path):
    """save_checkpoint reads a StateEntry only when writing it; open_checkpoint's mapping reads
    nothing until an entry is read, and gives the bytes that were saved."""
    reads = []
    w = torch.randn(1000)
    entry = StateEntry(w.shape, w.dtype, lambda: reads.append("w") or w)
    save_checkpoint(tmp_path / "c.safetensors", {"w": entry, "step": torch.tensor(3)}, {"step": 3})
    assert reads == ["w"]
    opened = open_checkpoint(tmp_path / "c.safetensors")
    assert isinstance(opened["w"], StateEntry) and opened["w"].shape == w.shape
    assert torch.equal(opened["w"].read(), w) and opened.meta == {"step": 3}
    with safetensors.safe_open(str(tmp_path / "c.safetensors"), "pt") as f:  # still plain safetensors
        assert torch.equal(f.get_tensor("w"), w)


def test_save_replaces_an_existing_checkpoint_atomically(tmp_path):
    path = _saved(tmp_path)
    save_checkpoint(path, {"w": torch.ones(3)}, {"step": 43})
    tensors, meta = load_checkpoint(path)
    assert meta == {"step": 43} and torch.equal(tensors["w"], torch.ones(3))
    assert os.listdir(tmp_path) == [path.name]
