"""The hand-written Llama (utils.llama, utils.llama_phases) against transformers: same logits, same tokens.

``lm`` (conftest.py) is the embedded model in float32 on CPU.

Tolerance: fp32 logits within 1e-4 of transformers (observed: 0 to 6e-5; both run
the same math, in a different order for the fused projections).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from utils import engine as E
from utils import llama as L
from utils import llama_phases as P
from utils.sampling import Sampling
from utils.shapes import llama_param_count
from utils.errors import (
    EmptyPromptError,
    InvalidTokenCountError,
    InvalidTokenIdError,
    PromptTooLongError,
    UnsupportedArchitectureError,
    WorkbookError,
)

ATOL = 1e-4
CHAT = ["Write a short poem about the sea.", "Explain what a KV cache is, in one paragraph.",
        "List three uses of a hammer, with one sentence about each of them, please."]
N_NEW = 32


@pytest.fixture(scope="module")
def model(lm):
    return L.Llama.from_hf(lm.model)


def chat_ids(tok, text: str) -> torch.Tensor:
    msgs = [{"role": "user", "content": text}]
    s = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tok(s, return_tensors="pt").input_ids


def left_padded(tok, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [tok(t).input_ids for t in texts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


# ----------------------------------------------------------------------------- the embedded model


def test_logits_match_transformers(lm, model):
    ids, mask = left_padded(lm.tokenizer, ["The capital of France is", "Hello"])
    with torch.inference_mode():
        ref = lm.model(input_ids=ids, attention_mask=mask).logits
    ours = P.forward_no_cache(model, ids, mask)
    real = mask.bool()  # padding positions are garbage in both: compare real tokens only
    diff = (ref[real] - ours[real]).abs().max().item()
    assert diff < ATOL, f"max |logit difference| {diff:.2e} >= {ATOL}"


@pytest.fixture(scope="module")
def chat(lm, model):
    """The CHAT prompts (3 different lengths) and our greedy tokens for each, run alone."""
    prompts = [chat_ids(lm.tokenizer, t) for t in CHAT]
    return prompts, [E.generate(model, p, N_NEW, eos_token_id=lm.tokenizer.eos_token_id)[0]
                     for p in prompts]


def test_greedy_matches_transformers_generate(lm, chat):
    eos = lm.tokenizer.eos_token_id
    for text, ids, ours in zip(CHAT, *chat):
        ref = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW,
                                do_sample=False, pad_token_id=eos)[0, ids.shape[1]:]
        assert len(ref) == N_NEW, "prompt should not stop early: pick another"
        assert ours.tolist() == ref.tolist(), text


def test_batch_left_padded_equals_alone(lm, model, chat):
    prompts, alone = chat
    assert len({p.shape[1] for p in prompts}) == 3  # three different lengths
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((3, width), lm.tokenizer.pad_token_id)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - p.shape[1]:], mask[i, width - p.shape[1]:] = p[0], 1
    batched = E.generate(model, ids, N_NEW, mask)
    for i, text in enumerate(CHAT):
        assert batched[i].tolist() == alone[i].tolist(), text


def test_cached_equals_no_cache(model, chat):
    (ids, *_), (alone, *_) = chat
    assert E.generate_no_cache(model, ids, 8)[0].tolist() == alone[:8].tolist()


def test_static_cache_equals_filled_only(model, chat):
    """The compile-ready path (attend to all slots, masked) gives the same tokens."""
    (ids, *_), (alone, *_) = chat
    assert E.generate(model, ids, 8, static=True)[0].tolist() == alone[:8].tolist()


def test_sampling_is_reproducible(model, chat):
    (ids, *_), (alone, *_) = chat
    draw = [E.generate(model, ids, 4, sampling=Sampling(0.8, top_k=20, seed=0)) for _ in range(2)]
    assert draw[0].tolist() == draw[1].tolist()
    assert E.generate(model, ids, 4, sampling=Sampling(1.0, top_k=1))[0].tolist() == alone[:4].tolist()


def test_extend_equals_full_pass(lm, model):
    """Prefill, then append 3 tokens at once (a speculative verify step): same logits."""
    ids = lm.tokenizer("One, two, three, four, five", return_tensors="pt").input_ids
    cache = model.new_cache(1, ids.shape[1])
    P.prefill(model, cache, ids[:, :-3])
    tail = P.extend(model, cache, ids[:, -3:])
    full = P.forward_no_cache(model, ids)[:, -3:]
    assert (tail - full).abs().max().item() < ATOL
    assert cache.length == ids.shape[1]


def test_seeded_top_p_sampling_is_reproducible_and_top_p_tiny_is_greedy(lm, model):
    ids = lm.tokenizer("My favourite colour is", return_tensors="pt").input_ids
    draw = [E.generate(model, ids, 8, sampling=Sampling(0.8, top_p=0.9, seed=0)) for _ in range(2)]
    assert draw[0].tolist() == draw[1].tolist()
    assert E.generate(model, ids, 8, sampling=Sampling(1.0, top_p=1e-6)).tolist() == E.generate(model, ids, 8).tolist()


def test_kv_cache_bytes_equal_formula(lm, model):
    s = lm.spec
    for batch, context in [(1, 100), (3, 257)]:
        cache = model.new_cache(batch, context)
        per_token = 2 * s.n_layers * s.n_kv_heads * s.head_dim * cache.k.element_size()
        assert cache.nbytes == per_token * context * batch
    assert model.new_cache(1, 1000).nbytes == s.kv_bytes_per_token * 1000
    assert 2 * 32 * 8 * 128 * 2 == 131_072  # the 8B example: 128 KiB per token in bf16


def test_projections_are_swappable(model):
    names = [n for n, _ in L.iter_linears(model)]
    assert len(names) == 4 * model.args.n_layers + 1 and names[-1] == "lm_head"
    assert all(isinstance(m, nn.Linear) for _, m in L.iter_linears(model))

    class Wrapped(nn.Module):  # a stand-in with the same call signature
        def __init__(self, inner: nn.Linear) -> None:
            super().__init__()
            self.inner, self.in_features, self.out_features = inner, inner.in_features, inner.out_features

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    ids = torch.tensor([[1, 2, 3, 4]])
    before = P.forward_no_cache(model, ids)
    old = L.replace_linear(model, "layers.0.mlp.down_proj", Wrapped(model.layers[0].mlp.down_proj))
    try:
        assert torch.equal(P.forward_no_cache(model, ids), before)
        assert dict(L.iter_linears(model))["layers.0.mlp.down_proj"] is not old
        with pytest.raises(KeyError, match="not a projection"):
            L.replace_linear(model, "layers.0.mlp.nope", old)
        with pytest.raises(ValueError, match="in_features"):
            L.replace_linear(model, "layers.0.attn.o_proj", nn.Linear(3, model.args.hidden_size))
    finally:
        L.replace_linear(model, "layers.0.mlp.down_proj", old)


# ----------------------------------------------------------------------------- clear errors


def test_errors(lm, model):
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(EmptyPromptError, match="empty"):
        E.generate(model, torch.zeros(1, 0, dtype=torch.long), 4)
    with pytest.raises(EmptyPromptError, match="all padding"):
        E.generate(model, ids, 4, torch.tensor([[0, 0, 0]]))
    for bad in (0, -3):
        with pytest.raises(InvalidTokenCountError, match="max_new_tokens must be a positive whole number"):
            E.generate(model, ids, bad)
    ctx = lm.spec.max_context
    with pytest.raises(PromptTooLongError, match=f"3 tokens and {ctx} more.*{ctx + 3} in all.*holds {ctx}"):
        E.generate(model, ids, ctx)
    with pytest.raises(PromptTooLongError, match="holds 2"):
        P.prefill(model, model.new_cache(1, 2), ids)
    cache = model.new_cache(1, 3)
    P.prefill(model, cache, ids)
    with pytest.raises(PromptTooLongError, match="cache is full: 3 of 3"):
        P.decode_one_token(model, cache, torch.tensor([5]))
    with pytest.raises(WorkbookError, match="LEFT-padded"):
        E.generate(model, ids, 2, torch.tensor([[1, 1, 0]]))
    with pytest.raises(InvalidTokenIdError, match=f"Token id {lm.spec.vocab_size} is outside the vocabulary"):
        E.generate(model, torch.tensor([[1, lm.spec.vocab_size]]), 2)
    with pytest.raises(InvalidTokenIdError, match="Token id -1"):
        E.generate(lm.model, torch.tensor([[1, -1]]), 2)


def test_unsupported_architecture_is_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=16))
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        L.Llama.from_hf(gpt2)


# ----------------------------------------------------------------------------- other Llama-family models


def tiny(kind: str) -> nn.Module:
    """A random 2-layer model of each supported family, exercising what SmolLM2 does not."""
    import transformers as tf

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  eos_token_id=None, bos_token_id=None, pad_token_id=0)
    if kind == "llama3-untied-bias":
        rope = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=16)
        cfg = tf.LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False,
                             attention_bias=True, mlp_bias=True)
        cls = tf.LlamaForCausalLM
    elif kind == "qwen2":
        cfg, cls = tf.Qwen2Config(**common, tie_word_embeddings=True), tf.Qwen2ForCausalLM
    else:  # mistral, with a sliding window shorter than the sequence
        cfg, cls = tf.MistralConfig(**common, sliding_window=5, head_dim=24), tf.MistralForCausalLM
    torch.manual_seed(0)
    return cls(cfg).eval()


@pytest.mark.parametrize("kind", ["llama3-untied-bias", "qwen2", "mistral"])
def test_the_shape_read_off_a_model_counts_its_parameters(kind):
    hf = tiny(kind)
    shape = L.args_from_hf(hf)
    counted = sum(p.numel() for p in hf.parameters())
    assert shape.n_params == counted == llama_param_count(shape)  # the formula knows biases, GQA, tying
    assert shape.changed().n_params == counted  # counted again from the shape alone
    assert shape.qkv_bias == (kind != "mistral") and shape.mlp_bias == (kind == "llama3-untied-bias")
    assert shape.windows == ((5, 5) if kind == "mistral" else ())


@pytest.mark.parametrize("kind", ["llama3-untied-bias", "qwen2", "mistral"])
def test_llama_family_matches_transformers(kind):
    hf = tiny(kind)
    model = L.Llama.from_hf(hf)
    assert torch.allclose(model.rope.inv_freq, hf.model.rotary_emb.inv_freq)
    ids = torch.randint(1, 96, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # second row left-padded
    with torch.inference_mode():
        ref = hf(input_ids=ids, attention_mask=mask).logits
    ours = P.forward_no_cache(model, ids, mask)
    assert (ref[mask.bool()] - ours[mask.bool()]).abs().max().item() < ATOL
    gen = hf.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=12, do_sample=False)
    assert E.generate(model, ids[:1], 12).tolist() == gen[:, 20:].tolist()


def test_batch_that_does_not_fit_is_a_clear_error(lm):
    from utils import llama
    from utils.errors import OutOfMemoryError

    model = llama.Llama.from_hf(lm.model)
    with pytest.raises(OutOfMemoryError, match=r"KV cache for 100000 sequence\(s\).*Reduce the batch size"):
        model.new_cache(batch=100_000, max_len=8_192)


def test_attention_decodes_with_the_cpu_kernel_and_prefills_with_pytorch(monkeypatch):
    """A decode query (T = 1) on a CPU goes to the workbook's kernel, bf16 or float32 (the float32 answer is
    PyTorch's up to float32 rounding), not float64 (PyTorch's float64 answer); a prefill (T > 1) to PyTorch's (a bf16 cache read in float32); with
    $WORKBOOK_CPU_ATTENTION=0 decode goes to PyTorch's."""
    from test_cpu_attention import pytorch_attention
    from utils import cpu_attention

    calls = []
    real = cpu_attention.decode_attention
    monkeypatch.setattr(cpu_attention, "decode_attention", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(1, 2, 40, 16, generator=g).bfloat16() for _ in range(2))
    one, four = torch.randn(1, 6, 1, 16, generator=g).bfloat16(), torch.randn(1, 6, 4, 16, generator=g).bfloat16()
    mask1, mask4 = torch.arange(40)[None, None, None] < 33, torch.ones(1, 1, 4, 40, dtype=torch.bool)
    L.attention(one, k, v, mask1)
    assert calls == [1]
    assert torch.equal(L.attention(four, k, v, mask4), pytorch_attention(four, k, v, mask4))
    assert calls == [1]
    one32, k32, v32 = one.float(), k.float(), v.float()
    torch.testing.assert_close(L.attention(one32, k32, v32, mask1), pytorch_attention(one32, k32, v32, mask1),
                               atol=1e-5, rtol=1e-5)
    assert calls == [1, 1]
    one64, k64, v64 = one.double(), k.double(), v.double()  # a float64 reference stays on PyTorch's, in float64
    assert torch.equal(L.attention(one64, k64, v64, mask1), nn.functional.scaled_dot_product_attention(
        one64, k64, v64, attn_mask=mask1, enable_gqa=True))
    assert calls == [1, 1]
    monkeypatch.setenv("WORKBOOK_CPU_ATTENTION", "0")
    assert torch.equal(L.attention(one, k, v, mask1), pytorch_attention(one, k, v, mask1))
    assert torch.equal(L.attention(one32, k32, v32, mask1), pytorch_attention(one32, k32, v32, mask1))
    assert calls == [1, 1]
