"""The fast path: decode near the bandwidth ceiling with stock PyTorch.

Why eager decode misses its ceiling on a small model: one decode step reads every
weight once, but in eager mode it also pays, for each of a few hundred small ops,
Python, the dispatcher, an allocation and (on a CPU) the start of a parallel region.
For a 135 M model those fixed costs are as large as the reading itself. The cure is
to do less per step, in this order (each is a row of the roofline lab's table):

1. **A static KV cache and a hot loop.** The cache is allocated once, sized to the
   request (prompt + new tokens, rounded up to :data:`BUCKET` slots), and every step
   attends over all its slots (the unfilled ones masked), so a step's shapes never
   change. The loop keeps the position as a device tensor advanced in place, picks
   the greedy token inside the step, and writes it into a preallocated output: no
   allocation, no host sync and no Python work per step beyond the call.
2. **A smaller dtype** (bf16; fp16 on GPUs): half the bytes to read.
3. **Compile the one-token step** (:func:`compile_step`): ``torch.compile`` with
   ``fullgraph=True`` fuses the small ops into a few kernels; on a CPU, inductor's
   *freezing* treats the weights as constants (pre-packed for oneDNN); on a GPU,
   CUDA graphs replay the whole step with one launch. It compiles **once per cache
   shape**: everything the step reads is a tensor or a constant of that shape
   (:class:`DecodeStep`), so nothing in it changes from step to step and dynamo has no
   reason to recompile (:func:`compile_count` counts, :func:`explain_recompiles` shows why).
4. **Weight-only int8 / int4 kernels** (:mod:`utils.quant`): fewer bytes again.

:meth:`FastDecoder.generate` runs a request (prefill eager, decode through the possibly
compiled step) and returns the same greedy tokens as :func:`utils.engine.generate` in the same dtype; :func:`fast_decode_speed` times its
decode loop the way :func:`utils.engine.decode_speed` times the eager one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

from . import engine, llama_phases, peer
from .errors import WorkbookError, check_prompt_length, check_token_count
from .llama import KVCache, Llama, iter_linears
from .models import EMBEDDED, LoadedModel
from .roofline import kv_bytes_per_token
from .tokens import filler_ids
from .timing import Timing, measure, profile_self_time, synchronize
from .variants import bytes_read_per_token, tokens_agreed

BUCKET = 256
"""Static caches are rounded up to a multiple of this many slots, so requests of similar
length share one compiled step (a 128-token prompt + 64 new tokens -> 256 slots)."""


DECODERS_PER_PROCESS = 64
"""Compiled decoders one process may hold (dynamo's per-code limit is raised to this; the default is 8)."""


def static_length(prompt_tokens: int, new_tokens: int, bucket: int = BUCKET) -> int:
    """Slots of the static cache for a request: ``prompt + new`` rounded up to ``bucket``."""
    need = prompt_tokens + new_tokens
    return -(-need // bucket) * bucket


# ----------------------------------------------------------------------------- the step


class DecodeStep(nn.Module):
    """One greedy decode step of ``model`` over one static ``cache``.

    ``forward(token [B, 1], slot [1]) -> next token [B]``. It writes the token's K/V at
    ``slot``, attends over all ``cache.max_len`` slots (a mask hides the unfilled ones)
    and takes the argmax inside the step, so only a [B] tensor leaves it. Every input
    is a tensor of a fixed shape and ``kv_len`` is a constant: a compiled copy of this
    module compiles once and is replayed for every token of every request that fits.
    """

    def __init__(self, model: Llama, cache: KVCache) -> None:
        super().__init__()
        self.model, self.cache, self.kv_len = model, cache, cache.max_len

    def forward(self, token: Tensor, slot: Tensor) -> Tensor:
        logits = self.model(token, slot, self.cache, self.kv_len)  # [B, 1, V]
        return logits[:, -1].argmax(dim=-1)  # [B]


def compile_options(device: torch.device, mode: str | None = None) -> dict[str, Any]:
    """The ``torch.compile`` arguments for a decode step on ``device``.

    GPU: ``reduce-overhead`` (CUDA graphs: the whole step is one launch). CPU:
    ``max-autotune-no-cudagraphs``: inductor times its own C++ GEMM templates against oneDNN's
    pre-packed linear for each projection and keeps the faster (on a 2-core Xeon: bf16 54.9
    tok/s against 38.9 with ``default``, int4 95.2 against 57.1, in about the same compile
    time, tokens identical). ``$WORKBOOK_COMPILE_MODE`` or ``mode`` overrides, e.g. ``default``.

    Under ``ATEN_CPU_CAPABILITY`` (a plainer CPU imitated, e.g. ``avx2``) a CPU gets ``default``: inductor's
    vector code then follows the imitated ISA while its GEMM templates still pick the real CPU's, and the
    two do not compile together (torch 2.13: ``cvtbf16_fp32(__m512i&, ...)`` in an AVX2 kernel).
    """
    imitated = device.type == "cpu" and bool(os.environ.get("ATEN_CPU_CAPABILITY"))
    chosen = mode or os.environ.get("WORKBOOK_COMPILE_MODE") or (
        "reduce-overhead" if device.type == "cuda" else "default" if imitated else "max-autotune-no-cudagraphs")
    return {"mode": chosen, "fullgraph": True, "dynamic": False}


def compile_step(step: DecodeStep, mode: str | None = None, backend: str = "inductor") -> Callable[..., Tensor]:
    """``torch.compile`` of one :class:`DecodeStep` (whole graph, static shapes).

    On a CPU it turns on inductor's freezing (weights become constants: pre-packed once).
    Everywhere it asks inductor to round every intermediate to the dtype as eager does
    (``emulate_precision_casts``): a fused bf16 kernel that kept float32 in between would
    change greedy tokens after a few dozen, and the fast path must make the eager loop's tokens.
    ``backend="eager"`` traces without generating code: what a unit test of the compile
    count needs, in a second instead of a minute.
    """
    device = step.cache.device
    # Every decoder is its own graph of the same code (DecodeStep.forward): a lab or benchmark that
    # builds one per model, dtype and context must not run into dynamo's limit of 8 per code.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, DECODERS_PER_PROCESS)
    if backend == "inductor":
        import torch._inductor.config as inductor_config

        inductor_config.emulate_precision_casts = True
        inductor_config.freezing = device.type == "cpu"
        inductor_config.autotune_num_choices_displayed = 0  # max-autotune: no table per matmul on stderr
        inductor_config.max_autotune_report_choices_stats = False
    options = compile_options(device, mode)
    if backend != "inductor":
        options.pop("mode")
    return torch.compile(step, backend=backend, **options)


# ----------------------------------------------------------------------------- the loop


@dataclass
class FastDecoder:
    """A model, a static cache sized for ``max_len`` slots and its (compiled) step.

    Build it once with :meth:`build`; :meth:`generate` then serves any request whose
    prompt + new tokens fit in ``max_len``. ``compile_s`` is the first call's extra
    time (tracing and code generation), reported apart from the decode speed.
    """

    model: Llama
    cache: KVCache
    step: Callable[..., Tensor]
    compiled: bool
    compile_s: float = 0.0
    label: str = ""
    calls: int = field(default=0, repr=False)

    @classmethod
    def build(cls, model: Llama, max_len: int, batch: int = 1, compiled: bool = True,
              mode: str | None = None, backend: str = "inductor", label: str = "") -> "FastDecoder":
        cache = llama_phases.new_cache(model, batch, max_len, static=True)
        step = DecodeStep(model, cache)
        fn = compile_step(step, mode, backend) if compiled else step
        return cls(model, cache, fn, compiled, label=label)

    @torch.inference_mode()
    def prefill(self, ids: Tensor) -> Tensor:
        """Eager prefill of ``ids`` [B, T] into the static cache; the first greedy token [B]."""
        check_prompt_length(ids.shape[-1], self.cache.max_len)
        return llama_phases.prefill(self.model, self.cache, ids).argmax(dim=-1)

    @torch.inference_mode()
    def decode(self, token: Tensor, n: int) -> Tensor:
        """``n`` greedy steps after ``token`` [B]: the new tokens [B, n].

        The hot loop: the slot is a device tensor advanced in place, each token is
        written into a preallocated output, nothing waits for the device.
        """
        start = self.cache.length
        if start + n > self.cache.max_len:
            raise WorkbookError(f"{n} more tokens after {start} do not fit the static cache of "
                                f"{self.cache.max_len} slots: build the decoder with a larger max_len.")
        out = token.new_empty(token.shape[0], n)
        slot = torch.tensor([start], device=token.device)
        token = token.view(-1, 1)
        for i in range(n):
            nxt = self.step(token, slot)  # [B]
            out[:, i] = nxt
            token = nxt.view(-1, 1)
            slot += 1
        self.cache.length = start + n
        self.calls += n
        return out

    def warm_up(self, ids: Tensor, n: int = 2) -> float:
        """Run one short request (compiling, if the step is compiled); returns its seconds."""
        synchronize(self.cache.device)
        t0 = time.perf_counter()
        self.decode(self.prefill(ids), n)
        synchronize(self.cache.device)
        seconds = time.perf_counter() - t0
        if self.compiled and not self.compile_s:
            self.compile_s = seconds
        return seconds

    def generate(self, ids: Tensor, max_new_tokens: int) -> Tensor:
        """Greedy: the new tokens [B, max_new_tokens] (the first from prefill, the rest decoded)."""
        check_token_count(max_new_tokens)
        first = self.prefill(ids)
        rest = self.decode(first, max_new_tokens - 1)
        return torch.cat([first[:, None], rest], dim=1)


def fast_decode_speed(decoder: FastDecoder, ids: Tensor, n_tokens: int, *, repeats: int = 3,
                      warmup: int = 1) -> Timing:
    """Time ``n_tokens`` decode steps of ``decoder`` after an untimed prefill of ``ids``."""
    timing = measure(lambda first: decoder.decode(first, n_tokens), setup=lambda: decoder.prefill(ids),
                     warmup=warmup, repeats=repeats, device=decoder.cache.device,
                     desc=f"decode {n_tokens} ({decoder.label or 'fast'})")
    return timing


# ----------------------------------------------------------------------------- compiles, counted


def compile_count() -> int:
    """Frames dynamo has compiled in this process so far (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def explain_recompiles(fn: Callable[[], Any]) -> list[str]:
    """Run ``fn`` and return dynamo's reason for every recompile it caused (empty: none)."""
    import logging

    reasons: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            reasons.append(record.getMessage())

    log = logging.getLogger("torch._dynamo.guards.__recompiles")  # what TORCH_LOGS=recompiles prints
    handler, old = Catch(), log.level
    torch._logging.set_logs(recompiles=True)
    log.addHandler(handler)
    try:
        fn()
    finally:
        log.removeHandler(handler)
        torch._logging.set_logs(recompiles=False)
        log.setLevel(old)
    return reasons


@torch.inference_mode()
def projections_seconds(model: Llama, repeats: int = 5) -> float:
    """Seconds one decode step spends in its projections alone: every layer of
    :func:`~utils.llama.iter_linears` applied once to one row, nothing else (median of ``repeats``).

    ``bytes_read_per_token(model) / projections_seconds(model)`` is the speed at which this
    device's matmul kernels read these weights: the ceiling that the *kernels* allow, which can
    sit far below the one the memory allows (a bf16 matrix-vector product that converts each
    weight to float32 on the way can be compute-bound on a CPU).
    """
    layers = [m for _, m in iter_linears(model)]
    rows = {m.in_features: torch.randn(1, m.in_features, dtype=model.dtype, device=model.device)
            for m in layers}

    def once() -> None:
        for m in layers:
            m(rows[m.in_features])

    return measure(once, warmup=1, repeats=repeats, device=model.device, progress=False).median


def profile_step(decoder: FastDecoder, ids: Tensor, n_tokens: int = 8) -> dict[str, float]:
    """Seconds per decode step of ``decoder`` by kind of operator (matmul, attention, everything
    else: :func:`utils.timing.op_kind`), from ``torch.profiler`` self times after a prefill.

    A compiled step's fused element-wise kernels count under "everything else".
    """
    first = decoder.prefill(ids)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if decoder.cache.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        decoder.decode(first, n_tokens)
    return {kind: us * 1e-6 / n_tokens for kind, us in profile_self_time(prof, decoder.cache.device).items()}


# ----------------------------------------------------------------------------- one row of the table


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

    def share(self, bandwidth: float) -> float:
        """Share of the ceiling ``bandwidth / bytes_per_token`` this row reaches."""
        return self.tok_s * self.bytes_per_token / bandwidth

    def as_dict(self, bandwidth: float, baseline_tok_s: float) -> dict[str, Any]:
        return {"name": self.name, "weights": self.weights, "context": self.context,
                "tok_s": round(self.tok_s, 2), "bytes_per_token": int(self.bytes_per_token),
                "share_of_ceiling": round(self.share(bandwidth), 3),
                "speedup": round(self.tok_s / baseline_tok_s, 2), "agree": self.agree,
                "compile_s": None if self.compile_s is None else round(self.compile_s, 1), "noisy": self.noisy}


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
                reference: Tensor | None = None, what: str = "", repeats: int = 3) -> Row:
    """A row for a :class:`FastDecoder` (its first call, the compile, timed apart)."""
    if decoder.compiled and not decoder.compile_s:
        decoder.warm_up(ids)
    tokens = decoder.generate(ids, n_tokens)[0]
    timing = fast_decode_speed(decoder, ids, n_tokens, repeats=repeats)
    agree = agreement_column(tokens, reference, what) if reference is not None else ""
    return Row(name, weights, ids.shape[-1], n_tokens / timing.median,
               step_bytes(decoder.model, ids.shape[-1] + n_tokens // 2), agree,
               decoder.compile_s if decoder.compiled else None, timing.noisy, tokens.tolist(), timing.relative_spread)


def print_rows(rows: list[Row], bandwidth: float, baseline: Row) -> None:
    """The table: tok/s, MB read per token, share of the ceiling, speed-up over ``baseline``, agreement, compile s."""
    print(f"{'context':>7}  {'row':<34} {'weights':<20} {'tok/s':>7} {'MB/tok':>7} {'ceiling':>8} "
          f"{'speed-up':>8}  {'compile':>8}  greedy tokens")
    for r in rows:
        compile_s = f"{r.compile_s:.0f} s" if r.compile_s else ""
        flag = "  NOISY" if r.noisy else ""
        mb, share = (f"{r.bytes_per_token / 1e6:.1f}", f"{r.share(bandwidth):.0%}") if r.bytes_per_token else ("?", "?")
        print(f"{r.context:>7}  {r.name:<34} {r.weights:<20} {r.tok_s:>7.1f} {mb:>7} "
              f"{share:>8} {r.tok_s / baseline.tok_s:>7.2f}x  {compile_s:>8}  {r.agree}{flag}")


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
