"""A discrete-event simulator of a serving cluster, fed with measured (or roofline) step costs.

One machine can be measured; a cluster of them cannot, here. So the chapter measures what
one step costs on this machine -- a prefill of ``n`` prompt tokens, one decode step over
``B`` rows -- and replays a trace of requests through a model of many machines that
charges exactly those costs. Nothing is run on a model: each machine is the serving core's
one loop (:class:`utils.scheduler.ServingLoop`, the same scheduler as the real engine) with
:class:`SimulatedExecutor`, whose steps cost what :class:`StepCosts` says instead of running.

**Colocated** serving (:func:`simulate_colocated`): every machine runs both phases. Each
iteration admits arrived requests (up to ``rows`` at once), feeds the decodes one token each
and the prompts whole or, with a ``token_budget``, in chunks of what the budget leaves. A long
prompt's prefill delays every running request's next token: prefill and decode *interfere*.
Chunked prefill (Sarathi, Agrawal et al. 2024) bounds that delay by one chunk.

**Disaggregated** serving (:func:`simulate_disaggregated`) puts the two phases on
separate machines: a prefill pool computes each prompt's KV cache and first token, the
cache moves over a link (``kv_bytes_per_token x prompt tokens / link bandwidth``), and
a decode pool makes the rest of the tokens. No prefill ever stalls a decode step, and
each pool can be sized (and on a real cluster, parallelised) for its own phase:
compute-bound prefill, bandwidth-bound decode. The price is the transfer and the
machines of one pool idling while the other is the bottleneck. Splitwise (Patel et al.
2024) and DistServe (Zhong et al. 2024) showed it pays when both a time-to-first-token
(TTFT) and a time-per-output-token (TPOT) target must hold.

A request is on time when it met both targets: ``TTFT <= ttft_slo_s`` and ``TPOT <= tpot_slo_s``,
with TPOT the mean time between its tokens; a run's **attainment** is the share on time
(:func:`attainment`). **Goodput** (DistServe's measure, :meth:`Sweep.goodput`) is the highest
offered load at which a target share (90%) of requests is on time. Throughput rewards a server
that makes tokens too late to be useful; goodput does not. :func:`best_split` tries every split
of ``N`` machines into prefill and decode pools against ``N`` colocated ones at one load;
:func:`goodput_sweep` at several.

The costs (:class:`StepCosts`) come from measurements (:func:`fit_costs`: chapter 03's prefill
fit, decode interpolated over the measured batch curve, made non-decreasing) or from an
accelerator's datasheet (:func:`costs_from_accelerator`: roofline times, each row's KV reads
at a given context included). A measured decode step's cost depends on the batch only: its
growth with the context is left out, and so is any contention on the link. Times are seconds; the simulation is
deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from tqdm.auto import tqdm

from . import roofline
from .blocks import BlockManager
from .errors import WorkbookError, check_count, check_number
from .requests import Request, Sequence as Seq, check_trace, synthetic_trace
from .scheduler import Policy, Scheduler, ServingLoop, Step
from .shapes import ModelShape
from .plotting import COLORS, finish, new_axes, plot_measured

# ----------------------------------------------------------------------------- what a step costs


@dataclass(frozen=True)
class StepCosts:
    """What one step costs on one machine: prefill of ``n`` tokens, a decode step over ``B`` rows.

    Prefill: ``prefill_overhead_s + n / prefill_rate_tok_s + n(n+1)/2 x prefill_pair_s`` (chapter 03's
    fit, :func:`utils.roofline.fit_prefill_time`; the attention term only when fitted). Decode: linear interpolation
    over the curve (``decode_batches``, ``decode_step_times_s``), flat below its first
    point and extended along its last segment (never downwards) beyond its last.
    """

    prefill_overhead_s: float
    prefill_rate_tok_s: float
    decode_batches: tuple[float, ...]
    decode_step_times_s: tuple[float, ...]
    kv_bytes_per_token: float
    label: str = ""
    prefill_pair_s: float = 0.0

    def prefill_s(self, n_tokens: int) -> float:
        """Seconds to prefill ``n_tokens`` prompt tokens (one call)."""
        n = check_count(n_tokens, "n_tokens")
        return self.prefill_overhead_s + n / self.prefill_rate_tok_s + n * (n + 1) / 2 * self.prefill_pair_s

    def decode_step_s(self, batch: int) -> float:
        """Seconds of one decode step over ``batch`` rows (each makes one token)."""
        b = check_count(batch, "batch")
        xs, ys = self.decode_batches, self.decode_step_times_s
        if len(xs) == 1 or b <= xs[0]:
            return ys[0]
        i = min(int(np.searchsorted(xs, b)), len(xs) - 1)  # the segment (xs[i-1], xs[i]]
        slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
        if b > xs[-1]:
            slope = max(slope, 0.0)
        return ys[i] + slope * (b - xs[i])

    def prefill_tok_s(self, n_tokens: int) -> float:
        """Prefill speed at a prompt of ``n_tokens``: ``n / prefill_s(n)``."""
        return n_tokens / self.prefill_s(n_tokens)

    def decode_tok_s(self, batch: int) -> float:
        """Aggregate decode speed at ``batch`` rows: ``batch / decode_step_s(batch)``."""
        return batch / self.decode_step_s(batch)

    def scaled(self, factor: float) -> "StepCosts":
        """Every step ``factor`` times as long (e.g. the costs as a served loop paid them: :func:`loop_factor`)."""
        f = check_number(factor, "factor")
        return StepCosts(self.prefill_overhead_s * f, self.prefill_rate_tok_s / f, self.decode_batches,
                         tuple(t * f for t in self.decode_step_times_s), self.kv_bytes_per_token, self.label,
                         self.prefill_pair_s * f)

    def step_s(self, step: Step, mixed: bool = True) -> float:
        """Seconds of one iteration: prompt chunks (``n > 1``) and decode tokens (``n == 1``).

        ``mixed``: one pass, the decode step plus the chunks' tokens at the prefill rate (they share
        its weight read); else each chunk's own prefill, then the decode step.
        """
        chunks = [n for _, n in step.work if n > 1]
        batch = len(step.work) - len(chunks)
        if not batch:
            return self.prefill_s(sum(chunks)) if mixed else sum(self.prefill_s(n) for n in chunks)
        if mixed:
            return self.decode_step_s(batch) + sum(chunks) / self.prefill_rate_tok_s
        return sum(self.prefill_s(n) for n in chunks) + self.decode_step_s(batch)


def fit_costs(prefill_points: Sequence[tuple[int, float]], decode_points: Sequence[tuple[int, float]],
              kv_bytes_per_token: float, label: str = "measured") -> StepCosts:
    """:class:`StepCosts` from measurements: [(prompt tokens, prefill s)], [(batch, s per decode step)].

    Prefill: chapter 03's fit (:func:`utils.roofline.fit_prefill_time`: least squares on the relative
    error, every term >= 0; attention's quadratic term from 4 distinct lengths up).
    Decode: the measured curve, interpolated between its points and made non-decreasing: a step over
    more rows never costs less than one over fewer, so where noise (a preempted step) says otherwise
    the points are pooled to their mean (:func:`non_decreasing`).
    """
    if not prefill_points or not decode_points:
        raise WorkbookError("fit_costs needs at least one prefill point and one decode point.")
    fit = roofline.fit_prefill_time([n for n, _ in prefill_points], [t for _, t in prefill_points])
    curve = sorted((check_count(b, "decode batch"), check_number(t, "decode step seconds", "s"))
                   for b, t in decode_points)
    if len({b for b, _ in curve}) != len(curve):
        raise WorkbookError(f"decode_points has a batch size twice: {curve}.")
    kv = check_number(kv_bytes_per_token, "kv_bytes_per_token", "bytes per token")
    return StepCosts(fit.fixed_s, fit.rate_tok_s, tuple(float(b) for b, _ in curve),
                     non_decreasing([t for _, t in curve]), kv, label, fit.per_pair_s)


def fit_noise(costs: StepCosts, prefill_points: Sequence[tuple[int, float]],
              decode_points: Sequence[tuple[int, float]]) -> float:
    """How far the points ``costs`` were fitted to stray from the fit: the std of measured / fitted, at least 5%."""
    ratios = ([s / costs.prefill_s(n) for n, s in prefill_points]
              + [s / costs.decode_step_s(b) for b, s in decode_points])
    return max(0.05, float(np.std(ratios)))


def loop_factor(costs: StepCosts, steps: Sequence[Step], mixed: bool = True) -> float:
    """What a served loop paid for its steps over what ``costs`` predicts for the same steps.

    ``steps``: a scheduler's history after serving (each step's ``seconds`` set by the loop). Above 1
    when the loop runs slower than the steps timed back to back, e.g. another program wakes the
    CPU's threads between steps; a simulator fed ``costs.scaled(factor)`` then predicts the queueing
    of that run, not the machine's load.
    """
    ran = [s for s in steps if s.work]
    if not ran or any(math.isnan(s.seconds) for s in ran):
        raise WorkbookError("loop_factor needs the steps of a served run (a scheduler's history after serve).")
    return float(sum(s.seconds for s in ran) / sum(costs.step_s(s, mixed) for s in ran))


def non_decreasing(ys: Sequence[float]) -> tuple[float, ...]:
    """``ys`` made non-decreasing by pooling adjacent violators: each run of points that falls is replaced
    by its mean (the least-squares non-decreasing fit). ``[9, 5, 8] -> (7, 7, 8)``."""
    pools: list[tuple[float, int]] = []  # (sum, count), their means non-decreasing
    for y in ys:
        total, count = float(y), 1
        while pools and pools[-1][0] / pools[-1][1] > total / count:
            s, c = pools.pop()
            total, count = total + s, count + c
        pools.append((total, count))
    return tuple(total / count for total, count in pools for _ in range(count))


def costs_from_accelerator(acc: Any, shape: ModelShape, efficiency: float = 0.5,
                           context_tokens: int = 0) -> StepCosts:
    """:class:`StepCosts` at an accelerator's roofline, reached at ``efficiency`` (0 < e <= 1).

    Prefill: compute-bound, ``2 x prefill params x n / (FLOP/s x e)`` (:meth:`~utils.shapes.ModelShape.prefill_params`:
    the LM head runs on the last position only). A decode step over ``B`` rows, each
    with ``context_tokens`` in its KV cache: ``max((weight bytes + B x context x KV bytes per token)
    / bandwidth, 2 x params read x B / FLOP/s) / e`` -- both terms linear in ``B``, so the curve is exact
    at its kink (the crossover batch) and beyond. ``context_tokens=0`` leaves the KV reads out.
    Weights and KV at the shape's own bytes per parameter (``shape.stored_in(1)`` for int8).
    """
    e = check_number(efficiency, "efficiency")
    if e > 1:
        raise WorkbookError(f"efficiency is a share of the peak, at most 1, got {efficiency!r}.")
    flops, bw = acc.bf16_dense_flops, acc.bandwidth_bytes_s
    kv = shape.kv_bytes_per_token
    weights_s = shape.weight_bytes_read_per_token / bw
    kv_s_per_row = check_count(context_tokens, "context_tokens", allow_zero=True) * kv / bw
    compute_s_per_row = 2.0 * shape.stored_in(1).weight_bytes_read_per_token / flops  # 2 FLOP per weight read
    gap = compute_s_per_row - kv_s_per_row  # how much faster compute grows with B than the KV reads
    crossover = weights_s / gap if gap > 0 else 1.0
    batches = (1.0, crossover, 2 * crossover) if crossover > 1 else (1.0, 2.0)
    steps = tuple(max(weights_s + kv_s_per_row * b, compute_s_per_row * b) / e for b in batches)
    rate = roofline.prefill_ceiling_tok_s(flops, shape.prefill_params()) * e
    at = f", {context_tokens:,}-token contexts" if context_tokens else ""
    return StepCosts(0.0, rate, batches, steps, kv, f"{shape.name} on {acc.name} at {e:.0%} of peak{at}")


# ----------------------------------------------------------------------------- the simulated executor


class SimulatedExecutor:
    """An executor that runs nothing: each step costs what :class:`StepCosts` says (tokens are 0)."""

    def __init__(self, costs: StepCosts, mixed: bool = True) -> None:
        self.costs, self.mixed = costs, mixed

    def execute(self, step: Step) -> tuple[list[int | None], float]:
        return [0] * len(step.work), self.costs.step_s(step, self.mixed)


def machine(name: str, costs: StepCosts, rows: int, max_len: int, token_budget: int | None = None,
            mixed: bool = True, policy: Policy | None = None) -> ServingLoop:
    """One simulated machine: ``rows`` sequences at once, each reserving ``max_len`` slots (a contiguous cache)."""
    scheduler = Scheduler(BlockManager(rows, max_len), rows, token_budget, policy=policy)
    return ServingLoop(scheduler, SimulatedExecutor(costs, mixed), name)


def _dispatch(seqs: Sequence[tuple[float, Seq]], machines: list[ServingLoop]) -> None:
    """Give each sequence (in order of readiness) to the machine with the fewest requests in it; run all."""
    for ready, seq in seqs:
        for m in machines:
            m.run_until(ready)  # bring every machine up to the moment the request appears
        _, target = min((m.load(ready), i) for i, m in enumerate(machines))
        machines[target].submit(seq, ready)
    for m in machines:
        m.run_until()


def _max_len(reqs: Sequence[Request]) -> int:
    return max(r.prompt_tokens + r.max_new_tokens for r in reqs)


# ----------------------------------------------------------------------------- the two ways to serve


def simulate_colocated(requests: Sequence[Request], costs: StepCosts, machines: int = 1, rows: int = 16,
                       token_budget: int | None = None, mixed: bool = True, policy: Policy | None = None) -> list[Seq]:
    """Serve ``requests`` on ``machines`` that each run both phases; results in request order.

    Each machine is the serving core's loop (:class:`utils.scheduler.ServingLoop`) over ``rows``
    rows with :class:`SimulatedExecutor`: the same schedule as :func:`utils.batching.serve_continuous`
    on a clock that charges :meth:`StepCosts.step_s`. Each arrival goes to the machine with the
    fewest requests in it (ties: lowest index). ``policy``: the scheduler's (default FCFS, decodes first).
    """
    reqs = check_trace(requests)
    rows, n = check_count(rows, "rows"), check_count(machines, "machines")
    pool = [machine(f"colocated {i}", costs, rows, _max_len(reqs), token_budget, mixed, policy) for i in range(n)]
    seqs = {r.id: Seq(r) for r in reqs}
    _dispatch(sorted(((r.arrival_s, seqs[r.id]) for r in reqs), key=lambda x: x[0]), pool)
    return [seqs[r.id] for r in reqs]


def kv_transfer_s(costs: StepCosts, prompt_tokens: int, link_bytes_s: float, link_latency_s: float = 0.0) -> float:
    """Seconds to move a prompt's KV cache: ``kv_bytes_per_token x prompt / link + latency``.

    ``link_bytes_s=math.inf`` is an instant link (only the latency remains).
    """
    latency = check_number(link_latency_s, "link_latency_s", "s", allow_zero=True)
    if link_bytes_s == math.inf:
        return latency
    link = check_number(link_bytes_s, "link_bytes_s", "bytes per second")
    return costs.kv_bytes_per_token * check_count(prompt_tokens, "prompt_tokens") / link + latency


def _prefill_pool(seqs: Sequence[Seq], costs: StepCosts, machines: int) -> None:
    """Prefill each sequence FIFO (by arrival) on the first free prefill machine (ties: lowest index).

    Not a batching loop: a prefill machine runs one prompt at a time. Its first token exists when the
    prefill ends (the token itself is a placeholder: nothing runs)."""
    free_at = [0.0] * check_count(machines, "prefill_machines")
    for seq in sorted(seqs, key=lambda s: s.request.arrival_s):
        start, i = min((max(t, seq.request.arrival_s), i) for i, t in enumerate(free_at))
        free_at[i] = start + costs.prefill_s(seq.request.prompt_tokens)
        seq.start_s, seq.num_computed, seq.machine = start, seq.request.prompt_tokens, f"prefill {i}"
        seq.add(0, free_at[i])


def simulate_disaggregated(requests: Sequence[Request], costs: StepCosts, prefill_machines: int,
                           decode_machines: int, rows: int = 16, link_bytes_s: float = 50e9,
                           link_latency_s: float = 0.0) -> list[Seq]:
    """Serve ``requests`` on a prefill pool and a decode pool; results in request order.

    Prefill machines take prompts FIFO, one at a time (``prefill_s(prompt)`` each); the first
    token exists when its prefill ends. The KV cache then moves over the link
    (:func:`kv_transfer_s`; transfers do not slow each other), and the request joins the decode
    machine with the fewest requests in it: the same loop as :func:`simulate_colocated`, whose
    sequences arrive with their prompt computed, so they only decode. The second token pays for
    the transfer, the first does not. A one-token request never leaves prefill. The default link
    is 50 GB/s (a 400 Gb/s network).
    """
    reqs = check_trace(requests)
    rows = check_count(rows, "rows")
    n_decode = check_count(decode_machines, "decode_machines")
    pool = [machine(f"decode {i}", costs, rows, _max_len(reqs)) for i in range(n_decode)]
    seqs = {r.id: Seq(r) for r in reqs}
    _prefill_pool(list(seqs.values()), costs, prefill_machines)
    ready = [(s.token_s[0] + kv_transfer_s(costs, s.request.prompt_tokens, link_bytes_s, link_latency_s), s)
             for s in seqs.values() if not s.done]
    _dispatch(sorted(ready, key=lambda x: (x[0], x[1].request.arrival_s)), pool)
    return [seqs[r.id] for r in reqs]


# ----------------------------------------------------------------------------- goodput and the best split


@dataclass(frozen=True)
class Attainment:
    """How many requests of one run met both targets (TTFT and TPOT), of how many: its SLO attainment.

    A run's attainment is not its goodput: **goodput** is a rate, the highest offered load at which
    a target share of requests still meets both (DistServe's measure, :meth:`Sweep.goodput`).
    """

    met: int
    total: int

    @property
    def share(self) -> float:
        """Share of the requests that met both targets."""
        return self.met / self.total


def meets_slo(result: Seq, ttft_slo_s: float, tpot_slo_s: float) -> bool:
    """``TTFT <= ttft_slo_s`` and ``TPOT`` (mean time between its tokens) ``<= tpot_slo_s``."""
    return result.ttft_s <= ttft_slo_s and result.tpot_s <= tpot_slo_s


def attainment(results: Sequence[Seq], ttft_slo_s: float, tpot_slo_s: float) -> Attainment:
    """The requests of one run that met both targets (:class:`Attainment`)."""
    if not results:
        raise WorkbookError("attainment needs at least one result.")
    ttft, tpot = check_number(ttft_slo_s, "ttft_slo_s", "s"), check_number(tpot_slo_s, "tpot_slo_s", "s")
    return Attainment(sum(meets_slo(r, ttft, tpot) for r in results), len(results))


@dataclass(frozen=True)
class Split:
    """One way to use the machines: ``prefill_machines == 0`` means all colocated."""

    prefill_machines: int
    decode_machines: int
    attainment: Attainment

    @property
    def label(self) -> str:
        if self.prefill_machines == 0:
            return f"{self.decode_machines} colocated"
        return f"{self.prefill_machines} prefill + {self.decode_machines} decode"


@dataclass(frozen=True)
class SplitComparison:
    """Every split of ``N`` machines at one load, the colocated ``N`` first, and the best by attainment."""

    splits: list[Split]

    @property
    def colocated(self) -> Split:
        return self.splits[0]

    @property
    def best(self) -> Split:
        """The most requests on time (a tie goes to the earlier: colocated, then fewer prefill machines)."""
        return max(self.splits, key=lambda s: (s.attainment.met, -self.splits.index(s)))


def best_split(requests: Sequence[Request], costs: StepCosts, n_machines: int, ttft_slo_s: float,
               tpot_slo_s: float, rows: int = 16, token_budget: int | None = None, link_bytes_s: float = 50e9,
               link_latency_s: float = 0.0) -> SplitComparison:
    """Attainment of ``n_machines`` colocated (with ``token_budget``) and of every prefill/decode split of them."""
    n = check_count(n_machines, "n_machines")
    if n < 2:
        raise WorkbookError(f"Splitting needs at least 2 machines (one per pool), got {n}.")
    one = simulate_colocated(requests, costs, n, rows, token_budget)
    splits = [Split(0, n, attainment(one, ttft_slo_s, tpot_slo_s))]
    for p in range(1, n):
        res = simulate_disaggregated(requests, costs, p, n - p, rows, link_bytes_s, link_latency_s)
        splits.append(Split(p, n - p, attainment(res, ttft_slo_s, tpot_slo_s)))
    return SplitComparison(splits)


def capacity_per_machine(costs: StepCosts, rows: int, prompt_tokens: tuple[int, int],
                         output_tokens: tuple[int, int]) -> float:
    """Rough requests/s one machine sustains: a mean prompt's prefill plus its share of full-batch decode steps."""
    mean_prompt, mean_output = sum(prompt_tokens) / 2, sum(output_tokens) / 2
    per_request = costs.prefill_s(int(mean_prompt)) + mean_output * costs.decode_step_s(rows) / rows
    return 1.0 / per_request


@dataclass(frozen=True)
class Sweep:
    """Every split of ``N`` machines at each offered load (requests/s, rising)."""

    rates: list[float]
    table: list[SplitComparison]

    def attainments(self, k: int) -> list[float]:
        """Share of requests on time for split ``k`` (0 = colocated) at each load."""
        return [cmp.splits[k].attainment.share for cmp in self.table]

    def goodput(self, k: int, share: float = 0.9) -> float:
        """Split ``k``'s goodput: the highest offered load at which ``share`` of requests meet both targets.

        DistServe's measure. Between two loads tried, where the attainment falls through ``share``, the
        rate is interpolated linearly; 0.0 when even the lowest load misses it, the highest load tried
        when none does (a lower bound then).
        """
        target = check_number(share, "share")
        a = self.attainments(k)
        if a[0] < target:
            return 0.0
        i = next((i for i, x in enumerate(a) if x < target), None)
        if i is None:
            return self.rates[-1]
        r0, r1, a0, a1 = self.rates[i - 1], self.rates[i], a[i - 1], a[i]
        return r0 + (a0 - target) / (a0 - a1) * (r1 - r0)

    def goodputs(self, share: float = 0.9) -> dict[str, float]:
        """Every split's goodput (:meth:`goodput`), by label, colocated first."""
        return {self.label(k): self.goodput(k, share) for k in range(len(self.table[0].splits))}

    def label(self, k: int) -> str:
        return self.table[0].splits[k].label


def goodput_sweep(costs: StepCosts, n_machines: int, ttft_slo_s: float, tpot_slo_s: float, *,
                  prompt_tokens: tuple[int, int], output_tokens: tuple[int, int], rows: int = 16,
                  token_budget: int | None = None, link_bytes_s: float = 50e9, n_requests: int = 200,
                  loads: Sequence[float] = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5), seed: int = 7) -> Sweep:
    """:func:`best_split` at loads of ``loads x`` the rough capacity of ``n_machines`` (one seeded trace each)."""
    unit = n_machines * capacity_per_machine(costs, rows, prompt_tokens, output_tokens)
    rates = [f * unit for f in loads]
    table = [best_split(synthetic_trace(n_requests, r, prompt_tokens, output_tokens, seed=seed), costs, n_machines,
                        ttft_slo_s, tpot_slo_s, rows=rows, token_budget=token_budget, link_bytes_s=link_bytes_s)
             for r in tqdm(rates, desc="offered loads", leave=False)]
    return Sweep(rates, table)


def plot_attainment(sweep: Sweep, title: str, share: float = 0.9) -> None:
    """Share of requests on time against offered load, one line per split; where each crosses ``share``
    is its goodput (DistServe's figure)."""
    fig, ax = new_axes(title, "offered load (requests/s)", "requests meeting both targets (share)")
    for k in range(len(sweep.table[0].splits)):
        if k == 0:
            plot_measured(ax, sweep.rates, sweep.attainments(0), label=f"{sweep.label(0)} (chunked prefill)",
                          color=COLORS["prefill"])
        else:
            ax.plot(sweep.rates, sweep.attainments(k), "s-", alpha=0.7, label=sweep.label(k))
    ax.axhline(share, ls=":", color=COLORS["ceiling"], label=f"target: {share:.0%} on time")
    finish(fig)


# ----------------------------------------------------------------------------- the simulator against the real loop


@dataclass(frozen=True)
class Agreement:
    """One figure of a trace, simulated against measured."""

    what: str
    simulated_s: float
    measured_s: float

    @property
    def ratio(self) -> float:
        """simulated / measured."""
        return self.simulated_s / self.measured_s

    def __str__(self) -> str:
        return (f"{self.what:<24} simulated {self.simulated_s:8.3f} s, measured {self.measured_s:8.3f} s "
                f"({self.ratio - 1:+.0%})")


def _trace_figures(items: Sequence[Any]) -> dict[str, float]:
    """Mean latency, mean TTFT, mean TPOT and makespan of anything with ``.request.arrival_s`` and ``.token_s``."""
    arrive = [s.request.arrival_s for s in items]
    first, last = [s.token_s[0] for s in items], [s.token_s[-1] for s in items]
    tpot = [(s.token_s[-1] - s.token_s[0]) / (len(s.token_s) - 1) for s in items if len(s.token_s) > 1]
    return {"mean latency": float(np.mean(np.subtract(last, arrive))),
            "mean TTFT": float(np.mean(np.subtract(first, arrive))),
            "mean TPOT": float(np.mean(tpot)) if tpot else 0.0,
            "makespan": max(last) - min(arrive)}


def compare_with_measured(simulated: Sequence[Seq], measured: Sequence[Seq]) -> list[Agreement]:
    """The simulator's figures of a trace against the measured run of the same trace."""
    if len(simulated) != len(measured):
        raise WorkbookError(f"{len(simulated)} simulated results against {len(measured)} measured ones: "
                            "simulate the same trace  that was served.")
    sim, real = _trace_figures(simulated), _trace_figures(measured)
    return [Agreement(k, sim[k], real[k]) for k in sim]


@dataclass(frozen=True)
class Validation:
    """The simulator against served runs of one trace: per figure, medians over the runs and their spreads."""

    agreement: list[Agreement]  # median simulated against median measured, per figure
    sim_spread: dict[str, float]  # how far each simulated figure moves between the runs' cost timings
    run_spread: dict[str, float]  # how far each measured figure moves between the runs
    loop_factors: tuple[float, ...]  # per run: what its loop paid per step over the costs timed before it
    simulated: list[list[Seq]]  # per run


def validate_runs(trace: Sequence[Request], runs: Sequence[tuple[StepCosts, Sequence[Seq], Sequence[Step]]],
                  rows: int, token_budget: int | None = None) -> Validation:
    """Simulate ``trace`` once per served run and compare: ``runs`` holds (the step costs timed just before
    the run, its sequences, its scheduler's history).

    Each simulation is fed its costs scaled by its run's :func:`loop_factor`, so that it predicts the
    queueing of that run (who waits, for how many steps) and not how slow the machine was meanwhile.
    """
    if not runs:
        raise WorkbookError("validate_runs needs at least one served run.")
    factors = tuple(loop_factor(costs, history) for costs, _, history in runs)
    sims = [simulate_colocated(trace, costs.scaled(f), rows=rows, token_budget=token_budget)
            for (costs, _, _), f in zip(runs, factors)]
    pairs = [compare_with_measured(sim, seqs) for sim, (_, seqs, _) in zip(sims, runs)]  # [run][figure]
    figures = [a.what for a in pairs[0]]
    sim_s = {f: [p[i].simulated_s for p in pairs] for i, f in enumerate(figures)}
    run_s = {f: [p[i].measured_s for p in pairs] for i, f in enumerate(figures)}
    return Validation([Agreement(f, float(np.median(sim_s[f])), float(np.median(run_s[f]))) for f in figures],
                      {f: _relative_spread(x) for f, x in sim_s.items()}, {f: _relative_spread(x) for f, x in run_s.items()},
                      factors, sims)


def _relative_spread(xs: Sequence[float]) -> float:
    """Interquartile range over median, as :attr:`utils.timing.Timing.relative_spread` (which needs torch)."""
    q1, mid, q3 = np.percentile(xs, [25, 50, 75])
    return float((q3 - q1) / mid) if mid > 0 else 0.0
