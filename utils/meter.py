"""A per-request meter line, in the style of an inference engine's log.

llama.cpp prints, after each request::

    prompt eval time =   98.31 ms /    50 tokens (  1.97 ms per token,   508.6 tokens per second)
           eval time = 1234.50 ms /    31 runs   ( 39.82 ms per token,    25.1 tokens per second)
          total time = 1332.81 ms /    81 tokens

"prompt eval" is prefill, "eval" is decode. Reading these two lines tells which phase
ate the latency: a slow first line is a TTFT problem (long prompt, slow prefill), a
slow second line a decode problem (weight bytes, bandwidth, batch). :func:`diagnose`
says which, and names the knobs for it.
"""

from __future__ import annotations

from .engine import RequestMetrics


def meter_lines(m: RequestMetrics) -> list[str]:
    """The three meter lines for one request (prefill, decode, total)."""
    n_dec = max(m.output_tokens - 1, 0)
    pre_ms, dec_ms = 1e3 * m.ttft_s, 1e3 * m.decode_s
    dec_per = dec_ms / n_dec if n_dec else float("nan")
    dec_tps = 1e3 / dec_per if n_dec and dec_per > 0 else float("nan")
    return [
        f"prompt eval time = {pre_ms:10.2f} ms / {m.prompt_tokens:5d} tokens "
        f"({pre_ms / m.prompt_tokens:8.2f} ms per token, {1e3 * m.prompt_tokens / pre_ms:9.2f} tokens per second)",
        f"       eval time = {dec_ms:10.2f} ms / {n_dec:5d} runs   "
        f"({dec_per:8.2f} ms per token, {dec_tps:9.2f} tokens per second)",
        f"      total time = {1e3 * m.total_s:10.2f} ms / {m.prompt_tokens + m.output_tokens:5d} tokens",
    ]


def format_meter(m: RequestMetrics) -> str:
    """The meter lines joined into one printable block."""
    return "\n".join(meter_lines(m))


def diagnose(m: RequestMetrics) -> str:
    """Which phase ate this request's latency (by share of its total time), and the knobs for it."""
    ttft_share = m.ttft_s / m.total_s
    if ttft_share >= 0.5:
        return (f"TTFT-bound: {ttft_share:.0%} of the time in prefill ({m.prompt_tokens} prompt tokens). "
                "Knobs: shorter prompt, prefix caching, faster prefill (bf16 where it is faster, a GPU).")
    return (f"decode-bound: {1 - ttft_share:.0%} of the time in decode ({m.output_tokens} output tokens). "
            "Knobs: fewer output tokens, smaller or quantized weights, speculative decoding. (Batching "
            "raises a server's total tokens per second, not this request's: each user's decode gets slower.)")
