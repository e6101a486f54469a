"""The serving core: every executor gives every request its tokens alone; engine and simulator schedule alike."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from utils import engine as E
from utils import llama as L
from utils import simulator as S
from utils.blocks import BlockManager
from utils.errors import PromptTooLongError, WorkbookError
from utils.executors import KVPool, ModelExecutor, paged_server, row_server
from utils.requests import Request, Sequence, poisson_arrivals
from utils.scheduler import Scheduler, fcfs, serve

from test_llama import tiny


def random_trace(n: int = 8, seed: int = 3, rate: float = 2000.0, vocab: int = 96) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 40, (n,), generator=g).tolist()
    outs = torch.randint(1, 12, (n,), generator=g).tolist()
    return [Request(i, t, torch.randint(1, vocab, (p,), generator=g).tolist(), o)
            for i, (t, p, o) in enumerate(zip(poisson_arrivals(n, rate, seed=seed), lens, outs))]


def alone(model, trace) -> dict[int, list[int]]:
    return {r.id: E.generate(model, torch.tensor(r.prompt)[None], r.max_new_tokens)[0].tolist() for r in trace}


@pytest.fixture(scope="module", params=["llama3-untied-bias", "mistral", "qwen2"])
def family(request):
    model = L.Llama.from_hf(tiny(request.param))
    trace = random_trace()
    return model, trace, alone(model, trace)


SERVERS = {  # name -> (scheduler, executor) for a model
    "rows, whole prompts, separate": lambda m: row_server(m, 3, 64, None, mixed=False),
    "rows, budget 8, mixed": lambda m: row_server(m, 3, 64, token_budget=8),
    "rows, budget 8, prefill first": lambda m: row_server(m, 4, 64, token_budget=8, decode_first=False),
    "paged, budget 12, mixed": lambda m: paged_server(m, 64, 4, max_seqs=4, token_budget=12),
    "paged, tiny cache: preemption": lambda m: paged_server(m, 13, 4, max_seqs=5, token_budget=16),
    "paged, prefix caching": lambda m: paged_server(m, 30, 4, max_seqs=4, prefix_caching=True),
}


@pytest.mark.parametrize("server", list(SERVERS))
def test_every_executor_gives_every_request_its_tokens_alone(family, server):
    model, trace, ref = family
    scheduler, executor = SERVERS[server](model)
    served = serve(trace, scheduler, executor)
    for s in served:
        assert s.tokens == ref[s.id], (server, s.id)
        assert len(s.token_s) == s.request.max_new_tokens and s.request.arrival_s <= s.start_s <= s.token_s[0]
    if "preemption" in server:
        assert sum(s.preemptions for s in served) > 0  # the test must exercise recompute
    assert scheduler.blocks.blocks_in_use() == 0 or scheduler.blocks.prefix_caching


def test_prefix_caching_reuses_a_shared_prompt_and_keeps_the_tokens(family):
    model, _, _ = family
    shared = list(range(1, 33))
    trace = [Request(i, float(i), shared + [40 + i, 50 + i], 5) for i in range(3)]
    scheduler, executor = paged_server(model, 40, 4, max_seqs=4, prefix_caching=True)
    served = serve(trace, scheduler, executor)
    assert [s.num_cached for s in served] == [0, 32, 32]
    assert all(s.tokens == r for s, r in zip(served, alone(model, trace).values()))


def test_the_default_model_serves_mixed_batches_exactly(lm):
    model = L.Llama.from_hf(lm.model)
    trace = random_trace(5, seed=1, vocab=lm.spec.vocab_size)
    ref = alone(model, trace)
    for scheduler, executor in (row_server(model, 3, 64, token_budget=10), paged_server(model, 9, 8, 4, 12)):
        served = serve(trace, scheduler, executor)
        assert all(s.tokens == ref[s.id] for s in served)


# ----------------------------------------------------------------------------- one schedule, engine and simulator


class ChargedClock:
    """A real executor whose seconds are the simulator's costs: the engine then runs on the simulated clock."""

    def __init__(self, executor, costs, mixed):
        self.executor, self.costs, self.mixed = executor, costs, mixed

    def execute(self, step):
        tokens, _ = self.executor.execute(step)
        return tokens, self.costs.step_s(step, self.mixed)


@pytest.mark.parametrize("budget,mixed", [(None, False), (10, True), (10, False)])
def test_engine_and_simulator_schedule_a_trace_identically(budget, mixed):
    model = L.Llama.from_hf(tiny("qwen2"))
    costs = S.fit_costs([(10, 0.02), (100, 0.11)], [(1, 0.01), (4, 0.016)], 1000.0)
    trace = random_trace(10, seed=5, rate=30.0)
    ref = alone(model, trace)
    real = Scheduler(BlockManager(12, 4), 4, budget)  # small: preemptions happen
    served = serve(trace, real, ChargedClock(ModelExecutor(model, KVPool(model, 12, 4), mixed), costs, mixed))
    sim = Scheduler(BlockManager(12, 4), 4, budget)
    simulated = serve([Request.of_length(r.id, r.arrival_s, r.prompt_tokens, r.max_new_tokens) for r in trace],
                      sim, S.SimulatedExecutor(costs, mixed))
    assert [s.record() for s in real.history] == [s.record() for s in sim.history]
    assert any(s.preempted for s in real.history)
    assert [t for s in served for t in s.token_s] == pytest.approx([t for s in simulated for t in s.token_s])
    assert all(s.tokens == ref[s.id] for s in served)


# ----------------------------------------------------------------------------- the policy


def seqs(*pending: int, computed: int = 0) -> list[Sequence]:
    out = []
    for i, n in enumerate(pending):
        s = Sequence(Request(i, 0.0, [1] * n, 4))
        s.num_computed = computed if computed < n else n - 1
        out.append(s)
    return out


def test_fcfs_spends_the_budget_decodes_first_or_prompts_first():
    running = seqs(5, 5, computed=4)  # two decodes
    waiting = seqs(30, 30)
    plan = fcfs(running, waiting, 10, 4)
    assert [n for _, n in plan] == [1, 1, 8]
    assert [n for _, n in fcfs(running, waiting, 10, 4, decode_first=False)] == [10]
    assert [n for _, n in fcfs(running, waiting, None, 3)] == [1, 1, 30]  # one seat left


def test_a_request_that_can_never_fit_is_refused():
    with pytest.raises(PromptTooLongError):
        Scheduler(BlockManager(2, 4), 2).add(Sequence(Request(0, 0.0, [1] * 8, 4)))


def test_a_policy_that_plans_nothing_is_named():
    scheduler = Scheduler(BlockManager(4, 4), 2, policy=lambda r, w, b, m: [])
    with pytest.raises(WorkbookError, match="planned nothing"):
        serve([Request(0, 0.0, [1, 2], 2)], scheduler, S.SimulatedExecutor(S.fit_costs([(1, 0.1)], [(1, 0.1)], 1)))


def test_the_simulator_imports_no_torch():
    code = "import sys, utils.simulator, utils.scheduler; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------------------- the lab's check names what is wrong


def over_budget(running, waiting, budget, max_seqs):
    return fcfs(running, waiting, None, max_seqs)


def last_come_first(running, waiting, budget, max_seqs):
    return fcfs(running, waiting[::-1], budget, max_seqs)


def starve_the_first(running, waiting, budget, max_seqs):
    plan = fcfs(running, waiting, budget, max_seqs)
    rest = [(s, n) for s, n in plan if s.id != 0]
    return rest or plan


@pytest.fixture(scope="module")
def lab_case():
    from test_batching import tiny_hf
    model = L.Llama.from_hf(tiny_hf())
    trace = random_trace(6, seed=2)
    return model, trace, alone(model, trace)


@pytest.mark.parametrize("policy,message", [(over_budget, "over the budget"), (last_come_first, "first come"),
                                            (starve_the_first, "request 0 is starved")])
def test_check_policy_names_what_is_wrong(lab_case, policy, message):
    from utils.checks import CheckFailed, check_policy
    with pytest.raises(CheckFailed, match=message):
        check_policy("policy", policy, *lab_case)


def test_check_policy_passes_fcfs(lab_case, capsys):
    from utils.checks import check_policy
    check_policy("policy", fcfs, *lab_case)
    assert "preemption" in capsys.readouterr().out
