"""The `l2l` command end to end: train writes every output, resume is bit-exact, info and bench run."""
import json

import pytest
import torch

import l2l_hw.bench.memory as bench_memory
import l2l_hw.bench.relay as bench_relay
from l2l_hw.checkpoint import load_checkpoint
from l2l_hw.cli import BENCHES, main
from l2l_hw.models import GPTConfig

TINY = ["--layers", "1", "--width", "32", "--heads", "2", "--context", "16", "--batch-size", "4",
        "--micro-batches", "2", "--lr", "3e-3", "--seed", "7"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _train(out, *extra):
    assert main(["train", *TINY, "--out", str(out), *extra]) == 0


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_tiny_config_writes_metrics_plot_checkpoint_and_prints_val_loss_and_sample(tmp_path, capsys):
    out = tmp_path / "run"
    _train(out, "--steps", "6", "--eval-every", "3")
    printed = capsys.readouterr().out
    assert "final val loss" in printed and "sample:\ndef " in printed
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all({"step", "loss", "lr", "tokens_per_s", "elapsed"} <= r.keys() for r in rows)
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tensors, meta = load_checkpoint(out / "checkpoint.safetensors")
    assert meta["step"] == 6 and meta["config"]["layers"] == 1
    assert {"rng.torch", "data.generator"} <= tensors.keys()
    assert any(k.startswith("relay.") for k in tensors)


def _assert_same_checkpoints(a, b):
    ta, ma = load_checkpoint(a / "checkpoint.safetensors")
    tb, mb = load_checkpoint(b / "checkpoint.safetensors")
    assert ta.keys() == tb.keys()
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and torch.equal(ta[name], tb[name]), name
    assert ma["step"] == mb["step"] and ma["config"] == mb["config"]
    ra, rb = _metrics(a), _metrics(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(1, len(ra) + 1))
    assert [(r["loss"], r["lr"], r.get("val_loss")) for r in ra] == [(r["loss"], r["lr"], r.get("val_loss")) for r in rb]


@pytest.mark.parametrize("state", ["fp32", "8bit"])
def test_resume_10_plus_10_steps_is_bit_identical_to_20_straight_with_dropout_and_cosine(tmp_path, state):
    # dropout draws from the torch RNG and the batches from the data generator: both must resume exactly
    opts = ["--dropout", "0.1", "--schedule", "cosine", "--warmup", "3", "--eval-every", "5", "--steps", "20",
            "--optimizer-state", state]
    _train(tmp_path / "straight", *opts)
    _train(tmp_path / "split", *opts, "--stop-after", "10")
    tensors, meta = load_checkpoint(tmp_path / "split" / "checkpoint.safetensors")
    assert meta["step"] == 10 and meta["config"]["optimizer_state"] == state
    # the state is stored as the EPS keeps it: 8-bit codes and one scale per block
    assert {t.dtype for k, t in tensors.items() if k.endswith(("/m", "/v"))} == \
        {torch.uint8 if state == "8bit" else torch.float32}
    assert any(k.endswith("/m_scale") for k in tensors) == (state == "8bit")
    assert main(["train", "--resume", "--out", str(tmp_path / "split")]) == 0
    _assert_same_checkpoints(tmp_path / "straight", tmp_path / "split")


def test_resume_with_a_larger_steps_target_continues_a_constant_schedule_run_exactly(tmp_path):
    opts = ["--schedule", "constant", "--warmup", "0", "--eval-every", "5"]
    _train(tmp_path / "straight", *opts, "--steps", "20")
    _train(tmp_path / "split", *opts, "--steps", "10")
    assert main(["train", "--resume", "--steps", "20", "--out", str(tmp_path / "split")]) == 0
    _assert_same_checkpoints(tmp_path / "straight", tmp_path / "split")


def test_resume_without_a_checkpoint_fails_with_a_message_naming_the_file(tmp_path, capsys):
    assert main(["train", "--resume", "--out", str(tmp_path / "empty")]) == 2
    assert "checkpoint.safetensors: no such checkpoint file" in capsys.readouterr().err


def test_train_on_a_user_data_folder(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("hello relay\n" * 2000)
    _train(tmp_path / "run", "--steps", "2", "--data", str(data))
    assert str(data) in capsys.readouterr().out


def test_info_prints_versions_backends_and_devices(capsys):
    assert main(["info"]) == 0
    printed = capsys.readouterr().out
    for word in ("l2l_hw", "python", "torch", "numpy", "EPS backends", "cpu", "golden", "devices"):
        assert word in printed


@pytest.mark.parametrize("command", [[], ["train"], ["info"], ["bench"], *(["bench", name] for name in BENCHES)])
def test_help_works_for_every_subcommand(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([*command, "--help"])
    assert e.value.code == 0 and "usage: l2l" in capsys.readouterr().out


def test_bench_approx_is_reachable_and_reports_the_memory_of_each_variant(capsys):
    assert main(["bench", "approx", "--memory-only", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert memory["fewbit"] < memory["exact"] and memory["projection_0.5"] < memory["exact"]


def test_bench_memory_counts_a_relay_flat_in_depth_below_pytorch(monkeypatch, capsys):
    monkeypatch.setattr(bench_memory, "DEPTHS", (2, 4))
    assert main(["bench", "memory", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["host_growth"] == 1.0  # activations="host": no growth with depth
    for row in report["peak_bytes"].values():
        assert 0 < row["relay_host"] <= row["relay_device"] < row["pytorch_checkpoint"] < row["pytorch"], row


def test_bench_relay_json_pairs_each_policy_with_its_pytorch_partner_and_contention(monkeypatch, capsys):
    monkeypatch.setattr(bench_relay, "MODEL", GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16))
    monkeypatch.setattr(bench_relay, "BATCH_SIZE", 8)
    assert main(["bench", "relay", "--json", "--steps", "1", "--contention", "--budgets"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["n_layer"] == 1
    assert {p: v["partner"] for p, v in report["pairs"].items()} == {
        "none": "plain", "full": "checkpointed", "selective": "selective"}
    for pair in report["pairs"].values():
        assert pair["ratio"] == pytest.approx(pair["relay_step_s"] / pair["torch_step_s"])
        assert pair["relay_peak_bytes"] > 0 and pair["torch_peak_bytes"] > 0
        assert pair["slowdown_ratio"] == pytest.approx(pair["relay_slowdown"] / pair["torch_slowdown"])
        assert pair["ratio_to_accumulating"] == pytest.approx(pair["relay_step_s"] / pair["torch_accumulating_step_s"])
    # checkpointing keeps less than plain PyTorch keeps
    assert report["pairs"]["full"]["torch_peak_bytes"] < report["torch_plain_peak_bytes"]
    planned = report["planned"]
    assert set(planned) >= {"full", "none"} and len(planned) == 5
    for p in planned.values():
        assert p["budget_bytes"] is None or p["kept_peak_bytes"] <= p["budget_bytes"]


def test_bench_relay_runs_the_relay_in_bf16_beside_pytorch_autocast_and_prices_the_fp32_sums(monkeypatch, capsys):
    monkeypatch.setattr(bench_relay, "MODEL", GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16))
    monkeypatch.setattr(bench_relay, "BATCH_SIZE", 8)
    assert main(["bench", "relay", "--json", "--steps", "1", "--precision", "bf16"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["precision"] == "bf16"
    for pair in report["pairs"].values():
        assert pair["ratio"] == pytest.approx(pair["relay_step_s"] / pair["torch_step_s"])
        assert pair["fp32_sums_cost"] == pytest.approx(pair["relay_step_s"] / pair["compute_sums_step_s"])
