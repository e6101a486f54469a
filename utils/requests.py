"""What a server knows about each request, without torch: requests, sequences, token times, traces.

A **request** is what a user sends: a prompt (token ids), how many tokens it wants, when it
arrived. A **sequence** is the request inside the server (nano-vllm's ``Sequence``, vLLM's
``Request``): its tokens so far, when each one existed, where its K/V lives (a block
table), and one number that drives everything the scheduler does:

    ``num_computed``: how many of its tokens (prompt + generated) have K/V in the cache.

Every iteration a sequence is fed ``n`` of its tokens that are not computed yet, starting at
position ``num_computed``. A prefill feeds the prompt (whole, or one chunk of it); a decode
step feeds the one token it generated last. Both are the same operation, so one batch can
hold both (a *mixed batch*). When ``num_computed`` reaches the number of tokens it has, the
logits of its last position give the next token. A sequence **preempted** for lack of KV
memory drops its cache (``num_computed = 0``) and later recomputes prompt + tokens in one
prefill: it still makes exactly the tokens it would have made (vLLM's *recompute*).

Times are seconds on an engine clock (measured or simulated); :class:`TokenTimes` reads
TTFT, latency, the gaps between tokens and TPOT off any object with ``request.arrival_s``
and ``token_s``. Nothing here imports torch: the simulator uses the same classes.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from .errors import WorkbookError, check_count, check_number


@dataclass(frozen=True)
class Request:
    """One request: its id, when it arrives (s), its prompt token ids, how many tokens it makes."""

    id: int
    arrival_s: float
    prompt: tuple[int, ...]
    max_new_tokens: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        check_number(self.arrival_s, "arrival_s", "s", allow_zero=True)
        check_count(len(self.prompt), "prompt length")
        check_count(self.max_new_tokens, "max_new_tokens")

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @classmethod
    def of_length(cls, id: int, arrival_s: float, prompt_tokens: int, max_new_tokens: int) -> "Request":
        """A request known by its lengths only (the simulator's): placeholder prompt ids, all 0."""
        return cls(id, arrival_s, (0,) * check_count(prompt_tokens, "prompt_tokens"), max_new_tokens)


class TokenTimes:
    """What a request's token times say: TTFT, latency, the gaps between tokens, TPOT, the worst gap."""

    request: Request
    token_s: list[float]

    @property
    def ttft_s(self) -> float:
        return self.token_s[0] - self.request.arrival_s

    @property
    def latency_s(self) -> float:
        """Arrival to last token."""
        return self.token_s[-1] - self.request.arrival_s

    @property
    def finish_s(self) -> float:
        return self.token_s[-1]

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


class Status(enum.Enum):
    WAITING = "waiting"  # arrived, not admitted (or preempted)
    RUNNING = "running"  # admitted: it holds KV memory
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence(TokenTimes):
    """A request inside the server: its tokens, their times, its place in the KV cache, its status."""

    request: Request
    tokens: list[int] = field(default_factory=list)  # generated so far
    token_s: list[float] = field(default_factory=list)  # when each existed
    start_s: float = math.nan  # its first prefill began
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose K/V is in the cache
    num_cached: int = 0  # of the prompt, tokens found in the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    preemptions: int = 0
    machine: str = ""  # where it ran (the simulator's clusters)

    @property
    def id(self) -> int:
        return self.request.id

    @property
    def num_tokens(self) -> int:
        return self.request.prompt_tokens + len(self.tokens)

    @property
    def to_compute(self) -> int:
        """Tokens still to feed before it can make its next one (1 while decoding)."""
        return self.num_tokens - self.num_computed

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.request.max_new_tokens

    def ids(self, start: int, stop: int) -> list[int]:
        """Token ids at positions ``start .. stop-1`` of prompt + generated tokens."""
        p = self.request.prompt
        return [*p[start:stop], *self.tokens[max(start - len(p), 0):max(stop - len(p), 0)]]

    def add(self, token: int, now: float) -> None:
        self.tokens.append(int(token))
        self.token_s.append(now)


# ----------------------------------------------------------------------------- arrivals and traces


def poisson_arrivals(n: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """``n`` arrival times (s) of a Poisson process: gaps drawn from Exp(rate), the first at 0."""
    check_count(n, "n")
    rate = check_number(rate_per_s, "rate_per_s", "requests per second")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def synthetic_trace(n: int, rate_per_s: float, prompt_tokens: tuple[int, int], output_tokens: tuple[int, int],
                    seed: int = 0) -> list[Request]:
    """``n`` length-only requests arriving as a Poisson process, lengths uniform in the (low, high) ranges."""
    rng = np.random.default_rng(seed)
    lengths = []
    for lo, hi in (prompt_tokens, output_tokens):
        if check_count(lo, "shortest length") > check_count(hi, "longest length"):
            raise WorkbookError(f"A length range must be (low, high) with low <= high, got {(lo, hi)}.")
        lengths.append(rng.integers(lo, hi + 1, size=n).tolist())
    arrivals = poisson_arrivals(n, rate_per_s, seed)
    return [Request.of_length(i, t, p, o) for i, (t, p, o) in enumerate(zip(arrivals, *lengths))]


def check_trace(trace: Iterable[Request]) -> list[Request]:
    """The trace as a list: non-empty, every item a :class:`Request`, every id once."""
    reqs = list(trace)
    if not reqs or not all(isinstance(r, Request) for r in reqs):
        raise WorkbookError("A trace is a non-empty list of Request (see make_trace, synthetic_trace).")
    if len({r.id for r in reqs}) != len(reqs):
        raise WorkbookError("Every request of a trace needs its own id.")
    return reqs
