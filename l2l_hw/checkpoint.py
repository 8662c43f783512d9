"""Checkpoints: one safetensors file, streamed, written atomically, checked on load. Never pickle.

Layout: a plain safetensors file (safetensors' own loaders read it) holding the tensors
as given, plus four metadata strings:
  "l2l_hw"         json.dumps(meta), the caller's dict (config, step, ...)
  "l2l_hw_format"  FORMAT_VERSION
  "l2l_hw_crc32"   json {tensor name: crc32 of its bytes, 8 hex digits}; safetensors itself
                   has no checksum, so without it flipped bytes in the data would load.
  "l2l_hw_header_crc32"  crc32 (8 hex digits) of the other three and of every tensor's
                   name, dtype, shape and offsets: with the tensor checksums, every byte of
                   the file is checked.

Streaming: the state of a large model is never copied whole. `save_checkpoint` takes
tensors or `StateEntry`s (read one at a time, as the EPS hands out its buffers) and
writes each one's bytes straight from its memory; the checksums are filled into the
header afterwards (fixed width, so the header keeps its length). `open_checkpoint`
checks every checksum in one pass over the file and then gives a mapping whose values
are `StateEntry`s, read from the file one at a time when loaded.
"""
import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Mapping

import torch
from zlib_ng.zlib_ng import crc32  # zlib's crc32, the same values, ~10x the speed

from l2l_hw.eps.base import StateEntry
from l2l_hw.version import __version__

FORMAT_VERSION = 2  # 2: checksums as fixed-width hex, written after the data; the header's own
META_KEY, FORMAT_KEY, CRC_KEY, HEADER_CRC_KEY = "l2l_hw", "l2l_hw_format", "l2l_hw_crc32", "l2l_hw_header_crc32"
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on the JSON header
CHUNK_BYTES = 64 << 20  # checksum pass: bytes read at a time
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
DTYPE_OF = {name: dtype for dtype, name in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used: missing, truncated, corrupted or foreign."""


def _raw(t: torch.Tensor):
    """The bytes of a tensor as a buffer over its own memory (no copy for a contiguous CPU tensor)."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


def _fsync_dir(folder: Path):
    with contextlib.suppress(OSError):  # not every OS/filesystem can open a directory
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def header_crc32(layout: dict) -> str:
    """The checksum of a header: every metadata string but this one, and every tensor's name,
    dtype, shape and offsets."""
    covered = {name: ({k: v for k, v in info.items() if k != HEADER_CRC_KEY} if name == "__metadata__" else info)
               for name, info in layout.items()}
    return f"{crc32(json.dumps(covered, sort_keys=True).encode()):08x}"


def _header(entries: dict, meta: dict, crcs: dict[str, int]) -> bytes:
    """The safetensors header (length-prefixed JSON, space-padded to 8 bytes)."""
    layout, offset = {}, 0
    for name, e in entries.items():
        nbytes = e.shape.numel() * e.dtype.itemsize
        layout[name] = {"dtype": DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    layout["__metadata__"] = {META_KEY: json.dumps(meta, sort_keys=True), FORMAT_KEY: str(FORMAT_VERSION),
                              CRC_KEY: json.dumps({n: f"{crcs.get(n, 0):08x}" for n in entries}, sort_keys=True)}
    layout["__metadata__"][HEADER_CRC_KEY] = header_crc32(layout)
    text = json.dumps(layout, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return len(text).to_bytes(8, "little") + text


def file_bytes(entries: Mapping[str, StateEntry], meta: dict) -> int:
    """The size of the file save_checkpoint(path, entries, meta) writes (its header's checksums
    are of fixed width): what a checkpoint takes on disk, known before any tensor exists."""
    data = sum(e.shape.numel() * e.dtype.itemsize for e in entries.values())
    return len(_header(dict(entries), meta, {})) + data


TEMPORARY_MARKER = "l2l-tmp"  # in the name of every temporary file save_checkpoint writes, with its pid


def _temporary_prefix(path: Path) -> str:
    return f".{path.name}.{TEMPORARY_MARKER}-{os.getpid()}-"


def temporary_beside(path: Path, folder: bool = False) -> Path:
    """A new empty file (or folder) beside `path`, named as this program names its temporaries
    (the marker and this pid: remove_stale_temporaries removes those a killed run left), with
    the mode open() (mkdir()) gives the run's other files; mkstemp (mkdtemp) make it 0600 (0700)."""
    if folder:
        made = tempfile.mkdtemp(prefix=_temporary_prefix(path), suffix=".tmp", dir=path.parent)
    else:
        fd, made = tempfile.mkstemp(prefix=_temporary_prefix(path), suffix=".tmp", dir=path.parent)
        os.close(fd)
    os.chmod(made, new_file_mode(folder))
    return Path(made)


def new_file_mode(folder: bool = False) -> int:
    """The mode open() (mkdir()) gives a new file (folder): 0o666 (0o777) less the user's umask.
    For what a writer makes 0600 (mkstemp; safetensors 0.8's save_file, and with it transformers'
    own save_pretrained), so that a model or run shared with a group is readable by it, as the
    folder's other files are."""
    umask = None
    with contextlib.suppress(OSError, ValueError):  # Linux: read without changing it
        with open("/proc/self/status") as f:
            umask = next((int(line.split()[1], 8) for line in f if line.startswith("Umask:")), None)
    if umask is None:  # elsewhere: set and put back at once
        umask = os.umask(0o022)
        os.umask(umask)
    return (0o777 if folder else 0o666) & ~umask


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def remove_stale_temporaries(path) -> list[Path]:
    """Remove the temporaries (files or folders, temporary_beside) that an interrupted write of
    `path` left beside it: only names this program writes (".{name}.l2l-tmp-{pid}-{random}.tmp")
    whose pid is no longer running. Anything else in the folder, whatever its name, is left
    alone. The removed paths."""
    path = Path(path)
    stale = []
    for p in path.parent.glob(f".{path.name}.{TEMPORARY_MARKER}-*-*.tmp"):
        pid = p.name[len(f".{path.name}.{TEMPORARY_MARKER}-"):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            stale.append(p)
    return stale


def _entry(name: str, t) -> StateEntry:
    if isinstance(t, StateEntry):
        entry = t
    elif isinstance(t, torch.Tensor):
        entry = StateEntry(t.shape, t.dtype, lambda t=t: t)
    else:
        raise TypeError(f"checkpoint entry {name!r} is a {type(t).__name__}, not a torch.Tensor")
    if entry.dtype not in DTYPES:
        raise TypeError(f"checkpoint entry {name!r} has dtype {entry.dtype}; a checkpoint stores "
                        f"{', '.join(str(d) for d in DTYPES)}")
    return entry


def run_meta(cfg, step: int, elapsed: float) -> dict:
    """A training run's checkpoint metadata: its config (TrainConfig.run_config()), step, seconds
    trained, this version, and where its state was (--state-dir), which --resume keeps unless told."""
    state_dir = str(Path(cfg.state_dir).expanduser().resolve()) if cfg.state_dir else None
    return {"config": cfg.run_config(), "step": step, "elapsed": elapsed, "l2l_hw_version": __version__,
            "state_dir": state_dir}


def save_checkpoint(path, tensors: Mapping[str, torch.Tensor | StateEntry], meta: dict) -> None:
    """Write atomically: a temporary file in the same folder, fsync, then os.replace.

    Tensors stream to the file one at a time (a StateEntry is read only when written). On
    any failure the temporary file is removed and an existing checkpoint at `path` is left
    as it was."""
    path = Path(path)
    entries = {name: _entry(name, t) for name, t in tensors.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_beside(path)
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY), "wb") as f:
            header = _header(entries, meta, {})
            f.write(header)
            crcs = {}
            for name, e in entries.items():
                t = e.read()
                if t.shape != e.shape or t.dtype != e.dtype:
                    raise ValueError(f"checkpoint entry {name!r} read as {t.dtype} {tuple(t.shape)}; "
                                     f"announced {e.dtype} {tuple(e.shape)}")
                data = _raw(t)
                crcs[name] = crc32(data)
                f.write(data)
                del t, data
            final = _header(entries, meta, crcs)
            assert len(final) == len(header)  # fixed-width checksums: the data stays where it is
            f.seek(0)
            f.write(final)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


class Checkpoint(Mapping):
    """An opened, checked checkpoint: `meta`, and its tensors as StateEntrys read on demand."""

    def __init__(self, path: Path, layout: dict[str, dict], data_start: int, meta: dict):
        self.path, self.meta = path, meta
        self._layout, self._start = layout, data_start

    def __getitem__(self, name: str) -> StateEntry:
        info = self._layout[name]
        shape = torch.Size(info["shape"])
        return StateEntry(shape, DTYPE_OF[info["dtype"]], lambda: self._read(info, shape))

    def __iter__(self):
        return iter(self._layout)

    def __len__(self):
        return len(self._layout)

    def _read(self, info: dict, shape: torch.Size) -> torch.Tensor:
        t = torch.empty(shape, dtype=DTYPE_OF[info["dtype"]])
        begin, end = info["data_offsets"]
        with open(self.path, "rb") as f:
            f.seek(self._start + begin)
            if f.readinto(_raw(t)) != end - begin:
                raise CheckpointError(f"{self.path}: truncated while reading (the file changed after it was opened)")
        return t

    def view(self, prefix: str) -> dict[str, StateEntry]:
        """The entries whose names start with `prefix`, without it."""
        return {name[len(prefix):]: self[name] for name in self if name.startswith(prefix)}

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: self[name].read() for name in self}


def _check_layout(path: Path, header: dict, size: int, data_start: int) -> dict[str, dict]:
    layout, end = {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPE_OF.get(info.get("dtype")) if isinstance(info, dict) else None
        shape, offsets = (info.get("shape"), info.get("data_offsets")) if isinstance(info, dict) else (None, None)
        if dtype is None or not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape) \
                or not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets) \
                or offsets[1] - offsets[0] != torch.Size(shape).numel() * dtype.itemsize or offsets[0] < 0:
            raise CheckpointError(f"{path}: corrupted bytes or not a safetensors file: entry {name!r} of the "
                                  f"header is not valid")
        layout[name] = info
        end = max(end, offsets[1])
    if size < data_start + end:
        raise CheckpointError(f"{path}: truncated: tensors need {data_start + end} bytes, file has {size}")
    if size > data_start + end:
        raise CheckpointError(f"{path}: corrupted: {size - data_start - end} bytes after the last tensor")
    return layout


def open_checkpoint(path) -> Checkpoint:
    """Open a checkpoint written by save_checkpoint, checking the header and every tensor's
    checksum (one streaming pass); CheckpointError naming the file and the fault otherwise."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path}: a folder, not a checkpoint file")
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        # safetensors layout: u64 little-endian header length N, N bytes of JSON, then the data.
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated: {len(head)} bytes, shorter than the 8-byte safetensors "
                                  f"header length")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: not a safetensors file (header length field reads {n} bytes)")
        if 8 + n > size:
            raise CheckpointError(f"{path}: truncated: header needs {8 + n} bytes, file has {size}")
        try:
            header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError("not an object")
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupted bytes or not a safetensors file: header is not valid "
                                  f"({e})") from None
        layout = _check_layout(path, header, size, 8 + n)
        metadata = header.get("__metadata__") or {}
        if not isinstance(metadata, dict) or META_KEY not in metadata:
            raise CheckpointError(f"{path}: missing l2l_hw metadata: a safetensors file, but not an l2l-hw checkpoint")
        if metadata.get(FORMAT_KEY) != str(FORMAT_VERSION):
            raise CheckpointError(
                f"{path}: format version mismatch: file has {metadata.get(FORMAT_KEY)!r}, "
                f"this l2l-hw reads version {FORMAT_VERSION}")
        if metadata.get(HEADER_CRC_KEY) != header_crc32(header):
            raise CheckpointError(f"{path}: corrupted bytes: the header (metadata, tensor names, dtypes, shapes or "
                                  "offsets) fails its crc32 check")
        try:
            meta = json.loads(metadata[META_KEY])
            crcs = {name: int(crc, 16) for name, crc in json.loads(metadata[CRC_KEY]).items()}
        except Exception as e:
            raise CheckpointError(f"{path}: corrupted bytes: cannot decode the metadata ({e})") from None
        if set(crcs) != set(layout):
            raise CheckpointError(f"{path}: corrupted: tensor names differ from the checksum table")
        for name, info in sorted(layout.items(), key=lambda item: item[1]["data_offsets"][0]):
            begin, end = info["data_offsets"]
            f.seek(8 + n + begin)
            crc, left = 0, end - begin
            while left:
                chunk = f.read(min(left, CHUNK_BYTES))
                crc, left = crc32(chunk, crc), left - len(chunk)
            if crc != crcs[name]:
                raise CheckpointError(f"{path}: corrupted bytes: tensor {name!r} fails its crc32 check")
    return Checkpoint(path, layout, 8 + n, meta)


def load_checkpoint(path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, meta) of a checkpoint written by save_checkpoint, all in memory; CheckpointError
    otherwise. For a large model, open_checkpoint and load from the mapping instead."""
    ckpt = open_checkpoint(path)
    return ckpt.tensors(), ckpt.meta
