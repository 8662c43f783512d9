"""Every rank of a multi-rank `l2l train` (data parallel with the state replicated or sharded, a
pipeline; ranks started as torchrun starts them, and under torchrun itself) ends the same way when
one rank fails, is killed or is signalled: one stderr line on each, naming the rank and the cause,
the exit code a single process gives (1; 130 for SIGINT, 143 for SIGTERM), no traceback, no c10d
log; the last checkpoint intact and --resume bit-exact afterwards. A pipeline (or replica) with a
disk tier keeps a state folder per rank. The slow cases are the same classes on the other ranks,
signals and layouts."""
import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from l2l_hw.checkpoint import load_checkpoint
from l2l_hw.distributed import free_port, run_local_ranks
from tests.test_nothing_lost import CKPT, rows, same_run, snapshot

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 180  # seconds for one multi-rank command; a hang fails the test, not the suite
STEPS, EVAL = 24, 4
MODES = {"dp": [], "dp-sharded": ["--shard-state"], "pipeline": ["--pipeline-stages", "2"]}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text("def f(x):\n    return x * 2 + 1  # a line of code\n" * 300)
    return path


def tiny(data: Path) -> list[str]:
    return ["--data", str(data), "--layers", "2", "--width", "32", "--heads", "2", "--context", "16",
            "--batch-size", "4", "--micro-batches", "2", "--steps", str(STEPS), "--eval-every", str(EVAL)]


def start(argv: list[str], world: int = 2, prelude: str | None = None) -> list[subprocess.Popen]:
    """`l2l ARGV` as ranks 0..world-1 of one gloo group, each its own process as torchrun starts them
    (after the Python of `prelude`, where given)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    command = ["-m", "l2l_hw.cli"] if prelude is None else ["-c", f"{prelude}\nimport sys, l2l_hw.cli\n"
                                                               "sys.exit(l2l_hw.cli.main(sys.argv[1:]))"]
    return [subprocess.Popen([sys.executable, *command, *argv], cwd=ROOT, text=True,
                             env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE) for r in range(world)]


def finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    results = []
    for p in procs:
        try:
            err = p.communicate(timeout=TIMEOUT)[1]
            results.append((p.returncode, err))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a rank did not end within {TIMEOUT} s (hang)")
    return results


def wait_for_rows(out: Path, n: int, procs: list[subprocess.Popen], said=lambda: "") -> None:
    deadline = time.monotonic() + TIMEOUT
    while rows(out) < n:
        assert all(p.poll() is None for p in procs), f"a rank ended before it was signalled: {said()}"
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.01)


def one_line_each(results, codes: dict[int, int], *words: str) -> list[str]:
    """Each rank in `codes` exited with its code and wrote exactly one stderr line, `l2l train:
    rank R of N: ...` holding every word (no traceback, no c10d log)."""
    lines = []
    for rank, code in codes.items():
        rc, err = results[rank]
        assert rc == code, (rank, rc, err[-3000:])
        assert len(err.splitlines()) == 1, (rank, err[-3000:])
        assert err.startswith(f"l2l train: rank {rank} of {len(results)}: "), err
        for word in words:
            assert word in err, (word, err)
        lines.append(err)
    return lines


def run_ok(argv: list[str]) -> None:
    for rank, (rc, err) in enumerate(finish(start(argv))):
        assert rc == 0, (rank, err[-3000:])


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data):
    """The uninterrupted run of each layout, made once: what every resumed run must equal."""
    made = {}

    def get(mode: str) -> Path:
        if mode not in made:
            made[mode] = tmp_path_factory.mktemp(f"straight-{mode}")
            run_ok(["train", *tiny(data), *MODES[mode], "--out", str(made[mode])])
        return made[mode]

    return get


def resumed_equals_straight(out: Path, straight_out: Path) -> None:
    run_ok(["train", "--resume", "--out", str(out)])
    same_run(straight_out, out)


def stop_one_rank(tmp_path, data, mode: str, target: int, signum: int):
    """Start a run of `mode`, send `signum` to rank `target` after 6 steps; the ranks' results."""
    out = tmp_path / "run"
    procs = start(["train", *tiny(data), *MODES[mode], "--out", str(out)])
    wait_for_rows(out, 6, procs)
    procs[target].send_signal(signum)
    return out, finish(procs)


KILLS = [("dp", 1), ("pipeline", 0)]  # issue 46's cases 6 and 8; the others are the slow ones
SLOW_KILLS = [("dp", 0), ("dp-sharded", 0), ("dp-sharded", 1), ("pipeline", 1)]


@pytest.mark.parametrize("mode,target", [*KILLS, *[pytest.param(*k, marks=pytest.mark.slow) for k in SLOW_KILLS]],
                         ids=[f"{m}-kill-rank{t}" for m, t in (*KILLS, *SLOW_KILLS)])
def test_kill_9_of_one_rank_ends_the_others_in_one_line_and_the_resume_is_bit_exact(tmp_path, data, straight,
                                                                                     mode, target):
    out, results = stop_one_rank(tmp_path, data, mode, target, signal.SIGKILL)
    assert results[target][0] == -signal.SIGKILL
    one_line_each(results, {1 - target: 1}, "died" if mode != "pipeline" or target == 1 else "has gone")
    tensors, meta = load_checkpoint(out / CKPT)  # the last one whole (its checksums are checked)
    assert meta["step"] % EVAL == 0 and meta["step"] >= EVAL
    resumed_equals_straight(out, straight(mode))


SIGNALS = [("pipeline", 0, signal.SIGINT)]  # issue 46's case 7; the others are the slow ones
SLOW_SIGNALS = [("dp", 1, signal.SIGTERM), ("pipeline", 1, signal.SIGTERM), ("pipeline", 1, signal.SIGINT), ("pipeline", 0, signal.SIGTERM),
                ("dp", 0, signal.SIGINT), ("dp-sharded", 1, signal.SIGINT), ("dp-sharded", 0, signal.SIGTERM)]


@pytest.mark.parametrize("mode,target,signum",
                         [*SIGNALS, *[pytest.param(*s, marks=pytest.mark.slow) for s in SLOW_SIGNALS]],
                         ids=[f"{m}-{signal.Signals(s).name}-rank{t}" for m, t, s in (*SIGNALS, *SLOW_SIGNALS)])
def test_a_signal_to_one_rank_stops_every_rank_at_one_step_with_its_code_and_the_resume_is_bit_exact(
        tmp_path, data, straight, mode, target, signum):
    out, results = stop_one_rank(tmp_path, data, mode, target, signum)
    name = signal.Signals(signum).name
    lines = one_line_each(results, {0: 128 + signum, 1: 128 + signum}, f"interrupted by {name} to rank {target} at "
                          "step", "resume with --resume")
    step = {int(line.split(" at step ")[1].split(";")[0]) for line in lines}
    assert len(step) == 1 and load_checkpoint(out / CKPT)[1]["step"] == step.pop()
    resumed_equals_straight(out, straight(mode))


def torchrun_logs(out: Path, argv: list[str]) -> tuple[subprocess.Popen, Path]:
    logs = out.with_name(out.name + "-logs")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "--log-dir", str(logs), "--redirects", "3", "-m", "l2l_hw.cli", *argv]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return proc, logs


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM to torchrun", "Ctrl-C to the group"])
@pytest.mark.parametrize("mode", ["pipeline", "dp"])
def test_a_signal_to_torchrun_or_its_group_ends_every_rank_in_one_line_and_the_resume_is_bit_exact(
        tmp_path, data, straight, mode, how):
    out = tmp_path / "run"
    proc, logs = torchrun_logs(out, ["train", *tiny(data), *MODES[mode], "--out", str(out)])
    try:
        wait_for_rows(out, 6, [proc])
        if how == "SIGTERM to torchrun":
            proc.send_signal(signal.SIGTERM)
        else:  # a terminal's Ctrl-C: SIGINT to every process of the foreground group; torchrun forwards it too
            os.killpg(proc.pid, signal.SIGINT)
        proc.wait(TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    word = "SIGTERM" if how == "SIGTERM to torchrun" else "SIGINT"
    for rank in (0, 1):
        err = Path(glob.glob(f"{logs}/*/attempt_0/{rank}/stderr.log")[0]).read_text()
        assert len(err.splitlines()) == 1 and err.startswith(f"l2l train: rank {rank} of 2: interrupted by {word}"), err
    resumed_equals_straight(out, straight(mode))


def test_bad_pipeline_geometry_is_refused_by_every_rank_in_one_line_before_anything_is_estimated(tmp_path, data):
    out = tmp_path / "run"  # 2 blocks are relayed as 4 layers: a boundary at 9 is past the last
    argv = ["train", *tiny(data), "--pipeline-stages", "2", "--pipeline-boundaries", "9", "--out", str(out)]
    one_line_each(finish(start(argv)), {0: 2, 1: 2}, "boundaries 9 do not split")
    assert not out.exists()


def test_more_pipeline_stages_than_layers_is_refused_in_one_line_naming_the_layers(data, capsys):
    from l2l_hw.cli import main

    assert main(["estimate", *tiny(data), "--layers", "1", "--pipeline-stages", "4"]) == 2
    assert capsys.readouterr().err == ("l2l estimate: 4 pipeline stages need at least 4 layers (one a stage); the "
                                       "model is relayed as 3: give 3 stages or fewer\n")


def launched(argv: list[str]) -> subprocess.Popen:
    """`l2l ARGV --nproc-per-node 2` as a terminal starts it: its own process group (setsid), Ctrl-C reaching all."""
    return subprocess.Popen([sys.executable, "-m", "l2l_hw.cli", *argv, "--nproc-per-node", "2"], cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)), text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def test_ctrl_c_of_l2l_s_own_launch_ends_with_each_rank_s_line_and_no_launcher_traceback(tmp_path, data):
    out = tmp_path / "run"
    proc = launched(["train", *tiny(data), "--steps", "2000", *MODES["pipeline"], "--out", str(out)])
    try:
        wait_for_rows(out, 6, [proc], lambda: proc.communicate()[1])
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: every process of the foreground group
        err = proc.communicate(timeout=TIMEOUT)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    lines = err.splitlines()
    assert len(lines) == 2 and all("interrupted by SIGINT" in line and "resume with --resume" in line
                                   for line in lines), err[-3000:]
    assert {line.split(":")[1].strip() for line in lines} == {"rank 0 of 2", "rank 1 of 2"}


def test_nproc_per_node_under_torchrun_s_other_count_is_refused_in_one_line(tmp_path, data):
    env = dict(os.environ, PYTHONPATH=str(ROOT), LOCAL_WORLD_SIZE="4")
    done = subprocess.run([sys.executable, "-m", "l2l_hw.cli", "train", *tiny(data), "--nproc-per-node", "2",
                           "--out", str(tmp_path / "run")], cwd=ROOT, env=env, text=True, capture_output=True)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "l2l train: --nproc-per-node 2: this is one of 4 ranks torchrun started; give one launcher (drop "
        "--nproc-per-node, or run l2l without torchrun)"]


def test_a_pipeline_in_one_process_is_refused_in_one_line_naming_nproc_per_node(tmp_path, data, capsys):
    from l2l_hw.cli import main

    assert main(["train", *tiny(data), *MODES["pipeline"], "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--nproc-per-node 2" in err, err


def test_a_rank_that_cannot_start_stops_every_rank_before_training_each_in_one_line(tmp_path, data):
    out = tmp_path / "run"  # rank 0 alone checks the output folder: it holds a run
    run_ok(["train", *tiny(data), "--steps", "2", "--out", str(out)])
    before = snapshot(out)
    results = finish(start(["train", *tiny(data), "--out", str(out)]))
    one_line_each(results, {0: 2}, f"--out {out}", "already holds a run")
    one_line_each(results, {1: 2}, "stopped before training: rank 0 cannot start", "already holds a run")
    assert snapshot(out) == before


LEFT_GROUP_IS_FREED = """
import weakref
import torch.distributed as dist
from l2l_hw.distributed import failed_ranks, join_torchrun, leave_torchrun
ranks = join_torchrun("cpu", 60)
group = weakref.ref(dist.group.WORLD)  # a strong reference here would keep it until Python finalizes
import torch._dynamo  # as l2l_hw.estimate's FakeTensorMode does, once the group exists
failed_ranks(None, "a last collective")
leave_torchrun(ranks)
print(group() is None)
"""


def test_a_group_left_is_freed_at_once_though_torch_dynamo_was_imported_after_it_was_joined():
    """A process group left by leave_torchrun is freed there (its gloo worker threads joined), not at
    the interpreter's exit: torch.distributed.nn binds `group.WORLD` as a default argument when
    first imported (by torch._dynamo), and a group alive while Python finalizes aborts a rank now
    and then ("terminate called without an active exception", issue 48): a gloo worker drops its
    last collective's tensors after the collective has returned, and a tensor made in Python
    takes the GIL to go; a thread taking the GIL while the interpreter finalizes is ended by
    pthread_exit, whose unwind meets a noexcept destructor (std::terminate)."""
    results = run_local_ranks(["-c", LEFT_GROUP_IS_FREED], 2, timeout_s=TIMEOUT, cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for r in results:
        assert (r.returncode, r.stdout.split()) == (0, ["True"]), r.stderr[-2000:]


def test_a_pipeline_with_a_state_dir_keeps_a_folder_per_rank_and_trains_as_in_memory(tmp_path, data, straight):
    out, state = tmp_path / "run", tmp_path / "state"
    run_ok(["train", *tiny(data), *MODES["pipeline"], "--state-dir", str(state), "--out", str(out)])
    assert sorted(p.name for p in state.iterdir()) == ["rank0", "rank1"]
    assert all((state / f"rank{r}" / "manifest.json").is_file() for r in (0, 1))
    want, _ = load_checkpoint(straight("pipeline") / CKPT)
    got, _ = load_checkpoint(out / CKPT)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want if k.startswith("relay."))


def test_finetune_on_two_ranks_averages_the_gradients_as_one_process_trains_the_whole_minibatch(tmp_path):
    # The ranks join their group before the relay is built, so its gradients are averaged (a relay
    # built first trained each rank on its own shard alone, and rank 0 saved its own weights).
    from tests.test_hf import TEXT, tiny, word_tokenizer
    from tests.helpers import rel_diff

    tiny("gpt2").save_pretrained(tmp_path / "gpt2")
    word_tokenizer(TEXT).save_pretrained(tmp_path / "gpt2")
    (tmp_path / "words.txt").write_text("\n".join(TEXT) + "\n")
    # SGD: Adam turns the rounding noise of another reduction order in the attention key bias's
    # exactly-zero gradient into full-size steps (docs/NUMERICS.md)
    argv = ["finetune", "--model", str(tmp_path / "gpt2"), "--data", str(tmp_path / "words.txt"), "--steps", "4",
            "--batch-size", "2", "--micro-batches", "1", "--context", "6", "--eval-every", "2", "--optimizer", "sgd",
            "--momentum", "0.9", "--lr", "0.05"]
    for rank, (rc, err) in enumerate(finish(start([*argv, "--out", str(tmp_path / "one")], world=1))):
        assert rc == 0, err[-3000:]
    run_ok([*argv, "--out", str(tmp_path / "two")])
    want, _ = load_checkpoint(tmp_path / "one" / CKPT)
    got, _ = load_checkpoint(tmp_path / "two" / CKPT)
    for name, w in want.items():
        if name.startswith("relay.eps/") and w.is_floating_point():
            assert rel_diff(got[name], w) <= 1e-5, name


# Pipeline stage 1 sends its first step's gradients and loss (3 sends: 2 micro-batches, the loss), then
# never sends again: alive, holding its connections, answering nothing.
MUTE_AFTER_FIRST_STEP = """
import l2l_hw.relay.pipeline as pipeline
send, sent = pipeline.Links.send, []
def mute(links, tensors, stage, tag):
    if links.stage == 1 and len(sent) >= 3:
        return
    sent.append(tag)
    send(links, tensors, stage, tag)
pipeline.Links.send = mute
"""


def test_a_pipeline_stage_that_never_answers_ends_every_rank_after_dist_timeout_in_one_line(tmp_path, data):
    # --dist-timeout is the stages' deadline too (TrainConfig.pipeline_config): with the default
    # 300 s the ranks would still wait when TIMEOUT fails the test. Both ranks wait on each other.
    procs = start(["train", *tiny(data), *MODES["pipeline"], "--pipeline-schedule", "flush", "--dist-timeout", "8",
                   "--out", str(tmp_path / "run")], prelude=MUTE_AFTER_FIRST_STEP)
    one_line_each(finish(procs), {0: 1, 1: 1}, "stopped answering")
