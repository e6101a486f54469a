"""Many requests at once: static batches, and continuous batching on the serving core.

Why batching pays: a decode step streams every weight from memory to make ONE token
per sequence. Run ``B`` sequences in the same step and the same weight read serves
``B`` tokens: the step's bytes barely change while its FLOPs grow ``B``-fold, so the
step time stays nearly flat until ``B`` reaches the ridge point
(:func:`utils.roofline.crossover_batch`) and aggregate tok/s grows almost ``B``-fold.

Two ways to fill the batch:

- **static** (:func:`serve_static`): gather up to ``B`` waiting requests, left-pad them into
  one batch, run it until its longest request is done, then take the next batch. A request
  that arrives meanwhile waits for the whole batch; a row that finished early idles.
- **continuous** (:func:`serve_continuous`; iteration-level scheduling, Orca, Yu et al. 2022):
  every iteration, admit waiting requests and retire finished ones. This is the serving core's
  one loop (:mod:`utils.scheduler`) over a contiguous cache of ``rows`` rows
  (:func:`utils.executors.row_server`).

A long prompt admitted whole stalls every running request for its whole prefill
(head-of-line blocking). **Chunked prefill** (SARATHI, Agrawal et al. 2023) gives each
iteration a token budget: the decodes take one token each and the prompt the rest, so
the stall shrinks to one chunk, and the chunk rides in the same forward pass as the
decodes (a mixed batch, :mod:`utils.executors`): they share one read of the weights.
:func:`mixed_step_costs` measures what that sharing saves.

Time is an engine clock: the measured duration of each iteration (synchronized),
fast-forwarded to the next arrival when nothing is running, so a trace of arrivals
takes no longer to replay than its work. Generation ignores end-of-sequence here: each
request makes exactly its ``max_new_tokens`` (as serving benchmarks do), greedy.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from . import engine
from .blocks import BlockManager
from .errors import WorkbookError, check_count
from .executors import KVPool, row_server, run_packed
from .llama import Llama
from .plotting import COLORS
from .requests import Request, Sequence as Seq, poisson_arrivals  # poisson_arrivals: re-exported
from .scheduler import serve
from .timing import Timing, interleaved, synchronize
from .tokens import filler_ids

__all__ = ["make_trace", "left_pad", "Clock", "serve_static", "serve_continuous", "MixedCost", "mixed_step_costs",
           "TraceSummary", "summarize", "plot_timeline", "Request", "poisson_arrivals"]

# ----------------------------------------------------------------------------- traces and padding


def make_trace(tokenizer: Any, arrivals: Sequence[float], prompt_lens: Sequence[int],
               output_lens: Sequence[int]) -> list[Request]:
    """Requests with English prompts of the given lengths (each from its own place in the text)."""
    if not len(arrivals) == len(prompt_lens) == len(output_lens):
        raise WorkbookError("arrivals, prompt_lens and output_lens must have one entry per request.")
    requests = []
    for i, (t, n_in, n_out) in enumerate(zip(arrivals, prompt_lens, output_lens)):
        offset = 23 * i  # a different stretch of prose for each request
        ids = filler_ids(tokenizer, offset + check_count(n_in, "prompt length"))[0, offset:]
        requests.append(Request(i, float(t), tuple(ids.tolist()), check_count(n_out, "output length")))
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


# ----------------------------------------------------------------------------- static batching


class Clock:
    """The engine clock of static batching: advances by the measured (synchronized) time of the work it runs."""

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


def serve_static(model: Any, trace: Sequence[Request], batch_size: int, pad_id: int = 0) -> list[Seq]:
    """Serve ``trace`` in static batches of up to ``batch_size``, either backend; in request order.

    When the engine is free it takes every request that has arrived (up to ``batch_size``),
    left-pads them into one batch and decodes until the longest is done.
    """
    check_count(batch_size, "batch_size")
    pending = deque(sorted(trace, key=lambda r: r.arrival_s))
    served = {r.id: Seq(r) for r in trace}
    clock = Clock(engine.device_of(model))
    while pending:
        clock.wait_for(pending[0].arrival_s)
        batch = [pending.popleft() for _ in range(batch_size) if pending and pending[0].arrival_s <= clock.now]
        _run_static_batch(model, [served[r.id] for r in batch], clock, pad_id)
    return [served[r.id] for r in trace]


@torch.inference_mode()
def _run_static_batch(model: Any, rows: list[Seq], clock: Clock, pad_id: int) -> None:
    device = engine.device_of(model)
    ids, mask = left_pad([torch.tensor(s.request.prompt, device=device) for s in rows], pad_id)
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


# ----------------------------------------------------------------------------- continuous batching


def serve_continuous(model: Llama, trace: Sequence[Request], rows: int, token_budget: int | None = None,
                     mixed: bool = True, decode_first: bool = True) -> list[Seq]:
    """Serve ``trace`` on the serving core over a contiguous cache of ``rows`` rows; in request order.

    ``token_budget``: tokens per iteration (decodes 1 each, prompts in chunks of what is left);
    None: every prompt whole. ``mixed``: chunks ride in the decode step's forward pass.
    """
    max_len = max(r.prompt_tokens + r.max_new_tokens for r in trace)
    scheduler, executor = row_server(model, rows, max_len, token_budget, mixed, decode_first)
    return serve(trace, scheduler, executor)


# ----------------------------------------------------------------------------- what a chunk costs in the decode step


@dataclass(frozen=True)
class MixedCost:
    """A decode step of ``batch`` sequences with a ``chunk``-token prompt piece: one pass or two."""

    chunk: int
    batch: int
    mixed: Timing  # one forward pass: the chunk rides with the decodes
    separate: Timing  # the chunk's pass, then the decode pass
    chunk_alone: Timing
    decode_alone: Timing

    @property
    def saved_s(self) -> float:
        """What riding along saves: separate - mixed (median seconds)."""
        return self.separate.median - self.mixed.median


def mixed_step_costs(model: Llama, prompts: Sequence[Sequence[int]], chunks: Sequence[int], context: int,
                     repeats: int = 5) -> list[MixedCost]:
    """Time, per ``c`` in ``chunks``: a decode step over ``prompts`` (each ``context`` tokens in) with ``c``
    tokens of a new prompt riding along, against the chunk and the decode step as two passes (interleaved)."""
    n_blocks = len(prompts) + 1
    pool, blocks = KVPool(model, n_blocks, context + max(chunks) + 1), BlockManager(n_blocks, context + max(chunks) + 1)
    running = [Seq(Request(i, 0.0, tuple(p[:context]), 2)) for i, p in enumerate(prompts)]
    newcomer = Seq(Request(len(prompts), 0.0, tuple(prompts[0][:1]) * (max(chunks) + 1), 1))
    for seq in [*running, newcomer]:
        blocks.grow(seq, seq.request.prompt_tokens)
    with torch.inference_mode():
        for seq in running:  # fill their caches: from here on each feeds its last prompt token
            run_packed(model, pool, [(seq, context - 1)])
            seq.num_computed = context - 1
    decodes = [(s, 1) for s in running]
    out = []
    for c in tqdm(chunks, desc="chunk sizes", leave=False):
        piece = [(newcomer, c)]
        t = interleaved({"mixed": lambda: run_packed(model, pool, decodes + piece),
                         "separate": lambda: (run_packed(model, pool, piece), run_packed(model, pool, decodes)),
                         "chunk": lambda: run_packed(model, pool, piece),
                         "decode": lambda: run_packed(model, pool, decodes)},
                        repeats=repeats, warmup=1, device=model.device, desc=f"chunk {c}")
        out.append(MixedCost(c, len(running), t["mixed"], t["separate"], t["chunk"], t["decode"]))
    return out


def packed_step_costs(model: Llama, token: int, prompt_lens: Sequence[int], batches: Sequence[int], context: int,
                      repeats: int = 3) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """What the serving loop's steps cost, timed through the executor it runs (:func:`run_packed`), interleaved:
    ``[(prompt tokens, seconds of that prefill pass)]`` and ``[(batch, seconds of a decode step at context)]``,
    the points :func:`utils.simulator.fit_costs` fits. ``token`` fills the prompts (speed does not depend on it)."""
    n, length = max(batches) + 1, max(max(prompt_lens), context) + 1
    pool, blocks = KVPool(model, n, length), BlockManager(n, length)
    seqs = [Seq(Request(i, 0.0, (token,) * length, 1)) for i in range(n)]
    for seq in seqs:
        blocks.grow(seq, length)
    with torch.inference_mode():
        for seq in seqs[1:]:  # fill their caches; from here on each feeds its token at ``context``
            run_packed(model, pool, [(seq, context)])
            seq.num_computed = context
        fns = {("prefill", p): (lambda p=p: run_packed(model, pool, [(seqs[0], p)])) for p in prompt_lens}
        fns |= {("decode", b): (lambda b=b: run_packed(model, pool, [(s, 1) for s in seqs[1:b + 1]])) for b in batches}
        t = interleaved(fns, repeats=repeats, warmup=1, device=model.device, desc="step costs")
    return ([(p, t["prefill", p].median) for p in prompt_lens], [(b, t["decode", b].median) for b in batches])


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


def summarize(served: Sequence[Seq]) -> TraceSummary:
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


def plot_timeline(ax: Any, served: Sequence[Seq], title: str = "") -> None:
    """One row per request: waiting (grey), prefill (blue), decode (orange), on the engine clock."""
    for i, s in enumerate(served):
        arrive, start, first, last = s.request.arrival_s, s.start_s, s.token_s[0], s.token_s[-1]
        ax.barh(i, start - arrive, left=arrive, color="#d0d0d0", label="waiting" if i == 0 else None)
        ax.barh(i, first - start, left=start, color=COLORS["prefill"], label="prefill" if i == 0 else None)
        ax.barh(i, last - first, left=first, color=COLORS["decode"], label="decode" if i == 0 else None)
    ax.set(title=title, xlabel="engine clock (s)", ylabel="request")
    ax.invert_yaxis()
    ax.legend(loc="lower right")
