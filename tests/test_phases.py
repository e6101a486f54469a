"""Prefill/decode measurement through transformers, the meter line, and bad input."""

from __future__ import annotations

import re

import pytest
import torch

from utils import phases
from utils.errors import EmptyPromptError, InvalidTokenCountError, PromptTooLongError
from utils.meter import format_meter
from utils.timing import Timing, measure


def test_timing_statistics():
    t = Timing((0.3, 0.1, 0.2, 0.4, 0.5))
    assert t.median == 0.3 and t.min == 0.1
    assert t.spread == pytest.approx(0.2)
    calls = []
    measure(lambda: calls.append(1), warmup=2, repeats=3)
    assert len(calls) == 5


def test_filler_ids_has_exact_length(lm):
    for n in (1, 7, 600, 2000):
        assert phases.filler_ids(lm.tokenizer, n).shape == (1, n)


def test_cached_decode_equals_generate(lm):
    ids = phases.encode_prompt(lm, "The three primary colours are", chat=False)
    logits, cache = phases.prefill(lm.model, ids)
    first = logits.argmax(-1, keepdim=True)
    rest = phases.decode_n_tokens(lm.model, cache, first, 11)
    ours = torch.cat([first, rest], dim=1)[0].tolist()
    ref = lm.model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    assert ours == ref


def test_run_request_and_meter(lm):
    m = phases.run_request(lm, "Name a colour.", 8, chat=True, stop_at_eos=False)
    assert m.output_tokens == 8 and len(m.token_ids) == 8
    assert m.total_s == pytest.approx(m.ttft_s + m.decode_s)
    assert m.prefill_s <= m.ttft_s
    lines = format_meter(m).splitlines()
    assert lines[0].lstrip().startswith("prompt eval time")
    assert re.search(rf"/\s+{m.prompt_tokens} tokens", lines[0])
    assert re.search(r"/\s+7 runs", lines[1])  # tokens after the first
    assert lines[2].lstrip().startswith("total time")


def test_measure_phases_report_tokens(lm):
    p = phases.measure_prefill(lm, 32, repeats=1, warmup=0)
    d = phases.measure_decode(lm, 4, prompt_tokens=8, repeats=1, warmup=0)
    assert (p.tokens, d.tokens) == (32, 4)
    assert p.tok_s > 0 and d.tok_s > 0


def test_empty_prompt_is_a_clear_error(lm):
    with pytest.raises(EmptyPromptError, match="empty"):
        phases.run_request(lm, "   ", 4)


def test_prompt_longer_than_context(lm):
    n = lm.spec.max_context
    with pytest.raises(PromptTooLongError, match=f"context holds {n}"):
        phases.measure_prefill(lm, n + 1)
    with pytest.raises(PromptTooLongError, match="asked for"):
        phases.run_request(lm, phases.filler_ids(lm.tokenizer, n - 2), 5)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_non_positive_token_count(lm, bad):
    with pytest.raises(InvalidTokenCountError, match="positive integer"):
        phases.run_request(lm, "Hello", bad)
