"""The benchmarks' one timer (l2l_hw/bench/timer.py): warm-up, then turns round robin."""
from l2l_hw.bench.timer import round_robin


def test_every_variant_warms_up_then_takes_one_turn_per_round():
    calls = []
    times = round_robin({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3, warmup=2)
    assert calls == ["a", "a", "b", "b"] + ["a", "b"] * 3
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    assert all(t >= 0 for ts in times.values() for t in ts)


def test_a_self_timed_variant_reports_its_own_seconds():
    seconds = iter([9.0, 1.0, 2.0, 3.0])  # the first is the warm-up's, not recorded
    assert round_robin({"step": lambda: next(seconds)}, rounds=3, warmup=1, self_timed=True) == {"step": [1.0, 2.0, 3.0]}
