"""utils.variants: bytes read, perplexity, agreement, the variants table, the predicted speed-up."""

from __future__ import annotations

import pytest
import torch

from utils.quant import Int4Linear, Int8Linear

# ----------------------------------------------------------------------------- judging a quantized model


@pytest.fixture(scope="module")
def tiny_pair():
    """A random untied Llama with an MLP width (88) that is not a multiple of 32: (transformers, hand-written)."""
    import transformers as tf

    from utils.llama import Llama

    cfg = tf.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
                         tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    hf = tf.LlamaForCausalLM(cfg).eval()
    return hf, Llama.from_hf(hf)


def _quantized_copy(model, make):
    import copy

    from utils.llama import iter_linears, replace_linear

    new = copy.deepcopy(model)
    for name, lin in iter_linears(model):
        replace_linear(new, name, make(lin))
    return new


def test_bytes_read_per_token_skips_only_the_untied_embedding(tiny_pair) -> None:
    from utils.llama import iter_linears
    from utils.variants import bytes_read_per_token

    hf, hand = tiny_pair
    every = sum(p.numel() for p in hf.parameters()) * 4
    assert bytes_read_per_token(hand) == every - hf.model.embed_tokens.weight.numel() * 4
    int8 = _quantized_copy(hand, lambda lin: Int8Linear.from_linear(lin, use_kernel=False))
    norms = (2 * 2 + 1) * 64 * 4  # two norms per layer and the final one, float32
    projections = sum(lin.weight.numel() + lin.out_features * 4 for _, lin in iter_linears(hand))  # q + scales
    assert bytes_read_per_token(int8) == projections + norms


def test_perplexity_is_the_same_on_both_backends_and_equals_transformers_loss(tiny_pair) -> None:
    import math

    from utils.variants import perplexity

    hf, hand = tiny_pair
    ids = torch.randint(1, 96, (1, 40), generator=torch.Generator().manual_seed(3))
    want = math.exp(hf(ids, labels=ids).loss.item())
    assert perplexity(hand, ids) == pytest.approx(want, rel=1e-4)
    assert perplexity(hf, ids) == pytest.approx(want, rel=1e-4)
    with pytest.raises(ValueError, match=r"\[1, T\]"):
        perplexity(hand, ids[:, :1])


def test_tokens_agreed() -> None:
    from utils.variants import tokens_agreed

    assert tokens_agreed(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 5, 4])) == 2
    assert tokens_agreed([5, 6], [5, 6, 7]) == 2
    assert tokens_agreed(torch.tensor([[7]]), [8]) == 0


def test_variant_table_measures_quality_bytes_and_speed(tiny_pair) -> None:
    from utils.variants import VariantTable

    _, hand = tiny_pair
    ids = torch.randint(1, 96, (1, 32), generator=torch.Generator().manual_seed(4))
    table = VariantTable(hand, ids, [ids[:, :5], ids[:, 5:12]], n_agree=6)
    base = table.add("fp32", hand, "fp32", "fp32", "F.linear", show=False)
    assert (base.agreed, base.of) == (12, 12) and base.tok_s != base.tok_s  # nan until measured
    int4 = _quantized_copy(hand, lambda lin: Int4Linear.from_linear(lin, 32))
    row = table.add("int4", int4, "int4 g32", "fp32", "aten", show=False)
    assert row.bytes < base.bytes / 4 and 0 <= row.agreed <= 12
    assert abs(row.ppl / base.ppl - 1) < 0.2
    calls = []
    table.measure_speeds(ids[:, :8], n_tokens=4, slow_tokens=2, repeats=2, between=lambda: calls.append(1))
    assert len(calls) == 3 and len(row.timing.samples) == 2 and row.tokens == 4
    assert row.tok_s > 0 and row.best_tok_s >= row.tok_s and row.kv_bytes > 0 and row.read > row.bytes


def test_predicted_speedup_is_amdahl() -> None:
    from utils.variants import predicted_speedup

    assert predicted_speedup(0.8, 1 / 6) == pytest.approx(3.0)
    assert predicted_speedup(0.3, 1e-9) == pytest.approx(1 / 0.7)
    assert predicted_speedup(0.0, 0.1) == 1.0
    with pytest.raises(ValueError):
        predicted_speedup(1.2, 0.5)


def test_decode_matmul_seconds_finds_the_matmuls(tiny_pair) -> None:
    from utils.variants import decode_matmul_seconds

    _, hand = tiny_pair
    seconds = decode_matmul_seconds(hand, torch.tensor([[1, 2, 3, 4]]), n_tokens=3)
    assert 0 < seconds < 1


def test_kernel_swap_speedup_replaces_only_the_operators() -> None:
    from utils.variants import StepProfile, between_ops_gap, kernel_swap_speedup, profile_distortion

    base = StepProfile(matmul_s=0.007, op_s=0.009, step_s=0.010)  # 1 ms between the operators
    assert kernel_swap_speedup(base, StepProfile(0.002, 0.003, 0.005)) == pytest.approx(10 / 4)
    assert kernel_swap_speedup(base, StepProfile(0.007, 0.009, 0.011)) == pytest.approx(1.0)  # same operators
    assert kernel_swap_speedup(base, StepProfile(0.014, 0.017, 0.020)) == pytest.approx(10 / 18)  # slower: a loss
    # a variant whose faster matmuls come with more operators around them gains less than its matmuls say
    assert kernel_swap_speedup(base, StepProfile(0.002, 0.006, 0.008)) == pytest.approx(10 / 7)
    # time the variant spends outside its operators (a sleep, Python) is not in the prediction
    assert kernel_swap_speedup(base, StepProfile(0.002, 0.003, 0.500)) == pytest.approx(10 / 4)
    assert between_ops_gap(base, StepProfile(0.002, 0.003, 0.004)) == pytest.approx(0.0)
    assert between_ops_gap(base, StepProfile(0.002, 0.003, 0.500)) == pytest.approx((0.497 - 0.001) / 0.004)
    # profiles that find bf16 1.2x faster than fp32 where the timer found 1.0x carry a 20 % error
    assert profile_distortion(StepProfile(0, 0, 0.012), StepProfile(0, 0, 0.010), 1.0) == pytest.approx(0.2)
    assert profile_distortion(StepProfile(0, 0, 0.012), StepProfile(0, 0, 0.010), 1.2) == pytest.approx(0.0)


def test_profile_decode_step_times_the_same_tokens(tiny_pair) -> None:
    from utils.variants import profile_decode_step

    _, hand = tiny_pair
    profile = profile_decode_step(hand, torch.tensor([[1, 2, 3, 4]]), n_tokens=3)
    assert 0 < profile.matmul_s < profile.op_s < profile.step_s < 1
