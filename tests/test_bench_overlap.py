"""`l2l bench overlap`: its sleeping layers' compute scales with the micro-batches, the inline
variant really runs the updates on the caller's thread, and its figures are the ones it
defines, from its own medians (no timing is asserted here)."""
import pytest

from l2l_hw import cli
from l2l_hw.bench import overlap

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def report():
    # Weights big enough that an update (a few ms) stands out of the sleeps' jitter on a loaded
    # machine, and sleeps that outweigh the relay's own overhead per step (~10 ms on 2 busy cores).
    return overlap.run(layers=4, params=500_000, micro_batches=(1, 2), compute_ratio=20.0, steps=2, warmup=1)


def test_report_has_a_row_of_every_variant_per_micro_batch_count(report):
    assert [row["micro_batches"] for row in report["rows"]] == [1, 2]
    assert report["model"]["layers"] == 4 and report["model"]["params_per_layer"] == 500_000
    c = report["calibration"]
    assert c["reference_micro_batches"] == 2 and c["update_s"] > 0 and c["t_fwd_s"] > 0
    assert c["sleeps_per_micro_batch"] >= 3 * 4, "every layer sleeps a forward and a backward per micro-batch"
    for row in report["rows"]:
        for v in overlap.VARIANTS:
            low, high = row["spread_s"][v]
            assert 0 < low <= row[f"{v}_s"] <= high
        assert row["step_drain_s"] >= 0


def test_sleep_layers_compute_scales_with_micro_batches(report):
    one, two = report["rows"]
    c = report["calibration"]
    slept = c["sleeps_per_micro_batch"] * c["t_fwd_s"]  # one micro-batch's sleeps through every layer
    assert two["compute_s"] - one["compute_s"] > 0.5 * slept, "each micro-batch sleeps through every layer"


def test_inline_updates_run_on_the_caller_and_add_to_the_compute(report):
    for row in report["rows"]:
        assert row["update_threads"]["inline"] == ["caller"]
        # the inline step runs the same sleeps and more: its fastest round is no faster than the compute's
        assert row["spread_s"]["inline"][0] >= row["spread_s"]["compute"][0]


def test_figures_are_computed_from_the_medians_as_defined(report):
    for row in report["rows"]:
        update, compute, step, inline = (row[f"{v}_s"] for v in ("update", "compute", "step", "inline"))
        assert row["efficiency"] == pytest.approx((inline - step) / min(compute, update))
        assert row["vs_bound"] == pytest.approx(step / max(compute, update))
        assert row["device_wait"] == pytest.approx(max(0.0, step - compute) / step)
        # the planned device share: a count of the model's layers, with the planner's reason
        assert 0 <= row["shared_layers"] <= 4 and "predicted device wait" in row["shared_plan"]
        assert 0.0 <= row["shared_wait"] < 1.0
    assert "updates on" in overlap.format_report(report)


def test_a_device_without_an_asynchronous_twin_is_refused():
    with pytest.raises(ValueError, match="cpu-async"):
        overlap.run(device="cpu")


def test_help_through_the_cli(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "overlap", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert " ".join(overlap.__doc__.split("\n\n")[0].split()) in out
    assert "--compute-ratio" in out and "--micro-batches" in out
