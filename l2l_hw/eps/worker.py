"""The update thread shared by the asynchronous EPS backends.

One worker thread serves a backend's queued updates, one chunk at a time, in the order the
groups are used next (the update's life, docs/ARCHITECTURE.md):

    submit(key, update)   queue group `key`'s update: a generator that yields between its
                          chunks and returns whether it saw a non-finite gradient
    order(keys)           the groups in the order the next forward sweep fetches them: the
                          backlog is served in that order, not first in, first out (the
                          backward pushes layer 0 last and the forward needs it first)
    result(key)           wait for `key`'s update: a waited-for group overtakes every other
                          at the next chunk boundary
    when_done(key, then)  call `then()` on the update thread as `key`'s update succeeds (the
                          relay starts the group's copy up to the device there)

So while the update of layer i overlaps the backward of layer i-1 on the caller's thread,
a group the device needs sooner never waits behind a whole later one. Updates of one group
never overlap: a group's update is collected (EPS.fetch, or its next push) before the next.

Inline, each update runs to its end on the caller's thread when it is pushed: where the
layers compute on the same cores as the update (the relay on the CPU), overlapping them
would only put more busy threads than cores on the machine. An update's error is raised
where its result is collected (fetch of that group, wait, commit), never lost and never a
deadlock.
"""
from __future__ import annotations

import atexit
import itertools
import threading
import weakref
from concurrent.futures import Future
from typing import Callable, Generator

Update = Generator[None, None, bool]  # yields between chunks; returns whether a gradient was not finite

LAST = float("inf")  # the rank of a group the next forward does not fetch: after every known one


class UpdateError(RuntimeError):
    """An eager update failed; the message names the EPS group."""


class _Task:
    def __init__(self, key: str, update: Update, seq: int):
        self.key, self.update, self.seq = key, update, seq
        self.done: Future = Future()
        self.waited: int | None = None  # set when a reader waits: it goes first
        self.then: list[Callable[[], None]] = []  # called on the update thread once it has succeeded


_BACKLOGS: "weakref.WeakSet[_Backlog]" = weakref.WeakSet()


@atexit.register
def _drain_backlogs() -> None:
    """At exit, an EPS nobody closed finishes its updates before the interpreter tears torch down
    (an update cut there aborts the process), as concurrent.futures' pools do."""
    for backlog in list(_BACKLOGS):
        backlog.close(wait=True)


class _Backlog:
    """The queued updates and the thread that serves them, started with the first update queued
    (an inline worker has none). The thread holds this, not the worker: a worker nobody closed
    is collected, and its thread ends once the backlog is served."""

    def __init__(self, name: str):
        self.cond = threading.Condition()
        self.queue: list[_Task] = []  # not finished
        self.rank: dict[str, int] = {}  # group -> its place in the next forward's fetches
        self.closed = False
        self.thread = threading.Thread(target=self.serve, name=name, daemon=True)

    def add(self, task: _Task) -> None:
        with self.cond:
            if self.closed:
                raise RuntimeError("the EPS update worker is shut down")
            self.queue.append(task)
            if not self.thread.is_alive():
                self.thread.start()
                _BACKLOGS.add(self)
            self.cond.notify_all()

    def close(self, wait: bool = False) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if wait and self.thread.ident is not None and self.thread is not threading.current_thread():
            self.thread.join()

    def next(self) -> _Task | None:
        """The task to advance by one chunk (the caller holds the lock): a waited-for one first,
        then in the next forward's order, then first in, first out."""
        while not self.queue:
            if self.closed:
                return None
            self.cond.wait()
        return min(self.queue, key=lambda t: (t.waited is None, t.waited or 0, self.rank.get(t.key, LAST), t.seq))

    def serve(self) -> None:
        while True:
            with self.cond:
                task = self.next()
            if task is None:
                return
            if _advance(task):
                with self.cond:
                    self.queue.remove(task)
                    then, task.then = task.then, []
                if task.done.exception() is None:
                    for call in then:
                        _call(call)


class UpdateWorker:
    def __init__(self, name: str = "l2l-eps-update"):
        self.name = name
        self.inline = False
        self._tasks: dict[str, _Task] = {}  # queued or running, not yet collected by result()
        self._seq = itertools.count()
        self._backlog = _Backlog(name)
        weakref.finalize(self, self._backlog.close)

    def order(self, keys: list[str]) -> None:
        """Serve the backlog in the order of `keys` (the next forward's fetches)."""
        with self._backlog.cond:
            self._backlog.rank = {key: i for i, key in enumerate(keys)}

    def submit(self, key: str, update: Update) -> None:
        """Queue group `key`'s update (a generator; see the module docstring). A previous update of
        the same group must have been collected (result) first."""
        if key in self._tasks:
            raise RuntimeError(f"group {key!r} has an update not yet collected; collect it with result() first")
        task = _Task(key, update, next(self._seq))
        self._tasks[key] = task
        if self.inline:
            _run_to_end(task)
        else:
            self._backlog.add(task)

    def pending(self, key: str) -> bool:
        """Group `key` has an update not yet collected."""
        return key in self._tasks

    def done(self, key: str) -> bool:
        """Group `key`'s update (if any) has finished: collecting it will not wait."""
        task = self._tasks.get(key)
        return task is None or task.done.done()

    def when_done(self, key: str, then: Callable[[], None]) -> None:
        """Call `then()` once group `key`'s update has succeeded: on the update thread as it ends,
        or now if it has ended (never after a failed update: its reader raises the error). An
        error of `then` is dropped: it only started early what the reader does anyway."""
        task = self._tasks.get(key)
        if task is not None:
            with self._backlog.cond:
                if not task.done.done():
                    task.then.append(then)
                    return
        if task is None or task.done.exception() is None:
            _call(then)

    def result(self, key: str) -> bool:
        """Wait for group `key`'s update (it goes first from the next chunk on); its non-finite
        flag, or its error."""
        task = self._tasks.get(key)
        if task is None:
            return False
        if not task.done.done():
            with self._backlog.cond:
                if task.waited is None:
                    task.waited = next(self._seq)
                self._backlog.cond.notify_all()
        try:
            return bool(task.done.result())
        except UpdateError:
            raise
        except Exception as exc:
            raise UpdateError(f"the EPS update of group {key!r} failed: {exc}") from exc
        finally:
            self._tasks.pop(key, None)

    def wait(self) -> set[str]:
        """Wait for every queued update; the groups whose update saw a non-finite gradient. The
        first error is raised after all have finished."""
        found, first_error = set(), None
        for key in list(self._tasks):
            try:
                if self.result(key):
                    found.add(key)
            except UpdateError as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return found

    def shutdown(self, wait: bool = False) -> None:
        """Stop the thread once the queued updates have finished; with `wait`, return only then."""
        self._backlog.close(wait)


def _advance(task: _Task) -> bool:
    """Run one chunk of `task`; whether it has finished (its future then holds the result)."""
    try:
        next(task.update)
        return False
    except StopIteration as stop:
        task.done.set_result(stop.value)
    except BaseException as exc:  # raised where the result is collected
        task.done.set_exception(exc)
    return True


def _call(then: Callable[[], None]) -> None:
    try:
        then()
    except Exception:  # see when_done
        pass


def _run_to_end(task: _Task) -> None:
    while not _advance(task):
        pass
