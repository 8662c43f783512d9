"""Checkpoints: one safetensors file, written atomically, checked on load. Never pickle.

Layout: the tensors as given, plus four safetensors metadata strings:
  "l2l_hw"         json.dumps(meta), the caller's dict (config, step, ...)
  "l2l_hw_format"  FORMAT_VERSION
  "l2l_hw_crc32"   json {tensor name: crc32 of its bytes}; safetensors itself has
                   no checksum, so without it flipped bytes in the data would load.
  "l2l_hw_header_crc32"  crc32 of the other metadata strings and of every tensor's name,
                   dtype and shape: with the tensor checksums, every byte of the file is checked.
"""
import contextlib
import json
import os
import tempfile
import zlib
from pathlib import Path

import safetensors.torch
import torch

FORMAT_VERSION = 2  # 2: the header checksum; a version-1 file is refused by the version check
META_KEY, FORMAT_KEY, CRC_KEY, HEADER_CRC_KEY = "l2l_hw", "l2l_hw_format", "l2l_hw_crc32", "l2l_hw_header_crc32"
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on the JSON header


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used: missing, truncated, corrupted or foreign."""


def _crc32(t: torch.Tensor) -> int:
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy())


def header_crc32(metadata: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    """The checksum of the header: every metadata string but this one, every tensor's name, dtype, shape."""
    layout = {name: [str(t.dtype), list(t.shape)] for name, t in tensors.items()}
    covered = {k: v for k, v in metadata.items() if k != HEADER_CRC_KEY}
    return str(zlib.crc32(json.dumps([covered, layout], sort_keys=True).encode()))


def remove_stale_temporaries(path) -> list[Path]:
    """Remove what an interrupted save_checkpoint(path) left beside `path`: its own temporary
    file and the one safetensors writes first (".tmp" and 6 characters). The removed paths."""
    path = Path(path)
    stale = [p for p in path.parent.glob(f".{path.name}.*.tmp")] + \
            [p for p in path.parent.glob(".tmp??????") if p.name[4:].isalnum()]
    for p in stale:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    return stale


def _standalone(tensors: dict) -> dict:
    # safetensors refuses tensors that share storage (tied weights) and wants them
    # contiguous on the CPU; clone the second and later views of one storage.
    out, seen = {}, set()
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"checkpoint entry {name!r} is a {type(t).__name__}, not a torch.Tensor")
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen and t.numel() else t
        seen.add(ptr)
    return out


def _fsync_dir(folder: Path):
    with contextlib.suppress(OSError):  # not every OS/filesystem can open a directory
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_checkpoint(path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Write atomically: a temporary file in the same folder, fsync, then os.replace.

    On any failure the temporary file is removed and an existing checkpoint at
    `path` is left as it was.
    """
    path = Path(path)
    tensors = _standalone(tensors)
    metadata = {
        META_KEY: json.dumps(meta, sort_keys=True),
        FORMAT_KEY: str(FORMAT_VERSION),
        CRC_KEY: json.dumps({name: _crc32(t) for name, t in tensors.items()}, sort_keys=True),
    }
    metadata[HEADER_CRC_KEY] = header_crc32(metadata, tensors)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        safetensors.torch.save_file(tensors, tmp, metadata=metadata)
        umask = os.umask(0)  # the file is 0600 (a temporary): give it the mode open() gives the run's others
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with open(tmp, "rb+") as f:  # save_file closed it; make its bytes durable before the rename
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _read_header(path: Path, raw: bytes) -> dict:
    # safetensors layout: u64 little-endian header length N, N bytes of JSON, then the data.
    if len(raw) < 8:
        raise CheckpointError(f"{path}: truncated: {len(raw)} bytes, shorter than the 8-byte safetensors header length")
    n = int.from_bytes(raw[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(f"{path}: not a safetensors file (header length field reads {n} bytes)")
    if 8 + n > len(raw):
        raise CheckpointError(f"{path}: truncated: header needs {8 + n} bytes, file has {len(raw)}")
    try:
        header = json.loads(raw[8 : 8 + n])
        ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise CheckpointError(f"{path}: corrupted bytes or not a safetensors file: header is not valid ({e})") from None
    expected = 8 + n + max(ends, default=0)
    if len(raw) < expected:
        raise CheckpointError(f"{path}: truncated: tensors need {expected} bytes, file has {len(raw)}")
    if len(raw) > expected:
        raise CheckpointError(f"{path}: corrupted: {len(raw) - expected} bytes after the last tensor")
    return header


def load_checkpoint(path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, meta) of a checkpoint written by save_checkpoint; CheckpointError otherwise."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path}: a folder, not a checkpoint file")
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    raw = path.read_bytes()
    header = _read_header(path, raw)
    metadata = header.get("__metadata__") or {}
    if META_KEY not in metadata:
        raise CheckpointError(f"{path}: missing l2l_hw metadata: a safetensors file, but not an l2l-hw checkpoint")
    if metadata.get(FORMAT_KEY) != str(FORMAT_VERSION):
        raise CheckpointError(
            f"{path}: format version mismatch: file has {metadata.get(FORMAT_KEY)!r}, "
            f"this l2l-hw reads version {FORMAT_VERSION}")
    try:
        tensors = safetensors.torch.load(raw)
        meta = json.loads(metadata[META_KEY])
        crcs = json.loads(metadata[CRC_KEY])
    except Exception as e:  # safetensors raises its own SafetensorError; json a ValueError
        raise CheckpointError(f"{path}: corrupted bytes: cannot decode ({e})") from None
    if metadata.get(HEADER_CRC_KEY) != header_crc32(metadata, tensors):
        raise CheckpointError(f"{path}: corrupted bytes: the header (metadata, tensor names, dtypes or shapes) "
                              "fails its crc32 check")
    if not isinstance(crcs, dict) or set(crcs) != set(tensors):
        raise CheckpointError(f"{path}: corrupted: tensor names differ from the checksum table")
    for name, t in tensors.items():
        if _crc32(t) != crcs[name]:
            raise CheckpointError(f"{path}: corrupted bytes: tensor {name!r} fails its crc32 check")
    return tensors, meta
