"""The request engine over both backends: same tokens, finish reasons, timing, meter, bad input."""

from __future__ import annotations

import re

import pytest
import torch

from utils import engine as E
from utils import phases
from utils.errors import EmptyPromptError, InvalidTokenCountError, PromptTooLongError, WorkbookError
from utils.llama import Llama
from utils.meter import diagnose, format_meter
from utils.sampling import Sampling
from utils.tokens import chat_ids, filler_ids


@pytest.fixture(scope="module")
def hand(lm):
    return Llama.from_hf(lm.model)


def test_filler_ids_has_exact_length(lm):
    for n in (1, 7, 600, 2000):
        assert filler_ids(lm.tokenizer, n).shape == (1, n)


def test_both_backends_equal_transformers_generate(lm, hand):
    ids = lm.tokenizer("The three primary colours are", return_tensors="pt").input_ids
    ref = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                            do_sample=False)[0, ids.shape[1]:].tolist()
    assert E.generate(lm.model, ids, 12)[0].tolist() == ref
    assert E.generate(hand, ids, 12)[0].tolist() == ref


def test_transformers_backend_left_padded_batch_equals_alone(lm):
    tok = lm.tokenizer
    rows = [tok(t).input_ids for t in ["The capital of France is", "Once upon a time, in a land far away, there"]]
    width = max(map(len, rows))
    ids = torch.full((2, width), tok.pad_token_id)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    batched = E.generate(lm.model, ids, 8, mask)
    for i, r in enumerate(rows):
        assert batched[i].tolist() == E.generate(lm.model, torch.tensor([r]), 8)[0].tolist()


@pytest.mark.parametrize("backend", ["transformers", "hand-written"])
def test_extend_and_rollback(lm, hand, backend):
    """Prefill, extend 3 tokens at once (a verify step), roll 2 back, decode: same as straight through."""
    model = lm.model if backend == "transformers" else hand
    ids = lm.tokenizer("One, two, three, four, five, six", return_tensors="pt").input_ids
    T = ids.shape[1]
    cache = E.new_cache(model, 1, T + 4)
    E.prefill(model, cache, ids[:, :-3])
    assert E.extend(model, cache, ids[:, -3:]).shape[:2] == (1, 3)
    E.rollback(cache, T - 2)
    assert cache.length == T - 2
    after = E.decode_one_token(model, cache, ids[:, -2])
    straight = E.new_cache(model, 1, T)
    want = E.prefill(model, straight, ids[:, :-1])
    assert (after - want).abs().max().item() < 1e-4
    with pytest.raises(WorkbookError, match="Cannot roll back"):
        E.rollback(cache, T + 10)


def test_stream_finish_reasons_and_stop_text(lm):
    ids = chat_ids(lm.tokenizer, "Count from one to twenty, separated by commas.")
    tokens = list(E.stream(lm.model, lm.tokenizer, ids, 6, stop_at_eos=False))
    assert [t.index for t in tokens] == list(range(6)) and tokens[-1].finish_reason == "length"
    assert all(t.finish_reason is None for t in tokens[:-1])
    assert all(a.seconds < b.seconds for a, b in zip(tokens, tokens[1:]))
    full = tokens[-1].text
    stop = next(s for s in [",", " ", "o", "e"] if s in full[1:])
    cut = list(E.stream(lm.model, lm.tokenizer, ids, 6, stop=(stop,), stop_at_eos=False))
    assert cut[-1].finish_reason == "stop" and cut[-1].text == full[:full.index(stop)]
    assert E.generate(lm.model, ids, 6)[0].tolist()[:len(cut)] == [t.id for t in cut]


def test_stream_ends_at_eos(lm):
    eos = lm.tokenizer.eos_token_id
    ids = chat_ids(lm.tokenizer, "What is the capital of France? Answer with one word.")
    greedy = E.generate(lm.model, ids, 40, eos_token_id=eos)[0].tolist()
    assert eos in greedy, "the model should answer within 40 tokens: pick another prompt"
    tokens = list(E.stream(lm.model, lm.tokenizer, ids, 40))
    assert tokens[-1].finish_reason == "eos" and [t.id for t in tokens] == greedy[:greedy.index(eos) + 1]


def test_run_request_and_meter(lm):
    m = E.run_request(lm, "Name a colour.", 8, chat=True, stop_at_eos=False)
    assert m.output_tokens == 8 and len(m.token_ids) == 8 and m.finish_reason == "length"
    assert 0 < m.prefill_s < m.ttft_s < m.total_s and len(m.arrivals_s) == 8
    lines = format_meter(m).splitlines()
    assert lines[0].lstrip().startswith("prompt eval time")
    assert re.search(rf"/\s+{m.prompt_tokens} tokens", lines[0])
    assert re.search(r"/\s+7 runs", lines[1])  # tokens after the first
    assert lines[2].lstrip().startswith("total time")


def test_diagnose_follows_the_shares():
    rm = E.RequestMetrics(prompt_tokens=1000, output_tokens=2, prefill_s=0.9, ttft_s=0.9, decode_s=0.1, total_s=1.0)
    assert diagnose(rm).startswith("TTFT-bound: 90%")
    rm = E.RequestMetrics(prompt_tokens=10, output_tokens=200, prefill_s=0.1, ttft_s=0.1, decode_s=3.9, total_s=4.0)
    assert diagnose(rm).startswith("decode-bound: 98%")
    knobs = diagnose(rm).split("Knobs: ")[1].split(". (")[0]
    assert "speculative decoding" in knobs and "batching" not in knobs  # batching slows one request's decode


def test_sampled_requests_repeat_with_a_seed(lm, hand):
    ids = lm.tokenizer("My favourite animal is", return_tensors="pt").input_ids
    s = Sampling(1.0, top_p=0.9, seed=3)
    draws = [E.generate(m, ids, 6, sampling=s)[0].tolist() for m in (lm.model, lm.model)]
    assert draws[0] == draws[1]


def test_phase_measurements_count_tokens(lm, hand):
    p = E.measure_prefill(lm, 32, repeats=1, warmup=0)
    d = E.measure_decode(lm, 4, prompt_tokens=8, repeats=1, warmup=0)
    batch = E.decode_speed(hand, filler_ids(lm.tokenizer, 8).repeat(3, 1), 4, repeats=1, warmup=0)
    assert (p.tokens, d.tokens, batch.tokens) == (32, 4, 12)
    assert p.tok_s > 0 and d.tok_s > 0 and batch.tok_s > 0


def test_empty_prompt_is_a_clear_error(lm):
    with pytest.raises(EmptyPromptError, match="empty"):
        E.run_request(lm, "   ", 4)
    with pytest.raises(EmptyPromptError, match="empty"):
        phases.prefill(lm.model, phases.new_cache(lm.model, 1, 4), torch.zeros(1, 0, dtype=torch.long))


@pytest.mark.parametrize("backend", ["transformers", "hand-written"])
def test_both_backends_refuse_the_same_bad_batches_alike(lm, hand, backend):
    """Empty, all padding, right-padded, a batch the cache was not made for: one check, the same error each way."""
    model = lm.model if backend == "transformers" else hand
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    bad = [(torch.zeros(2, 0, dtype=torch.long), None, 2, EmptyPromptError, "empty"),
           (ids, torch.tensor([[1, 1, 1], [0, 0, 0]]), 2, EmptyPromptError, "all padding"),
           (ids, torch.tensor([[1, 1, 1], [1, 1, 0]]), 2, WorkbookError, "LEFT-padded"),
           (ids, None, 3, WorkbookError, "made for batch 3")]
    for prompt, mask, rows, error, words in bad:
        with pytest.raises(error, match=words):
            E.prefill(model, E.new_cache(model, rows, 8), prompt, mask)
    logits = E.prefill(model, E.new_cache(model, 2, 8), ids, torch.tensor([[1, 1, 1], [0, 1, 1]]))  # left: fine
    assert logits.shape == (2, lm.spec.vocab_size)


def test_prompt_longer_than_context(lm):
    n = lm.spec.max_context
    with pytest.raises(PromptTooLongError, match=f"context holds {n}"):
        E.measure_prefill(lm, n + 1)
    with pytest.raises(PromptTooLongError, match="asked for"):
        E.run_request(lm, filler_ids(lm.tokenizer, n - 2), 5)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_non_positive_token_count(lm, bad):
    with pytest.raises(InvalidTokenCountError, match="positive whole number"):
        E.run_request(lm, "Hello", bad)


def test_a_model_that_brings_its_own_phases_is_driven_by_the_engine(lm, hand):
    """Chapter 05's by-hand model: a namespace with ``phases`` of the package's signatures."""
    from types import SimpleNamespace

    from utils import llama_phases

    calls = []

    def prefill(model, cache, ids, mask=None):
        calls.append("prefill")
        return llama_phases.prefill(hand, cache, ids, mask)

    def decode_one_token(model, cache, token):
        calls.append("decode")
        return llama_phases.decode_one_token(hand, cache, token)

    own = SimpleNamespace(device=hand.device, phases=SimpleNamespace(
        new_cache=lambda model, batch, max_len: llama_phases.new_cache(hand, batch, max_len),
        prefill=prefill, decode_one_token=decode_one_token, max_context=lambda model: 64))
    ids = lm.tokenizer("The three primary colours are", return_tensors="pt").input_ids
    assert E.generate(own, ids, 5)[0].tolist() == E.generate(hand, ids, 5)[0].tolist()
    assert calls == ["prefill"] + ["decode"] * 4
    assert E.decode_speed(own, ids, 3, repeats=1, warmup=0).tokens == 3
    with pytest.raises(PromptTooLongError):  # its own max_context is honoured
        E.generate(own, ids, 64)


def test_measure_prefills_interleaves_the_lengths(lm, monkeypatch):
    from utils import engine as eng
    seen = []
    real = eng.prefill
    monkeypatch.setattr(eng, "prefill", lambda model, cache, ids, mask=None: (seen.append(ids.shape[1]),
                                                                             real(model, cache, ids, mask))[1])
    got = eng.measure_prefills(lm, [8, 16], repeats=3, warmup=1)
    assert seen == [8, 16] * 4  # round-robin: warm-up round, then three timed rounds
    assert {n: (r.tokens, len(r.timing.samples)) for n, r in got.items()} == {8: (8, 3), 16: (16, 3)}
