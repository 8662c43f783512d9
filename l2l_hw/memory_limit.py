"""A memory limit for a child process: a cgroup of its own, made under this process's cgroup.

    with MemoryLimit(4 << 30) as limit:      # made and set now, or MemoryLimitError (one line)
        run = limit.run([sys.executable, "-c", ...])
        child = limit.start(argv, ...)       # or a subprocess.Popen inside it; limit.oom_kills(), peak_bytes()
    run.returncode, run.oom_killed, run.peak_bytes, run.stdout
    limits(), headroom()                     # the least limit over this process, and what it may still take

The kernel enforces the limit: a child that needs more than it is reclaimed first, then OOM-killed.

    cgroup v1  the memory controller's own hierarchy (/sys/fs/cgroup/memory): a child of this
               process's memory cgroup (/proc/self/cgroup's "memory:" line), memory.limit_in_bytes
               and, where the kernel accounts swap, memory.memsw.limit_in_bytes at the same value
               (no swapping past the limit). OOM kills: memory.oom_control's oom_kill.
    cgroup v2  the unified hierarchy (/sys/fs/cgroup with cgroup.controllers): a child of this
               process's cgroup ("0::" line), memory.max, memory.swap.max 0. The memory controller
               must be delegated to it (the parent's cgroup.subtree_control; v2 refuses to enable
               it where the parent holds processes itself). OOM kills: memory.events' oom_kill.

The child enters before it runs anything: a shell writes its own pid into the cgroup's
cgroup.procs and execs the command (no preexec_fn in a process with threads), so every
byte the command allocates is charged inside. The cgroup is removed when the MemoryLimit
closes (its remaining processes, the command's own children, killed first).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 62  # cgroup v1 reports "no limit" as the largest page multiple below 2**63


class MemoryLimitError(OSError):
    """No memory limit can be set here; the message says why, in one line."""


class OutOfMemoryKill(RuntimeError):
    """The command was killed by the kernel for exceeding its memory limit."""


@dataclass
class LimitedRun:
    """What the command did inside the limit."""

    returncode: int
    stdout: str
    stderr: str
    limit_bytes: int  # as the kernel set it (rounded down to a page)
    peak_bytes: int  # the cgroup's peak charge (its processes' memory and the page cache they caused); 0: unknown
    oom_kills: int  # processes the kernel's OOM killer killed inside
    version: int  # the cgroup version, 1 or 2

    @property
    def oom_killed(self) -> bool:
        return self.oom_kills > 0 or self.returncode == -signal.SIGKILL


def _own_cgroup(version: int, proc_cgroup: str) -> str:
    """This process's cgroup path in the hierarchy of `version` (/proc/self/cgroup)."""
    for line in proc_cgroup.splitlines():
        number, controllers, path = line.split(":", 2)
        if (version == 1 and "memory" in controllers.split(",")) or (version == 2 and number == "0"):
            return path
    raise MemoryLimitError(f"this process is in no cgroup{' v1 memory' if version == 1 else ' v2'} controller's "
                           "hierarchy (/proc/self/cgroup)")


def cgroup_version(root: Path | None = None) -> int | None:
    """1 where the v1 memory controller is mounted, 2 where the unified hierarchy has the memory
    controller, else None."""
    root = ROOT if root is None else root
    if (root / "memory" / "memory.limit_in_bytes").exists():
        return 1
    controllers = root / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        return 2
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)


def _stat(path: Path, field: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, value = line.split()
            if name == field:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def limits(root: Path | None = None, proc_cgroup: str | None = None) -> tuple[int, int] | None:
    """The memory limits over this process: (the least limit of its cgroup and those above it,
    the bytes it may still take before one of them: the least of limit - working set, the
    charge less the inactive page cache the kernel reclaims first). None where none is set."""
    root = ROOT if root is None else root
    version = cgroup_version(root)
    if version is None:
        return None
    proc_cgroup = Path("/proc/self/cgroup").read_text() if proc_cgroup is None else proc_cgroup
    try:
        path = _own_cgroup(version, proc_cgroup)
    except MemoryLimitError:
        return None
    base = root / "memory" if version == 1 else root
    names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file") if version == 1 else \
        ("memory.max", "memory.current", "inactive_file")
    least = room = None
    folder = base / path.lstrip("/")
    while True:
        limit = _read_int(folder / names[0])
        if limit is not None and limit < UNLIMITED:
            used = (_read_int(folder / names[1]) or 0) - _stat(folder / "memory.stat", names[2])
            least = limit if least is None else min(least, limit)
            room = max(0, limit - max(0, used)) if room is None else min(room, max(0, limit - max(0, used)))
        if folder == base:
            return None if least is None else (least, room)
        folder = folder.parent


def headroom(root: Path | None = None, proc_cgroup: str | None = None) -> int | None:
    """Bytes this process may still take under its cgroups' memory limits (limits()); None: no limit."""
    found = limits(root, proc_cgroup)
    return None if found is None else found[1]


class MemoryLimit:
    """A cgroup of `limit_bytes` under this process's own, made and set at construction (or one
    MemoryLimitError line saying why not); run() runs a command inside it; close() removes it."""

    def __init__(self, limit_bytes: int, root: Path | None = None, proc_cgroup: str | None = None):
        root = ROOT if root is None else root
        if limit_bytes <= 0:
            raise MemoryLimitError(f"a memory limit must be positive, not {limit_bytes} bytes")
        self.version = cgroup_version(root)
        if self.version is None:
            raise MemoryLimitError(f"cannot set a memory limit: {root} has neither the cgroup v1 memory controller "
                                   "nor cgroup v2 with the memory controller")
        proc_cgroup = Path("/proc/self/cgroup").read_text() if proc_cgroup is None else proc_cgroup
        parent = (root / "memory" if self.version == 1 else root) / _own_cgroup(self.version, proc_cgroup).lstrip("/")
        self.path = parent / f"l2l-{os.getpid()}-{id(self):x}"
        try:
            if self.version == 2:
                self._delegate(parent)
            self.path.mkdir()
        except OSError as e:
            why = ("cgroup v2 enables the memory controller only for the children of a cgroup without processes of "
                   "its own: run under a delegated one, e.g. systemd-run --scope" if self.version == 2 else
                   "it needs write access to the process's cgroup, as root")
            raise MemoryLimitError(f"cannot set a memory limit: cannot make a cgroup under {parent} "
                                   f"({e.strerror or e}; {why})") from None
        try:
            if self.version == 1:
                (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                memsw = self.path / "memory.memsw.limit_in_bytes"
                if memsw.exists():  # the kernel accounts swap: memory + swap within the same limit
                    memsw.write_text(str(limit_bytes))
                self.limit_bytes = _read_int(self.path / "memory.limit_in_bytes")
            else:
                (self.path / "memory.max").write_text(str(limit_bytes))
                swap = self.path / "memory.swap.max"
                if swap.exists():
                    swap.write_text("0")
                self.limit_bytes = _read_int(self.path / "memory.max")
        except OSError as e:
            self.close()
            raise MemoryLimitError(f"cannot set a memory limit on {self.path} ({e.strerror or e})") from None

    @staticmethod
    def _delegate(parent: Path) -> None:
        """cgroup v2: the memory controller enabled for the parent's children."""
        control = parent / "cgroup.subtree_control"
        if "memory" not in control.read_text().split():
            control.write_text("+memory")

    def start(self, argv: list[str], **popen) -> subprocess.Popen:
        """`argv` started inside the limit (subprocess.Popen's keywords): a shell enters the
        cgroup, then becomes the command, so nothing of it runs outside."""
        return subprocess.Popen(["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"),
                                 *argv], **popen)

    def run(self, argv: list[str], env: dict | None = None, timeout: float | None = None) -> LimitedRun:
        """`argv` inside the limit, its output captured: the run's exit, peak and OOM kills."""
        kills_before = self.oom_kills()
        if self.version == 1:  # the peak of this run, not of one before it
            (self.path / "memory.max_usage_in_bytes").write_text("0")
        child = self.start(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            raise
        return LimitedRun(child.returncode, stdout, stderr, self.limit_bytes, self.peak_bytes(),
                          self.oom_kills() - kills_before, self.version)

    def peak_bytes(self) -> int:
        """The cgroup's peak charge so far (0 where the kernel does not report it)."""
        return _read_int(self.path / ("memory.max_usage_in_bytes" if self.version == 1 else "memory.peak")) or 0

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer has killed in the cgroup."""
        if self.version == 1:
            return _stat(self.path / "memory.oom_control", "oom_kill")
        return _stat(self.path / "memory.events", "oom_kill")

    def close(self) -> None:
        """Remove the cgroup (processes still in it, the command's own children, are killed first)."""
        if not self.path.exists():
            return
        for attempt in range(50):
            try:
                pids = [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
            except OSError:
                pids = []
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)  # the killed processes are still leaving
        raise MemoryLimitError(f"cannot remove the cgroup {self.path}: it still holds processes")

    def __enter__(self) -> MemoryLimit:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
