"""The timing harness: statistics, noise flagged and re-measured, interleaved A/B, profile grouping."""

from __future__ import annotations

import pytest

from utils import timing
from utils.timing import Timing, interleaved, measure, op_kind


def test_timing_statistics():
    t = Timing((0.3, 0.1, 0.2, 0.4, 0.5))
    assert t.median == 0.3 and t.min == 0.1
    assert t.spread == pytest.approx(0.2)
    assert t.relative_spread == pytest.approx(0.2 / 0.3)
    calls = []
    measure(lambda: calls.append(1), warmup=2, repeats=3, remeasure_noisy=False)
    assert len(calls) == 5


def test_noisy_is_flagged_in_print():
    steady, noisy = Timing((1.0, 1.01, 0.99, 1.0)), Timing((1.0, 2.0, 0.5, 1.5))
    assert not steady.noisy and "NOISY" not in str(steady)
    assert noisy.noisy and "NOISY" in str(noisy)


def test_a_noisy_measurement_is_measured_again(monkeypatch):
    # first 5 timed repeats wildly spread, the next 5 steady: the steady set is kept
    times = iter([0, 0.001] + [0, 1, 0, 3, 0, 0.5, 0, 2.5, 0, 1.8] + [0, 1] * 5)
    fake = lambda: next(times)  # noqa: E731
    monkeypatch.setattr(timing.time, "perf_counter", fake)
    t = measure(lambda: None, warmup=1, repeats=5)
    assert t.samples == (1.0,) * 5


def test_interleaved_runs_round_robin():
    order = []
    out = interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, repeats=3, warmup=1)
    assert order == ["a", "b"] * 4
    assert set(out) == {"a", "b"} and all(len(t.samples) == 3 for t in out.values())


def test_interleaved_setup_runs_untimed_and_feeds_its_call():
    import time

    seen = []
    out = interleaved({"a": lambda x: seen.append(x), "b": lambda: time.sleep(0.002)}, repeats=2, warmup=0,
                      setup={"a": lambda: time.sleep(0.05) or len(seen)})
    assert seen == [0, 1]  # each call got its own setup's result
    assert max(out["a"].samples) < 0.04 < 0.05  # the 50 ms setup is not in the time
    assert min(out["b"].samples) >= 0.002


@pytest.mark.parametrize("name, kind", [
    ("aten::mm", "matmul"), ("aten::addmm", "matmul"), ("aten::_weight_int8pack_mm", "matmul"),
    ("workbook::int8_linear", "matmul"), ("workbook::int4_linear", "matmul"), ("workbook::decode_attention", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"), ("aten::softmax", "attention"),
    ("aten::mul", "everything else"), ("aten::index_copy_", "everything else")])
def test_op_kind(name, kind):
    assert op_kind(name) == kind
