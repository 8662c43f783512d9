"""`l2l bench gpu --dry-run`: every part of the GPU campaign at toy size on the CPU, the relay
on the asynchronous twin, writing the files a real campaign writes."""
import json
import subprocess
import sys

from l2l_hw.bench.gpu import FILES, MAX_FILE_BYTES, PARTS, compute_idle_fraction, trim


def test_dry_run_runs_every_part_and_writes_the_campaign_files(tmp_path):
    out = tmp_path / "gpu"
    done = subprocess.run([sys.executable, "-m", "l2l_hw.cli", "bench", "gpu", "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    assert all(p.stat().st_size <= MAX_FILE_BYTES for p in out.iterdir())
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["parts"]) == list(PARTS)
    failed = {name: r["error"] for name, r in summary["parts"].items() if "error" in r}
    assert not failed, failed
    assert summary["parts"]["tests"]["returncode"] == 0 and "passed" in summary["parts"]["tests"]["result"]
    for pair in ("no_recompute", "recompute"):
        assert summary["parts"]["resident"][pair]["relay_over_torch_tokens_per_s"] > 0
    assert summary["parts"]["syncs"]["transport_blocking_per_step"] == [1, 1, 1]  # the loss, read once a step
    assert json.loads((out / "trace.json").read_text())["traceEvents"]
    assert len(summary["parts"]["trace"]["idle_by_eps_threads"]) >= 1
    assert "[l2l bench gpu" in done.stdout  # it says what it is doing as it goes


def test_idle_fraction_of_the_compute_stream_is_the_time_outside_its_kernels():
    # stream 7: kernels over [0, 10) and [5, 15) and [30, 40): busy 25 of the 40 us window;
    # stream 9's kernel (a copy stream's, shorter in all) does not count
    events = [{"ph": "X", "cat": "kernel", "ts": ts, "dur": dur, "args": {"stream": stream}}
              for ts, dur, stream in [(0, 10, 7), (5, 10, 7), (30, 10, 7), (12, 2, 9)]]
    assert compute_idle_fraction(events)["compute_idle_fraction"] == 1 - 25 / 40


def test_a_trace_is_trimmed_to_its_longest_events():
    # the long events carry the long records (as a profiler's operators with their arguments
    # do): a cut proportional to the count alone would leave the file over its limit
    events = [{"ph": "X", "ts": i, "dur": i % 10, "name": "x" * (10 + 20 * (i % 10))} for i in range(1000)]
    kept = trim(events, 20_000)
    assert len(json.dumps({"traceEvents": kept})) <= 20_000
    assert min(e["dur"] for e in kept) >= max(e["dur"] for e in events if e not in kept)
    assert [e["ts"] for e in kept] == sorted(e["ts"] for e in kept)
