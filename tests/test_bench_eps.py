"""`l2l bench eps`: its comparisons are like for like (no timing is asserted here)."""
import os

import numpy as np
import pytest
import torch

from l2l_hw.bench import eps as bench_eps
from l2l_hw.eps import golden, host_kernel


def test_bench_reports_every_comparison_with_its_stream_limit():
    r = bench_eps.run(n=3 * host_kernel.tile(), threads=1, repeats=1, deepspeed=False)
    assert r["l2l_step"]["bytes_per_element"] == 28 and r["l2l_step"]["fused_vs_stream"] > 0
    assert r["deepspeed"] == {"skipped": "--no-deepspeed"}
    sf = r["state_formats"]
    assert [sf[s]["bytes_per_element"] for s in golden.STATE_FORMATS] == [28, 20, 16 + 4 * 4 / golden.QUANT_BLOCK]
    assert sf["fp32"]["elements_vs_fp32_state"] == 1.0
    assert all(sf[s]["stream_gelem_s"] > 0 for s in golden.STATE_FORMATS)
    assert "deepspeed" in bench_eps.format_report(r)  # the note says it was skipped


def test_stream_moves_the_bytes_it_claims():
    n = 2 * host_kernel.tile() + 77  # a tail the vector loop leaves to the scalar one
    reads, updates, writes = [torch.ones(n, dtype=torch.bfloat16)], [torch.zeros(n), torch.zeros(n, dtype=torch.uint8)], \
        [torch.full((n,), 7, dtype=torch.uint8)]
    for nontemporal in (False, True):
        host_kernel.stream(reads, updates, writes, nontemporal=nontemporal, threads=2)
    for t in updates:
        assert (t.view(torch.uint8) == 2).all(), "every byte of an updated stream is read and written once per call"
    assert (writes[0] == 1).all(), "every byte of a written stream is written"
    assert torch.equal(reads[0], torch.ones(n, dtype=torch.bfloat16)), "a read stream is left alone"


@pytest.mark.slow
def test_deepspeed_cpu_adam_computes_the_same_adamw_step():
    """The bench's DeepSpeed comparison is like for like: DeepSpeedCPUAdam (FMA, its own
    order, a rounded 1/sqrt(1 - beta2^t) factor) and the host kernel agree within 3 ulp at the
    scale of the update on one AdamW step."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # not installed, or unable to build its op here
        pytest.skip(f"deepspeed is not importable: {e}")
    n = 10_000
    p, m, v, grad = bench_eps.random_state(n, 3, torch.float32, 1.0)
    cfg = bench_eps.CONFIG
    param = torch.nn.Parameter(p.clone())
    param.grad = grad.clone()
    opt = DeepSpeedCPUAdam([param], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                           adamw_mode=True)
    opt.step()  # step 1 from zero state
    ours = p.clone()
    host_kernel.step("adamw", golden.step_scalars(cfg, 1), grad, ours, torch.zeros(n), torch.zeros(n))
    a, b, old = ours.numpy(), param.detach().numpy(), p.numpy()
    assert not np.array_equal(a, old), "the step must move the weights"
    # ulps at the scale of the update (docs/NUMERICS.md): of max(|p_old|, |p_new|, |p_new - p_old|)
    scale = np.maximum.reduce([np.abs(old), np.abs(a), np.abs(b), np.abs(a - old)])
    ulps = np.abs(a.astype(np.float64) - b) / np.spacing(scale)
    assert ulps.max() <= 3, f"DeepSpeedCPUAdam and the kernel differ by {ulps.max()} ulp"


def test_ratios_are_taken_within_each_round():
    """A machine that slows down between rounds must not move a ratio: each ratio is the
    median of the per-round ratios, and the stream of a round is its fastest variant."""
    r = bench_eps.Rounds({"fused": [1.0, 10.0, 100.0], "other": [3.0, 15.0, 200.0],
                          "stream plain 1t": [1.5, 30.0, 90.0], "stream plain 2t": [3.0, 12.0, 300.0]})
    assert r.times["stream"] == [1.5, 12.0, 90.0]
    assert r.speedup("fused", "other") == 2.0  # rounds: 3, 1.5, 2 (the ratio of medians would be 1.5)
    assert r.speedup("fused", "stream") == 1.2  # rounds: 1.5, 1.2, 0.9
    assert r.fastest_stream() == "plain 2t"  # medians 30 and 12


def test_stream_scaling_compares_the_fastest_stream_of_each_thread_count_round_by_round():
    """The figure that says whether the stream is a memory limit or one core's."""
    r = bench_eps.Rounds({"stream plain 1t": [4.0, 8.0, 6.0], "stream non-temporal 1t": [5.0, 7.0, 9.0],
                          "stream plain 2t": [2.0, 5.0, 3.0], "stream non-temporal 2t": [2.5, 4.0, 4.0]})
    assert r.stream_scaling(2) == 2.0  # fastest per round: 4/2, 7/4, 6/3 -> 2, 1.75, 2
