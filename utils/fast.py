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
decode loop the way :func:`utils.engine.decode_speed` times the eager one. Each of them measured is a row of
the roofline table (:mod:`utils.decode_table`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

from . import llama_phases
from .engine import PhaseResult
from .errors import WorkbookError, check_prompt_length, check_token_count
from .llama import KVCache, Llama, iter_linears
from .timing import measure, profile_self_time, synchronize

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


def cpu_gemm_backends(model: Llama) -> str | None:
    """The GEMM kernels max-autotune may pick from for ``model``'s step on this CPU: ``"CPP"`` (inductor's own C++
    templates only) for float weights on a 512-bit CPU; None (inductor's default) otherwise.

    By default inductor times its templates against ATen's oneDNN linear for each projection and keeps the faster.
    A decode row is a matrix-vector product of a few microseconds, and on a 2-core machine that timing is noisy;
    the pick is cached on disk and reused by every later compile, so one noisy pick sticks. Measured on a 2-core
    Xeon (AVX-512, AMX), compiled bf16 at 128 tokens, greedy tokens equal in all: 65 tok/s with the picks cached
    by earlier runs, 74-78 with a fresh cache, 74-78 with the templates only, 52 with oneDNN only; in one process
    beside transformers: 2.70x transformers bf16 with the templates only, 2.30x with the default. int8 weights did
    not gain (4.0x against 4.3x), and a 256-bit CPU was not measured: both keep the default.
    """
    from torch._inductor import cpu_vec_isa

    float_weights = all(type(m) is nn.Linear and m.weight.is_floating_point() for _, m in iter_linears(model))
    wide = cpu_vec_isa.pick_vec_isa().bit_width() >= 512 and not os.environ.get("ATEN_CPU_CAPABILITY")
    chosen = os.environ.get("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS")
    return None if chosen or not (wide and float_weights) else "CPP"


def _first_call_with(fn: Callable[..., Tensor], **config: Any) -> Callable[..., Tensor]:
    """``fn`` whose first call (the one that compiles) runs under inductor ``config``."""
    import torch._inductor.config as inductor_config

    state = {"compiled": False}

    def run(*args: Any) -> Tensor:
        if state["compiled"]:
            return fn(*args)
        with inductor_config.patch(**config):
            out = fn(*args)
        state["compiled"] = True
        return out

    return run


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
    gemms = cpu_gemm_backends(step.model) if device.type == "cpu" and options["mode"].startswith("max-autotune") else None
    if backend != "inductor":
        options.pop("mode")
    compiled = torch.compile(step, backend=backend, **options)
    return _first_call_with(compiled, max_autotune_gemm_backends=gemms) if backend == "inductor" and gemms else compiled


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
                      warmup: int = 1) -> PhaseResult:
    """Time ``n_tokens`` decode steps of ``decoder`` after an untimed prefill of ``ids`` [B, T]: the same
    shape as :func:`utils.engine.decode_speed` (tokens = ``n_tokens x B``)."""
    timing = measure(lambda first: decoder.decode(first, n_tokens), setup=lambda: decoder.prefill(ids),
                     warmup=warmup, repeats=repeats, device=decoder.cache.device,
                     desc=f"decode {n_tokens} ({decoder.label or 'fast'})")
    return PhaseResult("decode", n_tokens * (ids.shape[0] if ids.dim() == 2 else 1), timing)


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
