"""Planted regressions fail the chapters' decided timing checks; without them the checks pass or stay undecided.

Each test runs one chapter's check on the default model (float32, CPU) at small sizes, with the same
utils functions, prediction and bar as the notebook, twice: as is, and with a regression planted whose
effect is far larger than a shared machine's noise and grows with the work, so that a slow spell does not
hide it (a disabled KV cache; every prompt padded to the longest; every streamed token made to wait three
of its decode steps). As is, the check must pass or say "not decided here", never fail; planted, it must
raise :class:`~utils.decide.TimingCheckFailed`. Five repeats each: the spread is an interquartile range.
"""

from __future__ import annotations

import time

import pytest

from utils import engine, roofline
from utils.decide import PASSED, UNDECIDED, TimingCheckFailed, decide, decide_ratio, ratio_spread
from utils.hardware import measure_matmul_flops, probe_bandwidth
from utils.timing import interleaved
from utils.tokens import filler_ids
from utils.verdicts import decide_near

CASES = [pytest.param(False, id="as-is"), pytest.param(True, id="planted")]


def outcome(planted: bool, check) -> str | None:
    """Run ``check()``: planted, it must fail; as is, it must pass or be undecided."""
    if planted:
        with pytest.raises(TimingCheckFailed):
            check()
        return None
    result = check()
    assert result in (PASSED, UNDECIDED)
    return result


@pytest.mark.parametrize("planted", CASES)
def test_05_a_disabled_cache_fails_cached_vs_uncached(lm, planted):
    """05: 'cached decode step beats no cache by > 2x', predicted by StepCosts with a fixed cost measured apart."""
    model, s, c = lm.model, lm.spec, 256

    def stepper(context: int):  # one greedy decode step per next(), after an untimed prefill of `context` tokens
        cache = engine.new_cache(model, 1, context + 8)
        first = engine.prefill(model, cache, filler_ids(lm.tokenizer, context, lm.device)).argmax(dim=-1)
        return engine.decode_steps(model, cache, first, 8)

    ids, short, cached = filler_ids(lm.tokenizer, c, lm.device), stepper(32), stepper(c)

    def no_cache() -> None:
        engine.prefill(model, engine.new_cache(model, 1, c), ids)

    # the fixed cost of a pass: a real decode step at 32 tokens, interleaved with the two compared (a slow
    # spell moves all three alike); planted, the "cached" step at c runs the whole sequence again
    t = interleaved({"fixed": lambda: next(short), "no cache": no_cache,
                     "cached": no_cache if planted else (lambda: next(cached))}, repeats=5, warmup=1)
    costs = roofline.StepCosts(  # transformers' fused attention: the causal triangle, no score traffic
        fixed_s=t["fixed"].median, flops_per_s=measure_matmul_flops(lm.device, lm.dtype),
        bandwidth_bytes_s=probe_bandwidth(lm.device, probes=1).best,
        block_params=sum(p.numel() for p in model.model.layers.parameters()), kv_bytes_per_token=s.kv_bytes_per_token,
        n_layers=s.n_layers, n_heads=s.n_heads, head_dim=s.head_dim, square=1)
    outcome(planted, lambda: decide(f"cached decode step beats no cache by > 2x at {c} tokens",
                                    t["no cache"].median / t["cached"].median, bar=2.0,
                                    predicted=costs.no_cache_s(c, False) / costs.cached_s(c, False),
                                    spread=ratio_spread(t["no cache"], t["cached"])))


@pytest.mark.parametrize("planted", CASES)
def test_03_prompts_padded_to_the_longest_fail_ttft_grows(lm, planted, monkeypatch):
    """03: 'TTFT grows > 2x' from 16 to 256 prompt tokens, predicted from a one-token pass plus FLOPs / FLOP/s."""
    s, short, long = lm.spec, 16, 256
    P = roofline.prefill_params(s.weight_bytes_read_per_token, s.bytes_per_param, s.vocab_size, s.hidden_size)
    flops_s = measure_matmul_flops(lm.device, lm.dtype)
    dec = engine.measure_decode(lm, 8, prompt_tokens=32, repeats=3)  # before any plant: the one-token pass

    def compute_floor(n: int) -> float:  # the notebook's flops_of(n) / flops_s
        flops = roofline.prefill_flops(P, n, s.n_layers, s.n_heads * s.head_dim) + 2 * s.vocab_size * s.hidden_size
        return flops / flops_s

    if planted:  # every prompt padded to the longest: a short prompt costs as much as a long one
        real, padded = engine.prefill, filler_ids(lm.tokenizer, long, lm.device)
        monkeypatch.setattr(engine, "prefill", lambda model, cache, ids, mask=None: real(
            model, engine.new_cache(model, 1, long), padded))
    results = engine.measure_prefills(lm, [short, long], repeats=5)
    predicted = roofline.growth_with_fixed_cost(dec.timing.median / dec.tokens, compute_floor(short),
                                                compute_floor(long))
    outcome(planted, lambda: decide_ratio(f"TTFT grows > 2x from {short} to {long} prompt tokens",
                                          results[long].timing, results[short].timing, bar=2.0, predicted=predicted))


@pytest.mark.parametrize("planted", CASES)
def test_06_a_slow_stream_fails_decode_step_against_its_prediction(lm, planted, monkeypatch):
    """06: each request's decode step over the step measure_decode measured just before it, within 0.5x-2x."""
    o, ratios, wait = 8, [], {"s": 0.0}
    if planted:  # every streamed token waits 3 decode steps (the stream decodes the text so far after each one)
        real = type(lm.tokenizer).decode
        monkeypatch.setattr(type(lm.tokenizer), "decode",
                            lambda self, *a, **k: (time.sleep(wait["s"]), real(self, *a, **k))[1])
    engine.run_request(lm, filler_ids(lm.tokenizer, 16, lm.device), 2, stop_at_eos=False)  # warm-up
    for _ in range(5):
        dc = engine.measure_decode(lm, o, prompt_tokens=32, repeats=1, warmup=0).tok_s
        wait["s"] = 3 / dc if planted else 0.0
        m = engine.run_request(lm, filler_ids(lm.tokenizer, 32, lm.device), o, stop_at_eos=False)
        ratios.append(m.decode_s / (o - 1) * dc)
    outcome(planted, lambda: decide_near("32 + 8 tokens: decode step / measure_decode step", ratios)[0])

