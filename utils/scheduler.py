"""The scheduler and the serving loop: written once, for the real engine and for the simulator.

**Continuous batching** (iteration-level scheduling, Orca, Yu et al. 2022): every iteration the
server decides again which sequences run. One iteration of :class:`ServingLoop`:

1. requests that have arrived join the waiting queue (nothing running: the clock jumps to the
   next arrival);
2. the :class:`Scheduler` plans the iteration (a :class:`Step`): which sequences run and how
   many tokens each feeds. Its **policy** spends a per-iteration **token budget** (vLLM's
   ``max_num_batched_tokens``): a decode costs 1 token, a prompt as many as it feeds, so a long
   prompt is cut into chunks (**chunked prefill**, SARATHI, Agrawal et al. 2023). Decode-first
   (Sarathi-Serve's stall-free batching) gives the running decodes their tokens first and the
   prompts what is left; prefill-first the other way round. Admission is first come, first
   served, up to ``max_seqs`` sequences at once;
3. memory: each planned sequence must fit its new tokens in the KV cache
   (:class:`utils.blocks.BlockManager`). A waiting one that does not fit waits (and so does
   everyone behind it: FCFS). A running one that does not fit **preempts** the most recently
   admitted running sequence (its blocks are freed and it goes back to the front of the
   queue, to be recomputed later: vLLM's default);
4. an **executor** runs the step (one forward pass, or the chunks and the decodes as separate
   calls) and reports the next token of every sequence whose tokens are all computed, and the
   seconds it took; the clock advances by them;
5. finished sequences retire and free their blocks.

Executors (the one interface below, :class:`Executor`): :class:`utils.executors.ModelExecutor`
runs the hand-written model over contiguous rows or paged blocks;
:class:`utils.simulator.SimulatedExecutor` charges measured step costs and runs nothing.
Since the scheduler decides from the trace, the clock and the memory only, the simulator
replays the engine's schedule exactly when its clock charges the same times.

Nothing here imports torch.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from .blocks import BlockManager
from .errors import PromptTooLongError, WorkbookError, check_count
from .requests import Request, Sequence, Status, check_trace

Plan = list[tuple[Sequence, int]]
"""A policy's answer: (sequence, tokens it feeds this iteration), in batch order."""


@dataclass
class Step:
    """One iteration: what runs (each sequence and how many tokens it feeds), who was admitted, preempted."""

    work: Plan = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    seconds: float = math.nan  # what the executor says the step took (set once it has run)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.work)

    def record(self) -> tuple:
        """A comparable summary: (admitted ids, ((id, tokens), ...), preempted ids)."""
        return tuple(self.admitted), tuple((s.id, n) for s, n in self.work), tuple(self.preempted)


class Executor(Protocol):
    """What runs a :class:`Step`. ``execute`` feeds each ``(seq, n)`` of ``step.work`` its tokens at
    positions ``seq.num_computed .. + n - 1`` (K/V written into ``seq.block_table``'s blocks) and
    returns, per item, the next token where that completes the sequence's tokens (else None), and
    the seconds the step took. It must not change the sequences: the scheduler does."""

    def execute(self, step: Step) -> tuple[list[int | None], float]: ...


# ----------------------------------------------------------------------------- the policy


def fcfs(running: list[Sequence], waiting: list[Sequence], budget: int | None, max_seqs: int,
         decode_first: bool = True) -> Plan:
    """First come, first served within a token budget (``None``: unlimited, every prompt whole).

    Decodes (sequences with 1 token to feed) and prompts (running ones first, then the waiting
    queue in order, while fewer than ``max_seqs`` run) each take what the budget still allows.
    """
    left = math.inf if budget is None else budget
    decodes = [s for s in running if s.to_compute == 1]
    prompts = [s for s in running if s.to_compute > 1] + waiting[:max(0, max_seqs - len(running))]
    plan: Plan = []
    for group in ([decodes, prompts] if decode_first else [prompts, decodes]):
        for s in group:
            n = int(min(s.to_compute, left))
            if n <= 0:
                break
            plan.append((s, n))
            left -= n
    return plan


Policy = Callable[[list[Sequence], list[Sequence], "int | None", int], Plan]


# ----------------------------------------------------------------------------- the scheduler


class Scheduler:
    """Admission, the token budget, the decode set, preemption and retirement, over a :class:`BlockManager`."""

    def __init__(self, blocks: BlockManager, max_seqs: int, token_budget: int | None = None,
                 decode_first: bool = True, policy: Policy | None = None) -> None:
        self.blocks, self.max_seqs = blocks, check_count(max_seqs, "max_seqs")
        self.token_budget = None if token_budget is None else check_count(token_budget, "token_budget")
        self.policy: Policy = policy or (lambda r, w, b, m: fcfs(r, w, b, m, decode_first))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.history: list[Step] = []

    def add(self, seq: Sequence) -> None:
        """A request has arrived: it waits for admission."""
        need = seq.request.prompt_tokens + seq.request.max_new_tokens - 1
        if -(-need // self.blocks.block_size) > self.blocks.n_blocks:
            raise PromptTooLongError(f"Request {seq.id} needs {need} tokens of KV cache; the cache holds "
                                     f"{self.blocks.capacity_tokens} ({self.blocks.n_blocks} blocks of "
                                     f"{self.blocks.block_size}).")
        self.waiting.append(seq)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Step:
        """Plan one iteration: the policy's plan, kept within memory (admitting, preempting)."""
        step = Step()
        for seq, n in self.policy(list(self.running), list(self.waiting), self.token_budget, self.max_seqs):
            if seq.status is Status.WAITING and seq.id in step.preempted:
                continue  # preempted in this very step: it waits
            if seq.status is Status.WAITING and not self._admit(seq, step):
                break  # FCFS: no one overtakes the head of the queue
            n = min(n, seq.to_compute)  # a prefix-cache hit may have computed part of it
            if n > 0 and self._make_room(seq, n, step):
                self.blocks.grow(seq, n)
                step.work.append((seq, n))
        self.history.append(step)
        return step

    def _admit(self, seq: Sequence, step: Step) -> bool:
        if len(self.running) >= self.max_seqs or seq is not self.waiting[0]:
            return False
        self.blocks.admit(seq)
        if not self.blocks.can_grow(seq, min(seq.to_compute, self.token_budget or seq.to_compute)):
            self.blocks.release(seq)
            return False
        self.waiting.popleft()
        seq.status = Status.RUNNING
        self.running.append(seq)
        step.admitted.append(seq.id)
        return True

    def _make_room(self, seq: Sequence, n: int, step: Step) -> bool:
        """Preempt the newest running sequences until ``seq`` fits ``n`` more tokens (False: ``seq`` itself went)."""
        while not self.blocks.can_grow(seq, n):
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, step: Step) -> None:
        self.running.remove(seq)
        step.work = [(s, n) for s, n in step.work if s is not seq]
        self.blocks.release(seq)
        seq.status, seq.preemptions = Status.WAITING, seq.preemptions + 1
        self.waiting.appendleft(seq)
        step.preempted.append(seq.id)

    def update(self, step: Step, tokens: list[int | None], now: float) -> None:
        """After the executor ran ``step``: advance each sequence, add its new token, retire the finished."""
        for (seq, n), token in zip(step.work, tokens):
            old, seq.num_computed = seq.num_computed, seq.num_computed + n
            self.blocks.computed(seq, old)
            if seq.to_compute == 0:
                seq.add(token, now)
        for seq in [s for s in self.running if s.done]:
            self.running.remove(seq)
            self.blocks.release(seq)
            seq.status = Status.FINISHED


# ----------------------------------------------------------------------------- the loop


class ServingLoop:
    """One server: a scheduler, an executor and a clock; requests are handed to it as they arrive."""

    def __init__(self, scheduler: Scheduler, executor: Executor, name: str = "") -> None:
        self.scheduler, self.executor, self.name = scheduler, executor, name
        self.clock = 0.0
        self.arrivals: deque[Sequence] = deque()  # given to it, not yet arrived (in order of arrival)
        self.seqs: list[Sequence] = []
        self._ready: dict[int, float] = {}  # id(seq) -> when it may be admitted

    def submit(self, seq: Sequence, ready_s: float | None = None) -> None:
        """Hand it ``seq``, which it may admit from ``ready_s`` on (default: its arrival)."""
        seq.machine = self.name
        self.seqs.append(seq)
        self.arrivals.append(seq)
        self._ready[id(seq)] = seq.request.arrival_s if ready_s is None else ready_s

    def load(self, t: float) -> int:
        """Sequences in it at time ``t``: not finished by then."""
        return sum(1 for s in self.seqs if not (s.status is Status.FINISHED and s.finish_s <= t))

    def next_start(self) -> float:
        """When its next iteration begins: now, or (nothing to do) when the next request is ready."""
        if self.scheduler.busy:
            return self.clock
        return max(self.clock, self._ready[id(self.arrivals[0])]) if self.arrivals else math.inf

    def iterate(self) -> Step:
        """One iteration: take arrivals, schedule, execute, advance the clock, update the sequences."""
        self.clock = self.next_start()
        while self.arrivals and self._ready[id(self.arrivals[0])] <= self.clock:
            self.scheduler.add(self.arrivals.popleft())
        step = self.scheduler.schedule()
        if not step.work:
            raise WorkbookError("The scheduler planned nothing while requests wait: a policy must schedule "
                                "at least one token per iteration (is the token budget 0?).")
        for seq, _ in step.work:
            if math.isnan(seq.start_s):
                seq.start_s = self.clock
        tokens, step.seconds = self.executor.execute(step)
        self.clock += step.seconds
        self.scheduler.update(step, tokens, self.clock)
        return step

    def run_until(self, t: float = math.inf) -> None:
        """Run every iteration that begins before ``t``."""
        while self.next_start() < t:
            self.iterate()


def serve(trace: Iterable[Request], scheduler: Scheduler, executor: Executor) -> list[Sequence]:
    """Serve ``trace`` on one server; its sequences in the trace's order (``scheduler.history``: the schedule)."""
    reqs = check_trace(trace)
    loop = ServingLoop(scheduler, executor)
    seqs = {r.id: Sequence(r) for r in reqs}
    for r in sorted(reqs, key=lambda r: r.arrival_s):
        loop.submit(seqs[r.id])
    loop.run_until()
    return [seqs[r.id] for r in reqs]


# ----------------------------------------------------------------------------- auditing a policy


class PolicyError(WorkbookError):
    """A policy broke a rule of the schedule; the message names the request and the iteration."""


class AuditedPolicy:
    """Wraps a policy and checks every plan it makes: the budget, the seats, FCFS, and starvation.

    ``patience``: iterations a running or admitted-able request may go without any token fed
    while others are fed, before it counts as starved.
    """

    def __init__(self, policy: Policy, patience: int = 64) -> None:
        self.policy, self.patience = policy, patience
        self.iteration = 0
        self.idle: dict[int, int] = {}  # request id -> iterations in a row without a token fed

    def __call__(self, running: list[Sequence], waiting: list[Sequence], budget: int | None, max_seqs: int) -> Plan:
        self.iteration += 1
        plan = list(self.policy(list(running), list(waiting), budget, max_seqs))
        it = f"iteration {self.iteration}"
        fed = {s.id: n for s, n in plan}
        if budget is not None and sum(fed.values()) > budget:
            raise PolicyError(f"{it}: the plan feeds {sum(fed.values())} tokens, over the budget of {budget} "
                              f"({[(s.id, n) for s, n in plan]}).")
        for s, n in plan:
            if s not in running and s not in waiting:
                raise PolicyError(f"{it}: request {s.id} is neither running nor waiting.")
            if not 0 < n <= s.to_compute:
                raise PolicyError(f"{it}: request {s.id} is fed {n} tokens; it has {s.to_compute} to feed.")
        admitted = [s for s in waiting if s.id in fed]
        if admitted != waiting[:len(admitted)]:
            raise PolicyError(f"{it}: admits {[s.id for s in admitted]} ahead of request {waiting[0].id}, "
                              "which waited longer (first come, first served).")
        if len(running) + len(admitted) > max_seqs:
            raise PolicyError(f"{it}: {len(running) + len(admitted)} sequences would run; at most {max_seqs} may.")
        self._starvation(running + waiting[:max(0, max_seqs - len(running))], fed, it)
        return plan

    def _starvation(self, eligible: list[Sequence], fed: dict[int, int], it: str) -> None:
        for s in eligible:
            self.idle[s.id] = 0 if s.id in fed else self.idle.get(s.id, 0) + 1
            if self.idle[s.id] > self.patience and fed:
                raise PolicyError(f"{it}: request {s.id} is starved: no token fed for {self.idle[s.id]} "
                                  f"iterations while others ran ({sorted(fed)}).")
