"""A training process watched from outside: its steps, peak host and device memory, GPU idle share.

The campaign runs each training command it measures (`l2l finetune`, a peer) as a child
process and watches it the same way, so every method's figures are taken alike:

  steps            rows the child appends to a JSON Lines file (`l2l finetune`'s metrics.jsonl,
                   a peer's rows), each stamped with the wall-clock time it was seen
  peak host RSS    the child's own maximum resident set (os.wait4's ru_maxrss: its peak,
                   whatever it freed later)
  peak device      the most device memory NVML saw the child hold (every 0.1 s: the caching
                   allocator's reserve and the CUDA context included, as nvidia-smi shows it)
  GPU idle share   1 - the mean of NVML's utilization samples inside the timed steps' window:
                   NVML samples the share of time in which any kernel ran on the GPU (about
                   every 1/6 s); with one process on the GPU, that is its compute streams' busy
                   share. Not taken without NVML (the dry run on the CPU): None, with the reason.

`stop_after_rows`: the child is killed (SIGKILL) once that many rows are in, so a run ends
where its measurement ends (`l2l finetune` checkpoints its whole state at its last step: at
8 B parameters ~100 GB, more than the lent machine's disk).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

POLL_S = 0.1


class _Nvml:
    """The GPU's utilization samples and a process's memory, through NVML (pynvml)."""

    def __init__(self):
        import pynvml

        pynvml.nvmlInit()
        self.nv = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
                                                            or 0))
        self.last_ts = 0
        self.samples: list[tuple[float, float]] = []  # (wall-clock seconds, utilization %)

    def sample(self) -> None:
        try:
            kind, samples = self.nv.nvmlDeviceGetSamples(self.handle, self.nv.NVML_GPU_UTILIZATION_SAMPLES,
                                                         self.last_ts)
        except self.nv.NVMLError:  # NVML_ERROR_NOT_FOUND: no sample since last_ts
            return
        for s in samples:
            self.last_ts = max(self.last_ts, s.timeStamp)
            self.samples.append((s.timeStamp / 1e6, float(s.sampleValue.uiVal)))

    def memory_of(self, pid: int) -> int:
        procs = self.nv.nvmlDeviceGetComputeRunningProcesses(self.handle)
        return sum(p.usedGpuMemory or 0 for p in procs if p.pid == pid)


def nvml():
    """An NVML session, or the reason there is none."""
    try:
        return _Nvml(), None
    except Exception as e:  # no pynvml, no driver: the CPU
        return None, f"no NVML ({type(e).__name__}: {str(e)[:120]})"


def watch(cmd: list[str], rows_file: Path, log: Path, *, stop_after_rows: int | None = None,
          timeout: float = 600, env: dict | None = None) -> dict:
    """Run `cmd` to its end (or to `stop_after_rows` rows) and return what was seen of it:
    returncode, killed (by this watch), rows (each with `seen_at`), peak_rss_bytes,
    peak_device_bytes, util_samples, and `nvml` (None, or why there were no NVML figures)."""
    gpu, why_not = nvml()
    rows: list[dict] = []
    peak_device, killed, done = 0, None, threading.Event()
    with open(log, "ab") as out:
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

        def poll() -> None:
            nonlocal peak_device, killed
            offset, t0, last_sample = 0, time.monotonic(), 0.0
            while not done.is_set():
                if rows_file.exists():
                    with open(rows_file) as f:
                        f.seek(offset)
                        chunk = f.read()
                    whole = chunk[:chunk.rfind("\n") + 1]
                    offset += len(whole.encode())
                    rows.extend({**json.loads(line), "seen_at": time.time()} for line in whole.splitlines() if line)
                if gpu is not None:
                    peak_device = max(peak_device, gpu.memory_of(child.pid))
                    if time.monotonic() - last_sample > 1.0:
                        gpu.sample()
                        last_sample = time.monotonic()
                over = time.monotonic() - t0 > timeout
                if killed is None and ((stop_after_rows and len(rows) >= stop_after_rows) or over):
                    killed = "timeout" if over else f"after {len(rows)} rows"
                    os.killpg(child.pid, signal.SIGKILL)
                done.wait(POLL_S)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            _, status, usage = os.wait4(child.pid, 0)
        except BaseException:  # the campaign's time limit (gpu_checks.Cut): the child goes with it
            done.set()
            os.killpg(child.pid, signal.SIGKILL)
            os.waitpid(child.pid, 0)
            raise
        child.returncode = os.waitstatus_to_exitcode(status)
        done.set()
        poller.join()
    if gpu is not None:
        gpu.sample()
    return {"returncode": child.returncode, "killed": killed, "rows": rows,
            "peak_rss_bytes": usage.ru_maxrss * 1024, "peak_device_bytes": peak_device if gpu else None,
            "util_samples": gpu.samples if gpu else [], "nvml": why_not}


def idle_share(seen: dict, start: float, end: float) -> dict:
    """1 - mean NVML utilization over [start, end] (wall clock), from watch()'s samples."""
    inside = [v for t, v in seen["util_samples"] if start <= t <= end]
    if seen["nvml"] is not None or not inside:
        return {"gpu_idle_share": None,
                "measured_on": seen["nvml"] or "no NVML utilization sample inside the timed steps"}
    return {"gpu_idle_share": 1 - sum(inside) / len(inside) / 100,
            "measured_on": f"NVML utilization, {len(inside)} samples over {end - start:.1f} s of timed steps"}


def log_tail(log: Path, chars: int = 1500) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    return text[-chars:]
