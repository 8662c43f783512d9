"""`l2l bench convergence` (l2l_hw/bench/convergence.py): its flush row is plain PyTorch's run on the
same tokens, every schedule runs as 2 real stages, and the gaps and the acceptance are taken against
flush of the same seed."""
import pytest
import torch

from l2l_hw.bench import convergence as bench

TINY = dict(layers=2, width=32, heads=2, context=16, batch_size=4, micro_batches=2)


def plain_pytorch_val_loss(steps: int, seed: int) -> float:
    """The tiny run in plain PyTorch (no relay, no EPS, no pipeline): the same init, batches, AdamW
    schedule and validation windows as l2l_hw.train's."""
    from l2l_hw.eps.base import OptimConfig
    from l2l_hw.models import Corpus, build_gpt, lm_loss
    from l2l_hw.train import TrainConfig, corpus_val_batches

    cfg = TrainConfig(steps=steps, seed=seed, out=None, **TINY)
    corpus = Corpus.load(cfg.data)
    torch.manual_seed(cfg.seed)
    model = build_gpt(cfg.model_config())
    schedule = OptimConfig(lr=cfg.lr, schedule=cfg.schedule, warmup_steps=cfg.warmup_steps, total_steps=steps,
                           min_lr=cfg.floor(cfg.lr))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False)
    data = torch.Generator().manual_seed(cfg.seed)
    for step in range(1, steps + 1):
        x, y = corpus.batch("train", cfg.batch_size, cfg.context, data)
        for group in opt.param_groups:
            group["lr"] = schedule.lr_at(step)
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        windows = corpus_val_batches(corpus, cfg)
        return sum(float(lm_loss(model.eval()(x), y)) for x, y in windows) / len(windows)


def test_the_flush_row_of_2_stages_is_plain_pytorchs_validation_loss_on_the_same_tokens():
    r = bench.run(steps=2, seeds=(7,), optimizer_names=("adamw",), variants=("flush",), **TINY)
    (row,) = r["runs"]
    assert (row["optimizer"], row["variant"], row["seed"]) == ("adamw", "flush", 7)
    assert row["val_loss"] == pytest.approx(plain_pytorch_val_loss(2, 7), rel=1e-5)
    assert row["relay_val_loss"] == pytest.approx(row["val_loss"], rel=1e-5)  # flush: the masters are computed on
    assert r["model"]["layers"] == 2 and r["stages"] == 2


@pytest.mark.slow
def test_every_schedule_runs_on_tiny_sizes_and_muon_is_never_predicted():
    names = bench.optimizers()
    r = bench.run(steps=3, seeds=(7,), **TINY)
    rows = {(row["optimizer"], row["variant"]) for row in r["runs"]}
    assert ("adamw", "2bw+predict") in rows and ("adamw", "2bw") in rows and ("adamw", "flush") in rows
    if "muon" in names:
        assert rows >= {("muon", "flush"), ("muon", "2bw")} and ("muon", "2bw+predict") not in rows
        assert "muon_2bw_within_tolerance" in r["acceptance"]
    for optimizer, variants in r["summary"].items():
        for name, v in variants.items():
            if name != "flush":
                assert v["mean_gap"] == pytest.approx(v["mean"] - variants["flush"]["mean"])
    assert "adamw_recovered" in r["acceptance"]
    assert "AdamW: compensation recovers" in bench.format_report(r)


def test_gaps_are_taken_against_flush_of_the_same_seed_and_the_acceptance_from_their_means():
    runs = [{"optimizer": "adamw", "variant": v, "seed": s, "val_loss": loss} for v, s, loss in (
        ("flush", 1, 2.0), ("flush", 2, 3.0), ("2bw", 1, 2.5), ("2bw", 2, 3.3), ("2bw+predict", 1, 2.1),
        ("2bw+predict", 2, 3.2))] + [
        {"optimizer": "muon", "variant": v, "seed": 1, "val_loss": loss} for v, loss in (("flush", 2.2), ("2bw", 2.23))]
    summary = bench.summarize(runs)
    two_bw, predicted = summary["adamw"]["2bw"], summary["adamw"]["2bw+predict"]
    assert two_bw["gap"] == pytest.approx({1: 0.5, 2: 0.3}) and two_bw["mean_gap"] == pytest.approx(0.4)
    assert predicted["mean_gap"] == pytest.approx(0.15) and summary["adamw"]["flush"]["mean"] == 2.5
    a = bench.acceptance(summary)
    assert a["adamw_recovered"] == pytest.approx(1 - 0.15 / 0.4) and a["adamw_compensated_gap_at_most_half"]
    assert not a["muon_2bw_within_tolerance"]  # 0.03 > 0.02
    runs[-1]["val_loss"] = 2.21
    assert bench.acceptance(bench.summarize(runs))["muon_2bw_within_tolerance"]


def test_only_an_optimizer_the_eps_predicts_gets_a_compensated_row():
    assert bench.predicted("adamw")
    from l2l_hw.eps.base import OPTIMIZERS

    assert ("muon" in bench.optimizers()) == ("muon" in OPTIMIZERS)
    if "muon" in OPTIMIZERS:
        assert not bench.predicted("muon")
        assert bench.run(steps=1, seeds=(7,), optimizer_names=("muon",), variants=("2bw+predict",), **TINY)["runs"] == []
