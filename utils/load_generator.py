"""Load a real server with many requests: throughput, TTFT and time between tokens under load, goodput.

One request alone measures the engine's phases (:mod:`utils.openai_client`). A server is built
to serve many at once, and what a user sees then depends on the load. Two ways to make it:

- **closed loop, fixed concurrency** (:func:`run_concurrent`): ``N`` client threads, each sends the
  next request as soon as its last one finished, so ``N`` requests are always in flight. The
  server's batch holds up to ``N`` sequences: throughput grows with ``N`` (one read of the weights
  serves the whole batch, chapter 07 and the batching lab) while each user's gaps grow too.
  :func:`sweep_concurrency` runs several ``N``, interleaved.
- **open loop, arrival times** (:func:`run_arrivals`): each request is sent at its
  ``arrival_s`` (e.g. a Poisson process, :func:`utils.requests.poisson_arrivals`), whether or not
  the server kept up: past its capacity, the queue and TTFT grow without bound. This is how
  users arrive, and how serving benchmarks load a server.

Both replay :class:`utils.requests.Request` objects (their prompt token ids go to
``/completions`` as they are, so the server prefills exactly that many tokens; pass ``prompts``
to send text instead, or ``chat=True`` for ``/chat/completions``). The summary
(:class:`LoadSummary`) gives throughput (output tokens of the requests that finished / the run's
wall time), TTFT and time between tokens at p50 and p99, and **goodput**: the requests that met
both a TTFT target and a time-between-tokens target, per second and as a share of all the
requests. A request meets the time-between-tokens target by its mean time per output token after
the first (TPOT: time after the first token / tokens after it), as :func:`utils.simulator.goodput`
judges a simulated server, so the two are judged alike; p99 over every gap shows the stalls. TTFT is timed
from when the request was sent; in an open-loop run a request sent late (every thread busy) says so
in ``late_s``.

Every run is bounded: by its number of requests, and by ``deadline_s`` of wall time. A request
not sent by the deadline is reported as ``not run``; one still streaming at the deadline is cut
and counted as failed. A request that fails (see :class:`utils.openai_client.ServerError`) is
counted and its message kept; the run goes on.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from tqdm.auto import tqdm

from .errors import WorkbookError, check_count, check_number
from .openai_client import Client, ServerError, StreamResult
from .requests import Request, check_trace

OK, FAILED, NOT_RUN = "ok", "failed", "not run"


@dataclass(frozen=True)
class RequestOutcome:
    """What became of one request of a run: its result, or why it failed, or that it never ran.

    ``sent_s``: when it was sent, in seconds from the start of the run (nan if not run);
    ``late_s``: how long after its ``arrival_s`` that was (open loop only, else 0).
    """

    request: Request
    status: str  # OK, FAILED or NOT_RUN
    result: StreamResult | None = None
    error: str = ""
    kind: str = ""  # ServerError.kind
    sent_s: float = math.nan
    late_s: float = 0.0


@dataclass(frozen=True)
class LoadSummary:
    """What the server achieved over one run (seconds; p50/p99 over the requests that finished)."""

    requests: int
    ok: int
    failed: int
    not_run: int
    wall_s: float
    output_tokens: int
    throughput_tok_s: float  # output tokens of the finished requests / wall time
    ttft_p50_s: float
    ttft_p99_s: float
    tbt_p50_s: float  # over every gap between chunks of every finished request
    tbt_p99_s: float
    ttft_target_s: float
    tbt_target_s: float
    met_targets: int  # requests with TTFT <= target and mean time between tokens <= target
    goodput_per_s: float  # met_targets / wall time
    goodput_share: float  # met_targets / requests (failed and unrun ones count as missed)
    failures: dict[str, int]  # kind -> how many
    first_error: str  # the first failure's message ("" if none)

    def describe(self) -> str:
        """A few printable lines."""
        ms = lambda s: f"{1e3 * s:.1f} ms"  # noqa: E731
        lines = [f"{self.requests} requests: {self.ok} ok, {self.failed} failed, {self.not_run} not run, "
                 f"in {self.wall_s:.2f} s",
                 f"throughput {self.throughput_tok_s:.1f} output tok/s ({self.output_tokens} tokens)",
                 f"TTFT p50 {ms(self.ttft_p50_s)}, p99 {ms(self.ttft_p99_s)}; "
                 f"time between tokens p50 {ms(self.tbt_p50_s)}, p99 {ms(self.tbt_p99_s)}",
                 f"goodput {self.goodput_per_s:.2f} requests/s ({self.met_targets} of {self.requests}, "
                 f"{self.goodput_share:.0%}, met TTFT <= {ms(self.ttft_target_s)} and TBT <= {ms(self.tbt_target_s)})"]
        if self.failed:
            kinds = ", ".join(f"{k} {n}" for k, n in self.failures.items())
            lines.append(f"failures: {kinds}; first: {self.first_error}")
        return "\n".join(lines)


@dataclass(frozen=True)
class LoadRun:
    """One run: every request's outcome, in the order given, and their summary."""

    outcomes: list[RequestOutcome]
    summary: LoadSummary


# ----------------------------------------------------------------------------- the two ways to load a server


def run_concurrent(requests: Sequence[Request], concurrency: int, client: Client | None = None, *,
                   deadline_s: float = 300.0, ttft_target_s: float = 1.0, tbt_target_s: float = 0.1,
                   prompts: Sequence[str] | None = None, chat: bool = False, **params: Any) -> LoadRun:
    """Closed loop: ``concurrency`` threads, each sending the next request (in order) when its last one ended.

    ``params`` go to :meth:`Client.complete` (or :meth:`Client.chat`): ``tokenizer=`` to count tokens a server does
    not report, or keys of every request's body (e.g. ``ignore_eos=True`` on vLLM, for exact output lengths).
    """
    workers = check_count(concurrency, "concurrency")
    return _replay(requests, client, workers, False, deadline_s, (ttft_target_s, tbt_target_s), prompts, chat, params)


def run_arrivals(requests: Sequence[Request], client: Client | None = None, *, max_in_flight: int = 64,
                 deadline_s: float = 300.0, ttft_target_s: float = 1.0, tbt_target_s: float = 0.1,
                 prompts: Sequence[str] | None = None, chat: bool = False, **params: Any) -> LoadRun:
    """Open loop: each request sent at its ``arrival_s`` (from the start of the run), by up to
    ``max_in_flight`` threads; with every thread busy, the next request is sent late (``late_s``)."""
    workers = min(check_count(max_in_flight, "max_in_flight"), len(requests) or 1)
    return _replay(requests, client, workers, True, deadline_s, (ttft_target_s, tbt_target_s), prompts, chat, params)


def sweep_concurrency(requests: Sequence[Request], levels: Sequence[int], client: Client | None = None, *,
                      repeats: int = 1, progress: bool = True, **kwargs: Any) -> dict[int, list[LoadRun]]:
    """:func:`run_concurrent` at every concurrency in ``levels``, ``repeats`` rounds, interleaved (1, 2, 4, 1, 2,
    4, ...: a slow spell of the machine weighs on every level alike), with a progress bar unless ``progress=False``;
    ``kwargs`` as for :func:`run_concurrent`."""
    runs: dict[int, list[LoadRun]] = {check_count(c, "concurrency"): [] for c in levels}
    order = [c for _ in range(check_count(repeats, "repeats")) for c in runs]
    for c in tqdm(order, desc="clients", leave=False, disable=not progress):
        runs[c].append(run_concurrent(requests, c, client, **kwargs))
    return runs


# ----------------------------------------------------------------------------- the replay loop


def _replay(requests: Sequence[Request], client: Client | None, workers: int, timed: bool, deadline_s: float,
            targets: tuple[float, float], prompts: Sequence[str] | None, chat: bool, params: dict) -> LoadRun:
    """Run ``requests`` on ``workers`` threads until done or ``deadline_s``; outcomes and summary."""
    reqs = check_trace(requests)
    check_number(deadline_s, "deadline_s", "s")
    ttft_target, tbt_target = (check_number(t, name, "s") for t, name in zip(targets, ("ttft_target_s", "tbt_target_s")))
    if prompts is not None and len(prompts) != len(reqs):
        raise WorkbookError(f"prompts needs one text per request: {len(prompts)} for {len(reqs)} requests.")
    if chat and prompts is None:
        raise WorkbookError("A chat request needs text: pass prompts=[...] (one text per request).")
    client = client or Client()
    texts = dict(zip((r.id for r in reqs), prompts)) if prompts is not None else {}
    order = sorted(reqs, key=lambda r: r.arrival_s) if timed else reqs
    queue, done, taken, lock = deque(order), {}, set(), threading.Lock()
    start = time.perf_counter()
    stop = start + deadline_s

    def work() -> None:
        while True:
            with lock:
                if not queue:
                    return
                req = queue.popleft()
                taken.add(req.id)
            outcome = _send_one(client, req, texts.get(req.id), chat, params, start, stop, timed)
            with lock:
                done[req.id] = outcome

    threads = [threading.Thread(target=work, daemon=True, name=f"load-{i}") for i in range(workers)]
    for t in threads:
        t.start()
    give_up = stop + client.connect_timeout_s + 1.0  # every request gives up at ``stop``: slack to return
    for t in threads:
        t.join(max(give_up - time.perf_counter(), 0.0))
    wall = time.perf_counter() - start
    with lock:
        outcomes = [done.get(r.id) or _missing(r, r.id in taken) for r in reqs]
    return LoadRun(outcomes, summarize_run(outcomes, wall, ttft_target, tbt_target))


def _missing(req: Request, taken: bool) -> RequestOutcome:
    """A request with no outcome: never taken off the queue (not run), or stuck in a thread past the deadline."""
    if taken:
        return RequestOutcome(req, FAILED, error="still running well after the deadline", kind="deadline")
    return RequestOutcome(req, NOT_RUN, error="not sent before the deadline")


def _send_one(client: Client, req: Request, text: str | None, chat: bool, params: dict, start: float,
              stop: float, timed: bool) -> RequestOutcome:
    """Wait for the request's arrival (open loop), send it, and catch what fails; not run if ``stop`` comes first."""
    due = start + req.arrival_s if timed else time.perf_counter()
    if due >= stop:
        return _missing(req, taken=False)
    time.sleep(max(due - time.perf_counter(), 0.0))
    sent = time.perf_counter()
    if sent >= stop:
        return _missing(req, taken=False)
    prompt = text if text is not None else req.prompt
    try:
        send = client.chat if chat else client.complete
        result = send(prompt, req.max_new_tokens, deadline=stop, **params)
        return RequestOutcome(req, OK, result, sent_s=sent - start, late_s=sent - due)
    except ServerError as e:
        return RequestOutcome(req, FAILED, error=str(e), kind=e.kind, sent_s=sent - start, late_s=sent - due)
    except Exception as e:  # noqa: BLE001 -- one bad request must not stop the run
        return RequestOutcome(req, FAILED, error=f"{type(e).__name__}: {e}", kind="client",
                              sent_s=sent - start, late_s=sent - due)


# ----------------------------------------------------------------------------- the summary


def meets_targets(outcome: RequestOutcome, ttft_target_s: float, tbt_target_s: float) -> bool:
    """Finished, with ``TTFT <= ttft_target_s`` and its mean time between tokens (TPOT) ``<= tbt_target_s``."""
    r = outcome.result
    return outcome.status == OK and r is not None and r.ttft_s <= ttft_target_s and r.tpot_s <= tbt_target_s


def summarize_run(outcomes: Sequence[RequestOutcome], wall_s: float, ttft_target_s: float,
                  tbt_target_s: float) -> LoadSummary:
    """The :class:`LoadSummary` of a run's outcomes over ``wall_s`` seconds."""
    finished = [o.result for o in outcomes if o.status == OK and o.result is not None]
    failed = [o for o in outcomes if o.status == FAILED]
    ttft = [r.ttft_s for r in finished]
    gaps = [g for r in finished for g in r.gaps_s]
    tokens = sum(r.output_tokens for r in finished)
    met = sum(meets_targets(o, ttft_target_s, tbt_target_s) for o in outcomes)
    return LoadSummary(
        requests=len(outcomes), ok=len(finished), failed=len(failed),
        not_run=sum(o.status == NOT_RUN for o in outcomes), wall_s=wall_s, output_tokens=tokens,
        throughput_tok_s=tokens / wall_s if wall_s > 0 else math.nan,
        ttft_p50_s=_percentile(ttft, 50), ttft_p99_s=_percentile(ttft, 99),
        tbt_p50_s=_percentile(gaps, 50), tbt_p99_s=_percentile(gaps, 99),
        ttft_target_s=ttft_target_s, tbt_target_s=tbt_target_s, met_targets=met,
        goodput_per_s=met / wall_s if wall_s > 0 else math.nan,
        goodput_share=met / len(outcomes) if outcomes else math.nan,
        failures=dict(Counter(o.kind for o in failed)), first_error=min(failed, key=lambda o: o.sent_s).error if failed else "")


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def weight_read_gain(ttft_s: float, tbt_s: float, output_tokens: int, concurrency: int,
                     read_s: float | None = None) -> float:
    """Throughput at ``concurrency`` over throughput alone, **predicted** from a run alone by the weight-read model.

    Alone, each request takes ``TTFT + (n - 1) · TBT``. With ``c`` requests at once, their prompts prefilled
    together cost ``c`` times one (prefill is compute: ``c`` times the tokens), while a decode step of ``c`` rows
    shares one read of the weights among its rows: ``c · TTFT + (n - 1) · step(c)`` for ``c`` requests, with
    ``step(c) = read + c · (TBT - read)``. ``read_s`` is the weight read's share of a step alone (the weights'
    bytes over the measured bandwidth, at most ``TBT``); the rest of the step is each row's own work, done ``c``
    times. Without it the whole step is the read (``step(c) = TBT``). A measured gain below this says a step of
    ``c`` rows costs more than that.
    """
    c, n = check_count(concurrency, "concurrency"), check_count(output_tokens, "output_tokens")
    ttft, tbt = check_number(ttft_s, "ttft_s", "s"), check_number(tbt_s, "tbt_s", "s")
    read = tbt if read_s is None else min(check_number(read_s, "read_s", "s", allow_zero=True), tbt)
    return c * (ttft + (n - 1) * tbt) / (c * ttft + (n - 1) * (read + c * (tbt - read)))


def one_slot_ttft_ratio(ttft_s: float, tbt_s: float, output_tokens: int, concurrency: int, requests: int) -> float:
    """Median TTFT with one slot over median TTFT with ``concurrency`` slots, **predicted** from a run alone.

    The same closed loop in both (``concurrency`` clients, ``requests`` requests of ``output_tokens`` tokens). With
    one slot the server serves them in turn: each takes ``T = TTFT + (n - 1) · TBT`` as alone, and a request waits
    for every one ahead of it (:func:`_one_slot_ttfts`). With a slot per client nothing waits for a slot: the
    prompts that arrive together are prefilled in one pass, which costs ``concurrency`` times one prompt (prefill
    is compute), so the median TTFT is ``concurrency · TTFT``. The ratio holds whatever a decode step of many rows
    costs: it is about who waits, not how fast the batch runs.
    """
    c, n = check_count(concurrency, "concurrency"), check_count(output_tokens, "output_tokens")
    ttft, tbt = check_number(ttft_s, "ttft_s", "s"), check_number(tbt_s, "tbt_s", "s")
    queued = _one_slot_ttfts(ttft, ttft + (n - 1) * tbt, c, check_count(requests, "requests"))
    return float(np.median(queued)) / (min(c, requests) * ttft)


def _one_slot_ttfts(ttft_s: float, request_s: float, clients: int, requests: int) -> list[float]:
    """TTFT of each request, in order, when ``clients`` closed-loop clients share one slot: request ``k`` is sent
    when its client's last one ended, starts when the slot is free, and answers its first token ``ttft_s`` later."""
    sent, free, ttfts = [0.0] * min(clients, requests), 0.0, []
    for k in range(requests):
        start = max(sent[k], free)
        ttfts.append(start - sent[k] + ttft_s)
        free = start + request_s
        sent.append(free)  # the same client sends its next request, k + clients
    return ttfts
