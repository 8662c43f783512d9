"""`l2l estimate` against what runs measure: the device peak the relay's accounting reports
(relay.memory_report()), the peak resident memory of a real `l2l train` / `l2l finetune` in a
fresh process (VmHWM), the checkpoint and state files as written; and `l2l train` / `l2l
finetune` refusing, in one line and before anything loads, a run the estimate says cannot fit.

    python -m tests.test_estimate      the estimate-vs-peak table of every family and size"""
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import l2l_hw
from l2l_hw import estimate as est
from l2l_hw.models import build_gpt, lm_loss
from l2l_hw.train import TrainConfig
from tests.test_finetune import PARAGRAPHS, byte_level_tokenizer
from tests.test_nothing_lost import cli, one_line

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 0.10  # the acceptance: within 10% of the measured peaks
TEXT = PARAGRAPHS * 30  # ~47 kB: enough 128-token blocks for a few minibatches of 8

# family -> size -> the model (the reference GPT: l2l train's flags; Hugging Face: its config)
SIZES = {
    "gpt": {"small": ["--layers", "4", "--width", "256", "--heads", "4"],
            "medium": ["--layers", "6", "--width", "768", "--heads", "6"],
            "large": ["--layers", "8", "--width", "1280", "--heads", "10"]},
    "gpt2": {"small": dict(n_embd=128, n_layer=2, n_head=4, vocab_size=8192),
             "medium": dict(n_embd=512, n_layer=6, n_head=8, vocab_size=16384),
             "large": dict(n_embd=1024, n_layer=8, n_head=16, vocab_size=32000)},
    "llama": {"small": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=8192),
              "medium": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
                             num_key_value_heads=4, vocab_size=16384),
              "large": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                            num_key_value_heads=8, vocab_size=32000)},
}
RUN = ["--context", "128", "--batch-size", "8", "--steps", "1"]  # one step, then validation, checkpoint, report
IN_CI = {"small"}  # the sizes CI runs; the others are marked slow


def hf_folder(family: str, size: str, where: Path) -> Path:
    """A Hugging Face folder of `family` at `size` (random weights, bf16 as published checkpoints
    are) with a small byte-level tokenizer."""
    folder = where / f"{family}-{size}"
    if (folder / "config.json").exists():
        return folder
    tokenizer = byte_level_tokenizer(TEXT)
    torch.manual_seed(0)
    shape = SIZES[family][size]
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_positions=128, eos_token_id=tokenizer.eos_token_id,
                                           bos_token_id=tokenizer.eos_token_id, **shape))
    else:
        model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=128, eos_token_id=tokenizer.eos_token_id,
                                             bos_token_id=tokenizer.eos_token_id, **shape))
    model.to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_argv(family: str, size: str, where: Path, *extra: str) -> list[str]:
    """The command line of the run: `l2l train` of the reference GPT, `l2l finetune` of an HF model."""
    out = str(where / f"out-{family}-{size}")
    if family == "gpt":
        return ["train", *SIZES["gpt"][size], *RUN, "--out", out, "--overwrite", *extra]
    (where / "text.txt").write_text(TEXT)
    return ["finetune", "--model", str(hf_folder(family, size, where)), "--data", str(where / "text.txt"), *RUN,
            "--out", out, "--overwrite", *extra]


MEASURE = """
import json, sys
from l2l_hw import cli
from l2l_hw.estimate import rss_bytes
from l2l_hw.finetune import finetune
from l2l_hw.train import train
args = cli.build_parser().parse_args(sys.argv[1:])
result = (finetune if args.command == "finetune" else train)(cli.train_config(args))
print(json.dumps({"host_bytes": rss_bytes("VmHWM"), "device_bytes": result.relay.memory_report()["peak_bytes"]}))
"""
ESTIMATE = """
import argparse, json, sys
from l2l_hw import cli, estimate
args = cli.build_parser().parse_args(sys.argv[1:])
print(json.dumps(estimate.estimate(cli.train_config(args)).to_json()))
"""


def in_fresh_process(code: str, argv: list[str]) -> dict:
    """`code` run by a fresh interpreter with `argv`: its last line of output, as JSON."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def measure_and_estimate(family: str, size: str, where: Path) -> tuple[dict, dict]:
    argv = run_argv(family, size, where)
    estimated = in_fresh_process(ESTIMATE, argv)  # before the run: the run writes the token cache it reads
    return in_fresh_process(MEASURE, [*argv, "--account-memory"]), estimated


CASES = [pytest.param(family, size, marks=() if size in IN_CI else pytest.mark.slow)
         for family in SIZES for size in SIZES[family]]


@pytest.mark.parametrize("family,size", CASES)
def test_the_estimate_is_within_ten_percent_of_the_measured_peak_rss_and_device_memory(family, size, tmp_path):
    measured, estimated = measure_and_estimate(family, size, tmp_path)
    for what in ("host_bytes", "device_bytes"):
        assert abs(estimated[what] / measured[what] - 1) <= TOLERANCE, (what, estimated[what], measured[what],
                                                                        estimated["host"])


RELAY_CASES = [dict(recompute=r, activations=a, precision=p, tie_weights=t, micro_batches=u)
               for r, a in (("none", "device"), ("full", "device"), ("full", "host"), ("selective", "device"),
                            ("selective", "host"))
               for p, t, u in (("fp32", False, 4), ("bf16", True, 3))]
RELAY_CASES += [dict(activation_budget=b) for b in (1_500_000, 4_000_000)]  # planned recompute: 1 and 3 graphs kept


@pytest.mark.parametrize("options", RELAY_CASES, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_the_device_figure_is_the_peak_the_relay_s_accounting_reports(options, one_thread):
    cfg = TrainConfig(layers=3, width=64, heads=2, context=32, batch_size=7, steps=2, out=None, verbose=False,
                      account_memory=True, **options)
    relay = l2l_hw.train(cfg).relay  # two steps and a validation
    report, estimated = relay.memory_report(), est.estimate(cfg).device_bytes
    if cfg.activation_budget is None:
        assert estimated == pytest.approx(report["peak_bytes"], rel=1e-3)
        return
    # A budget's plan weighs the recompute times the relay measures in its first step, and so moves
    # with the machine's load (on 2 loaded cores the same case kept 1 to 3 graphs); the estimate weighs
    # bytes instead: it must never fall short of the run, and the run keeps within its budget
    assert report["peak_bytes"] <= estimated * (1 + TOLERANCE)
    assert report["kept_activation_peak_bytes"] <= cfg.activation_budget


def test_the_checkpoint_and_the_state_dir_take_the_bytes_estimated(tmp_path, one_thread):
    cfg = TrainConfig(layers=2, width=64, heads=2, context=32, batch_size=4, steps=1, out=str(tmp_path / "run"),
                      state_dir=str(tmp_path / "state"), optimizer_state="8bit", precision="bf16", verbose=False)
    estimated = est.estimate(cfg).disk
    l2l_hw.train(cfg)
    written = (tmp_path / "run" / "checkpoint.safetensors").stat().st_size
    assert abs(written - estimated["checkpoint"]) <= 24  # the header's elapsed seconds: a float of a few digits
    assert sum(f.stat().st_size for f in (tmp_path / "state" / "regions").iterdir()) == estimated["state_dir"]


@pytest.mark.parametrize("options", [{}, dict(precision="bf16"), dict(precision="fp16"), dict(pipedream_2bw=True),
                                     dict(optimizer_state="8bit", precision="bf16"), dict(optimizer="sgd")])
def test_the_eps_bytes_are_what_the_engine_allocates(options):
    cfg = TrainConfig(layers=2, width=48, heads=2, out=None, **options)
    with torch.device("meta"):
        layers = build_gpt(cfg.model_config())
    eps = l2l_hw.make_eps("cpu", optimizer=cfg.optimizer, state=cfg.optimizer_state)
    relay = l2l_hw.Relay(layers, lm_loss, eps=eps, precision=cfg.precision, pipedream_2bw=cfg.pipedream_2bw,
                         init=lambda i, m: {n: torch.zeros(p.shape) for n, p in m.named_parameters()})
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for group in relay.eps.buffers.values()
            for b in group.values() for t in b.all()}
    assert est.eps_bytes(cfg, relay.eps.shapes).memory == sum(held.values())
    relay.eps.close()


def test_l2l_train_refuses_a_run_too_large_for_this_machine_in_one_line_before_anything_loads(tmp_path, capsys):
    out = tmp_path / "run"
    rc, _, err = cli(capsys, "train", "--layers", "80", "--width", "16384", "--heads", "128", "--out", str(out))
    assert rc == 2
    one_line(err, "train", "does not fit", "host memory", "needed", "available")
    assert not out.exists()  # refused before the output folder is made, let alone the model


def test_l2l_finetune_refuses_a_model_too_large_before_reading_its_weights(tmp_path, capsys):
    folder = tmp_path / "huge"
    tokenizer = byte_level_tokenizer(TEXT)
    LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=32000, architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"not safetensors: never read")
    (tmp_path / "text.txt").write_text(TEXT)
    out = tmp_path / "run"
    rc, _, err = cli(capsys, "finetune", "--model", str(folder), "--data", str(tmp_path / "text.txt"), "--out",
                     str(out))
    assert rc == 2
    one_line(err, "finetune", "does not fit", "host memory")
    assert not out.exists()


def test_l2l_estimate_prints_the_figures_and_json_with_the_same_numbers(tmp_path, capsys):
    argv = ["estimate", "--layers", "2", "--width", "64", "--heads", "2", "--out", str(tmp_path / "run")]
    rc, text, _ = cli(capsys, *argv)
    assert rc == 0 and "fits" in text and "host memory" in text
    rc, text, _ = cli(capsys, *argv, "--json")
    figures = json.loads(text)
    assert rc == 0 and figures["fits"] is True
    assert {"host_bytes", "disk_bytes", "device_bytes", "fits", "largest"} <= set(figures)
    assert figures["host_bytes"] == sum(figures["host"].values())
    assert figures["largest"]["context"] >= 128 and figures["largest"]["micro_batches"] == 1
    assert not (tmp_path / "run").exists()  # an estimate writes nothing


def test_explain_prints_each_stage_s_action_list_as_the_relay_runs_it_with_the_memory_after_each(tmp_path, capsys):
    # the reference GPT of 2 blocks is 4 relayed layers (embedding, 2 blocks, head)
    from l2l_hw.relay.actions import SCHEDULES, layer_major

    argv = ["estimate", "--layers", "2", "--width", "64", "--heads", "2", "--micro-batches", "2",
            "--out", str(tmp_path / "run"), "--explain"]
    for stages, lists in ((1, [layer_major(range(4), 2)]),
                          (2, [SCHEDULES["flush"].actions(s, 2, [layers], 2, 3) for s, layers in enumerate(([0, 1],
                                                                                                             [2, 3]))])):
        rc, text, _ = cli(capsys, *argv, "--pipeline-stages", str(stages))
        blocks = text.split("action by action")[1:]
        assert rc == 0 and len(blocks) == stages
        mib = lambda value, unit: float(value.replace(",", "")) * (1024 if unit == "GiB" else 1)  # noqa: E731
        device = [mib(*line.split()[1:3]) if line.startswith("device") else mib(*line.split()[2:4])
                  for line in text.splitlines() if line.startswith(("device ", "stage ")) and "peak on" in line]
        for block, actions, peak in zip(blocks, lists, device):
            rows = [row for row in block.splitlines()[1:] if row.startswith("  ")]
            assert [row[2:30].strip() for row in rows] == [str(a) for a in actions]
            after = [mib(*row.split()[-2:]) for row in rows]
            assert max(after) <= peak and after[-1] < max(after)  # the peak falls inside an action; the step ends lighter


def test_the_largest_context_found_fits_and_one_more_token_does_not(one_thread):
    cfg = TrainConfig(layers=2, width=64, heads=2, context=64, batch_size=4, out=None)
    baseline = est.rss_bytes()
    need = est.figures(cfg, baseline).host_bytes
    have = {"host": need + (8 << 20), "device": None}  # 8 MiB more than the run of context 64 needs
    largest = est.largest(cfg, baseline, have, None)
    fits = lambda **change: est.memory_fits(dataclasses.replace(cfg, **change), baseline, have)
    assert largest["context"] >= 64 and fits(context=largest["context"]) and not fits(context=largest["context"] + 1)
    assert largest["optimizer_state"] == "fp32"


# The step time of `l2l estimate --measure` (measure_step) against real relay steps of the same
# config, timed here. Three shapes: a one-block model (a layer counted twice doubles its estimate),
# the same with 4x the blocks, and with 3x the micro-batches of the same size.
STEP_SHAPES = {"1 block": dict(layers=1, batch_size=16, micro_batches=4),
               "4 blocks": dict(layers=4, batch_size=16, micro_batches=4),
               "3x micro-batches": dict(layers=1, batch_size=48, micro_batches=12)}
# Measured on the 2 shared cores of the dev machine: estimate / step 0.84 to 0.90 (the relay's own
# work beside the layers), the scaling ratios 1.00 to 1.03; with 3 such jobs at once 0.5 to 1.1 and
# 0.6 to 2.0 in one attempt. A layer or micro-batches miscounted moves them 2x or more, every time.
STEP_FACTOR = 1.5  # estimate / measured step
SCALING_FACTOR = 1.4  # (the estimate's ratio of two shapes) / (the measured ratio)
STEP_ATTEMPTS = 3  # a busy spell can spoil an attempt; a wrong estimate fails them all


class TimedRelaySteps:
    """A Relay of cfg (the reference GPT, its micro-batches, recompute and optimizer) after one
    warm-up step: each call times one more train_step (seconds, wall clock)."""

    def __init__(self, cfg: TrainConfig):
        torch.manual_seed(cfg.seed)
        self.relay = l2l_hw.Relay(build_gpt(cfg.model_config()), lm_loss,
                                  eps=l2l_hw.make_eps("cpu", optimizer=cfg.optimizer),
                                  micro_batches=cfg.micro_batches, recompute=cfg.recompute)
        x = torch.randint(0, 256, (cfg.batch_size, cfg.context), generator=torch.Generator().manual_seed(cfg.seed))
        self.batch = (x, torch.roll(x, -1, 1))
        self.relay.train_step(*self.batch)

    def __call__(self) -> float:
        start = time.perf_counter()
        self.relay.train_step(*self.batch)
        return time.perf_counter() - start


def step_time_misfits(cfgs: dict, relays: dict, rounds: int = 2) -> list[str]:
    """What disagrees between the estimate and the measured steps: each the fastest of `rounds`
    (estimate) and 2 x `rounds` (relay) runs, interleaved so that a busy spell hits both."""
    estimated, measured = dict.fromkeys(cfgs, math.inf), dict.fromkeys(cfgs, math.inf)
    for _ in range(rounds):
        for name, cfg in cfgs.items():
            estimated[name] = min(estimated[name], est.measure_step(cfg)[0])
            measured[name] = min(measured[name], relays[name](), relays[name]())
    table = {n: f"{estimated[n]:.4f} s estimated, {measured[n]:.4f} s measured" for n in cfgs}
    misfits = [f"{n}: {table[n]}" for n in cfgs if not 1 / STEP_FACTOR <= estimated[n] / measured[n] <= STEP_FACTOR]
    base = next(iter(cfgs))
    for name in list(cfgs)[1:]:
        ratio = (estimated[name] / estimated[base]) / (measured[name] / measured[base])
        if not 1 / SCALING_FACTOR <= ratio <= SCALING_FACTOR:
            misfits.append(f"{name} / {base}: the estimate scales {ratio:.2f}x what measured steps do ({table})")
    return misfits


def test_the_measured_step_time_is_a_real_relay_step_s_and_scales_with_the_blocks_and_micro_batches(one_thread):
    # Fails when a layer or its micro-batches are counted twice, or not at all (a 4-block model
    # estimated as its 3 layer kinds; the micro-batches' count or size ignored): each moves the
    # estimate 2x or more from the relay's step, or its scaling from the measured scaling. Not
    # seen: the EPS update's share (1 to 2% of these steps).
    cfgs = {name: TrainConfig(width=128, heads=4, context=64, out=None, **shape) for name, shape in STEP_SHAPES.items()}
    relays = {name: TimedRelaySteps(cfg) for name, cfg in cfgs.items()}
    try:
        for _ in range(STEP_ATTEMPTS):
            misfits = step_time_misfits(cfgs, relays)
            if not misfits:
                break
        assert not misfits, misfits
    finally:
        for timed in relays.values():
            timed.relay.close()


STAGE = """
import json, sys
import torch, torch.distributed as dist
from l2l_hw.train import TrainConfig, build_relay
cfg = TrainConfig(**json.loads(sys.argv[1]), account_memory=True)
dist.init_process_group("gloo")
x = torch.randint(0, 256, (cfg.batch_size, cfg.context), generator=torch.Generator().manual_seed(cfg.seed))
with build_relay(cfg) as relay:  # the run's relay (l2l train's): this rank's stage
    for _ in range(cfg.steps):
        relay.train_step(x, torch.roll(x, -1, 1))
    print(json.dumps({"layers": [relay.first, relay.end], "device_bytes": relay.memory_report()["peak_bytes"]}))
dist.destroy_process_group()
"""
# A stage's estimate replays the action list the stage runs (estimate.pipeline_step), sampled where
# its accounting samples: the accounting's own figure, as the relay's is (before the replay, a model of
# the schedule was 3 to 22% below it).
PIPELINE_TOLERANCE = 1e-3


@pytest.mark.parametrize("micro_batches", [pytest.param(2, marks=pytest.mark.slow), 4,
                                           pytest.param(8, marks=pytest.mark.slow)])
def test_a_pipeline_is_estimated_per_stage_as_a_real_two_stage_run_splits_and_holds_it(one_thread, micro_batches):
    # 5 blocks + the embedding and the head: 7 layers relayed by 2 ranks, the stages as PipelineRelay
    # splits them in the run (whole layers, in order, 4 + 3) and each stage's device peak as its
    # accounting reports it after two steps
    from l2l_hw.distributed import run_local_ranks

    options = dict(layers=5, width=64, heads=2, context=32, batch_size=8, micro_batches=micro_batches, steps=2,
                   out=None, pipeline_stages=2, pipeline_schedule="flush")
    ranks = run_local_ranks(["-c", STAGE, json.dumps(options)], 2, timeout_s=180, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    measured = [json.loads(r.stdout.strip().splitlines()[-1]) for r in ranks]
    e = est.estimate(TrainConfig(**options))
    assert [s["layers"] for s in e.stages] == [m["layers"] for m in measured] == [[0, 4], [4, 7]]
    for s, m in zip(e.stages, measured):
        assert abs(s["device_bytes"] / m["device_bytes"] - 1) <= PIPELINE_TOLERANCE, (e.stages, measured)
    assert abs(e.device_bytes / max(m["device_bytes"] for m in measured) - 1) <= PIPELINE_TOLERANCE
    assert e.ranks == len(ranks) and e.host_bytes > 2 * e.host["baseline"]  # a process per stage, each its baseline


def test_a_replicated_pipeline_holds_a_replicas_shard_of_the_activations_on_each_rank(one_thread, monkeypatch):
    # 4 torchrun ranks as 2 stages x 2 replicas: a replica trains 4 of the 8 sequences, so each
    # rank's stage is the 2-rank pipeline's on a minibatch of 4, and the machine holds two of them
    cfg = dict(layers=4, width=64, heads=2, context=32, out=None, pipeline_stages=2, pipeline_schedule="flush",
               micro_batches=2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    replicated = est.estimate(TrainConfig(batch_size=8, **cfg))
    monkeypatch.setenv("WORLD_SIZE", "2")
    shard = est.estimate(TrainConfig(batch_size=4, **cfg))
    assert replicated.ranks == 4 and shard.ranks == 2
    assert replicated.stages == shard.stages
    assert {k: v for k, v in replicated.host.items() if k != "baseline"} == \
        {k: v for k, v in shard.host.items() if k != "baseline"}  # the baseline is this process's RSS as read
    assert replicated.host_bytes - 4 * replicated.host["baseline"] == 2 * (shard.host_bytes - 2 * shard.host["baseline"])


if __name__ == "__main__":
    import tempfile

    where = Path(tempfile.mkdtemp(prefix="l2l-estimate-"))
    print(f"{'family':<7} {'size':<7} {'parameters':>12} {'RSS est':>9} {'RSS peak':>9} {'ratio':>6} "
          f"{'device est':>11} {'device peak':>11} {'ratio':>6}")
    for family in SIZES:
        for size in SIZES[family]:
            m, e = measure_and_estimate(family, size, where)
            mib = lambda n: f"{n / 2**20:,.1f}"
            print(f"{family:<7} {size:<7} {e['parameters']:>12,} {mib(e['host_bytes']):>9} {mib(m['host_bytes']):>9} "
                  f"{e['host_bytes'] / m['host_bytes']:>6.3f} {mib(e['device_bytes']):>11} "
                  f"{mib(m['device_bytes']):>11} {e['device_bytes'] / m['device_bytes']:>6.3f}  {e['host']}",
                  flush=True)


def test_a_folder_of_config_json_alone_is_estimated_as_its_weights_in_the_config_s_dtype(tmp_path, one_thread):
    folder = hf_folder("llama", "small", tmp_path)  # bf16 weights, as save_pretrained wrote them
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((folder / "config.json").read_text())
    weights = (folder / "model.safetensors").stat().st_size
    assert est.weights_files(folder, 0) == [weights]
    (size,) = est.weights_files(bare, sum(p.numel() for p in LlamaForCausalLM.from_pretrained(folder).parameters()))
    assert abs(size - weights) <= 0.01 * weights  # safetensors' header and tied tensors aside
    cfg = TrainConfig(model=str(bare), context=128, batch_size=8, out=None, verbose=False)
    assert est.estimate(cfg).host_phases["build"] >= size


def test_an_index_that_names_no_weights_is_one_clear_line(tmp_path, capsys):
    folder = hf_folder("llama", "small", tmp_path)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    rc, _, err = cli(capsys, "estimate", "--model", str(folder), "--context", "128", "--batch-size", "8")
    assert rc == 2
    one_line(err, "estimate", "model.safetensors.index.json names no weights")


def test_nothing_is_counted_that_the_run_will_not_do_and_the_run_gathers_nothing_it_does_not_use(
        tmp_path, monkeypatch, one_thread):
    from l2l_hw.finetune import finetune
    from l2l_hw.relay.executor import Relay

    (tmp_path / "text.txt").write_text(TEXT)
    cfg = TrainConfig(model=str(hf_folder("llama", "small", tmp_path)), data=str(tmp_path / "text.txt"),
                      context=128, batch_size=8, steps=1, out=str(tmp_path / "run"), save=False)
    assert est.estimate(cfg).host_phases["end"] == 0  # no save, no --prompt: nothing gathered at the end
    assert est.estimate(dataclasses.replace(cfg, save=True)).host_phases["end"] > 0  # the save holds a shard

    def gathered(self):
        raise AssertionError("the run gathered the whole model, which --no-save without --prompt never uses")

    monkeypatch.setattr(Relay, "materialize", gathered)
    finetune(cfg).close()


def test_a_run_that_does_not_fit_names_the_flags_that_would_make_it_fit(tmp_path, capsys, one_thread):
    # width 1024: 8-bit state saves ~0.4 GB, far more than this process's RSS moves between estimates
    argv = ["--layers", "4", "--width", "1024", "--heads", "4", "--out", str(tmp_path / "run")]
    exact = est.estimate(TrainConfig(layers=4, width=1024, heads=4, out=str(tmp_path / "run")))
    small = est.estimate(TrainConfig(layers=4, width=1024, heads=4, out=str(tmp_path / "run"), optimizer_state="8bit"))
    between = (exact.host_bytes + small.host_bytes) // 2  # a machine that holds the 8-bit run, not the exact one
    rc, text, _ = cli(capsys, "estimate", *argv, "--host-memory", str(between), "--json")
    figures = json.loads(text)
    assert rc == 1 and not figures["fits"]
    ways = {tuple(w["flags"]): w for w in figures["ways_to_fit"]}
    assert ("--optimizer-state 8bit",) in ways and all(len(flags) == 1 for flags in ways)
    assert all(w["host_bytes"] <= between for w in ways.values())
    rc, text, _ = cli(capsys, "estimate", *argv, "--host-memory", str(between))
    assert rc == 1 and "fits with     --optimizer-state 8bit (host" in text
    rc, text, _ = cli(capsys, "estimate", *argv, "--host-memory", "1TiB", "--disk", "1TiB")
    assert rc == 0 and "1,024.00 GiB available" in text
