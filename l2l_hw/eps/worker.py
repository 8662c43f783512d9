"""The update thread shared by the asynchronous EPS backends.

One worker runs a backend's updates in the order the relay pushes them, so the update
of layer i overlaps the backward of layer i-1 on the caller's thread. Inline, it runs
each update on the caller's thread when it is pushed: where the layers compute on the
same cores as the update (the relay on the CPU), overlapping them would only put more
busy threads than cores on the machine. An update's error is raised where its result is
collected (fetch of that group, wait, commit), never lost and never a deadlock.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable


class UpdateError(RuntimeError):
    """An eager update failed; the message names the EPS group."""


class UpdateWorker:
    def __init__(self, name: str = "l2l-eps-update"):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._pending: dict[str, Future] = {}
        self.inline = False

    def submit(self, key: str, update: Callable[..., bool], *args) -> None:
        """Queue `update(*args)`, which returns whether it saw a non-finite gradient."""
        if not self.inline:
            self._pending[key] = self._pool.submit(update, *args)
            return
        done = self._pending[key] = Future()
        try:
            done.set_result(update(*args))
        except Exception as exc:  # raised where the result is collected, as from the thread
            done.set_exception(exc)

    def pending(self, key: str) -> bool:
        return key in self._pending

    def result(self, key: str) -> bool:
        """Wait for group `key`'s update; its non-finite flag, or its error."""
        future = self._pending.pop(key, None)
        if future is None:
            return False
        try:
            return bool(future.result())
        except UpdateError:
            raise
        except Exception as exc:
            raise UpdateError(f"the EPS update of group {key!r} failed: {exc}") from exc

    def wait(self) -> bool:
        """Wait for every queued update; raise the first error after all have finished."""
        found, first_error = False, None
        for key in list(self._pending):
            try:
                found |= self.result(key)
            except UpdateError as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return found

    def shutdown(self, wait: bool = False) -> None:
        self._pool.shutdown(wait=wait)
