"""The relay as a pipeline (l2l_hw/relay/pipeline.py) on gloo ranks: "flush" equals the
single-process relay, "2bw" equals the single-process relay in its PipeDream-2BW mode (dropout
included), at 1e-5 over 10 steps, with 2 and 3 stages; resume is bit-exact; a failing or killed
stage stops every rank with one clear error. Every rank is a real process (tests/pipe_worker.py)."""
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import l2l_hw
from l2l_hw.distributed import run_local_ranks
from l2l_hw.models.gpt import GPTConfig, build_gpt, lm_loss
from l2l_hw.relay.options import even_split
from l2l_hw.relay.actions import OneFOneB
from tests.helpers import coherent_batches, coherent_layers, launch_ranks, mlp_layers, ranks_ok, rel_diff
from tests.test_relay_equivalence import OPTIMIZERS, gpt_batches, mlp_batches

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
STEPS = 10
RNG_SEED = 1234  # the torch generator's seed at the first step, in every process
EPS_BACKEND = os.environ.get("L2L_PIPELINE_TEST_EPS", "cpu")  # golden: while the host kernel is rebuilt
LAUNCH_TIMEOUT = 120  # seconds for a whole multi-process run; a hang fails the test instead of CI


def gpt(dropout=0.0):
    torch.manual_seed(0)
    return build_gpt(GPTConfig(n_layer=3, n_embd=32, n_head=4, block_size=16, bias=False, dropout=dropout))


MODELS = {
    "gpt": (gpt, gpt_batches, lm_loss),
    "gpt-dropout": (lambda: gpt(dropout=0.2), gpt_batches, lm_loss),
    "mlp": (lambda: mlp_layers(depth=4), mlp_batches, nn.functional.mse_loss),
    "coherent": (coherent_layers, coherent_batches, nn.functional.mse_loss),  # tests/test_precision.py
}


def launch(world: int, **cfg) -> list[subprocess.CompletedProcess]:
    return launch_ranks("tests.pipe_worker", world, cfg, LAUNCH_TIMEOUT)


def run_ok(world: int, **cfg) -> dict:
    ranks_ok("tests.pipe_worker", world, cfg, LAUNCH_TIMEOUT)
    return safetensors.torch.load_file(cfg["out"])


def single_process(model: str, optimizer: str, steps: int, batch: int, micro_batches: int, pipedream_2bw: bool,
                   **options):
    """The reference: the single-process relay on the same minibatches, same generator seed."""
    make_model, make_batches, loss_fn = MODELS[model]
    relay = l2l_hw.Relay(make_model(), loss_fn, eps=l2l_hw.make_eps(EPS_BACKEND, **OPTIMIZERS[optimizer][0]),
                         micro_batches=micro_batches, pipedream_2bw=pipedream_2bw, **options)
    torch.manual_seed(RNG_SEED)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each stage runs (pipe_worker): a kernel's reduction order follows its threads
    try:
        losses = [relay.train_step(x, y) for x, y in make_batches(steps, batch=batch)]
    finally:
        torch.set_num_threads(threads)
    model = relay.materialize()
    want = {f"{i}.{n}": t for i, layer in enumerate(model) for n, t in layer.state_dict().items()}
    want["eval"] = torch.tensor([relay.evaluate(*make_batches(1, batch=batch)[0])], dtype=torch.float64)
    return want, losses


def assert_same(got: dict, want: dict, losses: list, what: str):
    for name, w in want.items():
        assert rel_diff(got[name], w) <= TOL, f"{what}: {name} differs by {rel_diff(got[name], w):.2e}"
    assert torch.allclose(got["losses"], torch.tensor(losses, dtype=torch.float64), rtol=TOL), \
        f"{what}: losses {got['losses'].tolist()} vs {losses}"


def test_1f1b_runs_each_micro_batch_forward_then_backward_once_with_at_most_s_minus_s_in_flight():
    for stages in (1, 2, 3, 4):
        for m in (1, 2, 3, 5, 8):
            for s in range(stages):
                acts = OneFOneB.order(s, stages, m)
                assert sorted(a for a in acts if a[0] == "F") == [("F", j) for j in range(m)]
                assert [a for a in acts if a[0] == "B"] == [("B", j) for j in range(m)]
                in_flight = peak = 0
                for kind, _ in acts:
                    in_flight += 1 if kind == "F" else -1
                    peak = max(peak, in_flight)
                assert peak == min(stages - s, m)
    assert even_split(7, 3) == [0, 2, 5, 7]
    assert OneFOneB.bubble(2, 8) == pytest.approx(1 / 9)


SLOW = pytest.mark.slow  # each multi-process run costs seconds of start-up: CI runs one of each kind


@pytest.mark.parametrize("stages,model,optimizer,schedule,stream", [
    pytest.param(2, "gpt", "adamw", "flush", 0, marks=SLOW), (3, "mlp", "sgd-momentum", "flush", 0),
    pytest.param(2, "gpt-dropout", "adamw", "2bw", 0, marks=SLOW), (3, "gpt-dropout", "adamw", "2bw", 5),
    pytest.param(3, "gpt-dropout", "adamw", "2bw", 0, marks=SLOW), pytest.param(3, "mlp", "adamw", "2bw", 3, marks=SLOW)])
def test_pipeline_equals_the_single_process_relay_over_10_steps_and_evaluates_alike(tmp_path, stages, model, optimizer,
                                                                                   schedule, stream):
    # batch 13 in 4 micro-batches: 4, 3, 3, 3 samples, weighted by their share. stream: 2bw's steps
    # run as one schedule (train_steps of `stream` steps: the next step's forwards overlap this one's backwards)
    got = run_ok(stages, model=model, optimizer=optimizer, steps=STEPS, batch=13, micro_batches=4,
                 schedule=schedule, stream=stream, out=str(tmp_path / "out.safetensors"))
    want, losses = single_process(model, optimizer, STEPS, 13, 4, pipedream_2bw=schedule == "2bw")
    assert_same(got, want, losses, f"{model}, {stages} stages, {schedule}")


@pytest.mark.parametrize("schedule,options", [
    ("flush", {}), pytest.param("2bw", {"recompute": "full", "activations": "host"}, marks=SLOW),
    pytest.param("flush", {"recompute": "selective", "activations": "host"}, marks=SLOW),
    pytest.param("2bw", {"recompute": "none", "shard_state": True}, marks=SLOW)])
def test_two_replicas_of_a_2_stage_pipeline_equal_the_single_process_relay_on_the_whole_minibatch(tmp_path, schedule,
                                                                                                  options):
    # 4 ranks: stages x replicas = 2 x 2; each replica trains its shard (7 and 6 of 13 samples) in 2
    # micro-batches, each stage's gradients averaged over its replicas by their sample counts
    got = run_ok(4, model="mlp", optimizer="adamw", steps=STEPS, batch=13, micro_batches=2, replicas=2,
                 schedule=schedule, out=str(tmp_path / "out.safetensors"), **options)
    want, losses = single_process("mlp", "adamw", STEPS, 13, 4, pipedream_2bw=schedule == "2bw")
    assert_same(got, want, losses, f"2 stages x 2 replicas, {schedule}, {options}")


@pytest.mark.parametrize("schedule,stream", [("2bw", 5), pytest.param("flush", 0, marks=SLOW)])
def test_layer_drop_skips_the_same_layers_on_every_stage_as_in_one_process(tmp_path, schedule, stream):
    # GPT with dropout, 5 layers on 3 stages [0, 2) [2, 3) [3, 5): each step skips each block with
    # probability 0.5, every stage drawing the whole model's layers from the step; stage 1 (one
    # block) passes its input on when its block is dropped; dropped layers draw no dropout mask
    drop = {"layer_drop": 0.5, "layer_drop_seed": 3}
    got = run_ok(3, model="gpt-dropout", optimizer="adamw", steps=STEPS, batch=13, micro_batches=4, schedule=schedule,
                 stream=stream, out=str(tmp_path / "out.safetensors"), **drop)
    want, losses = single_process("gpt-dropout", "adamw", STEPS, 13, 4, pipedream_2bw=schedule == "2bw", **drop)
    from l2l_hw.relay.layer_drop import LayerDrop
    drawn = [LayerDrop(0.5, 5, seed=3).layers(step) for step in range(1, STEPS + 1)]
    assert any(2 not in layers for layers in drawn) and any(len(layers) < 4 for layers in drawn)  # stage 1 skipped
    assert_same(got, want, losses, f"3 stages, {schedule}, layer drop")


def test_a_droppable_layer_that_changes_its_input_is_one_clear_error_on_every_rank():
    # the mlp's layer 0 maps 11 features to 19: its input cannot stand in for its output
    results = launch(2, model="mlp", optimizer="adamw", steps=2, batch=12, micro_batches=2, layer_drop=0.5,
                     droppable=[0, 1])
    for r, res in enumerate(results):
        assert res.returncode == 2, f"rank {r} exited {res.returncode}:\n{res.stderr[-2000:]}"
        lines = [line for line in res.stderr.splitlines() if "PipelineError" in line]
        assert len(lines) == 1 and "layer 0 may be dropped" in lines[0] and "must return what it takes" in lines[0], \
            res.stderr[-2000:]


@pytest.mark.parametrize("schedule,stream", [("flush", 0), pytest.param("2bw", 5, marks=SLOW)])
def test_planned_recompute_keeps_each_stage_within_its_budget_and_trains_as_one_process(tmp_path, schedule, stream):
    # the GPT's 5 layers on 2 stages, 4 micro-batches: stage 0 keeps up to 2 in flight, stage 1 one.
    # The first step runs full and measures; the plan keeps more where the budget has room
    kw = dict(model="gpt-dropout", optimizer="adamw", steps=STEPS, batch=13, micro_batches=4, schedule=schedule,
              stream=stream, account_memory=True)
    full = run_ok(2, out=str(tmp_path / "full.safetensors"), recompute="full", **kw)["kept"][:, 0]
    none = run_ok(2, out=str(tmp_path / "none.safetensors"), recompute="none", **kw)["kept"][:, 0]
    assert (full < none).all(), (full, none)
    budget = int(full.max() + 0.7 * (none.min() - full.max()))
    got = run_ok(2, out=str(tmp_path / "out.safetensors"), activation_budget=budget, **kw)
    assert (got["kept"][:, 0] <= budget).all(), (got["kept"], budget)
    assert got["kept"][:, 1].sum() > 0, got["kept"]  # some layer keeps more than its input
    want, losses = single_process("gpt-dropout", "adamw", STEPS, 13, 4, pipedream_2bw=schedule == "2bw")
    assert_same(got, want, losses, f"2 stages, {schedule}, activation_budget={budget}")


def test_fp16_replicas_of_a_pipeline_equal_the_data_parallel_relay_on_as_many_ranks(tmp_path):
    # 2 stages x 2 replicas in fp16 against the Relay on 2 data-parallel ranks: each replica's fp32
    # sums are averaged over the replicas before their one rounding, as the data-parallel ranks'
    # are. (One process sums all the micro-batches before it, a re-association a flipped fp16
    # rounding shows: ~1e-2 after AdamW; so the reference sums as the replicas do.)
    kw = dict(optimizer="adamw", steps=STEPS, batch=13, micro_batches=2, precision="fp16")
    got = run_ok(4, model="mlp", replicas=2, schedule="flush", out=str(tmp_path / "out.safetensors"), **kw)
    ranks_ok("tests.dp_worker", 2, dict(model="mlp4", out=str(tmp_path / "dp.safetensors"), **kw), LAUNCH_TIMEOUT)
    dp = safetensors.torch.load_file(str(tmp_path / "dp.safetensors"))
    want = {name: t for name, t in dp.items() if "." in name}  # the trained parameters
    assert_same(got, want, dp["losses"].tolist(), "2 stages x 2 replicas, fp16")


CLIPPED = {"clip_grad_norm": 0.05, "clip_mode": "global"}  # below the mlp's gradient norm: every step is clipped


@pytest.mark.parametrize("world,replicas,schedule,stream", [(4, 2, "flush", 0),
                                                             pytest.param(3, 1, "2bw", 5, marks=SLOW)])
def test_global_clipping_spans_the_stages_and_replicas_as_in_one_process(tmp_path, world, replicas, schedule, stream):
    # the norm is the whole model's, summed over the stages (each stage's own norm would clip each
    # part by its own factor: 9e-4 apart here); 2bw with 5 steps streamed as one schedule
    got = run_ok(world, model="mlp", optimizer="adamw", steps=STEPS, batch=13, micro_batches=4 // replicas,
                 replicas=replicas, schedule=schedule, stream=stream, out=str(tmp_path / "out.safetensors"), **CLIPPED)
    want, losses = single_process("mlp", "adamw", STEPS, 13, 4, pipedream_2bw=schedule == "2bw", **CLIPPED)
    assert_same(got, want, losses, f"{world // replicas} stages x {replicas} replicas, {schedule}, {CLIPPED}")


@pytest.mark.parametrize("options", [{"precision": "fp16"}, pytest.param({**CLIPPED, "precision": "bf16"}, marks=SLOW)])
def test_a_reduced_precision_pipeline_equals_the_single_process(tmp_path, options):
    # bit for bit in the pushes: the micro-batches' fp32 sums in the same order, one rounding each.
    # (Replicas re-associate the sums over the ranks, which a reduced precision's rounding shows.)
    got = run_ok(2, model="mlp", optimizer="adamw", steps=STEPS, batch=13, micro_batches=4, schedule="flush",
                 out=str(tmp_path / "out.safetensors"), **options)
    want, losses = single_process("mlp", "adamw", STEPS, 13, 4, pipedream_2bw=False, **options)
    assert_same(got, want, losses, f"2 stages, {options}")


@pytest.mark.parametrize("precision,schedule", [("fp32", "flush"), pytest.param("fp32", "2bw", marks=SLOW),
                                                pytest.param("fp16", "flush", marks=SLOW)])
def test_a_step_that_overflows_on_one_stage_is_skipped_by_every_stage(tmp_path, precision, schedule):
    # stage 0's gradients are Inf in step 3; the last stage's are finite, so only agreement skips it there
    got = run_ok(2, model="mlp", optimizer="adamw", steps=6, batch=12, micro_batches=2, schedule=schedule,
                 precision=precision, skip_nonfinite=True, inf_at_step=3, out=str(tmp_path / "out.safetensors"))
    steps, scales = got["steps_and_scales"].T.tolist()
    assert len(set(steps)) == 1 and len(set(scales)) == 1, (steps, scales)  # the stages agree
    if precision == "fp32":  # the run is the single process's on the other 5 minibatches
        make_model, make_batches, loss_fn = MODELS["mlp"]
        relay = l2l_hw.Relay(make_model(), loss_fn, eps=l2l_hw.make_eps(EPS_BACKEND, **OPTIMIZERS["adamw"][0]),
                             micro_batches=2, pipedream_2bw=schedule == "2bw", skip_nonfinite=True)
        for k, (x, y) in enumerate(make_batches(6, batch=12)):
            if k != 3:
                relay.train_step(x, y)
        assert steps == [5.0, 5.0]
        model = relay.materialize()
        for i, layer in enumerate(model):
            for n, w in layer.state_dict().items():
                assert rel_diff(got[f"{i}.{n}"], w) <= TOL, f"{i}.{n}"


def test_a_checkpoint_takes_each_stages_entries_from_that_stage_when_it_writes_them(tmp_path):
    # rank 0 writes; stage 1's entries are received one at a time as they are read, not gathered
    entries = str(tmp_path / "entries.safetensors")
    ranks_ok("tests.pipe_worker", 2, dict(model="mlp", optimizer="adamw", steps=3, batch=12, micro_batches=2,
                                          schedule="flush", entries=entries), LAUNCH_TIMEOUT)
    got = safetensors.torch.load_file(entries)
    read = {n[len("read."):]: t for n, t in got.items() if n.startswith("read.")}
    whole = {n[len("whole."):]: t for n, t in got.items() if n.startswith("whole.")}
    assert read.keys() == whole.keys() and all(torch.equal(read[n], whole[n]) for n in whole)
    lazy = json.loads(Path(entries + ".json").read_text())["lazy"]
    layer_of = {n: int(n.split("/")[1].removeprefix("layer")) for n in whole if n.startswith(("eps/layer", "buffers/"))}
    first = even_split(max(layer_of.values()) + 1, 2)[1]  # stage 1's first layer
    assert lazy == sorted(n for n, i in layer_of.items() if i >= first) and lazy


@SLOW
def test_resume_5_plus_5_steps_is_bit_identical_to_10_straight_and_loads_into_the_single_process_relay(tmp_path):
    cfg = dict(model="mlp", optimizer="adamw", steps=STEPS, batch=12, micro_batches=3, schedule="2bw")
    straight = run_ok(2, **cfg, out=str(tmp_path / "straight.safetensors"))
    run_ok(2, **dict(cfg, steps=5), out=str(tmp_path / "half.safetensors"), save=str(tmp_path / "state.safetensors"))
    resumed = run_ok(2, **cfg, start=5, load=str(tmp_path / "state.safetensors"), out=str(tmp_path / "resumed.safetensors"))
    for name, t in straight.items():
        want = t[5:] if name == "losses" else t
        assert torch.equal(resumed[name], want), f"{name} differs after resuming"
    # the stages' states together are a single-process relay's state (2BW's previous version included)
    state = safetensors.torch.load_file(tmp_path / "state.safetensors")
    make_model, _, loss_fn = MODELS["mlp"]
    single = l2l_hw.Relay(make_model(), loss_fn, eps=l2l_hw.make_eps(EPS_BACKEND, **OPTIMIZERS["adamw"][0]),
                          micro_batches=3, pipedream_2bw=True)
    single.load_state_dict(state)
    assert int(state["eps/step"]) == 5


@pytest.mark.parametrize("stages,how", [(2, "fail_at_step"), pytest.param(3, "fail_at_step", marks=SLOW),
                                        pytest.param(2, "die_at_step", marks=SLOW), (3, "die_at_step")])
def test_a_failing_or_killed_stage_stops_every_rank_with_one_clear_error(stages, how):
    results = launch(stages, model="mlp", optimizer="adamw", steps=6, batch=12, micro_batches=3, schedule="2bw",
                     timeout=30, **{how: 2})
    for r, res in enumerate(results):
        if how == "die_at_step" and r == stages - 1:
            assert res.returncode == -signal.SIGKILL
            continue
        assert res.returncode == 2, f"rank {r} exited {res.returncode}:\n{res.stderr[-2000:]}"
        lines = [line for line in res.stderr.splitlines() if "PipelineError" in line]
        assert len(lines) == 1, res.stderr[-2000:]
        if how == "fail_at_step":
            assert "boom: this layer fails on purpose" in lines[0] and f"stage {stages - 1}" in lines[0], lines[0]
        else:
            assert "died or stopped answering" in lines[0] or "has gone" in lines[0], lines[0]


# -- L2L inside a stage ------------------------------------------------------------------------
BLOCK_WIDTH, BLOCK_HIDDEN = 64, 256


def blocks(depth: int) -> nn.Sequential:
    """`depth` identical residual MLP blocks: every layer of every stage alike, so only depth varies."""
    from tests.helpers import ResidualMLP
    torch.manual_seed(0)
    return nn.Sequential(*[ResidualMLP(BLOCK_WIDTH, BLOCK_HIDDEN) for _ in range(depth)])


def block_batches(steps: int, batch: int) -> list:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(batch, BLOCK_WIDTH, generator=g), torch.randn(batch, BLOCK_WIDTH, generator=g))
            for _ in range(steps)]


@pytest.mark.parametrize("schedule", ["flush", pytest.param("2bw", marks=SLOW)])
def test_a_stages_peak_device_memory_does_not_grow_with_its_depth(tmp_path, schedule):
    # 2 stages of 2, 4 and 8 identical blocks, the same micro-batches; host activations: the stash
    # (each layer's input per micro-batch in flight) leaves the device too, as in the relay's constant-memory mode
    per_stage = [2, 4, 8]
    ranks_ok("tests.pipe_worker", 2, dict(memory=per_stage, schedule=schedule, steps=2, batch=8, micro_batches=4,
                                          activations="host", out=str(tmp_path / "peaks")), LAUNCH_TIMEOUT)
    layer_bytes = sum(p.numel() * p.element_size() for p in blocks(1).parameters())
    for rank in range(2):
        peaks = [json.loads((tmp_path / f"peaks.{rank}").read_text())[str(n)] for n in per_stage]
        assert max(peaks) <= 1.05 * min(peaks), f"stage {rank}: peak bytes {dict(zip(per_stage, peaks))}"
        # a layer's weights and gradients at least (the accounting sees them), far from a stage's 8 layers
        assert 2 * layer_bytes <= peaks[-1] < 8 * layer_bytes / 2, (rank, peaks, layer_bytes)


# -- the planner ------------------------------------------------------------------------------
def uneven_mlp(wide: int = 1, depth: int = 6, width: int = 128, hidden: int = 256):
    """Residual MLP blocks, block `wide` with a 4x wider hidden layer."""
    from tests.helpers import ResidualMLP
    torch.manual_seed(0)
    return nn.Sequential(*[ResidualMLP(width, hidden * (4 if i == wide else 1)) for i in range(depth)])


def test_planner_on_one_4x_wider_layer_is_within_15_percent_of_brute_force_and_beats_the_even_split():
    from l2l_hw.relay.planner import brute_force_split, plan_pipeline, profile_layers, stage_time_s
    layers = uneven_mlp()
    x, y = torch.randn(64, 32, 128), torch.randn(64, 32, 128)
    costs = profile_layers(layers, nn.functional.mse_loss, x, y, sizes=(8, 32), repeats=5, threads=1)
    assert costs[1].time_s(8) > 1.5 * max(c.time_s(8) for i, c in enumerate(costs) if i != 1), \
        f"the profile does not see the wide layer: {costs}"
    for stages in (2, 3):
        plan = plan_pipeline(costs, stages, batch=64, micro_batches=8)
        size = 64 / 8
        slowest = max(plan.stage_s) / 8
        _, brute = brute_force_split(costs, stages, size)
        even = even_split(len(costs), stages)
        even_slowest = max(stage_time_s(costs, a, b, size) for a, b in zip(even, even[1:]))
        assert slowest <= 1.15 * brute, (plan.describe(), brute)
        assert slowest < even_slowest, (plan.describe(), even, even_slowest)
        assert plan.describe().startswith(f"pipeline plan: {stages} stages")


def test_planner_respects_the_memory_limit_and_says_when_nothing_fits():
    from l2l_hw.relay.planner import LayerCost, best_split, plan_pipeline, stage_bytes
    # layer 0 is slow but small; layers 1..3 are fast and hold 1 MiB of weights each
    costs = [LayerCost(0.0, 4.0, 0.0, 0.0, 0, 0.0, 0.0)] + [LayerCost(0.0, 1.0, 0.0, 0.0, 2**19, 0.0, 0.0)] * 3
    free, _ = best_split(costs, 2, 1, 1.0)
    assert free == [0, 1, 4]  # 4 vs 3: the fastest split holds 3 MiB in stage 1
    limited, t = best_split(costs, 2, 1, 1.0, memory_limit=2 * 2**20)
    assert limited == [0, 2, 4] and t == 5.0
    assert all(stage_bytes(costs, a, b, s, 2, 1, 1.0) <= 2 * 2**20 for s, (a, b) in enumerate(zip(limited, limited[1:])))
    with pytest.raises(ValueError, match="no split of 4 layers into 2 stages fits"):
        plan_pipeline(costs, 2, batch=8, micro_batches=[2, 4], memory_limit=2**19)
    # the micro-batch count: a fixed cost per call favours fewer, the bubble favours more
    fixed = [LayerCost(1.0, 1.0, 0.0, 0.0, 0, 0.0, 0.0)] * 4
    assert plan_pipeline(fixed, 2, batch=64, micro_batches=[1, 2, 4, 8, 16, 64]).micro_batches == 8


# -- Hugging Face -----------------------------------------------------------------------------
def hf_batches(loss_fn, steps: int):
    from l2l_hw import hf
    from tests.test_hf import VOCAB
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (4, 8), generator=g)
        out.append(hf.batch(loss_fn, ids, ids.clone()))
    return out


@SLOW
def test_a_2_stage_pipeline_finetunes_a_llama_model_and_saves_a_folder_transformers_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    from l2l_hw import hf
    from tests.test_hf import tiny
    tiny("llama-untied").save_pretrained(tmp_path / "llama")
    steps = 3
    for r, res in enumerate(launch(2, hf=str(tmp_path / "llama"), steps=steps, save_hf=str(tmp_path / "tuned"))):
        assert res.returncode == 0, f"rank {r} failed:\n{res.stderr[-3000:]}"
    # the reference: the single-process relay on the same folder and batches
    relay = hf.from_pretrained(tmp_path / "llama", eps=l2l_hw.make_eps(EPS_BACKEND, **OPTIMIZERS["adamw"][0]),
                               micro_batches=2)
    for inputs, targets in hf_batches(relay.loss_fn, steps):
        relay.train_step(inputs, targets)
    hf.save_pretrained(relay, tmp_path / "single")
    tuned = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "tuned")
    single = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "single")
    start = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "llama")
    moved = False
    for (name, p), q, p0 in zip(tuned.named_parameters(), single.parameters(), start.parameters()):
        assert rel_diff(p, q) <= TOL, f"{name}: {rel_diff(p, q):.2e}"
        moved |= not torch.equal(p, p0)
    assert moved, "fine-tuning changed nothing"


# -- l2l train --pipeline-stages ------------------------------------------------------------------
TINY_RUN = ["--layers", "2", "--width", "32", "--heads", "2", "--context", "16", "--batch-size", "4",
            "--micro-batches", "2", "--eval-every", "3", "--dropout", "0.1", "--seed", "7", "--schedule", "constant",
            "--warmup", "2"]


def l2l_train(world: int, *args) -> str:
    """Rank 0's output of `l2l train` on `world` ranks."""
    results = run_local_ranks(["-m", "l2l_hw.cli", "train", *TINY_RUN, *args], world, timeout_s=LAUNCH_TIMEOUT,
                              cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    for r, res in enumerate(results):
        assert res.returncode == 0, f"rank {r} failed:\n{res.stderr[-3000:]}"
    return results[0].stdout


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_l2l_train_pipeline_stages_runs_flush_by_default_and_trains_as_one_process_over_5_steps(tmp_path):
    single = l2l_train(1, "--steps", "5", "--out", str(tmp_path / "single"))
    out = l2l_train(2, "--steps", "5", "--pipeline-stages", "2", "--out", str(tmp_path / "pipeline"))
    assert "one step stale" not in out and "one step stale" not in single  # exact: nothing traded
    one, two = metrics(tmp_path / "single"), metrics(tmp_path / "pipeline")
    assert len(one) == len(two) == 5
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=TOL), (a, b)
        if "val_loss" in a:
            assert b["val_loss"] == pytest.approx(a["val_loss"], rel=TOL), (a, b)


def assert_same_runs(single: Path, straight: Path, split: Path) -> None:
    """`straight` equals the single process to TOL, `split` (stopped and resumed) equals `straight` bit for bit."""
    for a, b, c in zip(*(metrics(out) for out in (single, straight, split))):
        assert a["loss"] == pytest.approx(b["loss"], rel=TOL) and b["loss"] == c["loss"], (a, b, c)
        if "val_loss" in a:
            assert a["val_loss"] == pytest.approx(b["val_loss"], rel=TOL) and b["val_loss"] == c["val_loss"]
    want = safetensors.torch.load_file(straight / "checkpoint.safetensors")
    got = safetensors.torch.load_file(split / "checkpoint.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@SLOW
def test_2bw_by_name_equals_the_single_process_2bw_says_what_it_trades_and_its_checkpoint_resumes_as_2bw(tmp_path):
    l2l_train(1, "--steps", "6", "--pipedream-2bw", "--out", str(tmp_path / "single"))
    two_bw = ["--pipeline-stages", "2", "--pipeline-schedule", "2bw"]
    out = l2l_train(2, "--steps", "6", *two_bw, "--out", str(tmp_path / "straight"))
    assert "schedule 2bw (PipeDream-2BW): no step waits for an update, but each computes on the weights one step " \
           "stale, delay compensation none" in out and "--pipeline-schedule flush (the default) trains exactly" in out
    l2l_train(2, "--steps", "3", *two_bw, "--out", str(tmp_path / "split"))
    # resumed with no schedule flag, as a run from before flush was the default: its checkpoint's 2bw, said
    resumed = l2l_train(2, "--steps", "6", "--pipeline-stages", "2", "--resume", "--out", str(tmp_path / "split"))
    assert ", as PipeDream-2BW: the schedule its checkpoint saved (a new run's default is flush)" in resumed
    assert_same_runs(tmp_path / "single", tmp_path / "straight", tmp_path / "split")


@SLOW
def test_2bw_with_prediction_on_2_stages_equals_the_single_process_and_resumes_bit_exactly(tmp_path):
    predict = ["--delay-compensation", "predict"]
    l2l_train(1, "--steps", "6", "--pipedream-2bw", *predict, "--out", str(tmp_path / "single"))
    two_bw = ["--pipeline-stages", "2", "--pipeline-schedule", "2bw", *predict]
    out = l2l_train(2, "--steps", "6", *two_bw, "--out", str(tmp_path / "straight"))
    assert "delay compensation predict" in out
    l2l_train(2, "--steps", "3", *two_bw, "--out", str(tmp_path / "split"))
    l2l_train(2, "--steps", "6", *two_bw, "--resume", "--out", str(tmp_path / "split"))
    assert_same_runs(tmp_path / "single", tmp_path / "straight", tmp_path / "split")
    plain = safetensors.torch.load_file(tmp_path / "straight" / "checkpoint.safetensors")
    assert any(k.endswith("/predicted") for k in plain)  # each stage's newest predicted copy, in the one file


@SLOW
@pytest.mark.parametrize("shard", [[], ["--shard-state"]])
def test_l2l_train_on_4_ranks_as_2_stages_x_2_replicas_equals_one_process_and_resumes_bit_exactly(tmp_path, shard):
    # no dropout: a replica draws its masks for its shard, the single process for the whole minibatch;
    # --shard-state: each stage's state sharded over its 2 replicas, its checkpoint whole
    pipeline = ["--pipeline-stages", "2", "--dropout", "0", *shard]
    l2l_train(1, "--steps", "4", "--dropout", "0", "--out", str(tmp_path / "single"))  # flush: the default
    out = l2l_train(4, "--steps", "4", *pipeline, "--out", str(tmp_path / "straight"))
    assert "through 2 pipeline stages, one a rank, a shard on each of 2 data-parallel replicas" in out
    assert ("EPS cpu (state sharded)" in out) == bool(shard)
    l2l_train(4, "--steps", "2", *pipeline, "--out", str(tmp_path / "split"))
    l2l_train(4, "--steps", "4", *pipeline, "--resume", "--out", str(tmp_path / "split"))
    single, straight, split = (metrics(tmp_path / name) for name in ("single", "straight", "split"))
    assert len(single) == len(straight) == len(split) == 4
    for a, b, c in zip(single, straight, split):
        assert a["loss"] == pytest.approx(b["loss"], rel=TOL) and b["loss"] == c["loss"], (a, b, c)
    want = safetensors.torch.load_file(tmp_path / "straight" / "checkpoint.safetensors")
    got = safetensors.torch.load_file(tmp_path / "split" / "checkpoint.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_l2l_train_with_the_planners_boundaries_prints_its_plan_and_trains_as_one_process(tmp_path):
    l2l_train(1, "--steps", "3", "--out", str(tmp_path / "single"))  # the pipeline's default, flush: exact
    out = l2l_train(2, "--steps", "3", "--pipeline-stages", "2", "--pipeline-boundaries", "auto",
                    "--out", str(tmp_path / "auto"))
    assert "pipeline plan: 2 stages, 2 micro-batches" in out and "stage 1: layers" in out
    # the banner counts every stage's parameters and says the batch goes through the stages
    from l2l_hw.train import TrainConfig

    model = build_gpt(TrainConfig(layers=2, width=32, heads=2, context=16, dropout=0.1).model_config())
    trained = sum(p.numel() for p in model.parameters())
    assert f"({trained:,} trained: stage 0 layers 0-" in out and "through 2 pipeline stages, one a rank" in out
    for a, b in zip(metrics(tmp_path / "single"), metrics(tmp_path / "auto")):
        assert a["loss"] == pytest.approx(b["loss"], rel=TOL)


def test_bad_pipeline_input_is_one_clear_error():
    from l2l_hw.options import OptionError
    from l2l_hw.relay.options import PipelineConfig
    from l2l_hw.relay.pipeline import PipelineRelay
    with pytest.raises(OptionError, match="must name 2 layer"):
        PipelineConfig(stages=3, boundaries="4")
    with pytest.raises(OptionError, match="ascending"):
        PipelineConfig(stages=3, boundaries="4,2")
    with pytest.raises(ValueError, match="none is initialized"):
        PipelineRelay(mlp_layers(), nn.functional.mse_loss, l2l_hw.make_eps(EPS_BACKEND),
                      pipeline=PipelineConfig(stages=2))
    with pytest.raises(OptionError, match="or 'auto'"):
        PipelineConfig(stages=2, boundaries="half")
    from l2l_hw.train import ConfigError, TrainConfig, build_relay
    with pytest.raises(ConfigError, match="auto profiles the reference GPT"):
        build_relay(TrainConfig(pipeline_stages=2, pipeline_boundaries="auto"), mlp_layers(), nn.functional.mse_loss)


@SLOW
def test_l2l_train_on_ranks_the_stages_do_not_divide_is_one_clear_line_on_every_rank(tmp_path):
    results = run_local_ranks(["-m", "l2l_hw.cli", "train", *TINY_RUN, "--steps", "2", "--pipeline-stages", "2",
                               "--out", str(tmp_path / "run")], 3, timeout_s=LAUNCH_TIMEOUT, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for rank, res in enumerate(results):
        assert res.returncode == 2 and res.stderr.strip().splitlines() == [
            f"l2l train: rank {rank} of 3: --pipeline-stages 2: must divide the 3 ranks (a pipeline of that many stages on each "
            "data-parallel replica)"], res.stderr[-2000:]


def test_shard_state_with_a_pipeline_needs_replicas_to_shard_over_in_one_line_on_every_rank(tmp_path):
    results = run_local_ranks(["-m", "l2l_hw.cli", "train", *TINY_RUN, "--steps", "2", "--pipeline-stages", "2",
                               "--shard-state", "--out", str(tmp_path / "run")], 2, timeout_s=LAUNCH_TIMEOUT, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for rank, res in enumerate(results):
        assert res.returncode == 2 and res.stderr.strip().splitlines() == [
            f"l2l train: rank {rank} of 2: --shard-state: shards each stage's optimizer state over its data-parallel "
            "replicas: run the 2 stages on a multiple of 2 ranks, 4 or more; this is 2"], res.stderr[-2000:]


def test_bench_pipeline_runs_every_variant_and_torch_1f1b_on_a_tiny_gpt():
    from l2l_hw.bench import pipeline as bench

    r = bench.run(stages=2, steps=2, rounds=2, layers=2, width=32, heads=2, context=16, batch=4, micro_batches=2)
    for key in ("step_s_relay_1_thread", "step_s_relay_2_threads", "step_s_pipeline_2bw", "step_s_pipeline_flush",
                "step_s_torch_1f1b", "speedup_2bw_vs_torch_1f1b", "speedup_flush_vs_torch_1f1b"):
        assert 0 < r[key]["min"] <= r[key]["median"] <= r[key]["max"], (key, r[key])
    assert r["bubble_theoretical"] == pytest.approx(1 / 3, abs=1e-3)  # (S - 1) / (M + S - 1)
    assert r["bubble_theoretical_2bw"] == pytest.approx(1 / 5, abs=1e-3)  # 2 steps in one schedule
    assert all(0 <= b < 1 for b in r["bubble_measured_flush"] + r["bubble_measured_2bw"])
    assert "torch 1F1B" in bench.format_report(r)
