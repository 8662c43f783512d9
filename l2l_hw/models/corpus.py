"""Byte corpora for the reference GPT; nothing is ever downloaded.

Default: the Python standard library's own .py sources on this machine
(~11 MB on CPython 3.11), which every Python install has.

Train/validation split, deterministic across machines and runs:
- a folder (the default or --data DIR): files sorted by relative path; a file
  goes to validation when crc32(relative path) % 10 == 0, else to training.
  If that leaves either side shorter than MIN_SPLIT_BYTES, the byte rule below
  is used on the concatenation instead.
- a single file (--data FILE): the last 10% of its bytes are validation.
Files are read in sorted order until SIZE_CAP_BYTES is reached. Only regular files
are read: a FIFO, socket or device in a folder is skipped (`Corpus.skipped` names them),
and given as --data it is refused, so no read can block.
"""
import os
import sysconfig
import zlib
from pathlib import Path

import numpy as np
import torch

from l2l_hw.inputs import path_kind

SIZE_CAP_BYTES = 16 * 2**20  # the whole 3.11 stdlib fits; loads in ~0.1 s
VAL_MODULUS = 10  # 1 file (or byte) in 10 goes to validation
MIN_SPLIT_BYTES = 4096
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idlelib"}

_cache: dict[tuple, "Corpus"] = {}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_text(raw: bytes) -> bool:
    return b"\0" not in raw[:8192]


def sorted_files(root: Path, suffix: str | None = None) -> list[str]:
    """Relative posix paths of the corpus files under root, sorted."""
    found = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        found += [Path(dirpath, f).relative_to(root).as_posix() for f in files
                  if not f.startswith(".") and (suffix is None or f.endswith(suffix))]
    return sorted(found)


def split_files(rel_paths) -> tuple[list[str], list[str]]:
    """(train, val) in the given order: crc32(relative path) % 10 == 0 goes to validation."""
    val = [p for p in rel_paths if zlib.crc32(p.encode()) % VAL_MODULUS == 0]
    train = [p for p in rel_paths if zlib.crc32(p.encode()) % VAL_MODULUS != 0]
    return train, val


class Corpus:
    """Train and validation bytes in memory, as uint8 tensors."""

    def __init__(self, train: np.ndarray, val: np.ndarray, source: str, skipped: tuple[str, ...] = ()):
        self.train = torch.from_numpy(train.copy())  # copy: frombuffer arrays are read-only
        self.val = torch.from_numpy(val.copy())
        self.source = source
        self.skipped = skipped  # paths under the folder that are not regular files, not read

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, cap: int = SIZE_CAP_BYTES) -> "Corpus":
        """The stdlib corpus (path None), or a user's text file or folder; cached."""
        root = stdlib_root() if path is None else Path(path).expanduser().resolve()
        key = (str(root), cap)
        if key not in _cache:
            _cache[key] = cls._read(root, cap, suffix=".py" if path is None else None)
        return _cache[key]

    @classmethod
    def _read(cls, root: Path, cap: int, suffix: str | None) -> "Corpus":
        kind = path_kind(root)
        if kind == "a regular file":
            raw = root.read_bytes()[:cap]
            if not _is_text(raw):
                raise ValueError(f"{root} is a binary file (NUL bytes in its first 8 KiB); give a text file or a folder")
            data = np.frombuffer(raw, dtype=np.uint8)
            return cls(*_split_bytes(data), source=str(root))
        if kind == "missing":
            raise FileNotFoundError(f"corpus path {root} is neither a file nor a folder: it does not exist")
        if kind != "a folder":
            raise ValueError(f"corpus path {root} is {kind}; give a text file or a folder")
        texts, total, skipped = {}, 0, []
        for rel in sorted_files(root, suffix):
            if total >= cap:
                break
            if path_kind(root / rel) != "a regular file":
                skipped.append(rel)
                continue
            raw = (root / rel).read_bytes()[: cap - total]
            if _is_text(raw):
                texts[rel] = raw
                total += len(raw)
        train_files, val_files = split_files(texts)
        train = b"".join(texts[f] for f in train_files)
        val = b"".join(texts[f] for f in val_files)
        if min(len(train), len(val)) < MIN_SPLIT_BYTES:  # too few files for a per-file split
            return cls(*_split_bytes(np.frombuffer(b"".join(texts.values()), np.uint8)), source=str(root),
                       skipped=tuple(skipped))
        return cls(np.frombuffer(train, np.uint8), np.frombuffer(val, np.uint8), source=str(root),
                   skipped=tuple(skipped))

    def batch(self, split: str, batch_size: int, block_size: int, generator: torch.Generator | None = None):
        """Random windows: x (B, T) int64 and y = x shifted by one byte."""
        data = {"train": self.train, "val": self.val}[split]
        if len(data) < block_size + 1:
            raise ValueError(f"{split} split has {len(data)} bytes, fewer than a context of {block_size} + 1")
        starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)  # (B,)
        window = data[starts[:, None] + torch.arange(block_size + 1)].long()  # (B, T+1)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def _split_bytes(data: np.ndarray):
    n_val = max(len(data) // VAL_MODULUS, 1)
    return data[:-n_val], data[-n_val:]
