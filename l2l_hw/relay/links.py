"""A pipeline stage's links to its neighbours: point-to-point transfers with a deadline.

Every wait polls its transfer with a deadline (PipelineConfig.timeout_s) and a shared error
slot in the process group's store. A stage that fails writes its error there first and
raises PipelineError; its neighbours see it (or see the connection drop, for a killed rank) and
raise a PipelineError naming the stage that failed, so every rank stops with one clear error.
"""
from __future__ import annotations

import concurrent.futures
import datetime
import itertools
import queue
import threading
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from l2l_hw.distributed import short_cause

STORE_POLL_S = 0.05  # how often a waiting stage looks for another stage's error in the store
ERROR_LINGER_S = 3.0  # how long rank 0 (the store's host) waits for every rank to read an error
CLOSE_JOIN_S = 10.0  # how long close() waits for the waiter thread, its waits done or cancelled
CANCEL_TAG = (1 << 30) + 1  # Links._cancel's receive: no transfer of the pipeline uses it (losses: 1 << 30)

class PipelineError(RuntimeError):
    """A stage failed or stopped answering; every stage of the pipeline raises it. (A pipeline
    that cannot be built as asked, a bad input, raises ValueError.)"""


class Spec(NamedTuple):
    """The shape and dtype of a tensor to receive."""

    shape: torch.Size
    dtype: torch.dtype


class Waiter:
    """One thread that runs blocking waits, so that a stage can look at its deadline and the
    error slot meanwhile. close() ends it; a wait that a failure left blocked must be cancelled
    first (Links.close): a thread still inside gloo's wait() when the interpreter exits aborts
    the process (see Links.close)."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="l2l-pipeline-wait", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, future = item
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the waiting thread
                future.set_exception(exc)

    def submit(self, fn) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        self._queue.put((fn, future))
        return future

    def close(self, timeout_s: float) -> bool:
        """End the thread once its waits are done; whether it ended within `timeout_s`."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


# -- point-to-point transfers with a deadline ---------------------------------------------------
class Links:
    """This stage's transfers to and from its neighbours, each wait polled against a deadline
    and the shared error slot, so no rank waits for a rank that has failed."""

    _instances = itertools.count()  # one error slot per pipeline built (the same count on every rank)

    def __init__(self, group, stage: int, stages: int, timeout_s: float):
        self.group, self.stage, self.stages, self.timeout_s = group, stage, stages, timeout_s
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")  # collectives'
        self.store = dist.distributed_c10d._get_default_store()
        self.slot = f"l2l_pipeline/{next(self._instances)}"
        self.sends: list = []
        self.failed = False  # a transfer failed or another stage reported an error: the links are done
        self._waiter: Waiter | None = Waiter()

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage)

    def recv(self, specs: list[Spec], stage: int, tag: int, device) -> tuple[list[torch.Tensor], list]:
        """Post receives of tensors shaped `specs` from `stage`; (buffers, works)."""
        bufs = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in specs]
        works = [self._guard(f"posting a receive from stage {stage}",
                             dist.irecv, b, self._peer(stage), group=self.group, tag=tag + k)
                 for k, b in enumerate(bufs)]
        return bufs, works

    def send(self, tensors: list[torch.Tensor], stage: int, tag: int) -> None:
        for k, t in enumerate(tensors):
            t = t.detach().contiguous()
            self.sends.append((t, self._guard(f"sending to stage {stage}", dist.isend, t, self._peer(stage),
                                              group=self.group, tag=tag + k), stage))

    def receive_one(self, spec: Spec, stage: int, tag: int) -> torch.Tensor:
        """One tensor shaped `spec` from `stage`, waited for, on the CPU."""
        (buf,), works = self.recv([spec], stage, tag, self.device)
        self.wait(works, f"receiving a checkpoint entry from stage {stage}")
        return buf.cpu()

    def gather(self, parts: list, mine, what: str) -> None:
        """Every stage's `mine` into `parts` (all_gather_object); a lost stage is a PipelineError."""
        self._guard(what, dist.all_gather_object, parts, mine, group=self.group)

    def all_reduce(self, t: torch.Tensor, op, what: str) -> torch.Tensor:
        """`t` reduced over the stages (a copy on the group's device); a lost stage is a PipelineError."""
        t = t.to(self.device, copy=True)
        self.wait([self._guard(what, dist.all_reduce, t, op=op, group=self.group, async_op=True)], what)
        return t

    def _guard(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise self.lost(what, exc) from exc

    def wait(self, works: list, what: str) -> None:
        """Wait for transfers against a deadline, the error slot and a dropped connection.
        gloo's point-to-point works report completion only through a blocking wait(), so a
        helper thread blocks in it while this thread looks at the error slot and the clock."""
        deadline = time.monotonic() + self.timeout_s
        for work in works:
            waiting = self._waiter.submit(work.wait)
            while True:
                try:
                    waiting.result(timeout=STORE_POLL_S)
                    break
                except concurrent.futures.TimeoutError:
                    self._raise_if_failed()
                    if time.monotonic() >= deadline:
                        raise self.lost(what, f"nothing within {self.timeout_s:g} s (PipelineConfig.timeout_s)")
                except Exception as exc:
                    raise self.lost(what, exc) from exc

    def finish_sends(self) -> None:
        sends, self.sends = self.sends, []
        for _, work, stage in sends:
            self.wait([work], f"sending to stage {stage}")

    def close(self) -> None:
        """Finish the sends under way (cancel them, and any wait left blocked, after a failure)
        and end the waiter thread. Idempotent.

        Why a blocked wait must not outlive the pipeline: the waiter thread sits in gloo's
        Work.wait() with the GIL released (pybind11's gil_scoped_release). When the peer's
        process goes, that wait returns, and the thread takes the GIL back in
        ~gil_scoped_release; if the interpreter is finalizing by then, CPython ends the thread
        with pthread_exit, whose forced unwind meets that noexcept destructor: std::terminate,
        "terminate called without an active exception", SIGABRT at exit."""
        if self._waiter is None:
            return
        if not self.failed:
            try:
                self.finish_sends()
            except PipelineError:
                pass  # failed meanwhile: cancelled below
        waiter, self._waiter = self._waiter, None
        if self.failed:
            self._cancel()
        self.sends = []
        waiter.close(CLOSE_JOIN_S)

    def _cancel(self) -> None:
        """Fail every transfer under way on the group: a receive of the pipeline's own tag that
        times out at once. gloo answers an application-side timeout by failing every pending
        operation of the group's context (UnboundBuffer::waitRecv -> Context::signalException),
        so the waits blocked on them return. Only after a failure: the group's point-to-point
        transfers are unusable afterwards."""
        peer = self._peer((self.stage + 1) % self.stages)
        try:
            probe = dist.irecv(torch.empty(1), peer, group=self.group, tag=CANCEL_TAG)
            probe.wait(datetime.timedelta(milliseconds=1))
        except Exception:
            pass  # the expected timeout, or the group already failed (which cancels them too)

    def _raise_if_failed(self) -> None:
        try:
            failed = self.store.check([f"{self.slot}/error"])
            message = self.store.get(f"{self.slot}/error").decode() if failed else None
        except Exception as exc:  # the store lives on rank 0's process: it has gone
            raise PipelineError(f"pipeline stage {self.stage}: rank 0's process has gone (its store does not "
                                f"answer: {short_cause(exc)})") from None
        if message is not None:
            self.failed = True
            self._seen()
            raise PipelineError(message)

    def _seen(self) -> None:
        """Count this rank as having read the error. Rank 0 holds the store: it waits (a little)
        for every rank to read it before raising, so its exit does not hide the message."""
        try:
            self.store.add(f"{self.slot}/seen", 1)
            if dist.get_rank() != 0:
                return
            deadline = time.monotonic() + ERROR_LINGER_S
            while self.store.add(f"{self.slot}/seen", 0) < dist.get_world_size() and time.monotonic() < deadline:
                time.sleep(STORE_POLL_S)
        except Exception:
            pass

    def lost(self, what: str, cause) -> PipelineError:
        """The error of a wait that failed: another stage's reported error, else a lost neighbour."""
        self.failed = True
        try:
            self._raise_if_failed()
        except PipelineError as reported:
            return reported
        cause = short_cause(cause) if isinstance(cause, BaseException) else cause
        return PipelineError(self.report(f"pipeline stage {self.stage} (rank {dist.get_rank()}): {what} failed; a "
                                         f"neighbouring stage died or stopped answering ({cause})"))

    def report(self, message: str) -> str:
        """Make `message` the pipeline's error unless another stage's came first; the one to raise."""
        self.failed = True
        try:
            if self.store.add(f"{self.slot}/failures", 1) == 1:
                self.store.set(f"{self.slot}/error", message)
            else:
                message = self.store.get(f"{self.slot}/error").decode()
        except Exception:
            return message
        self._seen()
        return message
