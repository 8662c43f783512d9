"""What a run reads from the file system: regular files only, each refused in one line
that names the path and what it is, so a FIFO, a socket or a device never blocks a read."""
from __future__ import annotations

import stat
from pathlib import Path

KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
         (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISREG, "a regular file"))


def path_kind(path) -> str:
    """What `path` is, in words ("a regular file", "a folder", "a FIFO (named pipe)", ...,
    "missing"); a symbolic link is what it points to."""
    try:
        mode = Path(path).stat().st_mode
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    return next((kind for test, kind in KINDS if test(mode)), "not a regular file")


def regular_file(path, what: str) -> Path:
    """`path` if it is a regular file (or a link to one); otherwise FileNotFoundError (missing)
    or ValueError (anything else), naming `what` the file is for and what the path is."""
    path = Path(path)
    kind = path_kind(path)
    if kind == "missing":
        raise FileNotFoundError(f"{what} {path} does not exist")
    if kind != "a regular file":
        raise ValueError(f"{what} {path} is {kind}, not a regular file")
    return path
