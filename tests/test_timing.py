"""The timing harness: statistics, noise flagged and re-measured, interleaved A/B, profile grouping."""

from __future__ import annotations

import time

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


def test_a_noisy_round_in_turns_is_timed_once_more_and_the_steadier_round_kept():
    """``interleaved(..., remeasure_noisy=True)``, as the bench's with/without comparisons call it: a round whose
    timings are noisy (spread over :data:`utils.timing.NOISE_THRESHOLD`) is timed again; a steady one is not."""
    calls = {"steady": 0, "jumpy": 0}

    def way(name, seconds):
        def run(_start):
            calls[name] += 1
            time.sleep(seconds(calls[name]))
        return run

    steady = {"a": way("steady", lambda n: 0.002), "b": way("steady", lambda n: 0.003)}
    a, b = interleaved(steady, setup={k: lambda: None for k in steady}, repeats=4, remeasure_noisy=True).values()
    assert calls["steady"] == 2 * (4 + 1) and not a.noisy and b.median > a.median  # one round: 4 + a warm-up each
    jumpy = {"a": way("jumpy", lambda n: 0.001 if n % 2 else 0.012), "b": way("steady", lambda n: 0.002)}
    interleaved(jumpy, setup={k: lambda: None for k in jumpy}, repeats=4, remeasure_noisy=True)
    assert calls["jumpy"] == 2 * (4 + 1)  # timed twice: every round of "a" is noisy
    calls["jumpy"] = 0
    interleaved(jumpy, setup={k: lambda: None for k in jumpy}, repeats=4)
    assert calls["jumpy"] == 4 + 1  # without remeasure_noisy: once, as before
