"""Nothing lost on the newer surfaces (issue 46): the output folder, the disk tier's state_dir,
the options added with pipelines and data parallelism, and the command's first seconds.

Every refused command is one stderr line and exit 2, and leaves every file that was there (the
earlier run, the user's own files beside it and in its subfolders, a state_dir) byte for byte
as it was: --overwrite removes an earlier run only once every input was checked, and then
only the files a run writes. The probe at the end runs the same classes across both commands,
three output folders, the refusals and the run modes (options x folders x faults)."""
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from l2l_hw.eps import disk_store
from tests.test_nothing_lost import cli, one_line, refused, snapshot

ROOT = Path(__file__).resolve().parents[1]
CORES = len(os.sched_getaffinity(0))
TRAIN = ["--layers", "2", "--width", "32", "--heads", "2", "--context", "16", "--batch-size", "4",
         "--micro-batches", "2", "--steps", "2", "--eval-every", "2"]
FINETUNE = ["--steps", "2", "--batch-size", "2", "--micro-batches", "1", "--context", "6", "--eval-every", "2"]
SHM = Path("/dev/shm")
TMPFS = disk_store.filesystem_type(SHM) == "tmpfs" if SHM.is_dir() else False

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------- what the probe starts from

@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """Data, a tiny Hugging Face model, and one finished run of each command (copied per test)."""
    from tests.test_hf import TEXT, tiny, word_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as one_thread does for the tests (this fixture runs before it)
    root = tmp_path_factory.mktemp("inputs")
    (root / "code.txt").write_text("def f(x):\n    return x * 2 + 1  # a line of code\n" * 200)
    (root / "words.txt").write_text("\n".join(TEXT) + "\n")
    tiny("gpt2").save_pretrained(root / "gpt2")
    word_tokenizer(TEXT).save_pretrained(root / "gpt2")
    paths = {"data": root / "code.txt", "words": root / "words.txt", "model": root / "gpt2"}
    for command in ("train", "finetune"):
        out = root / f"{command}-run"
        assert main_ok(command_argv(command, paths, out, tensorboard=True)) == 0
        paths[f"{command}-run"] = out
    state = root / "state"  # a state_dir of another model: 3 layers (the probe's train runs have 2)
    assert main_ok(["train", "--data", str(paths["data"]), *TRAIN, "--layers", "3", "--out", str(root / "other"),
                    "--state-dir", str(state)]) == 0
    paths["state"] = state
    torch.set_num_threads(threads)
    return paths


def main_ok(argv: list[str]) -> int:
    from l2l_hw.cli import main

    return main(argv)


def command_argv(command: str, paths: dict[str, Path], out: Path, tensorboard: bool = False) -> list[str]:
    if command == "train":
        argv = ["train", "--data", str(paths["data"]), *TRAIN]
    else:
        argv = ["finetune", "--model", str(paths["model"]), "--data", str(paths["words"]), *FINETUNE]
    return [*argv, "--out", str(out), *(["--tensorboard"] if tensorboard else [])]


def folder(kind: str, command: str, inputs: dict[str, Path], out: Path) -> None:
    """The output folder before the command: none, an earlier run, or an earlier run with the
    user's own files beside it and in each of its subfolders."""
    if kind == "empty":
        return
    shutil.copytree(inputs[f"{command}-run"], out)
    if kind == "run+user":
        for sub in ("", "tensorboard", "model", "tokens"):
            (out / sub).mkdir(exist_ok=True)
            (out / sub / "notes.txt").write_text(f"the user's, in {sub or 'out'}")


# ---------------------------------------------------------------------------- issue 46's cases, each

def test_overwrite_refused_for_a_missing_data_file_keeps_the_earlier_run(tmp_path, capsys, inputs):  # case 1
    out = tmp_path / "run"
    folder("run", "train", inputs, out)
    argv = command_argv("train", inputs, out)
    argv[argv.index("--data") + 1] = str(tmp_path / "missing.txt")
    refused(capsys, [*argv, "--overwrite"], ["--data", "missing.txt", "does not exist"], out)


@pytest.mark.skipif(not TMPFS, reason="no tmpfs at /dev/shm")
def test_overwrite_refused_for_a_state_dir_on_tmpfs_keeps_the_earlier_run(tmp_path, capsys, inputs):  # case 1
    out, state = tmp_path / "run", SHM / f"l2l-test-{os.getpid()}"
    folder("run", "train", inputs, out)
    try:
        refused(capsys, [*command_argv("train", inputs, out), "--overwrite", "--state-dir", str(state)],
                [str(state), "tmpfs"], out)
        assert not state.exists()  # what the refused EPS made is gone
    finally:
        shutil.rmtree(state, ignore_errors=True)


def test_finetune_overwrite_refused_for_a_missing_val_data_keeps_the_earlier_run(tmp_path, capsys, inputs):  # 1
    out = tmp_path / "run"
    folder("run", "finetune", inputs, out)
    refused(capsys, [*command_argv("finetune", inputs, out), "--overwrite", "--val-data", str(tmp_path / "v.txt")],
            ["--val-data", "v.txt", "does not exist"], out)


def test_finetune_into_a_model_folder_holding_a_user_file_is_refused_and_the_file_kept(tmp_path, capsys,
                                                                                      inputs):  # case 2
    out = tmp_path / "run"
    (out / "model").mkdir(parents=True)
    (out / "model" / "notes.txt").write_text("mine")
    refused(capsys, command_argv("finetune", inputs, out), [str(out / "model"), "notes.txt", "move it"], out)
    assert (out / "model" / "notes.txt").read_text() == "mine"


def test_overwrite_removes_the_earlier_runs_event_files_and_keeps_the_users_files_in_tensorboard(
        tmp_path, capsys, inputs):  # case 3
    out = tmp_path / "run"
    folder("run+user", "train", inputs, out)
    earlier = sorted((out / "tensorboard").glob("events.out.tfevents.*"))
    assert earlier
    rc, _, err = cli(capsys, *command_argv("train", inputs, out), "--overwrite")
    assert rc == 0, err
    assert sorted(p.name for p in (out / "tensorboard").iterdir()) == ["notes.txt"]
    assert (out / "tensorboard" / "notes.txt").read_text() == "the user's, in tensorboard"
    assert (out / "notes.txt").read_text() == "the user's, in out"


def test_more_threads_than_cores_are_refused_in_one_line(tmp_path, capsys, inputs):  # case 9
    refused(capsys, [*command_argv("train", inputs, tmp_path / "run"), "--threads", str(CORES + 1)],
            [f"--threads {CORES + 1}", f"at most {CORES}", "cores"], tmp_path)


def test_a_pipeline_with_powersgd_is_refused_in_one_line(tmp_path, capsys, inputs):  # case 10
    refused(capsys, [*command_argv("train", inputs, tmp_path / "run"), "--pipeline-stages", "2",
                     "--grad-compression", "powersgd"], ["--grad-compression powersgd", "pipeline", "drop it"],
            tmp_path)


def test_pipeline_boundaries_that_are_not_ascii_digits_are_named(tmp_path, capsys, inputs):  # case 12
    refused(capsys, [*command_argv("train", inputs, tmp_path / "run"), "--pipeline-stages", "2",
                     "--pipeline-boundaries", "²"], ["--pipeline-boundaries ²", "first layer of each stage"], tmp_path)


def test_a_full_disk_while_plotting_names_the_plot_and_keeps_the_last_one(tmp_path, capsys, inputs,
                                                                          monkeypatch):  # case 12
    import errno

    import matplotlib.figure

    out = tmp_path / "run"
    folder("run", "train", inputs, out)
    plot = (out / "loss.png").read_bytes()

    def full(self, path, **kwargs):
        Path(path).write_bytes(b"\x89PNG")  # a part of it, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    rc, _, err = cli(capsys, "train", "--resume", "--steps", "4", "--out", str(out))
    assert rc == 1
    one_line(err, "train", str(out / "loss.png"), "No space left on device")
    assert (out / "loss.png").read_bytes() == plot and sorted(p.name for p in out.iterdir()) == [
        "checkpoint.safetensors", "loss.png", "metrics.jsonl", "tensorboard"]


def full_disk(*args, **kwargs):
    import errno

    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_while_tokenizing_names_the_token_cache(tmp_path, capsys, inputs, monkeypatch):  # case 12
    from l2l_hw import finetune_data

    out = tmp_path / "run"
    monkeypatch.setattr(finetune_data, "_write_tokens", full_disk)
    rc, _, err = cli(capsys, *command_argv("finetune", inputs, out))
    assert rc == 1
    one_line(err, "finetune", str(out / "tokens"), "cannot write the token cache", "No space left on device")
    assert not list((out / "tokens").glob("*"))  # no temporary left


def test_a_full_disk_while_saving_the_model_names_it_and_keeps_the_one_saved_before(tmp_path, capsys, inputs,
                                                                                    monkeypatch):  # case 12
    from l2l_hw import hf

    out = tmp_path / "run"
    folder("run", "finetune", inputs, out)
    before = snapshot(out / "model")

    def partly(relay, path, **kwargs):
        (Path(path) / "model.safetensors").write_bytes(b"part of it")
        full_disk()

    monkeypatch.setattr(hf, "save_pretrained", partly)
    rc, _, err = cli(capsys, "finetune", "--resume", "--steps", "4", "--out", str(out), "--model", str(inputs["model"]),
                     "--data", str(inputs["words"]))
    assert rc == 1
    one_line(err, "finetune", str(out / "model"), "No space left on device", "saved before is unchanged")
    assert snapshot(out / "model") == before and sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def caught_signals(pid: int) -> int:
    """The mask of the signals process `pid` has a handler for (/proc/PID/status SigCgt)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return int(line.split()[1], 16)
    return 0


def python_signals() -> None:
    """A child's SIGINT as a terminal leaves it (Python then installs its KeyboardInterrupt handler),
    even where this test runs in the background of a shell, whose children inherit SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_the_command_imports_is_one_line_with_its_code_and_writes_nothing(tmp_path, inputs,
                                                                                       signum):  # case 11
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "l2l_hw.cli", *command_argv("train", inputs, out)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=python_signals)
    deadline = time.monotonic() + 60
    while not caught_signals(proc.pid) & (1 << (signal.SIGTERM - 1)):  # the first line of l2l_hw has run
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.001)
    proc.send_signal(signum)  # now torch is being imported (seconds), long before anything is written
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err
    one_line(err, "train", f"interrupted by {signal.Signals(signum).name} while starting", "nothing was written")
    assert not out.exists()


def test_the_command_leaves_the_signals_as_they_were_when_imported_as_a_library():
    done = subprocess.run([sys.executable, "-c", "import signal, l2l_hw; "
                                                 "print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, "
                                                 "signal.getsignal(signal.SIGINT) == signal.default_int_handler)"],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                          timeout=120, preexec_fn=python_signals)
    assert done.stdout.split() == ["True", "True"], done.stderr


# ---------------------------------------------------------------------------- the probe

FAULTS = {  # name -> (extra flags, given the inputs and tmp_path; words of the one line; commands)
    "missing data": (lambda i, t: ["--data", str(t / "missing.txt")], ["missing.txt", "does not exist"],
                     ("train", "finetune")),
    "missing val-data": (lambda i, t: ["--val-data", str(t / "missing.txt")], ["--val-data", "does not exist"],
                         ("finetune",)),
    "state-dir is a file": (lambda i, t: ["--state-dir", str(i["data"])], ["state_dir", "is a file, not a folder"],
                            ("train", "finetune")),
    "state-dir of another model": (lambda i, t: ["--state-dir", str(i["state"])], ["holds the state of another"],
                                   ("train",)),  # new: an earlier run's; resume or overwrite: the EPS's own check
    "state-dir of another run": (lambda i, t: ["--state-dir", str(i["state"])], ["holds the state of another"],
                                 ("finetune",)),
    "threads above the cores": (lambda i, t: ["--threads", str(CORES + 1)], [f"at most {CORES}"],
                                ("train", "finetune")),
    "pipeline boundaries ²": (lambda i, t: ["--pipeline-stages", "2", "--pipeline-boundaries", "²"],
                              ["--pipeline-boundaries ²"], ("train",)),
    "pipeline with powersgd": (lambda i, t: ["--pipeline-stages", "2", "--grad-compression", "powersgd"],
                               ["--grad-compression powersgd"], ("train",)),
    "powersgd in one process": (lambda i, t: ["--grad-compression", "powersgd"], ["powersgd", "torchrun"],
                                ("train", "finetune")),
    "warmup past the steps": (lambda i, t: ["--warmup", "50"], ["--warmup 50"], ("train", "finetune")),
}
FOLDERS = ("empty", "run", "run+user")
MODES = {"new": [], "overwrite": ["--overwrite"], "resume": ["--resume"]}
CASES = [pytest.param(command, kind, fault, mode, id=f"{command}-{kind}-{fault}-{mode}")  # each well under a second
         for command in ("train", "finetune") for kind in FOLDERS for fault, (_, _, commands) in FAULTS.items()
         if command in commands for mode in MODES]


def with_flags(argv: list[str], extra: list[str]) -> list[str]:
    """`argv` with each flag of `extra` set (replaced where argv has it)."""
    argv = list(argv)
    for flag, value in zip(extra[::2], extra[1::2]):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return argv


# The output folder's own refusals, which may come before the fault's: a run already there, no
# checkpoint to resume, a checkpoint whose run differs from the flags, the user's file in model/.
FOLDER_REFUSALS = (["already holds a run", "--overwrite"], ["no such checkpoint file"], ["in the checkpoint", "given"],
                   ["model", "notes.txt", "move it"])


@pytest.mark.parametrize("command,kind,fault,mode", CASES)
def test_probe_a_refused_command_is_one_line_exit_2_and_every_file_as_it_was(tmp_path, capsys, inputs, command,
                                                                             kind, fault, mode):
    out = tmp_path / "run"
    folder(kind, command, inputs, out)
    extra, words, _ = FAULTS[fault]
    argv = with_flags(command_argv(command, inputs, out), extra(inputs, tmp_path)) + MODES[mode]
    before = snapshot(tmp_path, inputs["state"])
    rc, _, err = cli(capsys, *argv)
    assert rc == 2, err
    line = one_line(err, command)
    assert any(all(word in line for word in refusal) for refusal in (words, *FOLDER_REFUSALS)), (words, line)
    after = snapshot(tmp_path, inputs["state"])
    assert {k: v for k, v in after.items() if k in before} == before
