"""`l2l bench gpu`: the dry run of the whole campaign (every part at toy size on the CPU, the
relay on the asynchronous twin, the peers on the CPU), the checks that make it fail (a NaN, a
cut, a failed peer), and its figures of merit against independent counts."""
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from l2l_hw import cli
from l2l_hw.bench.gpu import campaign, checks as gpu_checks, peers as gpu_peers
from l2l_hw.bench.gpu.capacity import search
from l2l_hw.bench.gpu.extras import compute_idle_fraction, trim
from l2l_hw.bench.gpu.figures import dense_bf16_peak, flops_per_token, rate_spread
from l2l_hw.bench.gpu.llama import LLAMA_3_8B, layer_parameters, parameters
from l2l_hw.bench.gpu.partners import GPTPartner
from l2l_hw.bench.gpu.sides import Side, SideError
from l2l_hw.models import GPTConfig, build_gpt, count_parameters, lm_loss

ADAMW = {"lr": 1e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


@pytest.mark.slow  # 1.5-3 min of CI's 30; docs/GPU_CAMPAIGN.md runs it before each device call
def test_dry_run_covers_the_three_regimes_and_every_peers_config(tmp_path):
    out = tmp_path / "gpu"
    done = subprocess.run([sys.executable, "-m", "l2l_hw.cli", "bench", "gpu", "--dry-run", "--out", str(out),
                           "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=900)
    summary = json.loads((out / "summary.json").read_text())
    assert done.returncode == 0, (summary["failed"], summary["cut"], done.stdout[-3000:], done.stderr[-3000:])
    assert sorted(p.name for p in out.iterdir()) == sorted(campaign.FILES)
    parts = summary["parts"]
    assert list(parts) == list(campaign.PARTS) and summary["failed"] == {} and summary["cut"] == {}
    assert summary["verdict"] == "passed" and "all 7 parts passed" in done.stdout
    assert parts["tests"]["returncode"] == 0 and "passed" in parts["tests"]["result"]
    peak = parts["matmul_peak"]  # the best of the sample, with its spread
    assert peak["peak_tflops"] == peak["tflops"]["max"] and peak["tflops"]["runs"] == campaign.DRY.matmul_rounds
    assert parts["loss"]["agree"] and parts["loss"]["bound_catches_twice_the_lr"]
    for name, regime in summary["regimes"].items():
        part = parts[name]
        for kind in regime["sides"]:  # each side: its grid (the winner among what ran), 3 alternated runs
            grid = part["grids"][kind]
            ran = [p for p in grid["points"] if "error" not in p]
            assert len(ran) >= 2 and grid["winner"] == max(ran, key=lambda p: p["tokens_per_s"])["knobs"]
            run = part["runs"][kind]
            assert run["tokens_per_s"]["runs"] == 3 and run["order"] == [0, 1, 2]
            assert run["tokens_per_s"]["min"] <= run["tokens_per_s"]["median"] <= run["tokens_per_s"]["max"]
            for point in ran:
                assert all(math.isfinite(x) for x in point["losses"])
                if kind.startswith("zero"):  # read back by DeepSpeed's own config class
                    read = point["deepspeed_read"]
                    assert read["stage"] == int(kind[4]) and read["micro_batch"] == point["knobs"]["micro_batch"]
                    assert read["micro_batch"] * read["gradient_accumulation_steps"] == regime["batch"]
        check = part["loss_check"]  # every side's losses against PyTorch's own drift x2
        assert check["reference"] in gpu_peers.PYTORCH and all(check["agree"].values())
        assert set(check["agree"]) == set(regime["sides"]) - {check["reference"]}
        assert part["relay_over_strongest"] > 0 and part["strongest_peer"] in regime["sides"]
    b, c = parts["regime_b"], parts["regime_c"]
    assert "live processes" in b["alternation"] and "fresh load" in c["alternation"]
    assert not b["sizes"]["torch_checkpointed"]["fits"]  # reported with its error, measured where it holds
    assert b["capacity_peers"]["torch_checkpointed"]["layers"] == b["sizes"]["torch_checkpointed"]["layers"] >= 1
    assert "does not fit" in b["capacity_peers"]["torch_checkpointed"]["error_at_regime_depth"]
    assert not c["sizes"]["zero3_offload"]["fits"] and "does not fit" in c["sizes"]["zero3_offload"]["error"]
    assert c["layers"] == min(c["sizes"][k]["layers"] for k in summary["regimes"]["regime_c"]["sides"])
    assert c["layers"] < summary["regimes"]["regime_c"]["layers"]
    assert parts["capacity"]["torch_layers"] >= 1 and parts["capacity"]["relay_layers"] >= 1
    assert "tokens/s" in done.stdout and "relay / strongest" in done.stdout  # figures as it goes


def test_a_nan_loss_fails_the_campaign_with_its_reason(tmp_path, monkeypatch, capsys):
    class NaNAtTheThirdStep(GPTPartner):  # past the first: max() over the steps would skip it
        def step(self, x, y):
            self.steps = getattr(self, "steps", 0) + 1
            loss = super().step(x, y)
            return math.nan if self.steps == 3 else loss

    monkeypatch.setattr(campaign, "GPTPartner", NaNAtTheThirdStep)
    code = cli.main(["bench", "gpu", "--dry-run", "--parts", "loss", "--out", str(tmp_path / "o"),
                     "--work", str(tmp_path / "w")])
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert code == 1 and summary["verdict"] == "failed"
    assert summary["failed"]["loss"] == "the torch loss curve[2] is nan (not finite)"
    assert "FAILED: the torch loss curve[2] is nan" in capsys.readouterr().out


@pytest.mark.slow
def test_a_nan_loss_in_a_side_fails_its_regime(tmp_path, monkeypatch):
    # a learning rate that overflows bf16: the relay's own losses become NaN in its process
    monkeypatch.setattr(campaign, "ADAMW", {**campaign.ADAMW, "lr": 1e38})
    code = cli.main(["bench", "gpu", "--dry-run", "--parts", "regime_a", "--out", str(tmp_path / "o"),
                     "--work", str(tmp_path / "w")])
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert code == 1
    assert "relay at {'recompute': 'full', 'activations': 'device', 'micro_batch': 2} losses[1] is nan" in \
        summary["failed"]["regime_a"]


def test_a_cut_part_makes_the_campaign_exit_non_zero_and_says_so(tmp_path, monkeypatch):
    def stuck(self):
        time.sleep(60)

    monkeypatch.setattr(campaign.Campaign, "tests", stuck)
    t0 = time.monotonic()
    code = cli.main(["bench", "gpu", "--dry-run", "--parts", "tests", "matmul_peak", "--time-limit", "2",
                     "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")])
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert code == 1 and time.monotonic() - t0 < 30
    assert summary["cut"] == {"tests": "the command's time limit (2 s) ran out in tests",
                              "matmul_peak": "not started: the command's time limit (2 s) was spent"}
    assert summary["failed"] == {} and summary["verdict"] == "cut"
    # a part past its own limit is cut; the next part runs
    code = cli.main(["bench", "gpu", "--dry-run", "--parts", "tests", "matmul_peak", "--part-limit", "3",
                     "--out", str(tmp_path / "o2"), "--work", str(tmp_path / "w2")])
    summary = json.loads((tmp_path / "o2" / "summary.json").read_text())
    assert code == 1 and summary["cut"] == {"tests": "tests ran past its limit of 3 s"}
    assert summary["parts"]["matmul_peak"]["peak_tflops"] > 0


def test_a_failed_peer_makes_the_campaign_exit_non_zero_with_its_reason(tmp_path, monkeypatch):
    grid = gpu_peers.grid

    def misconfigured(kind, hidden, shapes, variations=True):
        g = grid(kind, hidden, shapes, variations)
        return gpu_peers.Grid({**g.base, "overlap_comm": "sometimes"}, g.shapes) if kind == "zero2_offload" else g

    monkeypatch.setattr(gpu_peers, "grid", misconfigured)
    code = cli.main(["bench", "gpu", "--dry-run", "--parts", "regime_b", "--peers", "zero2_offload",
                     "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")])
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    reason = summary["failed"]["regime_b"]
    assert code == 1 and summary["verdict"] == "failed"
    assert "zero2_offload: ValidationError" in reason and "overlap_comm" in reason  # DeepSpeed's own refusal
    assert "no PyTorch side ran" in reason  # and the loss then has no reference: said, not skipped
    assert summary["parts"]["regime_b"]["grids"]["relay"]["winner"] is not None  # the relay still ran


def test_the_command_exits_non_zero_when_a_part_fails_and_the_others_still_run(tmp_path, monkeypatch):
    def broken(self):
        raise RuntimeError("a part that breaks")

    monkeypatch.setattr(campaign.Campaign, "matmul_peak", broken)
    code = cli.main(["bench", "gpu", "--dry-run", "--parts", "matmul_peak", "loss", "--out", str(tmp_path / "o"),
                     "--work", str(tmp_path / "w")])
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert code == 1
    assert summary["failed"] == {"matmul_peak": "RuntimeError: a part that breaks"}
    assert summary["parts"]["loss"]["agree"]


def test_a_failing_test_fails_the_tests_part(tmp_path, monkeypatch):
    failing = tmp_path / "test_failing.py"
    failing.write_text("def test_twin_and_transport_break():\n    assert False\n")
    monkeypatch.setattr(campaign, "TEST_FILES", (str(failing),))
    summary = campaign.run(str(tmp_path / "o"), dry_run=True, parts=("tests",), work=str(tmp_path / "w"))
    assert summary["parts"]["tests"]["returncode"] == 1
    assert "pytest exited 1" in summary["failed"]["tests"]


def test_a_side_process_reports_a_failed_load_and_serves_the_next_request(tmp_path):
    side = Side("torch", "cpu", None, tmp_path / "side.log", dict(os.environ), timeout_s=120)
    try:
        spec = {"kind": "torch_checkpointed", "knobs": {"micro_batch": 1}, "batch": 2, "context": 8, "seed": 0,
                "adamw": ADAMW, "folder": str(tmp_path / "no-model"), "text": str(tmp_path / "no-text"),
                "cache": str(tmp_path / "tokens")}
        with pytest.raises(SideError) as failed:
            side.load(spec)
        assert not failed.value.memory and "no-model" in str(failed.value)
        with pytest.raises(SideError, match="nothing loaded"):
            side.steps(1)
        side.unload()
        assert side.starts == 1  # the same process throughout
    finally:
        side.close()
    assert side.child is None


def test_the_checks_fail_on_nan_where_max_skips_it():
    values = [1.0, math.nan, 2.0]
    assert max(values) == 2.0  # what the campaign must not do
    with pytest.raises(gpu_checks.CheckFailed, match=r"losses\[1\] is nan"):
        gpu_checks.finite("losses", values)
    assert math.isnan(gpu_checks.largest(values))
    assert math.isnan(gpu_checks.difference([[1.0, math.nan]], [[1.0, 1.1]]))
    assert not gpu_checks.agrees(math.nan, 1.0) and gpu_checks.agrees(0.5, 1.0) and not gpu_checks.agrees(2.0, 1.0)
    assert math.isnan(gpu_checks.drift([[5.0, math.nan], [5.0, 4.0]])["drift"])
    with pytest.raises(gpu_checks.CheckFailed, match="inf"):
        gpu_checks.median_range("tokens/s", [1.0, math.inf, 2.0])


def test_drift_is_the_largest_spread_at_one_step_and_needs_two_runs():
    runs = [[5.0, 4.0, 3.0], [5.1, 3.9], [4.9, 4.05, 3.2]]
    assert gpu_checks.drift(runs) == {"drift": pytest.approx(0.2), "steps": 3, "runs": 3}
    assert gpu_checks.bound(0.2) == pytest.approx(0.4) and gpu_checks.bound(0.0) == gpu_checks.LOSS_BOUND_FLOOR
    assert gpu_checks.difference([[5.0, 4.3]], runs) == pytest.approx(0.4)
    with pytest.raises(gpu_checks.CheckFailed, match="no drift"):
        gpu_checks.drift([[5.0, 4.0]])


def test_the_runs_alternate():
    assert gpu_checks.alternated(["relay", "zero2", "fsdp2"], 3) == [
        (0, "relay"), (0, "zero2"), (0, "fsdp2"), (1, "relay"), (1, "zero2"), (1, "fsdp2"),
        (2, "relay"), (2, "zero2"), (2, "fsdp2")]


def test_a_time_limit_cuts_and_leaves_no_alarm_behind():
    t0 = time.monotonic()
    with pytest.raises(gpu_checks.Cut, match="too long"):
        with gpu_checks.time_limit(0.2, "too long"):
            time.sleep(5)
    assert time.monotonic() - t0 < 2
    with gpu_checks.time_limit(5, "unused"):
        pass
    time.sleep(0.1)  # no alarm left to fire
    deadline = gpu_checks.Deadline(total_s=100, part_s=10)
    assert deadline.for_part("x") == (10, "x ran past its limit of 10 s")


def test_every_deepspeed_grid_point_is_a_config_deepspeeds_own_class_reads_back():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    h = LLAMA_3_8B["hidden_size"]
    for kind in ("zero2_offload", "zero3_offload"):
        g = gpu_peers.grid(kind, h, (1, 2, 4))
        points = g.first_points() + g.second_points(g.first_points()[0])
        assert len(points) == 3 + len(g.variations)
        for knobs in points:
            read = gpu_peers.side_config(kind, knobs, 8, ADAMW, "cuda")["deepspeed_read"]
            assert read["stage"] == int(kind[4]) and read["train_batch_size"] == 8
            assert read["micro_batch"] == knobs["micro_batch"]
            assert read["reduce_bucket_size"] == knobs["reduce_bucket_size"]
            assert read["overlap_comm"] == knobs["overlap_comm"] and read["offload_optimizer"] == "cpu"
            if kind == "zero3_offload":
                assert read["offload_param"] == "cpu" and read["sub_group_size"] == knobs["sub_group_size"]
                assert read["stage3_prefetch_bucket_size"] == knobs["stage3_prefetch_bucket_size"]
                assert read["stage3_param_persistence_threshold"] == knobs["stage3_param_persistence_threshold"]
    config = gpu_peers.deepspeed_config("zero3_offload", g.first_points()[0], 8, ADAMW)
    config["zero_optimization"]["stage3_prefetch_bucket_sise"] = 1  # a typo
    with pytest.raises(Exception, match="stage3_prefetch_bucket_sise"):
        gpu_peers.validate_deepspeed(config)


def test_peers_are_sized_by_deepspeeds_own_estimators_and_zero2s_pinned_buffers():
    """At Llama-3-8B's 8.03 B parameters ZeRO-3 offload needs 18 B x 1.5 a parameter of host memory
    (DeepSpeed's rule), more than the H200 machine's 125 GiB; ZeRO-2 offload was killed by the
    host's OOM killer at 17 layers (4.76 B) inside DeepSpeed's estimate (16 B x 1.5): its pinned
    buffers, rounded up to powers of two, are counted beyond it."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    shape, h = LLAMA_3_8B, LLAMA_3_8B["hidden_size"]

    def model(layers):
        return gpu_peers.Model(parameters(shape, layers)["total"], shape["vocab_size"] * h, h, layers,
                               shape["vocab_size"], shape["intermediate_size"], h * h // 4)

    z3 = gpu_peers.grid("zero3_offload", h, (1,)).first_points()[0]
    z2 = gpu_peers.grid("zero2_offload", h, (1,)).first_points()[0]
    p32, p17 = parameters(shape, 32)["total"], parameters(shape, 17)["total"]
    assert gpu_peers.needs("zero3_offload", model(32), z3, 4096, 8).host_bytes >= 18 * 1.5 * p32 > 125 * 2**30
    zero2 = gpu_peers.needs("zero2_offload", model(17), z2, 4096, 8)
    assert zero2.parts["estimator_host"] == 16 * 1.5 * p17 < 125 * 2**30 < zero2.host_bytes
    unpinned = gpu_peers.needs("zero2_offload", model(17), {**z2, "pin_memory": False}, 4096, 8)
    assert unpinned.host_bytes < zero2.host_bytes
    one_sequence, two = (gpu_peers.activation_bytes(model(32), m, 4096) for m in (1, 2))
    assert two == 2 * one_sequence  # activations scale with the micro-batch
    assert layer_parameters(shape) == 218_112_000


@pytest.mark.parametrize("threshold, resolution", [(37, 0.0), (37, 0.1), (1, 0.0), (300, 0.1), (5, 0.5)])
def test_capacity_search_finds_the_largest_depth_that_fits_to_its_resolution(threshold, resolution):
    largest, best, tries = search(lambda n: {"fits": n <= threshold, "n": n}, start=4, resolution=resolution)
    smallest_failing = min(n for n, fits, _ in tries if not fits)
    assert largest <= threshold < smallest_failing
    assert smallest_failing - largest <= max(1, int(resolution * largest))
    assert best["n"] == largest


def test_model_flops_per_token_match_torchs_flop_counter_and_causal_attention_is_half():
    # 6 N + 12 L d T against torch's own count of a forward and backward: its matrix products,
    # attention's included (the math kernel: batched products over the whole T x T); the causal
    # count, the campaign's, is that less the half a causal kernel skips: 6 N + 6 L d T
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = GPTConfig(n_layer=3, n_embd=64, n_head=4, block_size=32, bias=False)
    model = build_gpt(cfg)
    x = torch.randint(0, 256, (2, cfg.block_size))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        lm_loss(model(x), x).backward()
    matmul_params = count_parameters(cfg) - (256 + cfg.block_size) * cfg.n_embd
    norms = (2 * cfg.n_layer + 1) * cfg.n_embd  # LayerNorm weights: counted in N, no matmul
    full = flops_per_token(matmul_params - norms, cfg.n_layer, cfg.n_embd, cfg.block_size, causal=False)
    assert counter.get_total_flops() / x.numel() == pytest.approx(full, rel=1e-9)
    masked_half = 6 * cfg.n_layer * cfg.n_embd * cfg.block_size
    assert flops_per_token(matmul_params - norms, cfg.n_layer, cfg.n_embd, cfg.block_size) == full - masked_half


def test_llama_3_8b_shape_has_its_8_03_b_parameters_as_transformers_builds_it():
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_3_8B))
    assert parameters(LLAMA_3_8B, 32)["total"] == sum(p.numel() for p in model.parameters()) == 8_030_261_248


@pytest.mark.parametrize("name, tflops", [("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0),
                                          ("NVIDIA H200", 989.4), ("NVIDIA H200 NVL", 835.5), ("cpu", None)])
def test_dense_bf16_peak_by_device_name(name, tflops):
    assert dense_bf16_peak(name)["tflops"] == tflops


def test_rate_spread_takes_min_from_the_slowest_run():
    assert rate_spread(100, [1.0, 2.0, 4.0]) == {"min": 25.0, "median": 50.0, "max": 100.0, "runs": 3}


def test_the_relays_recipe_resident_sums_gradients_in_fp32_and_refreshes_the_bf16_copy():
    # the fp32 sum of the micro-batches' bf16 gradients, against a float64 sum of the same
    cfg = GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16, bias=False)
    partner = GPTPartner(cfg, torch.device("cpu"), "recipe", micro_batches=4, lr=1e-2)
    x = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    expected = [torch.zeros(p.shape, dtype=torch.float64) for p in partner.params]
    for xj in x.tensor_split(4):
        grads = torch.autograd.grad(lm_loss(partner.model(xj), xj) / 4, partner.params)
        for e, g in zip(expected, grads):
            e += g.double()
    before = [m.clone() for m in partner.masters]
    opt_step, seen = partner.opt.step, []
    partner.opt.step = lambda: seen.extend(s.clone() for s in partner.sums)  # the sums AdamW would read
    partner.step(x, x)
    for s, e in zip(seen, expected):
        torch.testing.assert_close(s.double(), e, rtol=2**-20, atol=1e-12)
    partner.opt.step = opt_step
    partner.step(x, x)
    assert all((m != b).any() for m, b in zip(partner.masters, before) if m.dim() > 1)
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(partner.params, partner.masters))


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
