"""Judging a model variant against its baseline: bytes, quality, speed, and the speed-up to expect.

What every lab that makes a cheaper copy of the model needs (quantization today; a
draft model for speculative decoding next):

- :func:`bytes_read_per_token`: weight bytes one decode step reads, as stored;
- :func:`perplexity` on a fixed text, and :func:`tokens_agreed` with the baseline's greedy tokens;
- :class:`VariantTable`: each variant's bytes, perplexity and agreement measured as it is
  added, and their decode speeds measured together, interleaved;
- :func:`profile_decode_step`, :func:`predicted_speedup` and :func:`kernel_swap_speedup`: the
  predictions a speed-up is checked against: only the matmuls' share of a step shrinks, with the
  bytes (Amdahl) or with the variant's kernels' profiled time.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from . import engine, llama_phases
from .llama import Llama, RMSNorm, iter_linears
from .quant import stored_bytes
from .roofline import kv_bytes_per_token
from .timing import Timing, profile_self_time, synchronize

def bytes_read_per_token(model: Llama) -> int:
    """Weight bytes one decode step reads: every projection (:func:`~utils.llama.iter_linears`) and
    every RMSNorm, as stored (:func:`utils.quant.stored_bytes`). The input embedding is a lookup (one row a
    token) and is left out, unless it is tied to the LM head, which is read whole."""
    linears = sum(stored_bytes(m) for _, m in iter_linears(model))
    return linears + sum(stored_bytes(m) for m in model.modules() if isinstance(m, RMSNorm))


@torch.inference_mode()
def perplexity(model: Any, ids: Tensor) -> float:
    """``exp(mean cross-entropy)`` of predicting ``ids[0, 1:]`` from the tokens before each.

    ``model``: a hand-written :class:`~utils.llama.Llama` or a transformers causal LM; ``ids`` [1, T].
    """
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 2:
        raise ValueError(f"perplexity needs ids of shape [1, T] with T >= 2, got {tuple(ids.shape)}.")
    logits = (llama_phases.forward_no_cache(model, ids) if isinstance(model, Llama)
              else model(ids).logits)  # [1, T, V]
    nll = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:].to(logits.device))
    return math.exp(nll.item())


def tokens_agreed(a: Sequence[int] | Tensor, b: Sequence[int] | Tensor) -> int:
    """How many leading tokens two 1-D sequences share before they first differ."""
    a, b = torch.as_tensor(a).flatten().cpu(), torch.as_tensor(b).flatten().cpu()
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


@dataclass
class Variant:
    """One row of a quantization table: what the copy is, what it reads, how good and fast it is."""

    name: str
    model: Llama
    weights: str  # e.g. "int4 g32"
    activations: str  # e.g. "bf16"
    path: str  # which matmul runs, e.g. "aten._weight_int8pack_mm"
    slow: bool  # de-quantizes at every call: timed over fewer tokens
    bytes: int  # weight bytes read per token (bytes_read_per_token)
    ppl: float
    agreed: int  # greedy tokens equal to the baseline's, summed over the prompts
    of: int
    timing: Timing | None = None  # seconds per `tokens` decode tokens, one sample per repeat
    tokens: int = 0
    kv_bytes: float = 0.0  # KV cache read per token at the timed run's average context

    @property
    def read(self) -> float:
        """Bytes one decode step reads: weights plus the KV cache."""
        return self.bytes + self.kv_bytes

    @property
    def tok_s(self) -> float:
        """Median decode speed (nan until measured)."""
        return self.tokens / self.timing.median if self.timing else float("nan")

    @property
    def best_tok_s(self) -> float:
        """Fastest repeat: other load on the machine only ever slows a run down."""
        return self.tokens / self.timing.min if self.timing else float("nan")


class VariantTable:
    """Quantized copies of one baseline, each measured against it on the same text and prompts.

    ``add`` measures bytes, perplexity on ``eval_ids`` and greedy agreement over
    ``prompts`` (``n_agree`` tokens each) at once; :meth:`measure_speeds` times every
    variant's decode together, interleaved, so a busy moment weighs on all alike.
    """

    def __init__(self, baseline: Llama, eval_ids: Tensor, prompts: Sequence[Tensor], n_agree: int) -> None:
        self.eval_ids, self.prompts, self.n_agree = eval_ids, list(prompts), n_agree
        self.baseline_tokens = [engine.generate(baseline, ids, n_agree)[0] for ids in self.prompts]
        self.rows: dict[str, Variant] = {}

    def add(self, name: str, model: Llama, weights: str, activations: str, path: str,
            slow: bool = False, show: bool = True) -> Variant:
        """Measure ``model`` and keep it as row ``name`` (printed in one line unless ``show=False``)."""
        agreed = sum(tokens_agreed(engine.generate(model, ids, self.n_agree)[0], want)
                     for ids, want in zip(self.prompts, self.baseline_tokens))
        row = Variant(name, model, weights, activations, path, slow, bytes_read_per_token(model),
                      perplexity(model, self.eval_ids), agreed, self.n_agree * len(self.prompts))
        self.rows[name] = row
        if show:
            print(f"{name:34s} {row.bytes / 1e6:8.2f} MB/token  perplexity {row.ppl:9.3f}  "
                  f"greedy agreement {agreed}/{row.of}")
        return row

    def measure_speeds(self, ids: Tensor, n_tokens: int, slow_tokens: int, repeats: int,
                       between: Callable[[], Any] | None = None) -> None:
        """Decode ``n_tokens`` (``slow_tokens`` for slow rows) after ``ids``, every row once per round.

        Uses :func:`utils.engine.decode_speed` (untimed prefill, then timed greedy steps);
        ``between`` runs after the warm-up and after each round (e.g. a bandwidth probe).
        """
        tokens = {name: slow_tokens if r.slow else n_tokens for name, r in self.rows.items()}
        for name, r in self.rows.items():  # warm-up: one short untimed run each
            engine.decode_speed(r.model, ids, 2, repeats=1, warmup=0)
        samples: dict[str, list[float]] = {name: [] for name in self.rows}
        for _ in tqdm(range(repeats), desc="rounds of every variant", leave=False):
            if between is not None:
                between()
            for name, r in self.rows.items():
                result = engine.decode_speed(r.model, ids, tokens[name], repeats=1, warmup=0)
                samples[name] += result.timing.samples
        if between is not None:
            between()
        for name, r in self.rows.items():
            a = r.model.args
            r.timing, r.tokens = Timing(tuple(samples[name])), tokens[name]
            r.kv_bytes = (kv_bytes_per_token(a.n_layers, a.n_kv_heads, a.head_dim, r.model.dtype.itemsize)
                          * (ids.shape[-1] + tokens[name] / 2))


@dataclass(frozen=True)
class StepProfile:
    """One profiled decode, per token: the matmuls' self time, every operator's self time, and the step's wall time.

    All three come from the same tokens under the same profiler, so whatever else the machine
    did at that moment (another program reading memory, a slower clock) weighs on them alike.
    ``step_s - op_s`` is what runs between the operators: Python, dispatch, the profiler itself.
    """

    matmul_s: float
    op_s: float
    step_s: float


def profile_decode_step(model: Any, ids: Tensor, n_tokens: int = 4) -> StepProfile:
    """Profile ``n_tokens`` decode steps after ``ids`` (after a warm-up): :class:`StepProfile`, per step.

    The wall time includes the profiler's own cost per operator: compare profiles with profiles
    (:func:`kernel_swap_speedup`), and a profile with a timed step only through a ratio
    (:func:`profile_distortion`).
    """
    engine.decode_speed(model, ids, n_tokens, repeats=1, warmup=0)
    cache = engine.new_cache(model, ids.shape[0], ids.shape[-1] + n_tokens)
    token = engine.prefill(model, cache, ids).argmax(dim=-1)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if model.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        synchronize(model.device)
        start = time.perf_counter()
        engine.decode_n_tokens(model, cache, token, n_tokens)
        synchronize(model.device)
        step_s = (time.perf_counter() - start) / n_tokens
    per_kind = profile_self_time(prof, model.device)
    return StepProfile(per_kind.get("matmul", 0.0) * 1e-6 / n_tokens, sum(per_kind.values()) * 1e-6 / n_tokens, step_s)


def decode_matmul_seconds(model: Any, ids: Tensor, n_tokens: int = 4) -> float:
    """Seconds per decode step spent inside matmul operators (``torch.profiler`` self time, after a warm-up).

    Divide by a step's measured time (without the profiler) for the matmuls' share of the step.
    """
    return profile_decode_step(model, ids, n_tokens).matmul_s


def kernel_swap_speedup(base: StepProfile, variant: StepProfile) -> float:
    """Speed-up of the base step with its operators' time replaced by the variant's.

    ``base.step_s / (base.step_s - base.op_s + variant.op_s)``: the variant's kernels and the
    operators it adds around them (casts, reshapes) replace the base's; what runs between the
    operators (the model's Python, dispatch) is taken as the base's, so a delay the variant adds
    outside its operators does not lower the prediction. The profiles' own wall times are used,
    never a step timed at another moment: a machine slower while one of them ran moves the
    numerator and the denominator together.
    """
    between = max(base.step_s - base.op_s, 0.0)
    return base.step_s / max(between + variant.op_s, 1e-12)




def profile_distortion(slower: StepProfile, faster: StepProfile, timed_speedup: float) -> float:
    """How far two profiles' speed ratio misses the same two models' timed one: ``|profiled / timed - 1|``.

    A profiler slows each operator by its own cost, unevenly between models; a prediction made from
    profiles carries that error. Measured on two models the check does not judge (fp32 and bf16),
    it is part of the prediction's spread that a regression in the judged variant cannot move.
    """
    return abs(slower.step_s / faster.step_s / timed_speedup - 1)
def between_ops_gap(base: StepProfile, variant: StepProfile) -> float:
    """How far :func:`kernel_swap_speedup`'s assumption misses: the difference between the two profiles'
    time between operators, relative to the predicted variant step. It joins the prediction's spread:
    a variant that adds Python around its kernels (or a delay) widens it instead of moving the prediction."""
    between_base, between_variant = max(base.step_s - base.op_s, 0.0), max(variant.step_s - variant.op_s, 0.0)
    return abs(between_variant - between_base) / max(between_base + variant.op_s, 1e-12)


def predicted_speedup(matmul_share: float, bytes_ratio: float) -> float:
    """Decode speed-up when only the matmuls' time shrinks with the bytes (Amdahl's law).

    ``matmul_share``: the matmuls' share of the baseline step; ``bytes_ratio``: the
    variant's weight bytes ÷ the baseline's. ``1 / ((1 - m) + m x r)``: at m = 0.8 and
    r = 1/6 (fp32 -> int4), 3.0x; at m = 0.3, 1.3x however few the bytes.
    """
    if not 0 <= matmul_share <= 1 or bytes_ratio <= 0:
        raise ValueError(f"need 0 <= matmul_share <= 1 and bytes_ratio > 0, got {matmul_share}, {bytes_ratio}.")
    return 1 / ((1 - matmul_share) + matmul_share * bytes_ratio)


__all__ = [
    "bytes_read_per_token", "perplexity", "tokens_agreed", "Variant", "VariantTable",
    "decode_matmul_seconds", "predicted_speedup",
    "StepProfile", "profile_decode_step", "kernel_swap_speedup", "between_ops_gap",
    "profile_distortion",
]
