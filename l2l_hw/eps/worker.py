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

So while the update of layer i overlaps the backward of layer i-1 on the caller's thread,
a group the device needs sooner never waits behind a whole later one. Updates of one group
never overlap: a group is pushed again only after its update was collected (EPS.fetch).

Inline, each update runs to its end on the caller's thread when it is pushed: where the
layers compute on the same cores as the update (the relay on the CPU), overlapping them
would only put more busy threads than cores on the machine. An update's error is raised
where its result is collected (fetch of that group, wait, commit), never lost and never a
deadlock.
"""
from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future
from typing import Generator

Update = Generator[None, None, bool]  # yields between chunks; returns whether a gradient was not finite

LAST = float("inf")  # the rank of a group the next forward does not fetch: after every known one


class UpdateError(RuntimeError):
    """An eager update failed; the message names the EPS group."""


class _Task:
    def __init__(self, key: str, update: Update, seq: int):
        self.key, self.update, self.seq = key, update, seq
        self.done: Future = Future()
        self.waited: int | None = None  # set when a reader waits: it goes first


class UpdateWorker:
    def __init__(self, name: str = "l2l-eps-update"):
        self.name = name
        self.inline = False
        self._cond = threading.Condition()
        self._tasks: dict[str, _Task] = {}  # queued or running, not yet collected by result()
        self._queue: list[_Task] = []  # not finished
        self._rank: dict[str, int] = {}  # group -> its place in the next forward's fetches
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    def order(self, keys: list[str]) -> None:
        """Serve the backlog in the order of `keys` (the next forward's fetches)."""
        with self._cond:
            self._rank = {key: i for i, key in enumerate(keys)}

    def submit(self, key: str, update: Update) -> None:
        """Queue group `key`'s update (a generator; see the module docstring). A previous update of
        the same group must have been collected (result) first."""
        if key in self._tasks:
            raise RuntimeError(f"group {key!r} has an update not yet collected; collect it with result() first")
        task = _Task(key, update, next(self._seq))
        self._tasks[key] = task
        if self.inline:
            _run_to_end(task)
            return
        with self._cond:
            if self._closed:
                raise RuntimeError("the EPS update worker is shut down")
            self._queue.append(task)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def pending(self, key: str) -> bool:
        """Group `key` has an update not yet collected."""
        return key in self._tasks

    def done(self, key: str) -> bool:
        """Group `key`'s update (if any) has finished: collecting it will not wait."""
        task = self._tasks.get(key)
        return task is None or task.done.done()

    def result(self, key: str) -> bool:
        """Wait for group `key`'s update (it goes first from the next chunk on); its non-finite
        flag, or its error."""
        task = self._tasks.get(key)
        if task is None:
            return False
        if not task.done.done():
            with self._cond:
                if task.waited is None:
                    task.waited = next(self._seq)
                self._cond.notify_all()
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
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if wait and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    # -- the worker thread ------------------------------------------------------
    def _next(self) -> _Task | None:
        """The task to advance by one chunk (the caller holds the lock): a waited-for one first,
        then in the next forward's order, then first in, first out."""
        while not self._queue:
            if self._closed:
                return None
            self._cond.wait()
        return min(self._queue, key=lambda t: (t.waited is None, t.waited or 0, self._rank.get(t.key, LAST), t.seq))

    def _serve(self) -> None:
        while True:
            with self._cond:
                task = self._next()
            if task is None:
                return
            finished = _advance(task)
            if finished:
                with self._cond:
                    self._queue.remove(task)


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


def _run_to_end(task: _Task) -> None:
    while not _advance(task):
        pass
