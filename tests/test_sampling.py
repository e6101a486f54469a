"""utils.sampling: greedy, temperature, top-k, top-p, seeded draws."""

from __future__ import annotations

import pytest
import torch

from utils.errors import WorkbookError
from utils.sampling import GREEDY, Sampling, filtered_probs, sample, sample_next

# probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 (logits are their logs)
P = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
LOGITS = P.log()


def test_filtered_probs_is_softmax_at_temperature_one():
    assert torch.allclose(filtered_probs(LOGITS), P)
    assert torch.allclose(filtered_probs(LOGITS).sum(), torch.tensor(1.0))


def test_temperature_sharpens_and_flattens():
    cold, hot = filtered_probs(LOGITS, 0.5), filtered_probs(LOGITS, 2.0)
    assert cold[0] > P[0] > hot[0]
    assert torch.equal(filtered_probs(LOGITS, 0.0), torch.tensor([1.0, 0, 0, 0, 0]))


@pytest.mark.parametrize("top_p, kept", [(0.5, 1), (0.6, 2), (0.75, 2), (0.8, 3), (1.0, 5)])
def test_top_p_keeps_the_smallest_nucleus(top_p, kept):
    p = filtered_probs(LOGITS, 1.0, top_p)
    assert int((p > 0).sum()) == kept
    assert torch.allclose(p[:kept], P[:kept] / P[:kept].sum())


def test_top_k_keeps_k():
    p = filtered_probs(LOGITS, 1.0, top_k=2)
    assert torch.allclose(p, torch.tensor([2 / 3, 1 / 3, 0, 0, 0]))


def test_batches_are_filtered_row_by_row():
    batch = torch.stack([LOGITS, LOGITS.flip(0)])
    p = filtered_probs(batch, 1.0, 0.6)
    assert torch.equal((p > 0).sum(-1), torch.tensor([2, 2])) and p[1, 4] > 0


def test_greedy_is_the_argmax_and_draws_repeat_with_a_seed():
    assert sample_next(LOGITS) == 0 and torch.equal(sample(torch.stack([LOGITS, LOGITS.flip(0)])), torch.tensor([0, 4]))

    def draws(seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return [sample_next(LOGITS, 1.0, 0.9, g) for _ in range(50)]

    assert draws(0) == draws(0) and draws(0) != draws(1) and len(set(draws(0))) > 1


def test_draws_follow_the_filtered_distribution():
    g = torch.Generator().manual_seed(1)
    draws = [sample_next(LOGITS, 1.0, 0.6, g) for _ in range(3000)]
    assert set(draws) == {0, 1}  # top-p 0.6 keeps two tokens
    assert abs(draws.count(0) / len(draws) - 2 / 3) < 0.04


def test_settings_are_validated():
    assert GREEDY.greedy and not Sampling(0.8).greedy
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=0), dict(top_k=2.5)):
        with pytest.raises(WorkbookError):
            Sampling(**bad)
    assert Sampling(seed=3).generator() is not None and Sampling().generator() is None
