"""Many requests at once: static batches, a continuous scheduler, chunked prefill.

Why batching pays: a decode step streams every weight from memory to make ONE token
per sequence. Run ``B`` sequences in the same step and the same weight read serves
``B`` tokens: the step's bytes barely change while its FLOPs grow ``B``-fold, so the
step time stays nearly flat until ``B`` reaches the ridge point
(:func:`utils.roofline.crossover_batch`) and aggregate tok/s grows almost ``B``-fold.

Two ways to fill the batch:

- **static**: gather up to ``B`` waiting requests, left-pad them into one batch, run it
  until its longest request is done, then take the next batch. A request that arrives
  meanwhile waits for the whole batch; a row that finished early idles.
- **continuous** (iteration-level scheduling, Orca, Yu et al. 2022): every step, admit
  waiting requests into free rows and retire finished ones. Rows start and finish at
  different times, so each row of the KV cache keeps its own length
  (:class:`RowCache`) and a decode step writes each row at its own slot.

A long prompt admitted whole stalls every running request for its whole prefill
(head-of-line blocking). **Chunked prefill** (SARATHI, Agrawal et al. 2023) admits it
``chunk`` tokens per iteration, between decode steps: the stall shrinks to one chunk,
the long prompt's own TTFT grows. (SARATHI also fuses the chunk into the decode
batch so both share one weight read; here they are two calls, one after the other.)

Time is an engine clock: the measured duration of each iteration (synchronized),
fast-forwarded to the next arrival when nothing is running, so a trace of arrivals
takes no longer to replay than its work. Generation ignores end-of-sequence here: each
request makes exactly its ``max_new_tokens`` (as serving benchmarks do), greedy.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from . import engine
from .errors import PromptTooLongError, WorkbookError, check_count, check_number
from .llama import KVCache, Llama
from .plotting import COLORS
from .timing import synchronize
from .tokens import filler_ids

# ----------------------------------------------------------------------------- requests and traces


@dataclass(frozen=True)
class Request:
    """One request of a trace: when it arrives, its prompt ids [T], how many tokens it wants."""

    id: int
    arrival_s: float
    prompt: Tensor
    max_new_tokens: int


def poisson_arrivals(n: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """``n`` arrival times (s) of a Poisson process: gaps drawn from Exp(rate), the first at 0."""
    check_count(n, "n")
    rate = check_number(rate_per_s, "rate_per_s", "requests per second")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def make_trace(tokenizer: Any, arrivals: Sequence[float], prompt_lens: Sequence[int],
               output_lens: Sequence[int], device: torch.device | str = "cpu") -> list[Request]:
    """Requests with English prompts of the given lengths (each from its own place in the text)."""
    if not len(arrivals) == len(prompt_lens) == len(output_lens):
        raise WorkbookError("arrivals, prompt_lens and output_lens must have one entry per request.")
    requests = []
    for i, (t, n_in, n_out) in enumerate(zip(arrivals, prompt_lens, output_lens)):
        offset = 23 * i  # a different stretch of prose for each request
        ids = filler_ids(tokenizer, offset + check_count(n_in, "prompt length"), device)[0, offset:]
        requests.append(Request(i, float(t), ids, check_count(n_out, "output length")))
    return requests


def left_pad(prompts: Sequence[Tensor], pad_id: int) -> tuple[Tensor, Tensor]:
    """Prompts [T_i] as one LEFT-padded batch: ids [B, T_max] and mask [B, T_max] (True = real token)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=prompts[0].device)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool, device=prompts[0].device)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = p
        mask[row, width - len(p):] = True
    return ids, mask


def padding_share(lengths: Sequence[int]) -> float:
    """Share of the positions of a left-padded batch that are padding: ``1 - sum(T_i) / (B x max T_i)``."""
    return 1.0 - sum(lengths) / (len(lengths) * max(lengths))


# ----------------------------------------------------------------------------- what happened to each request


class TokenTimes:
    """What a request's token times say: TTFT, latency, the gaps between tokens, TPOT.

    For anything with ``request.arrival_s`` and ``token_s`` (when each token existed): a request
    served here (:class:`Served`) or in the simulator (:class:`utils.simulator.SimResult`).
    """

    request: Any
    token_s: Sequence[float]

    @property
    def ttft_s(self) -> float:
        return self.token_s[0] - self.request.arrival_s

    @property
    def latency_s(self) -> float:
        """Arrival to last token."""
        return self.token_s[-1] - self.request.arrival_s

    @property
    def gaps_s(self) -> list[float]:
        """Time between consecutive tokens."""
        return list(np.diff(self.token_s))

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first: the mean gap (0 for a one-token answer)."""
        return (self.token_s[-1] - self.token_s[0]) / (len(self.token_s) - 1) if len(self.token_s) > 1 else 0.0

    @property
    def max_tbt_s(self) -> float:
        """The longest time between two of its tokens (0 for a one-token answer)."""
        return max(self.gaps_s, default=0.0)


@dataclass
class Served(TokenTimes):
    """One request as the engine served it (times in seconds on the engine clock)."""

    request: Request
    start_s: float = float("nan")  # its prefill began
    tokens: list[int] = field(default_factory=list)
    token_s: list[float] = field(default_factory=list)  # when each token existed

    def add(self, token: int, now: float) -> None:
        self.tokens.append(token)
        self.token_s.append(now)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.request.max_new_tokens


class Clock:
    """The engine clock: advances by the measured (synchronized) time of the work it runs."""

    def __init__(self, device: torch.device | str) -> None:
        self.device, self.now = device, 0.0

    def run(self, fn: Callable[[], Any]) -> Any:
        synchronize(self.device)
        start = time.perf_counter()
        out = fn()
        synchronize(self.device)
        self.now += time.perf_counter() - start
        return out

    def wait_for(self, t: float) -> None:
        """Nothing to do until ``t``: jump there."""
        self.now = max(self.now, t)


# ----------------------------------------------------------------------------- static batching


def serve_static(model: Any, trace: Sequence[Request], batch_size: int, pad_id: int = 0) -> list[Served]:
    """Serve ``trace`` in static batches of up to ``batch_size``, either backend; in request order.

    When the engine is free it takes every request that has arrived (up to ``batch_size``),
    left-pads them into one batch and decodes until the longest is done.
    """
    check_count(batch_size, "batch_size")
    pending = deque(sorted(trace, key=lambda r: r.arrival_s))
    served = {r.id: Served(r) for r in trace}
    clock = Clock(engine.device_of(model))
    while pending:
        clock.wait_for(pending[0].arrival_s)
        batch = [pending.popleft() for _ in range(batch_size) if pending and pending[0].arrival_s <= clock.now]
        _run_static_batch(model, [served[r.id] for r in batch], clock, pad_id)
    return [served[r.id] for r in trace]


@torch.inference_mode()
def _run_static_batch(model: Any, rows: list[Served], clock: Clock, pad_id: int) -> None:
    ids, mask = left_pad([s.request.prompt for s in rows], pad_id)
    steps = max(s.request.max_new_tokens for s in rows)
    cache = engine.new_cache(model, len(rows), ids.shape[1] + steps)
    for s in rows:
        s.start_s = clock.now
    logits = clock.run(lambda: engine.prefill(model, cache, ids, mask))
    for _ in range(steps):
        token = logits.argmax(dim=-1)
        for s, t in zip(rows, token.tolist()):
            if not s.done:
                s.add(t, clock.now)
        if all(s.done for s in rows):
            return
        logits = clock.run(lambda: engine.decode_one_token(model, cache, token))


# ----------------------------------------------------------------------------- a cache whose rows live their own lives


class RowCache:
    """A KV cache of ``rows`` rows, each holding one request with its own length.

    ``lengths[r]`` is how many slots row ``r`` has filled (0: free). A row is claimed
    when a request is admitted and released when it finishes; its memory is reused.
    """

    def __init__(self, model: Llama, rows: int, max_len: int) -> None:
        if not isinstance(model, Llama):
            raise WorkbookError("Continuous batching needs the hand-written model (utils.llama.Llama): "
                                "its cache lets every row sit at its own position.")
        self.cache: KVCache = model.new_cache(check_count(rows, "rows"), check_count(max_len, "max_len"))
        self.lengths = [0] * rows
        self.in_use = [False] * rows

    def claim(self) -> int | None:
        """The lowest free row, now in use (None if all are busy)."""
        for row, busy in enumerate(self.in_use):
            if not busy:
                self.in_use[row], self.lengths[row] = True, 0
                return row
        return None

    def release(self, row: int) -> None:
        self.in_use[row], self.lengths[row] = False, 0


@torch.inference_mode()
def prefill_row(model: Llama, rows: RowCache, row: int, ids: Tensor) -> Tensor:
    """Append prompt ``ids`` [T] to row ``row`` (its whole prompt, or the next chunk): logits [V].

    The first piece resets the row (a fresh request); later pieces extend it.
    """
    view = rows.cache.rows(row, row + 1)
    if rows.lengths[row] == 0:
        logits = engine.prefill(model, view, ids[None])
    else:
        view.length = rows.lengths[row]
        logits = engine.extend(model, view, ids[None], last_only=True)[:, -1]
    rows.lengths[row] = view.length
    return logits[0]


@torch.inference_mode()
def decode_rows(model: Llama, rows: RowCache, tokens: Sequence[int], decoding: Sequence[bool]) -> Tensor:
    """One decode step over rows ``0 .. len(tokens)-1``, each at its own slot: logits [n, V].

    Rows marked ``decoding`` advance by one; the others (free, or between prefill chunks)
    ride along on a dummy token whose K/V lands in a slot that their next write overwrites.
    """
    n = len(tokens)
    lengths = rows.lengths[:n]
    if max(lengths) >= rows.cache.max_len:
        raise PromptTooLongError(f"A row of the cache is full ({rows.cache.max_len} slots): "
                                 "make the RowCache as long as the longest prompt + output.")
    device = rows.cache.device
    slots = torch.tensor(lengths, device=device)[:, None]  # [n, 1]: each row its next slot
    ids = torch.tensor(list(tokens), device=device)[:, None]  # [n, 1]
    logits = model(ids, slots, rows.cache.rows(0, n), max(lengths) + 1)[:, -1]
    for row in range(n):
        rows.lengths[row] += int(decoding[row])
    return logits


# ----------------------------------------------------------------------------- continuous batching


@dataclass
class _Row:
    """A request in a row: how much of its prompt is in the cache, and its next input token."""

    served: Served
    prompt_done: int = 0
    next_token: int | None = None


def serve_continuous(model: Llama, trace: Sequence[Request], rows: int,
                     chunk: int | None = None) -> list[Served]:
    """Serve ``trace`` with iteration-level scheduling over ``rows`` cache rows; in request order.

    Each iteration: admit arrived requests into free rows; run prefill work (every new
    prompt whole, or with ``chunk``, at most ``chunk`` prompt tokens in all); then one
    decode step for every row that has a token to feed; retire finished requests.
    """
    max_len = max(len(r.prompt) + r.max_new_tokens for r in trace)
    cache, clock = RowCache(model, rows, max_len), Clock(model.device)
    pending = deque(sorted(trace, key=lambda r: r.arrival_s))
    served = {r.id: Served(r) for r in trace}
    running: dict[int, _Row] = {}
    while pending or running:
        if not running:
            clock.wait_for(pending[0].arrival_s)
        while pending and pending[0].arrival_s <= clock.now and (row := cache.claim()) is not None:
            running[row] = _Row(served[pending.popleft().id])
        _prefill_work(model, cache, running, clock, chunk)
        _decode_step(model, cache, running, clock)
        for row in [r for r, st in running.items() if st.served.done]:
            cache.release(row)
            del running[row]
    return [served[r.id] for r in trace]


def _prefill_work(model: Llama, cache: RowCache, running: dict[int, _Row], clock: Clock,
                  chunk: int | None) -> None:
    """Prefill the waiting prompts (oldest first), whole or within a budget of ``chunk`` tokens."""
    budget = chunk if chunk is not None else float("inf")
    waiting = sorted((st.served.request.arrival_s, row) for row, st in running.items() if st.next_token is None)
    for _, row in waiting:
        st = running[row]
        prompt = st.served.request.prompt
        take = int(min(budget, len(prompt) - st.prompt_done))
        if take <= 0:
            return
        if st.prompt_done == 0:
            st.served.start_s = clock.now
        piece = prompt[st.prompt_done:st.prompt_done + take]
        logits = clock.run(lambda: prefill_row(model, cache, row, piece))
        st.prompt_done, budget = st.prompt_done + take, budget - take
        if st.prompt_done == len(prompt):  # the prompt is in: its logits give the first token
            st.next_token = int(logits.argmax())
            st.served.add(st.next_token, clock.now)


def _decode_step(model: Llama, cache: RowCache, running: dict[int, _Row], clock: Clock) -> None:
    """One decode step for every row with a token to feed and tokens still to make."""
    active = {row for row, st in running.items() if st.next_token is not None and not st.served.done}
    if not active:
        return
    n = max(active) + 1  # decode rows 0..n-1 only: free rows above are skipped
    tokens = [running[r].next_token if r in active else 0 for r in range(n)]
    logits = clock.run(lambda: decode_rows(model, cache, tokens, [r in active for r in range(n)]))
    for row, token in zip(range(n), logits.argmax(dim=-1).tolist()):
        if row in active:
            running[row].next_token = token
            running[row].served.add(token, clock.now)


# ----------------------------------------------------------------------------- summaries and plots


@dataclass(frozen=True)
class TraceSummary:
    """What serving a trace achieved: throughput, latency, time to first token, time between tokens."""

    requests: int
    output_tokens: int
    makespan_s: float  # first arrival to last token
    throughput_tok_s: float  # output tokens / makespan
    mean_latency_s: float
    p95_latency_s: float
    mean_ttft_s: float
    p95_ttft_s: float
    p99_tbt_s: float  # time between tokens, over every request's gaps
    max_tbt_s: float
    per_user_tok_s: float  # mean over requests of (tokens after the first) / their decode time


def summarize(served: Sequence[Served]) -> TraceSummary:
    """The :class:`TraceSummary` of a served trace."""
    lat = [s.latency_s for s in served]
    ttft = [s.ttft_s for s in served]
    gaps = [g for s in served for g in s.gaps_s] or [0.0]
    out = sum(len(s.tokens) for s in served)
    span = max(s.token_s[-1] for s in served) - min(s.request.arrival_s for s in served)
    per_user = [(len(s.tokens) - 1) / (s.token_s[-1] - s.token_s[0]) for s in served if len(s.tokens) > 1]
    return TraceSummary(len(served), out, span, out / span, float(np.mean(lat)), float(np.percentile(lat, 95)),
                        float(np.mean(ttft)), float(np.percentile(ttft, 95)), float(np.percentile(gaps, 99)),
                        float(max(gaps)), float(np.mean(per_user)) if per_user else float("nan"))


def plot_timeline(ax: Any, served: Sequence[Served], title: str = "") -> None:
    """One row per request: waiting (grey), prefill (blue), decode (orange), on the engine clock."""
    for i, s in enumerate(served):
        arrive, start, first, last = s.request.arrival_s, s.start_s, s.token_s[0], s.token_s[-1]
        ax.barh(i, start - arrive, left=arrive, color="#d0d0d0", label="waiting" if i == 0 else None)
        ax.barh(i, first - start, left=start, color=COLORS["prefill"], label="prefill" if i == 0 else None)
        ax.barh(i, last - first, left=first, color=COLORS["decode"], label="decode" if i == 0 else None)
    ax.set(title=title, xlabel="engine clock (s)", ylabel="request")
    ax.invert_yaxis()
    ax.legend(loc="lower right")
