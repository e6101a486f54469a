"""utils.simulator: hand-computed schedules, the real loop's exact mirror, goodput and the best split."""

from __future__ import annotations

import math

import pytest

from utils import simulator as S
from utils.errors import WorkbookError
from utils.hardware import accelerator
from utils.shapes import LLAMA3_8B
from utils.requests import Request, Sequence, synthetic_trace


def costs(overhead: float = 0.0, rate: float = 100.0, decode=((1, 0.05), (4, 0.08)), kv: float = 1000.0) -> S.StepCosts:
    """Prefill ``overhead + n / rate``; decode 0.05 s at batch 1, +0.01 s per extra row."""
    return S.fit_costs([(10, overhead + 10 / rate), (100, overhead + 100 / rate)], list(decode), kv)


def req(i: int, t: float, prompt: int, out: int) -> Request:
    return Request.of_length(i, t, prompt, out)


# ----------------------------------------------------------------------------- the costs


def test_fit_recovers_an_exact_line_and_interpolates_the_decode_curve():
    c = costs(overhead=0.1)
    assert c.prefill_overhead_s == pytest.approx(0.1) and c.prefill_rate_tok_s == pytest.approx(100)
    assert c.prefill_s(50) == pytest.approx(0.6)
    assert [c.decode_step_s(b) for b in (1, 2, 3, 4, 8)] == pytest.approx([0.05, 0.06, 0.07, 0.08, 0.12])
    assert c.decode_tok_s(4) == pytest.approx(4 / 0.08) and c.prefill_tok_s(50) == pytest.approx(50 / 0.6)


def test_fit_never_gives_a_negative_overhead_or_a_falling_extrapolation():
    c = S.fit_costs([(10, 0.05), (100, 1.2)], [(2, 0.05), (4, 0.04)], 1)  # a noisy, falling curve end
    # a line through both would start at -78 ms: the fit drops the fixed cost, least squares of s = n / rate
    # on the relative error (each point weighted by 1 / its time)
    through_origin = (10 / 0.05 + 100 / 1.2) / ((10 / 0.05) ** 2 + (100 / 1.2) ** 2)
    assert c.prefill_overhead_s == 0 and c.prefill_s(100) == pytest.approx(100 * through_origin)
    assert c.decode_step_s(1) == pytest.approx(0.045)  # flat below the first point; the falling pair pooled
    assert c.decode_step_s(4) == pytest.approx(0.045) and c.decode_step_s(16) == pytest.approx(0.045)


def test_a_preempted_step_cannot_make_more_rows_cheaper_than_fewer():
    assert S.non_decreasing([9.0, 5.0, 8.0]) == pytest.approx((7.0, 7.0, 8.0))
    assert S.non_decreasing([1.0, 3.0, 2.0, 2.0, 5.0]) == pytest.approx((1.0, 7 / 3, 7 / 3, 7 / 3, 5.0))
    assert S.non_decreasing([1.0, 2.0, 4.0]) == (1.0, 2.0, 4.0)  # a rising curve is kept as measured
    c = S.fit_costs([(32, 0.008), (256, 0.022)], [(1, 0.0094), (2, 0.0055), (4, 0.0076)], 1024)  # measured under load
    steps = [c.decode_step_s(b) for b in (1, 2, 3, 4)]
    assert steps == sorted(steps) and steps[0] == pytest.approx((0.0094 + 0.0055) / 2)


def test_accelerator_costs_are_the_roofline():
    h100 = accelerator("H100")
    c = S.costs_from_accelerator(h100, LLAMA3_8B, efficiency=0.5)
    assert c.prefill_s(1000) == pytest.approx(2 * LLAMA3_8B.prefill_params() * 1000 / (h100.bf16_dense_flops * 0.5))
    memory_s = LLAMA3_8B.weight_bytes_read_per_token / h100.bandwidth_bytes_s / 0.5
    assert c.decode_step_s(1) == pytest.approx(memory_s) and c.decode_step_s(8) == pytest.approx(memory_s)
    assert c.decode_step_s(2000) == pytest.approx(2 * LLAMA3_8B.stored_in(1).weight_bytes_read_per_token * 2000 / (h100.bf16_dense_flops * 0.5))
    assert c.kv_bytes_per_token == 131_072


# ----------------------------------------------------------------------------- colocated, by hand


def test_one_request_alone_prefills_then_decodes_at_batch_one():
    (r,) = S.simulate_colocated([req(0, 1.0, 50, 5)], costs())
    assert r.ttft_s == pytest.approx(0.5) and r.start_s == 1.0
    assert r.token_s == pytest.approx([1.5, 1.55, 1.60, 1.65, 1.70])
    assert r.tpot_s == pytest.approx(0.05) and r.max_tbt_s == pytest.approx(0.05)


def test_two_requests_queue_for_one_row():
    a, b = S.simulate_colocated([req(0, 0.0, 50, 3), req(1, 0.0, 50, 3)], costs(), rows=1)
    assert a.token_s == pytest.approx([0.5, 0.55, 0.60])
    assert b.start_s == pytest.approx(0.60) and b.token_s == pytest.approx([1.1, 1.15, 1.20])


def test_two_rows_prefill_both_then_decode_both():
    a, b = S.simulate_colocated([req(0, 0.0, 50, 2), req(1, 0.0, 50, 2)], costs(), rows=2)
    assert a.token_s == pytest.approx([1.0, 1.06]) and b.token_s == pytest.approx([1.0, 1.06])  # one pass of 100


def test_chunked_prefill_bounds_the_gap_of_running_requests():
    c = costs(overhead=0.01)
    trace = [req(0, 0.0, 10, 60), req(1, 0.3, 400, 2)]
    whole = S.simulate_colocated(trace, c, rows=2)[0]
    chunked = S.simulate_colocated(trace, c, rows=2, token_budget=20)[0]
    assert whole.max_tbt_s >= 400 / c.prefill_rate_tok_s
    assert chunked.max_tbt_s <= 19 / c.prefill_rate_tok_s + c.decode_step_s(1) + 1e-12
    assert chunked.max_tbt_s < whole.max_tbt_s / 5


def test_arrivals_go_to_the_least_loaded_machine():
    trace = [req(0, 0.0, 50, 10), req(1, 0.0, 50, 10), req(2, 0.1, 50, 10)]
    res = S.simulate_colocated(trace, costs(), machines=2)
    assert [r.machine for r in res] == ["colocated 0", "colocated 1", "colocated 0"]
    assert res[0].ttft_s == res[1].ttft_s == pytest.approx(0.5)


# ----------------------------------------------------------------------------- disaggregated, by hand


def test_the_transfer_delays_the_second_token_not_the_first():
    c = costs()  # 1000 B of KV per token: 50 tokens = 50 kB
    (r,) = S.simulate_disaggregated([req(0, 0.0, 50, 3)], c, 1, 1, link_bytes_s=1e5, link_latency_s=0.1)
    assert r.ttft_s == pytest.approx(0.5)  # prefill only
    assert r.token_s == pytest.approx([0.5, 0.5 + 0.5 + 0.1 + 0.05, 1.15 + 0.05])
    assert r.machine == "decode 0"


def test_free_prefill_and_an_instant_link_leave_pure_decode():
    c = costs(rate=1e15)
    trace = [req(i, 0.0, 100, 20) for i in range(3)]
    res = S.simulate_disaggregated(trace, c, prefill_machines=3, decode_machines=1, rows=4, link_bytes_s=math.inf)
    for r in res:
        assert r.tpot_s == pytest.approx(c.decode_step_s(3)) and r.max_tbt_s == pytest.approx(c.decode_step_s(3))
        assert r.ttft_s == pytest.approx(100 / 1e15)


def test_the_prefill_pool_is_fifo_and_a_one_token_answer_never_leaves_it():
    trace = [req(0, 0.0, 50, 1), req(1, 0.0, 50, 4), req(2, 0.0, 50, 4)]
    res = S.simulate_disaggregated(trace, costs(), 1, 1, link_bytes_s=math.inf)
    assert [r.token_s[0] for r in res] == pytest.approx([0.5, 1.0, 1.5])
    assert res[0].machine == "prefill 0" and res[0].token_s == pytest.approx((0.5,))


# ----------------------------------------------------------------------------- invariants


def every_way(trace):
    c = costs(overhead=0.02)
    yield S.simulate_colocated(trace, c, machines=1, rows=4)
    yield S.simulate_colocated(trace, c, machines=3, rows=2, token_budget=16)
    yield S.simulate_disaggregated(trace, c, 2, 2, rows=3, link_bytes_s=1e6, link_latency_s=0.01)


def test_every_request_gets_exactly_its_tokens_in_order_after_it_arrived():
    trace = synthetic_trace(60, rate_per_s=5.0, prompt_tokens=(8, 200), output_tokens=(1, 30), seed=4)
    for results in every_way(trace):
        assert [r.request for r in results] == trace
        for r in results:
            assert len(r.token_s) == r.request.max_new_tokens
            assert r.request.arrival_s <= r.start_s < r.token_s[0]
            assert all(g > 0 for g in r.gaps_s)


def test_the_simulation_is_deterministic():
    trace = synthetic_trace(40, rate_per_s=8.0, prompt_tokens=(8, 200), output_tokens=(1, 30), seed=5)
    assert trace == synthetic_trace(40, rate_per_s=8.0, prompt_tokens=(8, 200), output_tokens=(1, 30), seed=5)
    times = lambda: [[(r.machine, r.start_s, r.token_s) for r in res] for res in every_way(trace)]
    assert times() == times()


# ----------------------------------------------------------------------------- goodput and the best split


def test_attainment_counts_only_requests_that_met_both_targets():
    r = Request.of_length(0, 0.0, 10, 3)
    results = [Sequence(r, [0] * 3, [0.5, 0.6, 0.7], 0.0),  # meets both
               Sequence(r, [0] * 3, [0.9, 0.95, 1.0], 0.0),  # meets both: TTFT exactly at the target
               Sequence(r, [0] * 3, [1.5, 1.6, 1.7], 0.0),  # TTFT too long
               Sequence(r, [0] * 3, [0.5, 1.0, 1.5], 0.0)]  # TPOT 0.5 too long
    a = S.attainment(results, ttft_slo_s=0.9, tpot_slo_s=0.1)
    assert (a.met, a.total, a.share) == (2, 4, 0.5)


def interference_trace():
    """Prompts of 1 s and 40-token answers, one every 1.2 s: a new prefill stalls a running decode."""
    return [req(i, 1.2 * i, 100, 40) for i in range(12)]


def test_best_split_is_disaggregated_when_prefill_stalls_decode():
    cmp = S.best_split(interference_trace(), costs(), 2, ttft_slo_s=2.0, tpot_slo_s=0.07)
    assert [s.label for s in cmp.splits] == ["2 colocated", "1 prefill + 1 decode"]
    assert cmp.best.label == "1 prefill + 1 decode" and cmp.best.attainment.share == 1
    assert cmp.colocated.attainment.met < cmp.colocated.attainment.total


def test_best_split_is_colocated_when_the_link_is_slow():
    cmp = S.best_split(interference_trace(), costs(), 3, ttft_slo_s=2.0, tpot_slo_s=0.07, token_budget=10,
                       link_latency_s=5.0)  # the second token waits 5 s: TPOT fails everywhere disaggregated
    assert cmp.best is cmp.colocated and all(s.attainment.met == 0 for s in cmp.splits[1:])
    assert len(cmp.splits) == 3 and cmp.colocated.attainment.share == 1


# ----------------------------------------------------------------------------- the simulator against served runs


def served(trace, step_costs: S.StepCosts, rows: int = 2, budget: int | None = 16):
    """A "measured" run: the serving core's loop on a clock that charges ``step_costs``; (sequences, its steps)."""
    loop = S.machine("served", step_costs, rows, max(r.prompt_tokens + r.max_new_tokens for r in trace), budget)
    seqs = {r.id: Sequence(r) for r in trace}
    for r in trace:
        loop.submit(seqs[r.id])
    loop.run_until()
    return [seqs[r.id] for r in trace], loop.scheduler.history


TRACE = [req(0, 0.0, 40, 6), req(1, 0.1, 30, 8), req(2, 0.15, 60, 4), req(3, 0.5, 20, 5)]


def test_a_loop_that_paid_half_again_per_step_is_found_and_simulated_exactly():
    timed = costs(overhead=0.01)
    runs = [(timed, *served(TRACE, timed.scaled(f))) for f in (1.5, 1.4, 1.6)]  # slower than the costs said
    v = S.validate_runs(TRACE, runs, rows=2, token_budget=16)
    assert v.loop_factors == pytest.approx((1.5, 1.4, 1.6))
    assert all(a.ratio == pytest.approx(1.0) for a in v.agreement)  # same schedule, same clock
    assert v.run_spread["makespan"] > 0 and v.sim_spread["makespan"] == pytest.approx(v.run_spread["makespan"])
    assert [t for s in v.simulated[0] for t in s.token_s] == pytest.approx([t for s in runs[0][1] for t in s.token_s])


def test_a_simulator_that_schedules_differently_still_disagrees():
    timed = costs(overhead=0.01)  # a second row adds a fifth to a decode step
    runs = [(timed, *served(TRACE, timed, rows=1))]  # served one at a time, simulated with 2 rows below
    tpot = {a.what: a for a in S.validate_runs(TRACE, runs, rows=2, token_budget=16).agreement}["mean TPOT"]
    assert tpot.ratio > 1.5  # 2 rows: another request's prompt chunks ride in each decode step and slow it


def test_loop_factor_needs_a_run_and_scaled_costs_scale_every_step():
    c = costs(overhead=0.01)
    with pytest.raises(WorkbookError):
        S.loop_factor(c, [])
    assert c.scaled(2).prefill_s(50) == pytest.approx(2 * c.prefill_s(50))
    assert c.scaled(2).decode_step_s(3) == pytest.approx(2 * c.decode_step_s(3))
    with pytest.raises(WorkbookError):
        c.scaled(0)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("call", [
    lambda: S.simulate_colocated([req(0, 0, 5, 5)], costs(), rows=0),
    lambda: S.simulate_colocated([req(0, 0, 5, 5)], costs(), machines=1.5),
    lambda: S.simulate_colocated([req(0, 0, 5, 5)], costs(), token_budget=-1),
    lambda: S.simulate_colocated([], costs()),
    lambda: S.simulate_colocated([req(0, 0, 5, 5), req(0, 1, 5, 5)], costs()),
    lambda: S.simulate_disaggregated([req(0, 0, 5, 5)], costs(), 0, 1),
    lambda: S.simulate_disaggregated([req(0, 0, 5, 5)], costs(), 1, 1, link_bytes_s=-1),
    lambda: S.simulate_disaggregated([req(0, 0, 5, 5)], costs(), 1, 1, link_latency_s=float("nan")),
    lambda: Request.of_length(0, 0.0, 0, 5),
    lambda: Request.of_length(0, -1.0, 5, 5),
    lambda: S.attainment([], 1, 1),
    lambda: S.attainment(S.simulate_colocated([req(0, 0, 5, 5)], costs()), 0, 1),
    lambda: S.best_split([req(0, 0, 5, 5)], costs(), 1, 1, 1),
    lambda: S.fit_costs([], [(1, 0.1)], 1),
    lambda: S.fit_costs([(10, 0.2), (100, 0.1)], [(1, 0.1)], 1),
    lambda: S.fit_costs([(10, 0.2)], [(1, 0.1), (1, 0.2)], 1),
    lambda: S.fit_costs([(10, 0.2)], [(1, 0.1)], 0),
    lambda: S.costs_from_accelerator(accelerator("H100"), LLAMA3_8B, efficiency=1.5),
    lambda: synthetic_trace(5, 1.0, (10, 5), (1, 2)),
    lambda: S.compare_with_measured(S.simulate_colocated([req(0, 0, 5, 5)], costs()), []),
])
def test_bad_input_is_a_clear_error(call):
    with pytest.raises(WorkbookError):
        call()


def test_goodput_sweep_names_the_best_split_and_the_sustained_load():
    sim = S
    costs = sim.fit_costs([(10, 0.01), (100, 0.1)], [(1, 0.02), (4, 0.02)], kv_bytes_per_token=1000)
    one = sim.capacity_per_machine(costs, 4, (50, 50), (10, 10))
    assert one == pytest.approx(1 / (costs.prefill_s(50) + 10 * 0.02 / 4))
    sweep = sim.goodput_sweep(costs, 3, 10.0, 10.0, prompt_tokens=(50, 50), output_tokens=(10, 10), rows=4,
                              n_requests=20, loads=(0.1, 0.2))
    assert sweep.rates == pytest.approx([0.1 * 3 * one, 0.2 * 3 * one])
    assert [cmp.colocated.attainment.share for cmp in sweep.table] == [1.0, 1.0]  # loose targets: all on time
    assert sweep.goodput(0) == pytest.approx(sweep.rates[-1])  # a lower bound: on time at every load tried
    assert sweep.label(0) == "3 colocated"
    assert list(sweep.goodputs()) == ["3 colocated", "1 prefill + 2 decode", "2 prefill + 1 decode"]
    tight = sim.goodput_sweep(costs, 3, 1e-6, 1e-6, prompt_tokens=(50, 50), output_tokens=(10, 10), rows=4,
                              n_requests=20, loads=(0.1,))
    assert tight.goodput(0) == 0.0  # no request can meet an impossible target


def test_goodput_is_the_load_where_attainment_falls_through_the_target():
    def at(prefill, shares):
        return S.Split(prefill, 2 - prefill, S.Attainment(round(shares * 100), 100))
    table = [S.SplitComparison([at(0, a), at(1, b)]) for a, b in ((1.0, 1.0), (0.95, 0.8), (0.5, 0.2))]
    sweep = S.Sweep([1.0, 2.0, 3.0], table)
    assert sweep.goodput(0) == pytest.approx(2.0 + (0.95 - 0.9) / (0.95 - 0.5))  # between 2 and 3 req/s
    assert sweep.goodput(1) == pytest.approx(1.0 + (1.0 - 0.9) / (1.0 - 0.8))  # between 1 and 2
    assert sweep.goodput(1, share=0.5) == pytest.approx(2.0 + (0.8 - 0.5) / (0.8 - 0.2))
    assert sweep.attainments(0) == [1.0, 0.95, 0.5]
    assert sweep.goodputs() == pytest.approx({"2 colocated": sweep.goodput(0), "1 prefill + 1 decode": sweep.goodput(1)})


def test_accelerator_decode_steps_read_every_rows_kv_cache():
    h100 = accelerator("H100")
    kv = LLAMA3_8B.kv_bytes_per_token
    weights = LLAMA3_8B.weight_bytes_read_per_token
    c = S.costs_from_accelerator(h100, LLAMA3_8B, efficiency=1.0, context_tokens=1000)
    for b in (1, 8, 64, 256):  # bandwidth-bound at 1k tokens: weights + every row's KV, read once per step
        assert c.decode_step_s(b) == pytest.approx((weights + b * 1000 * kv) / h100.bandwidth_bytes_s)
    assert 256 * 1000 * kv / weights > 2  # the figure: 256 rows of 1k tokens read 2.2x the weights
    flat = S.costs_from_accelerator(h100, LLAMA3_8B, efficiency=1.0)
    assert c.decode_step_s(256) > 3 * flat.decode_step_s(256) and c.prefill_s(1000) == flat.prefill_s(1000)
