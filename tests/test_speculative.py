"""utils.speculative: greedy speculative output is plain greedy output, for every draft and k, on both
backends; the sampling rule keeps the target's distribution; the formula; clear errors; and the lab's
check functions fail on the classic wrong answers."""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

from utils import engine
from utils import speculative as S
from utils.checks import (CheckFailed, check_greedy_acceptance, check_sampling_rule, check_speculative_output)
from utils.errors import InvalidTokenCountError, WorkbookError
from utils.llama import Llama
from utils.sampling import GREEDY, Sampling

VOCAB = 50


def tiny_hf(seed: int = 0, layers: int = 3):
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=88, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=None, bos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(cfg).eval()


class RandomDraft:
    """Proposes random tokens: almost every draft is rejected (exercises the rollback)."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.g = torch.Generator().manual_seed(seed)

    def start(self, prompt, max_len) -> None:
        pass

    def propose(self, context, k, sampling=GREEDY, generator=None):
        return torch.randint(0, VOCAB, (k,), generator=self.g).tolist(), None


class MixedDraft(RandomDraft):
    """The target's own greedy tokens with one wrong token every few: partial acceptances."""

    name = "mixed"

    def __init__(self, truth: Sequence[int], prompt_len: int) -> None:
        super().__init__(1)
        self.truth, self.prompt_len = list(truth), prompt_len

    def propose(self, context, k, sampling=GREEDY, generator=None):
        i = len(context) - self.prompt_len
        out = self.truth[i:i + k]
        if len(out) > 1 and i % 3 == 0:
            out[len(out) // 2] = (out[len(out) // 2] + 1) % VOCAB
        return out, None


@pytest.fixture(scope="module")
def models():
    hf = tiny_hf()
    return {"transformers": hf, "hand-written": Llama.from_hf(hf)}


@pytest.fixture(scope="module")
def prompt():
    torch.manual_seed(1)
    return torch.randint(1, VOCAB, (1, 12))


def drafts_for(hand: Llama, truth: list[int], prompt_len: int) -> list:
    return [S.PromptLookup(), S.ModelDraft(S.early_exit_model(hand, 1), "early exit 1"),
            S.ModelDraft(S.early_exit_model(hand, 2), "early exit 2"),
            S.ModelDraft(S.quantized_model(hand, 32), "int4"), S.ModelDraft(hand, "itself"),
            S.ModelDraft(tiny_hf(seed=5, layers=1), "another model"), RandomDraft(), MixedDraft(truth, prompt_len)]


@pytest.mark.parametrize("backend", ["transformers", "hand-written"])
def test_greedy_speculative_equals_plain_greedy(models, prompt, backend):
    target, n_new = models[backend], 20
    want = engine.generate(target, prompt, n_new)[0].tolist()
    for draft in drafts_for(models["hand-written"], want, prompt.shape[1] + 1):
        for k in (1, 2, 3, 5, 8):
            got = S.speculative_generate(target, draft, prompt, n_new, k)
            assert got.tokens == want, f"{backend}, draft {draft.name}, k={k}"
            assert got.steps >= 1 and got.accepted <= got.drafted


def test_counts_of_a_perfect_and_a_hopeless_draft(models, prompt):
    hand = models["hand-written"]
    perfect = S.speculative_generate(hand, S.ModelDraft(hand, "itself"), prompt, 21, 4)
    assert perfect.rejected == 0 and perfect.alpha == 1.0
    assert perfect.draft_lengths == [4, 4, 4, 4]  # 20 tokens after the first: 4 passes of 4 + 1
    assert perfect.tokens_per_step == 5.0 == perfect.predicted_tokens_per_step()
    hopeless = S.speculative_generate(hand, RandomDraft(), prompt, 21, 4)
    assert hopeless.alpha < 0.2 and hopeless.tokens_per_step < 1.3


def test_eos_stops_the_loop(models, prompt):
    hand = models["hand-written"]
    plain = engine.generate(hand, prompt, 16)[0].tolist()
    eos = plain[5]
    got = S.speculative_generate(hand, S.ModelDraft(hand, "itself"), prompt, 16, 4, eos_token_id=eos)
    assert got.tokens == plain[:plain.index(eos) + 1]


def test_the_held_in_model_too(lm):
    hand = Llama.from_hf(lm.model)
    ids = lm.tokenizer("Copy this list: red, green, blue, red, green, blue, red,", return_tensors="pt").input_ids
    want = engine.generate(hand, ids, 12)[0].tolist()
    for draft in (S.PromptLookup(), S.ModelDraft(S.early_exit_model(hand, 8), "early exit 8")):
        for k in (2, 5):
            assert S.speculative_generate(hand, draft, ids, 12, k).tokens == want
            assert S.speculative_generate(lm.model, draft, ids, 12, k).tokens == want


def test_early_exit_shares_weights_and_leaves_the_model_alone(models):
    hand = models["hand-written"]
    draft = S.early_exit_model(hand, 2)
    assert len(hand.layers) == 3 and hand.args.n_layers == 3
    assert len(draft.layers) == 2 and draft.args.n_layers == 2
    assert draft.layers[0] is hand.layers[0] and draft.lm_head is hand.lm_head and draft.norm is hand.norm
    assert draft.new_cache(1, 8).k.shape[0] == 2
    with pytest.raises(WorkbookError, match="only 3 layers"):
        S.early_exit_model(hand, 4)


def test_prompt_lookup():
    assert S.prompt_lookup([1, 2, 3, 4, 9, 2, 3], 2) == [4, 9]
    assert S.prompt_lookup([5, 1, 7, 6, 1, 8, 1], 3) == [8, 1]  # the most recent match of [1]
    assert S.prompt_lookup([1, 2, 3], 4) == []
    assert S.prompt_lookup([4, 4], 3) == [4]


def test_expected_tokens_per_step():
    assert S.expected_tokens_per_step(0.0, 4) == 1.0
    assert S.expected_tokens_per_step(1.0, 4) == 5.0
    assert S.expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)
    assert S.expected_tokens_per_step(0.8, 4) == pytest.approx(sum(0.8 ** i for i in range(5)))
    with pytest.raises(WorkbookError, match="alpha"):
        S.expected_tokens_per_step(1.5, 2)


def test_clear_errors_on_bad_input(models, prompt):
    hand = models["hand-written"]
    for bad_k in (0, -1, 1.5, True):
        with pytest.raises(WorkbookError, match="k"):
            S.speculative_generate(hand, S.PromptLookup(), prompt, 8, bad_k)
    with pytest.raises(InvalidTokenCountError):
        S.speculative_generate(hand, S.PromptLookup(), prompt, 0, 2)
    with pytest.raises(WorkbookError, match="batch 1"):
        S.speculative_generate(hand, S.PromptLookup(), prompt.repeat(2, 1), 8, 2)
    with pytest.raises(WorkbookError, match="context"):
        S.speculative_generate(hand, S.PromptLookup(), prompt, 200, 2)


# ----------------------------------------------------------------------------- the sampling rule


def first_two_tokens(rule, p: torch.Tensor, q: torch.Tensor, draws: int) -> torch.Tensor:
    """Counts [2, V] of the first two tokens a step emits, with drafts drawn from q each time."""
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(2, p.shape[1])
    for _ in range(draws):
        drafted = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(q.shape[0])]
        n, nxt = rule(drafted, p, q, g)
        emitted = drafted[:n] + [nxt]
        for j, t in enumerate(emitted[:2]):
            counts[j, t] += 1
    return counts


P = torch.tensor([[0.5, 0.3, 0.1, 0.1, 0.0], [0.05, 0.05, 0.1, 0.2, 0.6], [0.2, 0.2, 0.2, 0.2, 0.2]])
Q = torch.tensor([[0.1, 0.2, 0.3, 0.2, 0.2], [0.3, 0.3, 0.2, 0.1, 0.1]])


def wrong_residual(drafted, p, q, g):  # resample a rejection from p itself
    for i, x in enumerate(drafted):
        if float(torch.rand((), generator=g)) < min(1.0, float(p[i, x] / q[i, x])):
            continue
        return i, int(torch.multinomial(p[i], 1, generator=g))
    return len(drafted), int(torch.multinomial(p[len(drafted)], 1, generator=g))


def always_accept(drafted, p, q, g):
    return len(drafted), int(torch.multinomial(p[len(drafted)], 1, generator=g))


def test_sampling_rule_keeps_the_target_distribution():
    counts = first_two_tokens(S.accept_sampled, P, Q, 20_000)
    freq = counts / counts.sum(dim=1, keepdim=True)
    tv = 0.5 * (freq - P[:2]).abs().sum(dim=1)
    assert (tv < 0.02).all(), tv  # ~0.006 expected from sampling noise alone


@pytest.mark.parametrize("rule", [wrong_residual, always_accept])
def test_wrong_sampling_rules_are_caught(rule):
    counts = first_two_tokens(rule, P, Q, 20_000)
    freq = counts / counts.sum(dim=1, keepdim=True)
    assert (0.5 * (freq - P[:2]).abs().sum(dim=1)).max() > 0.05


def test_residual():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(S.residual(p, q), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.equal(S.residual(p, p), p)


def test_sampled_loop_with_a_deterministic_draft_runs(models, prompt):
    hand = models["hand-written"]
    got = S.speculative_generate(hand, S.PromptLookup(), prompt, 12, 3, sampling=Sampling(1.0, seed=0))
    again = S.speculative_generate(hand, S.PromptLookup(), prompt, 12, 3, sampling=Sampling(1.0, seed=0))
    assert len(got.tokens) == 12 and got.tokens == again.tokens
    draft = S.ModelDraft(S.early_exit_model(hand, 1), "early exit")
    assert len(S.speculative_generate(hand, draft, prompt, 12, 3, sampling=Sampling(0.8, top_k=10, seed=1)).tokens) == 12


# ----------------------------------------------------------------------------- the lab's check functions


def off_by_one(drafted, logits):  # compares draft i with the prediction one slot later
    best = logits.argmax(-1).tolist()
    n = 0
    while n < len(drafted) and drafted[n] == best[n + 1]:
        n += 1
    return n, best[min(n + 1, len(best) - 1)]


def bonus_forgotten(drafted, logits):  # all accepted: returns the last draft's row again
    n, nxt = S.accept_greedy(drafted, logits)
    return n, (logits.argmax(-1).tolist()[n - 1] if n == len(drafted) and n else nxt)


def test_check_greedy_acceptance():
    check_greedy_acceptance("right", S.accept_greedy)
    for wrong in (off_by_one, bonus_forgotten, lambda d, l: (0, int(l[0].argmax())),
                  lambda d, l: (len(d), int(l[-1].argmax()))):
        with pytest.raises(CheckFailed):
            check_greedy_acceptance("wrong", wrong)


def test_check_sampling_rule():
    check_sampling_rule("right", S.accept_sampled)
    for wrong in (wrong_residual, always_accept):
        with pytest.raises(CheckFailed, match="total variation"):
            check_sampling_rule("wrong", wrong)


def no_rollback(target, draft, ids, n_new, k):
    """The loop without rollback: rejected drafts stay in the cache."""
    cache = engine.new_cache(target, 1, ids.shape[1] + n_new * (k + 1))
    context = ids[0].tolist() + [int(engine.prefill(target, cache, ids).argmax(-1))]
    while len(context) - ids.shape[1] < n_new:
        drafted, _ = draft.propose(context, k)
        logits = engine.extend(target, cache, torch.tensor([[context[-1], *drafted]]))[0]
        n, nxt = S.accept_greedy(drafted, logits)
        context += [*drafted[:n], nxt]
    return context[ids.shape[1]:][:n_new]


def test_check_speculative_output(models, prompt):
    hand = models["hand-written"]
    want = engine.generate(hand, prompt, 16)[0]
    check_speculative_output("right", S.speculative_generate(hand, RandomDraft(), prompt, 16, 3).tokens, want)
    with pytest.raises(CheckFailed, match="first difference at token"):
        check_speculative_output("no rollback", no_rollback(hand, RandomDraft(), prompt, 16, 3), want)
    with pytest.raises(CheckFailed, match="makes 16"):
        check_speculative_output("too short", want[:10].tolist(), want)


def test_draft_model_setting(monkeypatch):
    from utils.models import draft_model_name

    monkeypatch.delenv("WORKBOOK_DRAFT_MODEL", raising=False)
    assert draft_model_name() is None
    monkeypatch.setenv("WORKBOOK_DRAFT_MODEL", "  ")
    assert draft_model_name() is None
    monkeypatch.setenv("WORKBOOK_DRAFT_MODEL", " /some/folder ")
    assert draft_model_name() == "/some/folder"
