"""The serving chapter's planted regression (07), kept apart from tests/test_planted.py so that make test can
run it in the other lane; the same rule: as is, the check passes or stays undecided, planted, it fails."""

from __future__ import annotations

import pytest

from test_planted import CASES, outcome
from utils import simulator as sim
from utils.batching import make_trace, packed_step_costs
from utils.decide import PASSED, UNDECIDED
from utils.executors import row_server
from utils.llama import Llama
from utils.scheduler import serve
from utils.tokens import filler_ids
from utils.verdicts import decide_simulator


@pytest.mark.parametrize("planted", CASES)
def test_07_a_simulator_that_charges_thrice_fails_simulator_vs_served(lm, planted, monkeypatch):
    """07: 'the simulator's <figure> within 2x of the measured run': a 4-request trace served three times, the
    step costs timed before each run (utils.simulator.validate_runs, as the chapter does at a smaller size)."""
    if planted:  # the simulator's clock charges every step three times what the costs say
        real = sim.SimulatedExecutor.execute
        monkeypatch.setattr(sim.SimulatedExecutor, "execute", lambda self, step: (
            lambda out: (out[0], 3 * out[1]))(real(self, step)))
    model = Llama.from_hf(lm.model)
    trace = make_trace(lm.tokenizer, [0.0, 0.05, 0.1, 0.3], [40, 24, 48, 32], [6, 8, 6, 6])
    token, runs = int(filler_ids(lm.tokenizer, 1, lm.device)[0, -1]), []
    for _ in range(3):
        points = packed_step_costs(model, token, [16, 96], [1, 2], 48, repeats=3)  # far apart: the fit needs growth
        scheduler, executor = row_server(model, 2, 64, token_budget=32)
        runs.append((sim.fit_costs(*points, lm.spec.kv_bytes_per_token), serve(trace, scheduler, executor),
                     scheduler.history))
    validation = sim.validate_runs(trace, runs, rows=2, token_budget=32)
    noise = sim.fit_noise(runs[-1][0], *points)  # how well the last costs fit their points
    outcome(planted, lambda: UNDECIDED if UNDECIDED in decide_simulator(validation, noise) else PASSED)
