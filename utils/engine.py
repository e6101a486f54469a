"""One request engine over either backend: generate, stream, time each phase.

The phase vocabulary (:func:`new_cache`, :func:`prefill`, :func:`decode_one_token`,
:func:`extend`, :func:`rollback`) dispatches on the model: a hand-written
:class:`~utils.llama.Llama` runs :mod:`utils.llama_phases`, anything else is a
transformers model and runs :mod:`utils.phases` (a model that carries its own ``phases``
namespace of the same signatures runs those: chapter 05's by-hand model). Everything below is written once
over that vocabulary, so swapping backends is swapping the model you pass:

- :func:`decode_steps`: the decode loop as a generator, one token per row per step;
  rows that finish (end-of-sequence) keep repeating it while the others go on;
- :func:`generate` / :func:`generate_no_cache`: greedy (or sampled) tokens, with the
  KV cache and without it (the quadratic baseline);
- :func:`stream`: one request, token by token as each is made, with its text so far,
  the time it arrived and, on the last one, why generation ended (``length``, ``eos``,
  ``stop``); :func:`run_request` collects it into :class:`RequestMetrics`;
- :func:`prefill_speed` and :func:`decode_speed` (a model and a prompt in, a :class:`PhaseResult` out: the one
  prefill-speed and the one decode-speed function the chapters, labs and benchmark all call; the fast path's
  :func:`utils.fast.fast_decode_speed` has the same shape), and :func:`measure_prefill` / :func:`measure_decode`,
  the same on an English prompt of ``n`` tokens.

Conventions (the design's measurement protocol): prefill tok/s = prompt tokens ÷
prefill time; TTFT = prefill + the first sample; decode tok/s = tokens after the first
÷ their time. Reading a token id with ``int()`` waits for the device, so a time
taken after it is a synchronized time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor

from . import llama_phases, phases
from .errors import check_prompt_length, check_token_count
from .llama import KVCache, Llama
from .models import LoadedModel
from .sampling import GREEDY, Sampling, sample
from .timing import Timing, interleaved, measure, synchronize
from .tokens import encode, filler_ids

# ----------------------------------------------------------------------------- the phases, either backend


def backend_for(model_or_cache: Any) -> Any:
    """The phase functions for this model (or cache).

    A model (or cache) that brings its own ``phases`` (a namespace with ``new_cache``, ``prefill``,
    ``decode_one_token``, ``max_context`` of the same signatures: a model written by hand in a
    notebook) runs those; the hand-written :class:`~utils.llama.Llama` (or its cache) runs
    :mod:`utils.llama_phases`; anything else is a transformers model and runs :mod:`utils.phases`.
    """
    own = getattr(model_or_cache, "phases", None)
    if own is not None and not isinstance(model_or_cache, (Llama, KVCache)):
        return own
    return llama_phases if isinstance(model_or_cache, (Llama, KVCache)) else phases


def device_of(model: Any) -> torch.device:
    return model.device


def max_context(model: Any) -> int:
    """Positions the model was trained for."""
    return backend_for(model).max_context(model)


def new_cache(model: Any, batch: int, max_len: int, static: bool = False) -> Any:
    """An empty KV cache for ``batch`` rows of up to ``max_len`` tokens (``static``: hand-written only)."""
    if static:
        return llama_phases.new_cache(model, batch, max_len, static=True)
    return backend_for(model).new_cache(model, batch, max_len)


def prefill(model: Any, cache: Any, ids: Tensor, mask: Tensor | None = None) -> Tensor:
    """The prompt [B, T] in one pass (resets ``cache``): logits of the next token [B, V]."""
    return backend_for(model).prefill(model, cache, ids, mask)


def decode_one_token(model: Any, cache: Any, token: Tensor) -> Tensor:
    """One new token per row ([B] or [B, 1]) at the next position: logits [B, V]."""
    return backend_for(model).decode_one_token(model, cache, token)


def extend(model: Any, cache: Any, tokens: Tensor, last_only: bool = False) -> Tensor:
    """Several new positions [B, T] after what ``cache`` holds: logits [B, T, V]."""
    return backend_for(model).extend(model, cache, tokens, last_only)


def rollback(cache: Any, length: int) -> None:
    """Forget everything after the first ``length`` tokens of ``cache``."""
    backend_for(cache).rollback(cache, length)


# ----------------------------------------------------------------------------- loops


def _eos_tensor(eos_token_id: int | Sequence[int] | None, device: torch.device) -> Tensor | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, device=device)


@torch.inference_mode()
def decode_steps(model: Any, cache: Any, token: Tensor, n: int, *, sampling: Sampling = GREEDY,
                 eos_token_id: int | Sequence[int] | None = None,
                 generator: torch.Generator | None = None) -> Iterator[Tensor]:
    """Feed ``token`` [B] (the last one sampled) and yield the next token of every row [B], up to ``n`` times.

    A row that has produced an end-of-sequence token keeps yielding it (as padding);
    the loop ends early once every row has.
    """
    eos = _eos_tensor(eos_token_id, token.device)
    done = torch.isin(token, eos) if eos is not None else None
    for _ in range(n):
        if done is not None and bool(done.all()):
            return
        nxt = sample(decode_one_token(model, cache, token), sampling, generator)
        if done is not None:
            nxt = torch.where(done, eos[0], nxt)
            done = done | torch.isin(nxt, eos)
        yield nxt
        token = nxt


def decode_n_tokens(model: Any, cache: Any, token: Tensor, n: int, **kwargs: Any) -> Tensor:
    """:func:`decode_steps` collected: the new tokens [B, n'] (n' < n if every row ended)."""
    out = list(decode_steps(model, cache, token, n, **kwargs))
    return torch.stack(out, dim=1) if out else token.new_empty(token.shape[0], 0)


def _as_batch(ids: Tensor) -> Tensor:
    return ids if ids.dim() == 2 else ids.view(1, -1)


@torch.inference_mode()
def generate(model: Any, ids: Tensor, max_new_tokens: int, mask: Tensor | None = None, *,
             sampling: Sampling = GREEDY, eos_token_id: int | Sequence[int] | None = None,
             static: bool = False) -> Tensor:
    """Prefill, then decode: the NEW tokens [B, n] (n <= max_new_tokens; greedy by default).

    The cache is sized to the request: prompt + max_new_tokens positions.
    """
    check_token_count(max_new_tokens)
    ids = _as_batch(ids)
    B, T = ids.shape
    check_prompt_length(T, max_context(model), max_new_tokens)
    cache = new_cache(model, B, T + max_new_tokens, static=static)
    generator = sampling.generator()
    first = sample(prefill(model, cache, ids, mask), sampling, generator)  # [B]
    rest = decode_n_tokens(model, cache, first, max_new_tokens - 1, sampling=sampling,
                           eos_token_id=eos_token_id, generator=generator)
    return torch.cat([first[:, None], rest], dim=1)


@torch.inference_mode()
def generate_no_cache(model: Any, ids: Tensor, max_new_tokens: int, mask: Tensor | None = None, *,
                      eos_token_id: int | Sequence[int] | None = None) -> Tensor:
    """Greedy decoding that recomputes the whole sequence for every new token: [B, n].

    Step t processes T + t tokens, so n steps cost ~ n·T + n²/2 token-passes: quadratic.
    """
    check_token_count(max_new_tokens)
    ids = _as_batch(ids)
    check_prompt_length(ids.shape[1], max_context(model), max_new_tokens)
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.view(ids.shape).bool()
    eos = _eos_tensor(eos_token_id, ids.device)
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    out: list[Tensor] = []
    for _ in range(max_new_tokens):
        cache = new_cache(model, ids.shape[0], ids.shape[1])  # thrown away after this step
        nxt = prefill(model, cache, ids, mask).argmax(dim=-1).to(ids.device)
        if eos is not None:
            nxt = torch.where(done, eos[0], nxt)
            done = done | torch.isin(nxt, eos)
        out.append(nxt)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        if eos is not None and bool(done.all()):
            break
    return torch.stack(out, dim=1)


# ----------------------------------------------------------------------------- one request, streamed


@dataclass(frozen=True)
class Token:
    """One generated token as a stream hands it out."""

    id: int
    index: int  # 0 for the first new token
    seconds: float  # since the request started, when this token existed
    text: str  # the answer so far (special tokens skipped, cut before a stop sequence)
    prefill_s: float  # the prefill pass of this request (the same on every token)
    finish_reason: str | None = None  # on the last token: "length", "eos" or "stop"


def _finish(tid: int, n: int, max_new: int, eos: set[int], text: str,
            stop: Sequence[str]) -> tuple[str | None, str]:
    """Why generation ends after this token (None: it goes on), and the text cut at a stop sequence."""
    if tid in eos:
        return "eos", text
    hits = [text.index(s) for s in stop if s in text]
    if hits:
        return "stop", text[:min(hits)]
    return ("length" if n >= max_new else None), text


@torch.inference_mode()
def stream(model: Any, tokenizer: Any, ids: Tensor, max_new_tokens: int, *, sampling: Sampling = GREEDY,
           stop: Sequence[str] = (), stop_at_eos: bool = True) -> Iterator[Token]:
    """Serve one request, yielding each :class:`Token` as soon as it exists.

    Ends on the model's end-of-sequence token (``eos``, unless ``stop_at_eos=False``),
    on a stop sequence in the text (``stop``; the text is cut just before it) or when
    ``max_new_tokens`` are made (``length``); the last token says which.
    """
    check_token_count(max_new_tokens)
    ids = _as_batch(ids)
    check_prompt_length(ids.shape[1], max_context(model), max_new_tokens)
    eos = {tokenizer.eos_token_id} if stop_at_eos and tokenizer.eos_token_id is not None else set()
    generator, out = sampling.generator(), []
    synchronize(device_of(model))
    start = time.perf_counter()
    cache = new_cache(model, 1, ids.shape[1] + max_new_tokens)
    logits = prefill(model, cache, ids)
    synchronize(device_of(model))
    prefill_s = time.perf_counter() - start
    token = sample(logits, sampling, generator)  # [1]
    while True:
        out.append(int(token))  # int() waits for the device: the token really exists now
        reason, text = _finish(out[-1], len(out), max_new_tokens, eos,
                               tokenizer.decode(out, skip_special_tokens=True), stop)
        yield Token(out[-1], len(out) - 1, time.perf_counter() - start, text, prefill_s, reason)
        if reason is not None:
            return
        token = sample(decode_one_token(model, cache, token), sampling, generator)


@dataclass
class RequestMetrics:
    """What one request cost, phase by phase (seconds), and what it produced."""

    prompt_tokens: int
    output_tokens: int
    prefill_s: float
    ttft_s: float
    decode_s: float
    total_s: float
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    arrivals_s: list[float] = field(default_factory=list)  # when each token existed

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first over their time (nan when only one token was made)."""
        n = self.output_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")


def collect(tokens: Iterator[Token], prompt_tokens: int) -> RequestMetrics:
    """Drain a :func:`stream` into :class:`RequestMetrics` (TTFT = when the first token existed)."""
    seen = list(tokens)
    first, last = seen[0], seen[-1]
    return RequestMetrics(
        prompt_tokens=prompt_tokens, output_tokens=len(seen), prefill_s=first.prefill_s,
        ttft_s=first.seconds, decode_s=last.seconds - first.seconds, total_s=last.seconds,
        token_ids=[t.id for t in seen], text=last.text, finish_reason=last.finish_reason or "length",
        arrivals_s=[t.seconds for t in seen])


def run_request(lm: LoadedModel, prompt: str | Tensor, max_new_tokens: int, *, chat: bool = False,
                sampling: Sampling = GREEDY, stop: Sequence[str] = (), stop_at_eos: bool = True,
                model: Any = None) -> RequestMetrics:
    """Serve one request (text, or ids [1, T]) and time each phase, as an engine's meter would.

    ``model`` swaps the backend (e.g. a hand-written :class:`~utils.llama.Llama` built
    from ``lm.model``); the tokenizer stays ``lm``'s.
    """
    ids = prompt if isinstance(prompt, Tensor) else encode(lm.tokenizer, prompt, chat=chat, device=lm.device)
    tokens = stream(model if model is not None else lm.model, lm.tokenizer, ids, max_new_tokens,
                    sampling=sampling, stop=stop, stop_at_eos=stop_at_eos)
    return collect(tokens, _as_batch(ids).shape[1])


# ----------------------------------------------------------------------------- phase speeds


@dataclass(frozen=True)
class PhaseResult:
    """One phase measured: how many tokens it handled and how long that took."""

    phase: str
    tokens: int
    timing: Timing

    @property
    def tok_s(self) -> float:
        return self.tokens / self.timing.median

    @property
    def ms_per_token(self) -> float:
        return 1e3 * self.timing.median / self.tokens

    def __str__(self) -> str:
        return f"{self.phase}: {self.tokens} tokens in {self.timing} -> {self.tok_s:,.1f} tok/s"


def prefill_speed(model: Any, ids: Tensor, *, repeats: int = 5, warmup: int = 1) -> PhaseResult:
    """Time one prefill pass of ``ids`` [B, T] (a fresh, untimed cache each time): tokens = ``B x T``.

    The same shape as :func:`decode_speed` (and :func:`utils.fast.fast_decode_speed`): a model and a prompt in,
    a :class:`PhaseResult` out; :func:`measure_prefill` is the same on an English prompt of ``n`` tokens.
    """
    ids = _as_batch(ids)
    B, T = ids.shape
    check_prompt_length(T, max_context(model))
    timing = measure(lambda cache: prefill(model, cache, ids), setup=lambda: new_cache(model, B, T),
                     warmup=warmup, repeats=repeats, device=device_of(model), desc=f"prefill {T}")
    return PhaseResult("prefill", B * T, timing)


def measure_prefill(lm: LoadedModel, n_tokens: int, *, repeats: int = 5, warmup: int = 1,
                    model: Any = None) -> PhaseResult:
    """:func:`prefill_speed` of an ``n_tokens``-token English prompt (of ``model``, default the loaded one)."""
    model = model if model is not None else lm.model
    check_prompt_length(n_tokens, max_context(model))
    return prefill_speed(model, filler_ids(lm.tokenizer, n_tokens, lm.device), repeats=repeats, warmup=warmup)


def measure_prefills(lm: LoadedModel, lengths: Sequence[int], *, repeats: int = 5, warmup: int = 1,
                     model: Any = None) -> dict[int, PhaseResult]:
    """:func:`measure_prefill` of several prompt lengths, interleaved (16, 64, 256, 16, 64, 256, ...).

    A slow spell on a shared machine then weighs on every length alike, so ratios between lengths
    (TTFT growth) keep their meaning. Each pass gets a fresh cache, created inside the timed call
    (an empty transformers cache costs microseconds; a preallocated one is allocated in the timing).
    """
    model = model if model is not None else lm.model
    for n in lengths:
        check_prompt_length(n, max_context(model))
    ids = {n: filler_ids(lm.tokenizer, n, lm.device) for n in lengths}
    fns = {n: (lambda n=n: prefill(model, new_cache(model, 1, n), ids[n])) for n in lengths}
    timings = interleaved(fns, repeats=repeats, warmup=warmup, device=lm.device, desc="prefills")
    return {n: PhaseResult("prefill", n, timings[n]) for n in lengths}


def decode_speed(model: Any, ids: Tensor, n_tokens: int = 32, *, repeats: int = 3, warmup: int = 1,
                 static: bool = False) -> PhaseResult:
    """Time ``n_tokens`` greedy decode steps after an untimed prefill of ``ids`` [B, T].

    The one decode-speed function: tokens = ``n_tokens x B`` (every row makes one per
    step); a fresh prefill before each repeat, so every repeat decodes the same context.
    """
    setup, run = decode_request(model, ids, n_tokens, static=static)
    timing = measure(run, setup=setup, warmup=warmup, repeats=repeats, device=device_of(model),
                     desc=f"decode {n_tokens}")
    return PhaseResult("decode", n_tokens * _as_batch(ids).shape[0], timing)


def decode_request(model: Any, ids: Tensor, n_tokens: int, *, static: bool = False
                   ) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """What :func:`decode_speed` times, as ``(setup, run)`` for :func:`utils.timing.measure` or
    :func:`utils.timing.interleaved`: ``setup()`` prefills ``ids`` into a fresh cache (untimed), ``run(setup())``
    makes ``n_tokens`` greedy decode steps."""
    check_token_count(n_tokens, "n_tokens")
    ids = _as_batch(ids)
    B, T = ids.shape
    check_prompt_length(T, max_context(model), n_tokens)

    def setup() -> tuple[Any, Tensor]:
        cache = new_cache(model, B, T + n_tokens, static=static)
        return cache, prefill(model, cache, ids).argmax(dim=-1)

    def run(arg: tuple[Any, Tensor]) -> None:
        for _ in decode_steps(model, arg[0], arg[1], n_tokens):
            pass

    return setup, run


def measure_decode(lm: LoadedModel, n_tokens: int = 32, *, prompt_tokens: int = 32, repeats: int = 3,
                   warmup: int = 1, model: Any = None) -> PhaseResult:
    """:func:`decode_speed` after a ``prompt_tokens``-token English prompt."""
    check_token_count(prompt_tokens, "prompt_tokens")
    ids = filler_ids(lm.tokenizer, prompt_tokens, lm.device)
    return decode_speed(model if model is not None else lm.model, ids, n_tokens, repeats=repeats, warmup=warmup)
