"""The `l2l` command's first moments, before torch is imported (seconds on a loaded machine).

When this process runs the command (the console script `l2l`, `python -m l2l_hw.cli`,
`torchrun ... -m l2l_hw.cli`), l2l_hw/__init__.py calls install() before any heavy import:

    signals   SIGINT and SIGTERM end the process at once with one line and exit 130 / 143, as
              they do later in the command (l2l_hw/cli.py run_command takes over); nothing has
              been read or written yet
    c10d      its C++ warnings are not printed (TORCH_CPP_LOG_LEVEL, read once when torch loads;
              a value the user set is kept): a rank whose peer died would print ~25 lines of
              socket errors and stack frames before its own one line that says what happened

Imported as a library, l2l_hw changes neither.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

COMMANDS = ("train", "finetune", "info", "bench")
PROGRAM_MODULES = ("l2l_hw.cli",)  # what `python -m` runs as the command


def running_the_command() -> bool:
    """Whether this process is the `l2l` command (argv as Python was given it)."""
    argv = getattr(sys, "orig_argv", sys.argv)
    if Path(sys.argv[0]).name == "l2l":
        return True
    return any(a == "-m" and b in PROGRAM_MODULES for a, b in zip(argv, argv[1:]))


def command_name() -> str:
    """`l2l train` (the subcommand where argv names one), as the command's messages begin."""
    given = [a for a in sys.argv[1:] if a in COMMANDS]
    return f"l2l {given[0]}" if given else "l2l"


def _stop(signum, frame):
    name = signal.Signals(signum).name
    print(f"{command_name()}: interrupted by {name} while starting; nothing was written", file=sys.stderr)
    raise SystemExit(128 + signum)


DEFAULTS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}  # Python's own


def install() -> None:
    """Where this process runs the command: the handlers and c10d's log level above."""
    if not running_the_command() or threading.current_thread() is not threading.main_thread():
        return
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    for signum, default in DEFAULTS.items():
        if signal.getsignal(signum) is default:
            signal.signal(signum, _stop)


def started() -> None:
    """The command has parsed its arguments and starts: the signals act as Python's defaults
    again (a command that writes installs its own: l2l_hw/cli.py run_command)."""
    for signum, default in DEFAULTS.items():
        if signal.getsignal(signum) is _stop:
            signal.signal(signum, default)
