"""`l2l bench llama-here` at a toy width: the folder it makes loads in transformers, the estimate
runs before the fine-tune, and the report's ratio is the run's kernel-measured peak over the
estimate's host bytes (no figure is asserted: the real run is docs/BENCHMARKS.md's)."""
import pytest
import transformers

from l2l_hw.bench import llama_here

pytestmark = pytest.mark.slow  # two child processes, each importing torch and transformers (~40 s)


def test_a_toy_llama_goes_through_the_estimate_and_the_fine_tune(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_here, "LLAMA_3_8B", dict(llama_here.LLAMA_3_8B, hidden_size=64, intermediate_size=128,
                                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=2048))
    report = llama_here.run(str(tmp_path), layers=2, context=16, steps=2)
    model = transformers.AutoConfig.from_pretrained(tmp_path / "model")
    assert model.num_hidden_layers == 2 and model.hidden_size == 64
    assert report["peak_over_estimate"] == report["peak_rss_bytes"] / report["estimated_host_bytes"]
    assert len(report["losses"]) == 2 and report["flags"] == list(llama_here.RUN_FLAGS)
    assert not (tmp_path / "state").exists()  # --remove-state-dir
    assert "peak RSS" in llama_here.format_report(report)
