"""utils.batching: static and continuous batching give every request the tokens it gets alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from utils import batching as B
from utils import engine as E
from utils import llama as L
from utils.checks import CheckFailed, check_equal, check_served
from utils.errors import WorkbookError
from utils.requests import Sequence


def tiny_hf(kind: str = "llama") -> nn.Module:
    """A random 2-layer model; ``mistral`` has a sliding window shorter than the sequences."""
    import transformers as tf

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    if kind == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=6)).eval()
    return tf.LlamaForCausalLM(tf.LlamaConfig(**common)).eval()


def random_trace(n: int = 7, seed: int = 3) -> list[B.Request]:
    g = torch.Generator().manual_seed(seed)
    arrivals = B.poisson_arrivals(n, rate_per_s=2000.0, seed=seed)  # tiny model: ~1 ms a step
    lens = torch.randint(3, 30, (n,), generator=g).tolist()
    outs = torch.randint(1, 12, (n,), generator=g).tolist()
    return [B.Request(i, t, torch.randint(1, 96, (p,), generator=g).tolist(), o)
            for i, (t, p, o) in enumerate(zip(arrivals, lens, outs))]


def alone(model, trace) -> dict[int, list[int]]:
    return {r.id: E.generate(model, torch.tensor(r.prompt)[None], r.max_new_tokens)[0].tolist() for r in trace}


@pytest.fixture(scope="module", params=["llama", "mistral"])
def hand(request):
    return L.Llama.from_hf(tiny_hf(request.param))


# ----------------------------------------------------------------------------- the building blocks


def test_left_pad_puts_prompts_at_the_right_edge():
    ids, mask = B.left_pad([torch.tensor([5, 6, 7]), torch.tensor([9])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[True, True, True], [False, False, True]]


def test_rows_view_shares_memory(hand):
    cache = hand.new_cache(4, 8)
    view = cache.rows(1, 3)
    view.k.fill_(1.0)
    assert cache.k[:, 1:3].eq(1).all() and cache.k[:, 0].eq(0).all() and cache.k[:, 3].eq(0).all()


def test_poisson_arrivals_are_seeded_and_increasing():
    a = B.poisson_arrivals(50, 10.0, seed=1)
    assert a == B.poisson_arrivals(50, 10.0, seed=1) and a[0] == 0.0
    assert all(y >= x for x, y in zip(a, a[1:]))
    assert 50 / 10.0 * 0.5 < a[-1] < 50 / 10.0 * 1.6  # mean gap 1/rate


# ----------------------------------------------------------------------------- the schedulers


@pytest.mark.parametrize("budget,mixed", [(None, True), (6, True), (6, False)])
def test_continuous_batching_gives_every_request_its_tokens_alone(hand, budget, mixed):
    trace = random_trace()
    served = B.serve_continuous(hand, trace, rows=3, token_budget=budget, mixed=mixed)
    check_served("continuous", served, trace, alone(hand, trace))


def test_static_batching_on_both_backends():
    hf = tiny_hf()
    trace = random_trace(seed=5)
    reference = alone(hf, trace)
    for model in (hf, L.Llama.from_hf(hf)):
        check_served("static", B.serve_static(model, trace, batch_size=3), trace, reference)


def test_continuous_batching_needs_the_hand_written_model():
    with pytest.raises(WorkbookError, match="hand-written model"):
        B.serve_continuous(tiny_hf(), random_trace(), rows=2)


def test_summary_of_a_known_trace():
    r0, r1 = B.Request(0, 0.0, [1], 3), B.Request(1, 1.0, [1], 2)
    s0 = Sequence(r0, [1, 2, 3], [0.5, 1.0, 1.5], 0.0)
    s1 = Sequence(r1, [4, 5], [2.0, 4.0], 1.0)
    summary = B.summarize([s0, s1])
    assert summary.output_tokens == 5 and summary.makespan_s == 4.0
    assert summary.throughput_tok_s == pytest.approx(5 / 4)
    assert summary.mean_latency_s == pytest.approx((1.5 + 3.0) / 2)
    assert summary.mean_ttft_s == pytest.approx((0.5 + 1.0) / 2)
    assert summary.max_tbt_s == pytest.approx(2.0)
    assert summary.per_user_tok_s == pytest.approx((2 / 1.0 + 1 / 2.0) / 2)


# ----------------------------------------------------------------------------- the checks fail on wrong answers


@pytest.fixture(scope="module")
def served_right():
    model = L.Llama.from_hf(tiny_hf())
    trace = random_trace(4, seed=11)
    return trace, B.serve_continuous(model, trace, rows=2), alone(model, trace)


def test_check_served_fails_on_a_dropped_request(served_right):
    trace, served, ref = served_right
    with pytest.raises(CheckFailed, match=r"missing \[2\]"):
        check_served("s", [s for s in served if s.request.id != 2], trace, ref)


def test_check_served_fails_on_reordered_requests(served_right):
    trace, served, ref = served_right
    with pytest.raises(CheckFailed, match="order"):
        check_served("s", served[::-1], trace, ref)


def test_check_served_fails_on_a_wrong_token_and_on_times_out_of_order(served_right):
    trace, served, ref = served_right
    bad = Sequence(served[0].request, [*served[0].tokens[:-1], -1], served[0].token_s, served[0].start_s)
    with pytest.raises(CheckFailed, match="first difference"):
        check_served("s", [bad, *served[1:]], trace, ref)
    early = Sequence(served[1].request, served[1].tokens, served[1].token_s, served[1].request.arrival_s - 1)
    with pytest.raises(CheckFailed, match="out of order"):
        check_served("s", [served[0], early, *served[2:]], trace, ref)


def test_a_batch_without_its_mask_is_caught(lm):
    """Padding read as text changes the padded row's tokens: the lab's check must say so."""
    model = L.Llama.from_hf(lm.model)
    tok = lm.tokenizer
    prompts = [tok(t, return_tensors="pt").input_ids[0] for t in
               ["The capital of France is", "Water boils at a temperature of one hundred degrees, and"]]
    ids, mask = B.left_pad(prompts, tok.pad_token_id)
    want = E.generate(model, prompts[0][None], 8)[0]
    assert E.generate(model, ids, 8, mask)[0].tolist() == want.tolist()
    with pytest.raises(CheckFailed):
        check_equal("row 0 without its mask", E.generate(model, ids, 8)[0], want)


def test_mixed_step_costs_times_both_ways(hand):
    prompts = [list(range(1 + i, 21 + i)) for i in range(3)]
    costs = B.mixed_step_costs(hand, prompts, [4, 8], context=16, repeats=2)
    assert [c.chunk for c in costs] == [4, 8] and all(c.batch == 3 for c in costs)
    assert all(c.mixed.median > 0 and c.separate.median > 0 for c in costs)


def test_packed_step_costs_time_the_executors_passes_for_the_simulators_fit():
    from utils.simulator import fit_costs
    model = L.Llama.from_hf(tiny_hf())
    prefill, decode = B.packed_step_costs(model, 7, [8, 32], [1, 2], context=16, repeats=3)
    assert [n for n, _ in prefill] == [8, 32] and [b for b, _ in decode] == [1, 2]
    assert all(s > 0 for _, s in prefill + decode)
    # The decode points are what fit_costs takes. Whether 32 tokens took longer than 8 on a tiny model is noise
    # (CI: 0.77 ms against 0.71 ms, and the fit refused them), so the prefill line here is given, not timed:
    # chapter 07 fits measured prefill points on the real model, at lengths far enough apart.
    costs = fit_costs([(8, 0.001), (32, 0.002)], decode, 1024)
    assert costs.decode_step_s(2) >= costs.decode_step_s(1) > 0
