"""Prefill and decode, measured through transformers with a KV cache.

A request runs in two phases:

- **prefill**: the whole prompt goes through the model in one parallel forward pass.
  It fills the KV cache and yields the logits of the first new token. Its time sets
  the time-to-first-token (TTFT = prefill + first sample). Compute-bound.
- **decode**: one forward pass per new token, each reading every weight once.
  Memory-bandwidth-bound: ``decode tok/s ~ bandwidth / bytes read per token``.

Conventions (the design's measurement protocol): prefill tok/s = prompt tokens /
prefill time; decode tok/s = generated tokens after the first / their time.
Greedy sampling throughout, so every run is reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import check_prompt_length, check_token_count
from .models import REPO_ROOT, LoadedModel
from .timing import Timing, measure, synchronize, timer

FILLER_TEXT = REPO_ROOT / "data" / "prose_en.txt"


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


@dataclass
class RequestMetrics:
    """What one request cost, phase by phase (seconds)."""

    prompt_tokens: int
    output_tokens: int
    prefill_s: float
    ttft_s: float
    decode_s: float
    total_s: float
    token_ids: list[int] = field(default_factory=list)
    text: str = ""

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first over their time (nan when only one token was made)."""
        n = self.output_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")


def filler_ids(tokenizer: Any, n_tokens: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Exactly ``n_tokens`` of English prose as ids, shape [1, n_tokens] (text repeated as needed)."""
    check_token_count(n_tokens, "n_tokens")
    ids = tokenizer(FILLER_TEXT.read_text(), add_special_tokens=False).input_ids
    reps = -(-n_tokens // len(ids))
    return torch.tensor([(ids * reps)[:n_tokens]], device=device)


def encode_prompt(lm: LoadedModel, prompt: str, chat: bool = False) -> torch.Tensor:
    """Token ids of ``prompt`` on the model's device, shape [1, T]; chat applies the template."""
    if not prompt or not prompt.strip():
        check_prompt_length(0, lm.spec.max_context)  # raises EmptyPromptError
    if chat:
        text = lm.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    else:
        text = prompt
    ids = lm.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    return ids.to(lm.device)


def new_cache(model: Any) -> Any:
    """An empty transformers KV cache for ``model`` (grows as tokens are added)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


@torch.inference_mode()
def prefill(model: Any, input_ids: torch.Tensor, cache: Any | None = None) -> tuple[torch.Tensor, Any]:
    """One forward pass over the whole prompt [B, T]; returns (last logits [B, V], filled cache)."""
    cache = new_cache(model) if cache is None else cache
    out = model(input_ids=input_ids, cache=cache, use_cache=True)
    return out.logits[:, -1, :], out.cache


@torch.inference_mode()
def decode_one_token(model: Any, cache: Any, token: torch.Tensor) -> torch.Tensor:
    """One forward pass for one new token per sequence [B, 1]; returns logits [B, V]."""
    out = model(input_ids=token, cache=cache, use_cache=True)
    return out.logits[:, -1, :]


@torch.inference_mode()
def decode_n_tokens(model: Any, cache: Any, first: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy-decode ``n`` tokens after ``first`` [B, 1]; returns the new tokens [B, n]."""
    token, out = first, []
    for _ in range(n):
        token = decode_one_token(model, cache, token).argmax(dim=-1, keepdim=True)
        out.append(token)
    return torch.cat(out, dim=1)


def measure_prefill(lm: LoadedModel, n_tokens: int, *, repeats: int = 5, warmup: int = 1) -> PhaseResult:
    """Time one prefill pass of ``n_tokens`` prompt tokens (a fresh cache each time)."""
    check_prompt_length(n_tokens, lm.spec.max_context)
    ids = filler_ids(lm.tokenizer, n_tokens, lm.device)
    timing = measure(lambda: prefill(lm.model, ids), warmup=warmup, repeats=repeats,
                     device=lm.device, desc=f"prefill {n_tokens}")
    return PhaseResult("prefill", n_tokens, timing)


def measure_decode(lm: LoadedModel, n_tokens: int = 32, *, prompt_tokens: int = 32,
                   repeats: int = 3, warmup: int = 1) -> PhaseResult:
    """Time ``n_tokens`` greedy decode steps after an (untimed) prefill of ``prompt_tokens``."""
    check_token_count(n_tokens)
    check_prompt_length(prompt_tokens, lm.spec.max_context, n_tokens)
    ids = filler_ids(lm.tokenizer, prompt_tokens, lm.device)

    def setup() -> tuple[Any, torch.Tensor]:
        logits, cache = prefill(lm.model, ids)
        return cache, logits.argmax(dim=-1, keepdim=True)

    timing = measure(lambda arg: decode_n_tokens(lm.model, arg[0], arg[1], n_tokens), setup=setup,
                     warmup=warmup, repeats=repeats, device=lm.device, desc=f"decode {n_tokens}")
    return PhaseResult("decode", n_tokens, timing)


@torch.inference_mode()
def run_request(lm: LoadedModel, prompt: str | torch.Tensor, max_new_tokens: int, *,
                chat: bool = False, stop_at_eos: bool = True) -> RequestMetrics:
    """Serve one greedy request and time each phase, as an engine's meter would."""
    check_token_count(max_new_tokens)
    ids = prompt if isinstance(prompt, torch.Tensor) else encode_prompt(lm, prompt, chat)
    check_prompt_length(ids.shape[-1], lm.spec.max_context, max_new_tokens)
    eos = lm.tokenizer.eos_token_id
    with timer(lm.device) as t_prefill:
        logits, cache = prefill(lm.model, ids)
    with timer(lm.device) as t_first:
        token = logits.argmax(dim=-1, keepdim=True)
        out = [int(token)]
    with timer(lm.device) as t_decode:
        while len(out) < max_new_tokens and not (stop_at_eos and out[-1] == eos):
            token = decode_one_token(lm.model, cache, token).argmax(dim=-1, keepdim=True)
            out.append(int(token))  # int() waits for the device: the token is really there
    ttft = t_prefill["seconds"] + t_first["seconds"]
    return RequestMetrics(
        prompt_tokens=ids.shape[-1], output_tokens=len(out), prefill_s=t_prefill["seconds"],
        ttft_s=ttft, decode_s=t_decode["seconds"], total_s=ttft + t_decode["seconds"],
        token_ids=out, text=lm.tokenizer.decode(out, skip_special_tokens=True))
