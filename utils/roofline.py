"""The arithmetic of generation: KV bytes, roofline ceilings, intensity, request time.

Pure functions on plain numbers, all in SI units so that they combine without
conversion factors:

=====================  ==========================================
quantity               unit
=====================  ==========================================
memory, weights, KV    bytes (B); 1 GB = 1e9 B, 1 GiB = 2**30 B
bandwidth              bytes per second (B/s); 1 TB/s = 1e12 B/s
compute                floating-point operations (FLOP)
compute rate           FLOP per second (FLOP/s); 1 TFLOP/s = 1e12
arithmetic intensity   FLOP per byte (FLOP/B)
speed                  tokens per second (tok/s)
time                   seconds (s)
=====================  ==========================================

The two ceilings the workbook measures against:

- **decode** makes one token per forward pass and must read every weight (and the
  KV cache so far) from memory for it: ``tok/s <= bandwidth / bytes read per token``.
  It is memory-bandwidth-bound.
- **prefill** runs the whole prompt through one pass; each weight read is reused for
  every prompt token, so the limit is arithmetic: ``tok/s <= FLOP/s / (2 x params)``.
  It is compute-bound.

Which one binds is the roofline model: a kernel doing ``I`` FLOP per byte moved runs
at ``min(peak FLOP/s, I x bandwidth)``; the *ridge point* ``peak / bandwidth`` is
the intensity where the two meet.

Bad input (a negative size, zero bandwidth, a fractional token count) raises a
:class:`~utils.errors.WorkbookError` that names the argument and its unit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from .errors import (InvalidTokenCountError, OutOfMemoryError, WorkbookError, check_count,
                     check_fraction, check_number)

GB = 1e9
"""Bytes in a (decimal) gigabyte, as vendors and these formulas count them."""


# ----------------------------------------------------------------------- KV cache


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int,
                       bytes_per_elem: float) -> float:
    """Bytes of KV cache one token adds to one sequence.

    ``2 x n_layers x n_kv_heads x head_dim x bytes_per_elem`` (B/token): a key and a
    value vector per KV head per layer. Grouped-query attention shrinks it by using
    fewer KV heads than query heads.

    Llama-3-8B in bf16: ``2 x 32 x 8 x 128 x 2 = 131,072`` B = 128 KiB per token.
    """
    layers = check_count(n_layers, "n_layers")
    heads = check_count(n_kv_heads, "n_kv_heads")
    dim = check_count(head_dim, "head_dim")
    size = check_number(bytes_per_elem, "bytes_per_elem", "bytes per element")
    per_token = 2 * layers * heads * dim * size
    return int(per_token) if per_token.is_integer() else per_token


def kv_cache_bytes(n_layers: int, n_kv_heads: int, head_dim: int, bytes_per_elem: float,
                   context_tokens: int, batch: int = 1) -> float:
    """Bytes of the whole KV cache: ``kv_bytes_per_token x context_tokens x batch`` (B).

    It grows linearly with context and with batch. Llama-3-8B in bf16 holds
    ~2.6 GB at 20,000 tokens and ~17.2 GB at 131,072 (128 Ki) tokens, per sequence.
    """
    per_token = kv_bytes_per_token(n_layers, n_kv_heads, head_dim, bytes_per_elem)
    tokens = check_count(context_tokens, "context_tokens", allow_zero=True, error=InvalidTokenCountError)
    return per_token * tokens * check_count(batch, "batch")


# ------------------------------------------------------------------------- decode


def weight_bytes(n_params: float, bytes_per_param: float) -> float:
    """Bytes of the weights: ``n_params x bytes_per_param`` (B).

    Bytes per parameter: fp32 4, bf16/fp16 2, int8 1, int4 0.5 (plus scales).
    """
    return (check_number(n_params, "n_params", "parameters")
            * check_number(bytes_per_param, "bytes_per_param", "bytes per parameter"))


def linear_bytes(shapes: Sequence[tuple[int, int]], bits: float, group: int | None = None,
                 scale_bits: int = 16, zero_point: bool = False) -> float:
    """Bytes of linear layers' weights stored at ``bits`` per weight (``shapes``: (out_features, in_features)).

    Each output row carries a scale of ``scale_bits`` (and a zero point of as many with ``zero_point``), or
    one per ``group`` inputs, a partial last group padded so it still has its own:
    ``out x (in x bits + ceil(in / group) x scale_bits x (2 if zero_point else 1)) / 8``.
    A float format has no scales: ``scale_bits=0``.
    """
    bits = check_number(bits, "bits", "bits per weight")
    total = 0.0
    for out_f, in_f in shapes:
        scales = 1 if group is None else math.ceil(check_count(in_f, "in_features") / check_count(group, "group"))
        total += check_count(out_f, "out_features") * (in_f * bits + scales * scale_bits * (2 if zero_point else 1)) / 8
    return total


def weight_bytes_read_per_token(n_params: float, bytes_per_param: float, vocab_size: int,
                                hidden_size: int, tied_embeddings: bool) -> float:
    """Weight bytes one decode step really reads (B): all weights but an untied input embedding.

    The input embedding is a lookup: a step reads one of its rows, not the whole table.
    With tied embeddings the same table is the LM head, which *is* read whole; untied,
    ``vocab x hidden`` parameters are skipped. Llama-3-8B in bf16 (untied, 128,256 x 4,096):
    ~16.06 GB stored, ~15.0 GB read per token.
    """
    params = check_number(n_params, "n_params", "parameters")
    size = check_number(bytes_per_param, "bytes_per_param", "bytes per parameter")
    skipped = 0 if tied_embeddings else check_count(vocab_size, "vocab_size") * check_count(hidden_size, "hidden_size")
    if skipped >= params:
        raise WorkbookError(f"n_params ({params:,.0f}) must exceed the embedding ({skipped:,}).")
    return (params - skipped) * size


def decode_bytes_per_token(weight_bytes: float, kv_bytes_per_token: float,
                           context_tokens: int) -> float:
    """Bytes one decode step reads from memory at batch 1 (B/token).

    ``weight_bytes + kv_bytes_per_token x context_tokens``: every weight once, plus
    the keys and values of every token already in the context. At short context the
    weights dominate; at long context the KV cache can rival them.
    """
    weights = check_number(weight_bytes, "weight_bytes", "bytes")
    per_token = check_number(kv_bytes_per_token, "kv_bytes_per_token", "bytes per token",
                        allow_zero=True)
    return weights + per_token * check_count(context_tokens, "context_tokens", allow_zero=True, error=InvalidTokenCountError)


def decode_ceiling_tok_s(bandwidth_bytes_s: float, bytes_per_token: float) -> float:
    """Fastest possible decode at batch 1: ``bandwidth / bytes read per token`` (tok/s).

    8 GB of weights at 400 GB/s: 50 tok/s. 40 GB at 1.2 TB/s: 30 tok/s. A measured
    speed close to this is bandwidth-bound; far below it, something else (kernel
    launch overhead, Python, poor kernels) is the limit.
    """
    bandwidth = check_number(bandwidth_bytes_s, "bandwidth_bytes_s", "bytes per second")
    return bandwidth / check_number(bytes_per_token, "bytes_per_token", "bytes per token")


# ------------------------------------------------------------------------ prefill


def attention_flops(n_layers: int, attn_dim: int, new_tokens: int, cached_tokens: int = 0) -> float:
    """FLOP of attention itself (scores and weighted sum) for ``new_tokens`` after ``cached_tokens``.

    The one formula every chapter uses. Per layer, a query at position ``p`` takes a
    dot product with ``p + 1`` keys (``q·kᵀ``: 2 x attn_dim x (p+1) FLOP) and sums as
    many values (another 2 x attn_dim x (p+1)). A **causal** mask means a query never
    looks ahead, so only the lower triangle of the score matrix is computed:
    ``4 x n_layers x attn_dim x Σ_p (p + 1)`` over the new positions
    ``p = cached .. cached + new - 1``. Prefill of T tokens (``cached = 0``): ``2·L·d·T(T+1)``,
    about half the full ``T x T`` square; one decode step at context c: ``4·L·d·(c+1)``.
    ``attn_dim`` is ``n_heads x head_dim`` (the hidden size in Llama models).
    """
    layers, dim = check_count(n_layers, "n_layers"), check_count(attn_dim, "attn_dim")
    new = check_count(new_tokens, "new_tokens", error=InvalidTokenCountError)
    old = check_count(cached_tokens, "cached_tokens", allow_zero=True, error=InvalidTokenCountError)
    keys_seen = new * old + new * (new + 1) / 2  # Σ (p + 1) over the new positions
    return 4.0 * layers * dim * keys_seen


def attention_score_bytes(n_layers: int, n_heads: int, new_tokens: int, cached_tokens: int = 0,
                          bytes_per_elem: float = 4, passes: int = 1) -> float:
    """Memory traffic of attention scores that are materialized (B): ``passes x L x H x new x (cached + new) x bytes``.

    An attention written as plain tensor operations (``q @ kᵀ``, scale, mask, softmax,
    ``@ v``) writes a ``[heads, new, cached + new]`` score matrix per layer -- the whole
    rectangle, masked part included -- and every following operation passes over it
    again: ``passes`` counts those writes and reads. It grows with the square of the
    context: 9 heads at 2,048 tokens in float32 is 151 MB per layer per pass. A fused
    kernel (FlashAttention, ``scaled_dot_product_attention`` on a GPU) keeps the scores
    in on-chip memory and moves none of these bytes.
    """
    layers, heads = check_count(n_layers, "n_layers"), check_count(n_heads, "n_heads")
    new = check_count(new_tokens, "new_tokens", error=InvalidTokenCountError)
    old = check_count(cached_tokens, "cached_tokens", allow_zero=True, error=InvalidTokenCountError)
    size = check_number(bytes_per_elem, "bytes_per_elem", "bytes per element")
    return float(check_count(passes, "passes") * layers * heads * new * (old + new) * size)


def prefill_flops(n_params: float, n_tokens: int, n_layers: int | None = None,
                  hidden_size: int | None = None) -> float:
    """Floating-point operations to prefill ``n_tokens`` prompt tokens (FLOP).

    Weights: ``2 x n_params x n_tokens`` -- each parameter does one multiply and one
    add per token (the embedding lookup is counted too, a small overestimate).

    Attention, added when ``n_layers`` and ``hidden_size`` are given:
    :func:`attention_flops` with the causal mask, ``2 x n_layers x hidden x T(T+1)``.
    It matters once ``n_tokens`` approaches ``n_params / (n_layers x hidden)``.
    """
    params = check_number(n_params, "n_params", "parameters")
    tokens = check_count(n_tokens, "n_tokens", error=InvalidTokenCountError)
    flops = 2.0 * params * tokens
    if (n_layers is None) != (hidden_size is None):
        raise WorkbookError("Give both n_layers and hidden_size for the attention term, "
                            "or neither for the weights-only estimate 2 x params x tokens.")
    if n_layers is not None:
        flops += attention_flops(n_layers, hidden_size, tokens)  # type: ignore[arg-type]
    return flops


def prefill_ceiling_tok_s(flops_per_s: float, n_params: float) -> float:
    """Fastest possible prefill: ``FLOP/s / (2 x n_params)`` (tok/s).

    The weights-only FLOP count; long prompts add attention work and run slower.
    """
    rate = check_number(flops_per_s, "flops_per_s", "FLOP per second")
    return rate / (2.0 * check_number(n_params, "n_params", "parameters"))


# ----------------------------------------------------------------------- roofline


def arithmetic_intensity(flops: float, bytes_moved: float) -> float:
    """Work per byte of memory traffic: ``flops / bytes`` (FLOP/B)."""
    work = check_number(flops, "flops", "FLOP", allow_zero=True)
    return work / check_number(bytes_moved, "bytes_moved", "bytes")


def ridge_point(peak_flops: float, bandwidth_bytes_s: float) -> float:
    """Intensity where the roofline bends: ``peak FLOP/s / bandwidth`` (FLOP/B).

    Below it a kernel is memory-bound, above it compute-bound. H100 SXM in bf16:
    989e12 / 3.35e12 ~ 295 FLOP/B.
    """
    peak = check_number(peak_flops, "peak_flops", "FLOP per second")
    return peak / check_number(bandwidth_bytes_s, "bandwidth_bytes_s", "bytes per second")


def decode_intensity(bytes_per_param: float, batch: int = 1) -> float:
    """Intensity of one decode step over the weights: ``2 x batch / bytes_per_param``.

    Each weight read (``bytes_per_param`` bytes) does one multiply-add (2 FLOP) per
    sequence in the batch. bf16 at batch 1: 1 FLOP/B -- hundreds of times below a
    GPU's ridge point, hence bandwidth-bound. (KV-cache reads are left out; they add
    bytes and keep decode attention near 1 FLOP/B at any batch.)
    """
    size = check_number(bytes_per_param, "bytes_per_param", "bytes per parameter")
    return 2.0 * check_count(batch, "batch") / size


def crossover_batch(peak_flops: float, bandwidth_bytes_s: float,
                    bytes_per_param: float) -> float:
    """Batch at which decode stops being memory-bound: ``ridge x bytes_per_param / 2``.

    Below it, a larger batch is nearly free (same bytes, more tokens); above it, the
    step time grows with the batch. H100 SXM in bf16: ~295 sequences.
    """
    ridge = ridge_point(peak_flops, bandwidth_bytes_s)
    return ridge * check_number(bytes_per_param, "bytes_per_param", "bytes per parameter") / 2.0


# -------------------------------------------------------------- the whole request


@dataclass(frozen=True)
class RequestTime:
    """Where the time of one request goes (seconds, and shares of the total)."""

    ttft_s: float
    """Time to first token ~ prefill: ``prompt_tokens / prefill_tok_s``."""
    decode_s: float
    """Time to generate the output: ``output_tokens / decode_tok_s``."""
    total_s: float
    ttft_share: float
    """``ttft_s / total_s``, between 0 and 1."""
    decode_share: float
    """``decode_s / total_s``, between 0 and 1."""

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def request_time(prompt_tokens: int, prefill_tok_s: float, output_tokens: int,
                 decode_tok_s: float) -> RequestTime:
    """The total-time model: ``total = prompt / prefill speed + output / decode speed``.

    1,000 prompt tokens at 2,000 tok/s plus 300 output tokens at 40 tok/s:
    0.5 s + 7.5 s = 8.0 s, 94% of it decoding. A 12,000-token RAG prompt at
    1,500 tok/s plus 500 out at 40 tok/s: 8.0 s + 12.5 s = 20.5 s, 39% in TTFT.
    Output tokens cost far more time each than input tokens.
    """
    prompt = check_count(prompt_tokens, "prompt_tokens", error=InvalidTokenCountError)
    output = check_count(output_tokens, "output_tokens", allow_zero=True, error=InvalidTokenCountError)
    ttft = prompt / check_number(prefill_tok_s, "prefill_tok_s", "tokens per second")
    decode = output / check_number(decode_tok_s, "decode_tok_s", "tokens per second")
    total = ttft + decode
    return RequestTime(ttft_s=ttft, decode_s=decode, total_s=total,
                       ttft_share=ttft / total, decode_share=decode / total)


def ceiling_speeds(n_params: float, bytes_per_param: float, peak_flops: float, bandwidth_bytes_s: float,
                   bytes_read_per_token: float | None = None) -> tuple[float, float]:
    """(prefill, decode) tok/s at an accelerator's ceilings for a model of ``n_params`` weights.

    Prefill at the FLOP/s ceiling (:func:`prefill_ceiling_tok_s`), decode at the bandwidth
    ceiling (:func:`decode_ceiling_tok_s`) over ``bytes_read_per_token`` -- by default every
    weight (``n_params x bytes_per_param``); give :func:`weight_bytes_read_per_token` for a
    model with an untied input embedding. Weights only: attention FLOPs and the KV-cache
    read are left out, so these are upper bounds on speed.
    """
    read = (weight_bytes(n_params, bytes_per_param) if bytes_read_per_token is None
            else check_number(bytes_read_per_token, "bytes_read_per_token", "bytes per token"))
    return prefill_ceiling_tok_s(peak_flops, n_params), decode_ceiling_tok_s(bandwidth_bytes_s, read)


def request_time_at_ceilings(prompt_tokens: int, output_tokens: int, n_params: float, bytes_per_param: float,
                             peak_flops: float, bandwidth_bytes_s: float,
                             bytes_read_per_token: float | None = None) -> RequestTime:
    """:func:`request_time` at the speeds of :func:`ceiling_speeds`: the least time a request can take.

    Llama-3-8B in bf16 on an H100 SXM (989.4 TFLOP/s, 3.35 TB/s, ~15.0 GB read per token):
    1,000 prompt + 300 output tokens take at least ~0.016 s + ~1.34 s.
    """
    pf, dc = ceiling_speeds(n_params, bytes_per_param, peak_flops, bandwidth_bytes_s, bytes_read_per_token)
    return request_time(prompt_tokens, pf, output_tokens, dc)


def request_cost(input_tokens: int, output_tokens: int, usd_per_m_input: float,
                 usd_per_m_output: float, cached_input_tokens: int = 0,
                 usd_per_m_cached_input: float | None = None) -> float:
    """Price of one request in USD: tokens x (price per million tokens) / 1e6.

    Input and output are priced separately (output is dearer: each output token is a
    sequential decode step, the input one parallel prefill). ``cached_input_tokens`` of
    the input, if any, are billed at ``usd_per_m_cached_input`` (prompt caching).
    """
    n_in = check_count(input_tokens, "input_tokens", allow_zero=True, error=InvalidTokenCountError)
    n_out = check_count(output_tokens, "output_tokens", allow_zero=True, error=InvalidTokenCountError)
    n_cached = check_count(cached_input_tokens, "cached_input_tokens", allow_zero=True,
                           error=InvalidTokenCountError)
    if n_cached > n_in:
        raise WorkbookError(f"cached_input_tokens ({n_cached}) cannot exceed input_tokens ({n_in}).")
    p_in = check_number(usd_per_m_input, "usd_per_m_input", "USD per million tokens", allow_zero=True)
    p_out = check_number(usd_per_m_output, "usd_per_m_output", "USD per million tokens", allow_zero=True)
    p_cached = p_in if usd_per_m_cached_input is None else check_number(
        usd_per_m_cached_input, "usd_per_m_cached_input", "USD per million tokens", allow_zero=True)
    return ((n_in - n_cached) * p_in + n_cached * p_cached + n_out * p_out) / 1e6


def cost_per_million_tokens(usd_per_hour: float, tok_s: float) -> float:
    """What a million tokens cost on a machine rented at ``usd_per_hour`` making ``tok_s`` (USD).

    ``usd_per_hour / 3,600 s / tok_s x 1e6``: the machine's price per second divided by
    the tokens it makes per second. At $2/h, 1,000 tok/s costs ~$0.56 per million tokens;
    40 tok/s costs ~$13.9. A fully busy machine is assumed: idle time costs the same.
    """
    price = check_number(usd_per_hour, "usd_per_hour", "USD per hour")
    return price / 3600.0 / check_number(tok_s, "tok_s", "tokens per second") * 1e6


@dataclass(frozen=True)
class TokenCosts:
    """Cost per million input (prefill) and output (decode) tokens on one machine (USD)."""

    input_usd_per_m: float
    output_usd_per_m: float

    @property
    def output_over_input(self) -> float:
        """How many times dearer an output token is than an input token."""
        return self.output_usd_per_m / self.input_usd_per_m


def token_costs(usd_per_hour: float, prefill_tok_s: float, decode_tok_s: float) -> TokenCosts:
    """Input and output cost per million tokens from the two phases' speeds on one machine.

    ``decode_tok_s`` is the machine's aggregate output rate: at batch ``B``,
    ``B / step time``. Batching raises it (the weights are read once per step for every
    row), so the ratio output/input falls with the batch: at batch 1 it is about
    ``prefill tok/s / decode tok/s``, often 20-100x; a busy server runs it down to a few x.
    """
    return TokenCosts(cost_per_million_tokens(usd_per_hour, prefill_tok_s),
                      cost_per_million_tokens(usd_per_hour, decode_tok_s))


# ------------------------------------------------------------------------ capacity


def max_context_tokens(memory_bytes: float, weight_bytes: float, kv_bytes_per_token: float,
                       batch: int = 1, reserve_fraction: float = 0.1) -> int:
    """How many context tokens per sequence fit in memory beside the weights.

    ``floor((memory x (1 - reserve) - weights) / (kv_bytes_per_token x batch))``.
    ``reserve_fraction`` keeps room for activations, the allocator and the runtime.
    An 8B bf16 model (16 GB) on an 80 GB GPU with 10% reserve leaves 56 GB:
    ~427k tokens of 128 KiB each at batch 1, ~53k per sequence at batch 8.

    Raises :class:`~utils.errors.OutOfMemoryError` if the weights alone do not fit.
    """
    memory = check_number(memory_bytes, "memory_bytes", "bytes")
    weights = check_number(weight_bytes, "weight_bytes", "bytes")
    per_token = check_number(kv_bytes_per_token, "kv_bytes_per_token", "bytes per token")
    seqs = check_count(batch, "batch")
    usable = memory * (1.0 - check_fraction(reserve_fraction, "reserve_fraction"))
    if weights >= usable:
        raise OutOfMemoryError(
            f"The weights ({weights / GB:.2f} GB) leave no room for a KV cache in "
            f"{usable / GB:.2f} GB usable memory ({memory / GB:.2f} GB minus "
            f"{reserve_fraction:.0%} reserve). Use a smaller dtype (bf16, int8, int4) "
            "or a smaller model.")
    return math.floor((usable - weights) / (per_token * seqs))


def tokens_that_fit(memory_bytes: float, weight_bytes: float, kv_bytes_per_token: float,
                    batch: int = 1, reserve_fraction: float = 0.1) -> int | None:
    """:func:`max_context_tokens`, or None where the weights alone leave no room (for tables of many cases)."""
    try:
        return max_context_tokens(memory_bytes, weight_bytes, kv_bytes_per_token, batch, reserve_fraction)
    except OutOfMemoryError:
        return None


def max_sequences(memory_bytes: float, weight_bytes: float, kv_bytes_per_token: float,
                  context_tokens: int, reserve_fraction: float = 0.1) -> int:
    """How many sequences of ``context_tokens`` each fit in memory beside the weights.

    ``floor((memory x (1 - reserve) - weights) / (kv_bytes_per_token x context))``: the
    batch that memory allows, whatever compute would allow. An 8B bf16 model on an 80 GB
    GPU at 32k context (4 GiB of KV each): 13 sequences.

    Raises :class:`~utils.errors.OutOfMemoryError` if the weights alone do not fit.
    """
    per_sequence_tokens = max_context_tokens(memory_bytes, weight_bytes, kv_bytes_per_token,
                                             reserve_fraction=reserve_fraction)
    context = check_count(context_tokens, "context_tokens", error=InvalidTokenCountError)
    return per_sequence_tokens // context


# ----------------------------------------------------------------------- the chapters' timing predictions


def prefill_params(weight_bytes_read_per_token: float, bytes_per_param: float, vocab_size: int,
                   hidden_size: int) -> float:
    """Parameters every prompt token goes through in a prefill pass (chapter 03's ``P``).

    The weights a decode step reads, less the LM head (``vocab x hidden``), which a prefill
    runs on the last position only; the input embedding is a lookup, not a matmul.
    """
    params = check_number(weight_bytes_read_per_token, "weight_bytes_read_per_token", "bytes") / check_number(
        bytes_per_param, "bytes_per_param", "bytes per parameter")
    head = check_count(vocab_size, "vocab_size") * check_count(hidden_size, "hidden_size")
    if params <= head:
        raise WorkbookError(f"{params:,.0f} parameters read per token leave none beside a {head:,}-weight LM head.")
    return params - head


def pass_flops(prompt_params: float, n_tokens: int, n_layers: int, attn_dim: int, head_params: float) -> float:
    """FLOP of one forward pass over ``n_tokens`` that keeps the last position's logits only.

    What a prefill computes, and what a decode step *without* a cache recomputes at context
    ``n_tokens``: every token through the ``prompt_params`` (:func:`prefill_params`), causal
    attention (:func:`attention_flops`), and the LM head (``head_params`` = vocab x hidden) once.
    """
    head = check_number(head_params, "head_params", "parameters")
    return prefill_flops(prompt_params, n_tokens, n_layers, attn_dim) + 2.0 * head


def prefill_over_decode(flops_per_s: float, bandwidth_bytes_s: float, prompt_params: float,
                        bytes_read_per_token: float) -> float:
    """How many times decode's tok/s prefill makes, at the two ceilings (the prediction of 03, 04, 06).

    Compute-bound prefill, ``FLOP/s / (2 x prompt_params)``, over bandwidth-bound decode,
    ``bandwidth / bytes read per token``. Measured decode on a CPU usually sits well below
    its ceiling, so the measured ratio is usually larger: a conservative prediction.
    """
    prefill, decode = ceiling_speeds(prompt_params, 1.0, flops_per_s, bandwidth_bytes_s, bytes_read_per_token)
    return prefill / decode


def growth_with_fixed_cost(fixed_s: float, work_short_s: float, work_long_s: float) -> float:
    """``(fixed + long) / (fixed + short)``: how much longer the longer pass takes when every pass
    also costs ``fixed_s`` (chapter 03: TTFT from the shortest to the longest prompt, with a
    one-token pass as the fixed cost and FLOPs / FLOP/s as the work)."""
    fixed = check_number(fixed_s, "fixed_s", "seconds")
    short = check_number(work_short_s, "work_short_s", "seconds", allow_zero=True)
    return (fixed + check_number(work_long_s, "work_long_s", "seconds", allow_zero=True)) / (fixed + short)


@dataclass(frozen=True)
class CacheStepModel:
    """Chapter 05's time model of one step at context ``c``, without and with a KV cache (seconds).

    Without: ``fixed + (2 x block_params x c + square x attention FLOPs) / FLOP/s``; with:
    ``fixed + KV bytes of c tokens / bandwidth``; each plus, with ``traffic``, the score matrix's
    passes over memory (:func:`attention_score_bytes`). ``fixed_s``: a one-token pass measured on
    its own (a decode step at a short context), never the step being predicted.
    """

    fixed_s: float
    flops_per_s: float
    bandwidth_bytes_s: float
    block_params: float
    kv_bytes_per_token: float
    n_layers: int
    n_heads: int
    head_dim: int
    square: int = 2  # a hand-written attention computes the whole c x c square: twice the causal triangle
    score_passes: int = 8
    score_bytes: float = 4

    def score_traffic_s(self, new: int, cached: int) -> float:
        nbytes = attention_score_bytes(self.n_layers, self.n_heads, new, cached, self.score_bytes, self.score_passes)
        return nbytes / self.bandwidth_bytes_s

    def no_cache_s(self, c: int, traffic: bool = True) -> float:
        """One step that runs all ``c`` tokens again."""
        flops = 2 * self.block_params * c + self.square * attention_flops(self.n_layers, self.n_heads * self.head_dim, c)
        return self.fixed_s + flops / self.flops_per_s + (self.score_traffic_s(c, 0) if traffic else 0.0)

    def cached_s(self, c: int, traffic: bool = True) -> float:
        """One step of one new token over ``c`` cached ones."""
        kv = self.kv_bytes_per_token * c / self.bandwidth_bytes_s
        return self.fixed_s + kv + (self.score_traffic_s(1, c) if traffic else 0.0)


# ----------------------------------------------------------------------------- the cost of a prefill pass, fitted


@dataclass(frozen=True)
class PrefillFit:
    """Measured prefill passes fitted to the physics: ``TTFT(n) = fixed + n x per_token + n(n+1)/2 x per_pair``.

    ``fixed_s``: what every pass costs whatever its length (operators launched, every weight read
    once); ``per_token_s``: one more prompt token through the weights' matmuls; ``per_pair_s``: one
    more causal query-key pair of attention (``n(n+1)/2`` of them, :func:`attention_flops`). All three
    are >= 0: no term of the physics saves time. ``worst_residual``: the largest
    ``|fit - measured| / measured`` over the points fitted.
    """

    fixed_s: float
    per_token_s: float
    per_pair_s: float
    worst_residual: float

    def seconds(self, n_tokens: int) -> float:
        """The fitted time of one pass over ``n_tokens`` (a prediction beyond the lengths measured)."""
        n = check_count(n_tokens, "n_tokens", error=InvalidTokenCountError)
        return self.fixed_s + n * self.per_token_s + n * (n + 1) / 2 * self.per_pair_s

    @property
    def rate_tok_s(self) -> float:
        """Prompt tokens per second at the margin, before attention: ``1 / per_token_s``."""
        return 1.0 / self.per_token_s

    def attention_share(self, n_tokens: int) -> float:
        """The part of ``seconds(n)`` the attention term accounts for."""
        n = check_count(n_tokens, "n_tokens", error=InvalidTokenCountError)
        return n * (n + 1) / 2 * self.per_pair_s / self.seconds(n)

    def __str__(self) -> str:
        pair = f" + n(n+1)/2 x {self.per_pair_s * 1e9:.3g} ns" if self.per_pair_s else ""
        return f"TTFT(n) = {self.fixed_s * 1e3:.1f} ms + n x {self.per_token_s * 1e3:.3f} ms{pair}"


def fit_prefill_time(lengths: Sequence[int], seconds: Sequence[float], *,
                     attention: bool | None = None) -> PrefillFit:
    """:class:`PrefillFit` of measured passes: least squares on the **relative** error, every term >= 0.

    Each point is weighted by 1 / its own time, so a noisy long prompt cannot pull the fixed cost
    below zero (an unweighted line through 16 .. 1,024 tokens can). The terms are fitted by trying
    every subset that keeps the per-token term and keeping the best fit whose coefficients are all
    >= 0 (non-negative least squares, exact for three terms). ``attention``: fit the quadratic term;
    by default only from 4 distinct lengths up (three terms need a point left over to be tested).
    """
    n = np.array([check_count(x, "prefill tokens", error=InvalidTokenCountError) for x in lengths], dtype=float)
    s = np.array([check_number(x, "prefill seconds", "s") for x in seconds], dtype=float)
    if len(n) != len(s) or not len(n):
        raise WorkbookError(f"fit_prefill_time needs one time per length (got {len(n)} lengths, {len(s)} times).")
    distinct = len(set(n.tolist()))
    if distinct >= 2 and np.polyfit(n, s, 1)[0] <= 0:
        raise WorkbookError("The prefill times do not grow with the prompt length: measure a wider "
                            f"range of lengths (got {list(zip(n.tolist(), s.tolist()))}).")
    attention = distinct >= 4 if attention is None else attention
    columns = np.stack([np.ones_like(n), n, n * (n + 1) / 2], axis=1) / s[:, None]  # rows weighted by 1 / s
    candidates = ([(1,), (0, 1)] + ([(1, 2), (0, 1, 2)] if attention else [])) if distinct >= 2 else [(1,)]
    best: tuple[float, np.ndarray] | None = None
    for keep in candidates:
        coef, *_ = np.linalg.lstsq(columns[:, keep], np.ones_like(s), rcond=None)
        if coef.min() < 0 or coef[keep.index(1)] <= 0:
            continue  # a negative term: not the physics
        full = np.zeros(3)
        full[list(keep)] = coef
        error = float(np.sum((columns @ full - 1.0) ** 2))
        if best is None or error < best[0] - 1e-12:  # a tie keeps the fewer terms (tried first)
            best = (error, full)
    assert best is not None  # the per-token term alone always fits times that grow
    full = best[1]
    worst = float(np.max(np.abs(columns @ full - 1.0)))
    return PrefillFit(float(full[0]), float(full[1]), float(full[2]), worst)
