"""`l2l bench gpu`: the dry run of the whole campaign (every part at toy size on the CPU, the
relay on the asynchronous twin, the peers on the CPU), its failures, and its figures of merit
against independent counts."""
import json
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from l2l_hw import cli
from l2l_hw.bench import gpu
from l2l_hw.bench.gpu_capacity import search
from l2l_hw.bench.gpu_extras import compute_idle_fraction, trim
from l2l_hw.bench.gpu_figures import dense_bf16_peak, flops_per_token, rate_spread
from l2l_hw.bench.gpu_llama import LLAMA_3_8B, parameters
from l2l_hw.bench.gpu_partners import GPTPartner
from l2l_hw.bench.gpu_peers import host_bytes
from l2l_hw.models import GPTConfig, build_gpt, count_parameters, lm_loss


def test_dry_run_runs_every_part_prints_its_figures_and_writes_the_campaign_files(tmp_path):
    out = tmp_path / "gpu"
    done = subprocess.run([sys.executable, "-m", "l2l_hw.cli", "bench", "gpu", "--dry-run", "--out", str(out),
                           "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    assert done.returncode == 0, (summary["failed"], done.stdout[-3000:], done.stderr[-3000:])
    assert sorted(p.name for p in out.iterdir()) == sorted(gpu.FILES)
    assert all(p.stat().st_size <= gpu.MAX_FILE_BYTES for p in out.iterdir())
    parts = summary["parts"]
    assert list(parts) == list(gpu.PARTS) and summary["failed"] == {}
    assert parts["tests"]["returncode"] == 0 and "passed" in parts["tests"]["result"]
    for u in gpu.DRY.micro_batch_counts:  # three partners, each >= 3 runs, the ratio against the strongest
        figures = parts["resident"][f"micro_batches_{u}"]
        assert figures["strongest"] in ("autocast", "recipe", f"compiled_{figures['strongest'][9:]}")
        assert figures["relay"]["tokens_per_s"]["runs"] >= 3 and figures["relay_over_strongest"] > 0
    assert parts["capacity"]["torch_layers"] >= 1 and parts["capacity"]["relay_layers"] >= 1
    assert parts["loss"]["agree"] and len(parts["loss"]["curves"]["relay"]) == gpu.DRY.loss_steps
    for name in ("llama_8b", "llama_largest"):
        assert parts[name]["tokens_per_s"]["runs"] == gpu.DRY.llama_timed and parts[name]["peak_host_rss_bytes"] > 0
    for peer in ("zero3_offload", "zero2_offload", "fsdp2_offload", "torch_resident"):
        assert parts["peers"][peer]["tokens_per_s"]["runs"] == gpu.DRY.peer_steps - 1, parts["peers"][peer]
    assert "tokens/s" in done.stdout and "relay / strongest" in done.stdout  # figures as it goes
    assert "all 8 parts passed" in done.stdout


def test_the_command_exits_non_zero_when_a_part_fails_and_the_others_still_run(tmp_path, monkeypatch):
    def broken(self):
        raise RuntimeError("a part that breaks")

    monkeypatch.setattr(gpu.Campaign, "matmul_peak", broken)
    code = cli.main(["bench", "gpu", "--dry-run", "--parts", "matmul_peak", "loss", "--out", str(tmp_path / "o"),
                     "--work", str(tmp_path / "w")])
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert code == 1
    assert summary["failed"] == {"matmul_peak": "RuntimeError: a part that breaks"}
    assert summary["parts"]["loss"]["agree"]


def test_a_failing_test_fails_the_tests_part(tmp_path, monkeypatch):
    failing = tmp_path / "test_failing.py"
    failing.write_text("def test_twin_and_transport_break():\n    assert False\n")
    monkeypatch.setattr(gpu, "TEST_FILES", (str(failing),))
    summary = gpu.run(str(tmp_path / "o"), dry_run=True, parts=("tests",), work=str(tmp_path / "w"))
    assert summary["parts"]["tests"]["returncode"] == 1
    assert "pytest exited 1" in summary["failed"]["tests"]


@pytest.mark.parametrize("threshold, resolution", [(37, 0.0), (37, 0.1), (1, 0.0), (300, 0.1), (5, 0.5)])
def test_capacity_search_finds_the_largest_depth_that_fits_to_its_resolution(threshold, resolution):
    largest, best, tries = search(lambda n: {"fits": n <= threshold, "n": n}, start=4, resolution=resolution)
    smallest_failing = min(n for n, fits, _ in tries if not fits)
    assert largest <= threshold < smallest_failing
    assert smallest_failing - largest <= max(1, int(resolution * largest))
    assert best["n"] == largest


def test_model_flops_per_token_match_torchs_flop_counter_on_the_reference_gpt():
    # 6 N + 12 L d T against torch's own count of a forward and backward: its matrix products,
    # attention's included (the math kernel: batched products over the whole T x T, as PaLM counts)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = GPTConfig(n_layer=3, n_embd=64, n_head=4, block_size=32, bias=False)
    model = build_gpt(cfg)
    x = torch.randint(0, 256, (2, cfg.block_size))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        lm_loss(model(x), x).backward()
    matmul_params = count_parameters(cfg) - (256 + cfg.block_size) * cfg.n_embd
    norms = (2 * cfg.n_layer + 1) * cfg.n_embd  # LayerNorm weights: counted in N, no matmul
    ours = flops_per_token(matmul_params - norms, cfg.n_layer, cfg.n_embd, cfg.block_size)
    assert counter.get_total_flops() / x.numel() == pytest.approx(ours, rel=1e-9)


def test_llama_3_8b_shape_has_its_8_03_b_parameters_as_transformers_builds_it():
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_3_8B))
    assert parameters(LLAMA_3_8B, 32)["total"] == sum(p.numel() for p in model.parameters()) == 8_030_261_248


def test_zero2_offload_is_sized_by_its_pinned_buffers_beyond_deepspeeds_estimate():
    """ZeRO-2 offload was killed by the host's OOM killer at 17 Llama-3-8B layers (4.76 B) on the H200
    machine (125 GiB available), inside DeepSpeed's own estimate (16 B x 1.5): the peers' sizing
    counts its whole-model pinned buffers, which the pinned allocator rounds up to powers of two."""
    p17, p14 = (parameters(LLAMA_3_8B, n)["total"] for n in (17, 14))
    assert 16 * 1.5 * p17 < 125 * 2**30 < host_bytes("zero2_offload", p17)
    assert host_bytes("zero2_offload", p14) < host_bytes("zero3_offload", p14) == 18 * 1.5 * p14
    assert host_bytes("zero2_offload", 2**30) == 24 * 2**30  # powers of two: nothing rounded


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
