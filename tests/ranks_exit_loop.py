"""Run a 2-rank test worker many times; count the runs in which every rank exited 0 (not in CI).

    python -m tests.ranks_exit_loop [RUNS] [pipe|dp]      (default: 200 pipe)

Issue 48's check that ranks end through the interpreter's own exit, without os._exit: with
PYTHONFAULTHANDLER=1, a rank aborted at teardown (SIGABRT, "terminate called without an active
exception") shows as exit code -6 and its stderr is printed. Each run trains 2 steps.
"""
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from l2l_hw.distributed import run_local_ranks

ROOT = Path(__file__).resolve().parents[1]


def main(runs: int, worker: str) -> int:
    codes, clean, t0 = collections.Counter(), 0, time.monotonic()
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONFAULTHANDLER="1")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = dict(model="mlp", optimizer="adamw", steps=2, batch=8, micro_batches=2, out=f"{tmp}/out.safetensors")
        if worker == "pipe":
            cfg["schedule"] = "flush"
        for run in range(runs):
            results = run_local_ranks(["-m", f"tests.{worker}_worker", json.dumps(cfg)], 2, timeout_s=300, cwd=ROOT,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for rank, res in enumerate(results):
                codes[res.returncode] += 1
                if res.returncode != 0:
                    print(f"run {run} rank {rank}: exit {res.returncode}\n{res.stderr[-3000:]}", flush=True)
            clean += all(res.returncode == 0 for res in results)
            if (run + 1) % 25 == 0:  # a run cut short still says how far it got
                print(f"{worker}: {clean} of {run + 1} runs clean so far", flush=True)
    print(f"{worker}: {clean} of {runs} runs ended with exit 0 on both ranks; exit codes by rank {dict(codes)}; "
          f"{time.monotonic() - t0:.0f} s")
    return 0 if clean == runs else 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200, sys.argv[2] if len(sys.argv) > 2 else "pipe"))
