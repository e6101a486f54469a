"""The roofline table: each way of decoding measured as one row, as the roofline lab and ``make bench`` print it.

A :class:`Row` holds a decode loop's speed at one context, the bytes it reads per token (weights as
stored plus the KV cache one step reads, :func:`step_bytes`), its share of the ceiling
``bandwidth / bytes`` and whether its greedy tokens equal its reference's
(:func:`agreement_column`; where they part, :func:`divergence` gives the logit gap there, a near-tie
below :data:`NEAR_TIE`). :func:`eager_row` times a loop of :mod:`utils.engine`,
:func:`decoder_row` a :class:`utils.fast.FastDecoder`, :func:`llama_cpp_row` llama.cpp on the embedded
GGUF file (:mod:`utils.peer`); :func:`print_rows` prints the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from . import engine, llama_phases, peer
from .fast import FastDecoder, fast_decode_speed
from .llama import Llama
from .models import EMBEDDED, LoadedModel
from .roofline import kv_bytes_per_token
from .tokens import filler_ids
from .variants import bytes_read_per_token, tokens_agreed


@dataclass
class Row:
    """One way of decoding, measured: a row of the roofline lab's table and of ``make bench``.

    ``bytes_per_token``: weights as stored plus the KV cache one step reads at this context.
    ``agree``: leading greedy tokens equal to ``reference`` (the eager loop in the same dtype;
    a quantized row: its own model's eager loop), e.g. ``"64/64 vs eager bfloat16"``.
    """

    name: str
    weights: str
    context: int
    tok_s: float
    bytes_per_token: float
    agree: str = ""
    compile_s: float | None = None
    noisy: bool = False
    tokens: list[int] = field(default_factory=list, repr=False)
    spread: float = 0.0  # relative spread (IQR / median) of the timed repeats, for utils.decide
    text: str = field(default="", repr=False)  # a peer's output as text (to compare a server's stream with)
    split: tuple[int, float] | None = None  # where the tokens part from the reference, and the logit gap there
    compiled_how: str = ""  # a packaged step: "built" or "loaded" (utils.fast.PackagedStep); "" otherwise
    reload_s: float | None = None  # a step built here, loaded again from disk by a new decoder (a second process's wait)

    def share(self, bandwidth: float) -> float:
        """Share of the ceiling ``bandwidth / bytes_per_token`` this row reaches."""
        return self.tok_s * self.bytes_per_token / bandwidth

    def as_dict(self, bandwidth: float, baseline_tok_s: float) -> dict[str, Any]:
        return {"name": self.name, "weights": self.weights, "context": self.context,
                "tok_s": round(self.tok_s, 2), "bytes_per_token": int(self.bytes_per_token),
                "share_of_ceiling": round(self.share(bandwidth), 3),
                "speedup": round(self.tok_s / baseline_tok_s, 2), "agree": self.agree,
                "compile_s": None if self.compile_s is None else round(self.compile_s, 1),
                "compiled_how": self.compiled_how, "reload_s": None if self.reload_s is None else round(self.reload_s, 1),
                "noisy": self.noisy,
                "spread": round(self.spread, 3)}


def step_bytes(model: Llama, context: int) -> float:
    """Bytes one decode step reads at ``context`` tokens: the weights as stored plus the KV cache."""
    a = model.args
    kv = kv_bytes_per_token(a.n_layers, a.n_kv_heads, a.head_dim, model.dtype.itemsize) * context
    return float(bytes_read_per_token(model) + kv)


def agreement_column(tokens: Tensor | list[int], reference: Tensor | list[int], what: str) -> str:
    """The table's greedy-tokens column, ``"k/n vs <what>"``: leading tokens equal to the reference
    (:func:`utils.verdicts.agreement` says the same in a sentence)."""
    n = len(torch.as_tensor(reference).flatten())
    return f"{tokens_agreed(tokens, reference)}/{n} vs {what}"


NEAR_TIE = 0.02
"""Two picks whose logits differ by less than this share of the largest |logit| are a near-tie: a rounding
difference between two correct kernels can flip them (bf16 and int kernels round differently compiled)."""


def divergence(model: Llama, prompt: Tensor, got: list[int], want: list[int]) -> tuple[int, float] | None:
    """Where ``got`` first parts from ``want`` and the logit gap there between the two picks, as a share of
    the largest |logit| (``model`` scores the prompt plus ``want``'s tokens so far, from scratch); None if
    they agree wherever both have tokens."""
    i = tokens_agreed(got, want)
    if i >= min(len(got), len(want)):
        return None
    ids = torch.cat([prompt.reshape(1, -1), torch.tensor([want[:i]], dtype=prompt.dtype, device=prompt.device)], 1)
    with torch.inference_mode():
        logits = llama_phases.forward_no_cache(model, ids, last_only=True)[0, -1].float()
    return i, float((logits[want[i]] - logits[got[i]]).abs() / logits.abs().max())


def split_note(split: tuple[int, float] | None) -> str:
    """Why two token streams part (:func:`divergence`): a near-tie rounded the other way, or a real difference;
    "" when they do not part."""
    if split is None:
        return ""
    return (f" (at token {split[0]} the picks' logits differ by {split[1]:.2%} of the largest: "
            + ("a near-tie)" if split[1] < NEAR_TIE else f"NOT a near-tie, over {NEAR_TIE:.0%})"))


def eager_row(name: str, model: Any, ids: Tensor, n_tokens: int, *, weights: str, bytes_per_token: float,
              reference: Tensor | None = None, what: str = "", repeats: int = 3) -> Row:
    """A row for the eager loop of either backend (transformers or hand-written), via
    :func:`utils.engine.decode_speed`, with its greedy tokens compared to ``reference``."""
    tokens = engine.generate(model, ids, n_tokens)[0]
    result = engine.decode_speed(model, ids, n_tokens, repeats=repeats)
    agree = agreement_column(tokens, reference, what) if reference is not None else ""
    return Row(name, weights, ids.shape[-1], result.tok_s, bytes_per_token, agree,
               noisy=result.timing.noisy, tokens=tokens.tolist())


def decoder_row(name: str, decoder: FastDecoder, ids: Tensor, n_tokens: int, *, weights: str,
                reference: Tensor | None = None, what: str = "", repeats: int = 3, reload: bool = False) -> Row:
    """A row for a :class:`FastDecoder` (its first call, the compile, timed apart). ``reload``: if that call
    built a package, time a new decoder loading it (what the next process waits)."""
    if decoder.compiled and not decoder.compile_s:
        decoder.warm_up(ids)
    how = getattr(decoder.step, "source", "")
    reload_s = (FastDecoder.build(decoder.model, decoder.cache.max_len, decoder.cache.batch,
                                   mode=decoder.mode).warm_up(ids)
                if reload and how == "built" else None)
    tokens = decoder.generate(ids, n_tokens)[0]
    result = fast_decode_speed(decoder, ids, n_tokens, repeats=repeats)
    agree = agreement_column(tokens, reference, what) if reference is not None else ""
    split = divergence(decoder.model, ids, tokens.tolist(), reference.tolist()) if reference is not None else None
    agree += split_note(split)
    return Row(name, weights, ids.shape[-1], result.tok_s, step_bytes(decoder.model, ids.shape[-1] + n_tokens // 2),
               agree, decoder.compile_s if decoder.compiled else None, result.timing.noisy, tokens.tolist(),
               result.timing.relative_spread, split=split, compiled_how=how, reload_s=reload_s)


def print_rows(rows: list[Row], bandwidth: float, baseline: Row) -> None:
    """The table: tok/s, MB read per token, share of the ceiling, speed-up over ``baseline``, agreement, compile s."""
    print(f"{'context':>7}  {'row':<34} {'weights':<20} {'tok/s':>7} {'MB/tok':>7} {'ceiling':>8} "
          f"{'speed-up':>8}  {'compile':>20}  greedy tokens")
    for r in rows:
        compile_s = compile_column(r)
        flag = "  NOISY" if r.noisy else ""
        mb, share = (f"{r.bytes_per_token / 1e6:.1f}", f"{r.share(bandwidth):.0%}") if r.bytes_per_token else ("?", "?")
        print(f"{r.context:>7}  {r.name:<34} {r.weights:<20} {r.tok_s:>7.1f} {mb:>7} "
              f"{share:>8} {r.tok_s / baseline.tok_s:>7.2f}x  {compile_s:>20}  {r.agree}{flag}")


def compile_column(r: Row) -> str:
    """The compile column: seconds of the first call, how the step came (built or loaded) and a reload's seconds."""
    if not r.compile_s:
        return ""
    built = f"{r.compile_s:.0f} s {r.compiled_how}".rstrip()
    return built + (f", {r.reload_s:.1f} s load" if r.reload_s is not None else "")


def llama_cpp_row(lm: LoadedModel, context: int, new_tokens: int, repeats: int,
                  reference: list[int], what: str = "eager float32") -> tuple[Row | None, str]:
    """llama.cpp on the embedded Q4_1 file at ``context`` (a row), or (None, why there is none).

    Its bytes per token: the whole GGUF file (its tied embedding is the LM head, read whole) plus
    its float16 KV cache at the middle of the request.
    """
    if lm.name != EMBEDDED or lm.device.type != "cpu":
        return None, "only for the embedded model on the CPU (its GGUF file is what llama.cpp reads)"
    why = "" if peer.installed() else peer.ensure_installed()
    if why:
        return None, why
    try:
        r = peer.llama_cpp_speed(filler_ids(lm.tokenizer, context)[0].tolist(), new_tokens, repeats=repeats)
    except Exception as exc:  # a peer that fails must not stop the measurement: its row says why
        return None, f"llama.cpp failed: {type(exc).__name__}: {exc}"
    s = lm.spec
    kv = kv_bytes_per_token(s.n_layers, s.n_kv_heads, s.head_dim, 2) * (context + new_tokens // 2)  # float16 cache
    return Row(r.engine, f"{r.weights} (GGUF file)", context, r.decode_tok_s,
               float(peer.embedded_gguf().stat().st_size + kv), agreement_column(r.tokens, reference, what),
               tokens=r.tokens, text=r.text), ""
