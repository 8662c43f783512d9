"""Training inside a memory limit: the cgroup (l2l_hw/memory_limit.py), the reference GPT made
layer by layer (models/gpt.py build_gpt_meta), `l2l bench disk --memory-limit` (bench/disk_limit.py)."""
import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import l2l_hw
from l2l_hw import estimate, memory_limit
from l2l_hw.bench import disk_limit
from l2l_hw.memory_limit import MemoryLimit, MemoryLimitError, headroom
from l2l_hw.models import GPTConfig, build_gpt, lm_loss
from l2l_hw.models.gpt import build_gpt_meta
from l2l_hw.train import TrainConfig, build_eps, build_relay, relay_options

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]
L2L = [sys.executable, "-m", "l2l_hw.cli"]


def cgroup_or_skip(limit: int) -> MemoryLimit:
    try:
        return MemoryLimit(limit)
    except MemoryLimitError as e:
        pytest.skip(f"no memory limit can be set here: {e}")


def own_cgroup_children() -> set[str]:
    """The l2l-* cgroups under this process's memory cgroup (none is left behind)."""
    version = memory_limit.cgroup_version()
    if version is None:
        return set()
    line = next(line for line in Path("/proc/self/cgroup").read_text().splitlines()
                if (version == 1 and "memory" in line.split(":")[1].split(",")) or
                (version == 2 and line.startswith("0:")))
    base = memory_limit.ROOT / ("memory" if version == 1 else "") / line.split(":", 2)[2].lstrip("/")
    return {p.name for p in base.glob("l2l-*")}


# ---------------------------------------------------------------------------- the model, layer by layer
@pytest.mark.parametrize("tie", [False, True])
def test_the_gpt_made_layer_by_layer_has_build_gpts_weights_and_leaves_the_rng_where_it_does(tie):
    cfg = GPTConfig(n_layer=3, n_embd=64, n_head=4, block_size=16, tie_weights=tie, dropout=0.1,
                    linear_projection=0.5)
    torch.manual_seed(7)
    whole = build_gpt(cfg)
    after_whole = torch.get_rng_state()
    torch.manual_seed(7)
    layers, init = build_gpt_meta(cfg)
    assert all(t.is_meta for t in layers.parameters())
    made = [init(i, layer) for i, layer in enumerate(layers)]
    init.finish()
    assert torch.equal(torch.get_rng_state(), after_whole)
    for i, layer in enumerate(whole):
        for name, p in layer.named_parameters():
            if tie and i == len(whole) - 1 and name == "lm_head.weight":
                continue  # build_gpt drew the head's own and then tied it to the token table (layer 0's)
            assert torch.equal(made[i][name], p), (i, name)
    assert (layers[-1].lm_head.weight is layers[0].wte.weight) == tie


def test_a_later_layer_first_draws_the_layers_before_it_as_a_pipeline_stage_would():
    cfg = GPTConfig(n_layer=4, n_embd=32, n_head=2, block_size=8)
    torch.manual_seed(3)
    whole = build_gpt(cfg)
    torch.manual_seed(3)
    layers, init = build_gpt_meta(cfg)
    third = init(3, layers[3])
    assert all(torch.equal(third[n], p) for n, p in whole[3].named_parameters())
    with pytest.raises(ValueError, match="layer 2 was made already"):
        init(2, layers[2])


def test_l2l_trains_the_layer_by_layer_gpt_bit_identically_to_build_gpts_whole_one():
    """build_relay (the model made as the EPS takes it) against a Relay over build_gpt's whole model,
    the way the reference GPT was built before: the same losses bit for bit, dropout drawing from
    torch's RNG at every step."""
    cfg = TrainConfig(layers=3, width=64, heads=4, context=16, batch_size=4, micro_batches=2, dropout=0.1,
                      steps=3, out=None, verbose=False)
    g = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(0, 256, (4, 16), generator=g) for _ in range(2)) for _ in range(3)]

    def losses(relay):
        with relay:
            return [relay.train_step(x, y) for x, y in batches]

    layered = losses(build_relay(cfg))
    torch.manual_seed(cfg.seed)  # build_relay's whole build, as it was
    whole = losses(l2l_hw.Relay(build_gpt(cfg.model_config()), lm_loss, eps=build_eps(cfg), options=relay_options(cfg)))
    assert layered == whole


def test_the_estimate_counts_one_layer_for_the_build_not_the_whole_model():
    cfg = TrainConfig(layers=12, width=256, heads=4, context=16, batch_size=1, micro_batches=1, out=None,
                      verbose=False)
    e = estimate.estimate(cfg)
    block = 12 * 256 * 256 + 13 * 256  # a block's parameters: 4 matrices of C x C, 4C x C twice; biases, norms
    assert e.host_phases["build"] == 2 * block * 4  # made, then registered; never the 12 blocks at once
    assert e.host_phases["build"] < e.trained * 4 / 5


# ---------------------------------------------------------------------------- the cgroup
def test_a_child_past_its_limit_is_oom_killed_and_reported_one_within_runs_and_the_cgroup_goes():
    limit = cgroup_or_skip(256 * MiB)
    with limit:
        grow = "import sys; a = bytearray(int(sys.argv[1]) << 20); a[::4096] = b'x' * len(a[::4096]); print(len(a))"
        within = limit.run([sys.executable, "-c", grow, "64"])
        past = limit.run([sys.executable, "-c", grow, "512"])
        path = limit.path
        assert path.exists()
    assert not path.exists() and path.name not in own_cgroup_children()
    assert within.returncode == 0 and within.stdout.strip() == str(64 * MiB) and not within.oom_killed
    assert 64 * MiB <= within.peak_bytes <= 256 * MiB
    assert past.oom_killed and past.oom_kills >= 1 and past.returncode == -signal.SIGKILL
    assert past.limit_bytes == 256 * MiB


ESTIMATE = """
import json, sys
from l2l_hw.estimate import estimate
from l2l_hw.train import TrainConfig
cfg = TrainConfig(layers=40, width=512, heads=8, context=32, batch_size=1, micro_batches=1, out=None, verbose=False,
                  state_dir=sys.argv[1] or None)
print(json.dumps(estimate(cfg).to_json()))
"""


def test_a_child_sees_the_limit_as_its_headroom_and_the_estimate_refuses_a_ram_run_past_it():
    """Inside a 768 MiB limit (this machine has GiBs free): the estimate that l2l train checks before
    loading anything sees the limit, refuses the state in RAM (1.5 GB) and takes it on disk."""
    limit = cgroup_or_skip(768 * MiB)
    with limit:
        seen = limit.run([sys.executable, "-c", "from l2l_hw.memory_limit import headroom; print(headroom())"])
        in_ram = limit.run([sys.executable, "-c", ESTIMATE, ""])
        on_disk = limit.run([sys.executable, "-c", ESTIMATE, "/var/tmp/l2l-never-made"])
    assert headroom() is None or headroom() > 768 * MiB  # this process is not limited by it
    assert 0 < int(seen.stdout) < 768 * MiB
    ram, disk = json.loads(in_ram.stdout), json.loads(on_disk.stdout)
    assert not ram["fits"] and ram["available"]["host"] <= 768 * MiB
    assert ram["host"]["eps"] > 768 * MiB  # 40 blocks of 3.1 M parameters, 12 B each
    assert ram["shortfall"][0].startswith("host memory:") and ram["shortfall"][0].endswith("available")
    assert disk["fits"] and disk["disk"]["state_dir"] > 768 * MiB and disk["host_bytes"] <= 768 * MiB
    assert not Path("/var/tmp/l2l-never-made").exists()


def test_no_cgroup_to_set_a_limit_in_is_refused_in_one_line(tmp_path):
    with pytest.raises(MemoryLimitError, match="neither the cgroup v1 memory controller nor cgroup v2") as e:
        MemoryLimit(MiB, root=tmp_path)
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    with pytest.raises(MemoryLimitError, match="cannot make a cgroup under") as e:
        MemoryLimit(MiB, root=tmp_path, proc_cgroup="4:memory:/gone/away\n")
    assert "\n" not in str(e.value)
    assert headroom(root=tmp_path, proc_cgroup="4:memory:/\n") is None  # no limit set: none to report


# ---------------------------------------------------------------------------- the bench's refusals
def bench(*args, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([*L2L, "bench", "disk", *args], capture_output=True, text=True, cwd=cwd)


def test_a_limit_below_what_even_the_disk_tier_needs_is_refused_in_one_line_before_anything_is_written(tmp_path):
    (tmp_path / "kept").write_text("an earlier file")
    done = bench("--memory-limit", "200MiB", "--dir", str(tmp_path))
    assert done.returncode == 2 and done.stdout == ""
    line, = done.stderr.splitlines()
    assert line.startswith("l2l bench disk: --memory-limit 0.20 GiB is below what even the disk tier needs")
    assert [p.name for p in tmp_path.iterdir()] == ["kept"] and (tmp_path / "kept").read_text() == "an earlier file"


def test_a_dir_without_room_for_the_state_and_a_limit_that_cannot_be_set_are_refused_before_anything_is_written(
        tmp_path, monkeypatch, capsys):
    (tmp_path / "kept").write_text("an earlier file")
    # a limit the disk tier's needs (this process's RSS among them) stay well under, so --dir is what refuses
    args = type("Args", (), {"dir": str(tmp_path), "memory_limit": 3 << 30, "rounds": 1, "json": False})
    free = estimate.free_disk_bytes(tmp_path)
    monkeypatch.setattr(estimate.machine, "free_disk_bytes", lambda path: 2 << 30)  # a filesystem with 2 GiB free
    assert disk_limit.run_from_args(args) == 2
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith("l2l bench disk: --dir: no room for the disk tier's state: disk at ")
    assert line.endswith("2.00 GiB free (nothing was written)")
    monkeypatch.setattr(estimate.machine, "free_disk_bytes", lambda path: free)
    monkeypatch.setattr(memory_limit, "ROOT", tmp_path / "no-cgroups")  # a machine without a cgroup to write
    assert disk_limit.run_from_args(args) == 2
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith("l2l bench disk: cannot set a memory limit:")
    assert [p.name for p in tmp_path.iterdir()] == ["kept"]


# ---------------------------------------------------------------------------- training inside the limit
@pytest.mark.slow
def test_a_gpt_with_state_3x_the_limit_trains_inside_it_on_disk_with_the_ram_tiers_losses(tmp_path):
    """`l2l bench disk --memory-limit 1GiB`: 3.26 GB of state on disk, trained in a 1 GiB cgroup, the
    same losses bit for bit as the model built whole with its state in RAM; no OOM kill; nothing
    left behind. About 80 s."""
    cgroup_or_skip(MiB).close()
    before = own_cgroup_children()
    done = bench("--memory-limit", "1GiB", "--dir", str(tmp_path), "--rounds", "1", "--json")
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    assert r["state_vs_limit"] >= 3 and r["state_bytes"] >= 3 << 30
    assert r["bit_identical"] and len(r["disk"]["losses"]) == 2 and r["disk"]["val_loss"] == r["ram"]["val_loss"]
    assert r["ram"]["build"] == "whole"  # the reference: the model built whole, the usual way
    assert r["disk"]["oom_kills"] == 0 and r["disk"]["cgroup_peak_bytes"] <= 1 << 30
    assert r["disk"]["peak_rss_bytes"] < (1 << 30) < r["ram"]["peak_rss_bytes"]
    assert list(tmp_path.iterdir()) == [] and own_cgroup_children() == before


@pytest.mark.slow
def test_a_run_killed_inside_the_limit_resumes_inside_it_bit_exactly(tmp_path):
    """A disk-tier run with state 3x its 1 GiB limit, a checkpoint each step, killed with SIGKILL at
    a random moment of its steps after the first checkpoint, resumed inside the limit: every step's
    loss equals the RAM tier's uninterrupted run. About 3 minutes."""
    limit = cgroup_or_skip(1 << 30)
    cfg = disk_limit.sized(1 << 30, 3, str(tmp_path / "state"))
    fields = {k: getattr(cfg, k) for k in ("layers", "width", "heads", "context", "batch_size", "micro_batches",
                                           "steps", "seed", "verbose")}
    run = {**fields, "out": str(tmp_path / "run"), "eval_every": 1, "state_dir": cfg.state_dir}
    child = lambda c: [sys.executable, "-m", "l2l_hw.bench.disk_limit", json.dumps({"config": c, "build": "layered"})]
    try:
        resumed, ram = killed_and_resumed(limit, child, run, fields)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)  # 3 GB of state and a checkpoint or two
    assert json.loads(resumed.stdout.splitlines()[-1])["losses"] == json.loads(ram.stdout.splitlines()[-1])["losses"]


def killed_and_resumed(limit, child, run, fields):
    with limit:
        first = limit.start(child(run), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while not (Path(run["out"]) / "checkpoint.safetensors").exists():  # the first step checkpointed
            assert first.poll() is None, first.communicate()
            time.sleep(0.2)
        time.sleep(random.uniform(0.5, 8.0))  # into the second step (about 6 s), or its checkpoint
        first.kill()
        first.communicate()
        assert first.returncode == -signal.SIGKILL and limit.oom_kills() == 0
        resumed = limit.run(child({**run, "resume": True}))
    assert resumed.returncode == 0, resumed.stderr
    assert not resumed.oom_killed and resumed.peak_bytes <= 1 << 30
    ram = subprocess.run(child({**fields, "out": None, "eval_every": 3}), capture_output=True, text=True)
    assert ram.returncode == 0, ram.stderr
    return resumed, ram
