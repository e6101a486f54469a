"""Long context: when the KV cache outweighs the model, and four answers to it.

Past some context length a decode step reads more KV cache than weights, and prefill's
attention scores grow with the square of the prompt. The pieces chapter 08 measures:

- :func:`crossover_context`, :func:`step_seconds`: where KV reads equal weight reads, and the
  predicted step time ``(weight bytes + KV bytes/token x context) / bandwidth``;
- :func:`random_llama`, :func:`fill_cache`: a hand-written Llama of any shape
  (:func:`utils.shapes.by_name`, e.g. a shape-only model with 1, 4 or all KV heads) with random weights, refused with
  the numbers when it does not fit, and a cache filled with random keys and values to time a
  step at a long context without prefilling it;
- :class:`Int8KVCache`: keys and values stored as int8 with one float16 scale per token and
  head (absmax), de-quantized as attention reads them; :func:`with_int8_kv` gives the same
  model (shared weights) whose caches are int8, for every phase, engine and executor;
- :class:`WindowKVCache`: a sliding window of ``W`` slots written round-robin: memory and
  step time stop growing past ``W``; :func:`windowed` makes the full-cache reference;
- :func:`tiled_attention`: attention computed in blocks with an online softmax
  (FlashAttention's idea), never holding the ``T x S`` score matrix;
  :class:`PeakMemory` measures the high-water mark of the tensors an operation allocates.

All of them talk to :class:`utils.llama.Llama` through the cache interface of
:class:`~utils.llama.KVCache`: ``positions``, ``mask``, ``update`` (and ``rows`` for executors).
"""

from __future__ import annotations

import math
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .device import check_fits, dtype_name
from .errors import WorkbookError, check_count, check_number
from .llama import KVCache, Llama, rope_inv_freq
from .models import random_init_
from .roofline import decode_bytes_per_token, kv_bytes_per_token
from .shapes import ModelShape

INT8_MAX = 127
SCALE_DTYPE = torch.float16  # one scale per token and head: 2 bytes beside head_dim int8 bytes


# ----------------------------------------------------------------------------- the crossover


def crossover_context(weight_bytes_read: float, kv_bytes_per_token_: float, batch: int = 1) -> float:
    """Context (tokens per sequence) at which a step's KV reads equal its weight reads.

    ``weight bytes read per step / (KV bytes per token x batch)``: a batch of ``batch``
    sequences reads the weights once but every sequence's cache.
    """
    weights = check_number(weight_bytes_read, "weight_bytes_read", "bytes")
    per_token = check_number(kv_bytes_per_token_, "kv_bytes_per_token", "bytes per token")
    return weights / (per_token * check_count(batch, "batch"))


def step_seconds(weight_bytes_read: float, kv_bytes_per_token_: float, context: int, bandwidth: float,
                 batch: int = 1) -> float:
    """Predicted decode step time: ``(weights + KV bytes/token x context x batch) / bandwidth`` (s)."""
    kv = kv_bytes_per_token_ * check_count(batch, "batch")
    return decode_bytes_per_token(weight_bytes_read, kv, context) / check_number(bandwidth, "bandwidth", "B/s")


def step_past_base(base_s: float, kv_bytes_per_token_: float, base_context: int, context: int, bandwidth: float,
                   batch: int = 1) -> float:
    """Predicted decode step time at ``context`` from a step **measured** at a short ``base_context``: that step,
    plus the KV bytes of the tokens past it over ``bandwidth`` (s).

    The measured step holds the weights' read and every fixed cost at this machine's own speed, which on a CPU
    is often well below the probe's bandwidth (one thread's matmuls, a core shared); only the added cache is
    predicted from bytes. Attention reads its cache no faster than the bandwidth, so this is a floor on how
    the step grows with context.
    """
    added = kv_bytes_per_token_ * check_count(batch, "batch") * (context - base_context)
    if added < 0:
        raise WorkbookError(f"context {context} is shorter than the base step's {base_context}.")
    return check_number(base_s, "base_s", "s") + added / check_number(bandwidth, "bandwidth", "B/s")


# ----------------------------------------------------------------------------- models of any shape


def random_llama(args: ModelShape, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0) -> Llama:
    """A hand-written Llama of shape ``args`` with random weights (:func:`utils.models.random_init_`).

    Raises :class:`~utils.errors.OutOfMemoryError` with the numbers when its weights do not fit.
    Its tokens mean nothing; its speed is real: bytes are bytes.
    """
    device, count = torch.device(device), args.n_params
    check_fits(count * dtype.itemsize, device, what=f"a {count / 1e9:.2f} B-parameter model in {dtype_name(dtype)}", weights=True)
    with torch.device("meta"):  # sizes only: memory comes with to_empty, in the final dtype
        model = Llama(args)
    model = model.to_empty(device=device).to(dtype)
    if args.tied_embeddings:  # to_empty gives each module its own tensor: tie them again
        model.lm_head.weight = model.embed.weight
    random_init_(model, seed)
    model.rope.inv_freq = rope_inv_freq(args.head_dim, args.rope).to(device)  # float32, computed, not random
    return model.eval()


@torch.inference_mode()
def fill_cache(model: Llama, cache: KVCache, length: int, seed: int = 0) -> KVCache:
    """Write random keys and values into the first ``length`` slots of every layer (through the
    cache's own ``update``, so an int8 cache quantizes them and a window keeps its last ``W``).

    A decode step's cost depends on how many slots it reads, not on their values: this times a
    step at a long context without paying for the prefill (which a shape-only model's tokens would
    not make meaningful anyway).
    """
    if not 0 < length <= cache.max_len:
        raise WorkbookError(f"Cannot fill {length} slots of a cache of {cache.max_len}.")
    a, gen = model.args, torch.Generator(device=cache.device).manual_seed(seed)
    slots = torch.arange(length, device=cache.device)
    shape = (cache.batch, a.n_kv_heads, length, a.head_dim)
    for i in range(a.n_layers):
        k, v = (torch.randn(shape, generator=gen, device=cache.device).to(model.dtype) for _ in range(2))
        cache.update(i, k, v, slots, length)
    cache.valid.fill_(True)
    cache.n_pad.zero_()
    cache.length = length
    return cache


# ----------------------------------------------------------------------------- int8 KV cache


def quantize_kv(x: Tensor) -> tuple[Tensor, Tensor]:
    """Keys or values ``x`` [..., D] -> (int8 [..., D], scale [..., 1]): one absmax scale per vector.

    ``scale = max|x| / 127``, rounded to float16 first (the 2 bytes stored per head and token), then
    ``q = round(x / scale)``: each element is off by at most ``scale / 2``.
    """
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / INT8_MAX).to(SCALE_DTYPE).float().clamp(min=2.0 ** -24)
    q = torch.round(x.float() / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale.to(SCALE_DTYPE)


def dequantize_kv(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """The inverse of :func:`quantize_kv`: ``q x scale`` in ``dtype``."""
    return (q.to(torch.float32) * scale.to(torch.float32)).to(dtype)


def int8_kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int) -> float:
    """KV bytes one token adds in an :class:`Int8KVCache`: int8 elements plus a float16 scale per vector."""
    return kv_bytes_per_token(n_layers, n_kv_heads, head_dim, 1) * (head_dim + SCALE_DTYPE.itemsize) / head_dim


class Int8KVCache(KVCache):
    """A :class:`~utils.llama.KVCache` that stores keys and values as int8, one scale per token and head.

    ``k``, ``v``: int8 [n_layers, batch, n_kv_heads, max_len, head_dim]; ``k_scale``, ``v_scale``:
    float16 [n_layers, batch, n_kv_heads, max_len, 1]. ``update`` quantizes the new keys and values as
    it writes them and hands attention the first ``kv_len`` slots de-quantized to ``dtype`` (one layer
    at a time: the float copy is transient). Same interface as the float cache, ``rows`` included,
    so prefill, decode, extend, the engine and the row executors use it unchanged.
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, static: bool = False) -> None:
        super().__init__(n_layers, batch, n_kv_heads, max_len, head_dim, torch.int8, device, static)
        scales = (n_layers, batch, n_kv_heads, max_len, 1)
        for name in ("k_scale", "v_scale"):
            self.register_buffer(name, torch.zeros(scales, dtype=SCALE_DTYPE, device=device), persistent=False)
        self.dtype = dtype

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.k_scale.nbytes + self.v_scale.nbytes

    def update(self, i: int, k: Tensor, v: Tensor, slots: Tensor, kv_len: int) -> tuple[Tensor, Tensor]:
        """Quantize and write layer ``i``'s new k, v [B, Hkv, T, D] at ``slots`` ([T] or [B, T]); return the
        first ``kv_len`` slots de-quantized, [B, Hkv, kv_len, D] each in the model's dtype."""
        out = []
        for name, x in (("k", k), ("v", v)):
            q, scale = quantize_kv(x)
            for store, new in ((getattr(self, name)[i], q), (getattr(self, f"{name}_scale")[i], scale)):
                if slots.dim() == 1:
                    store.index_copy_(2, slots, new)
                else:
                    store.scatter_(2, slots[:, None, :, None].expand(new.shape), new)
            stored, scales = getattr(self, name)[i], getattr(self, f"{name}_scale")[i]
            out.append(dequantize_kv(stored[:, :, :kv_len], scales[:, :, :kv_len], x.dtype))
        return out[0], out[1]

    def rows(self, start: int, stop: int) -> "Int8KVCache":
        """Rows ``start:stop`` as a cache that shares this one's memory (see :meth:`KVCache.rows`)."""
        view = Int8KVCache.__new__(Int8KVCache)
        nn.Module.__init__(view)
        for name in ("k", "v", "k_scale", "v_scale"):
            view.register_buffer(name, getattr(self, name)[:, start:stop], persistent=False)
        for name in ("valid", "n_pad"):
            view.register_buffer(name, getattr(self, name)[start:stop], persistent=False)
        view.length, view.static, view.dtype = 0, self.static, self.dtype
        return view


class Int8KVLlama(Llama):
    """The same :class:`~utils.llama.Llama` (its weights shared, not copied) whose caches are int8."""

    def new_cache(self, batch: int, max_len: int, static: bool = False) -> Int8KVCache:
        a = self.args
        nbytes = int8_kv_bytes_per_token(a.n_layers, a.n_kv_heads, a.head_dim) * max_len * batch
        check_fits(nbytes, self.device, what=f"an int8 KV cache for {batch} sequence(s) x {max_len} tokens")
        return Int8KVCache(a.n_layers, batch, a.n_kv_heads, max_len, a.head_dim, self.dtype, self.device, static)


def with_int8_kv(model: Llama) -> Int8KVLlama:
    """``model`` with an int8 KV cache: every ``new_cache`` (prefill, generate, perplexity, a left-padded batch)
    gives an :class:`Int8KVCache`. Shares the weights: nothing is copied."""
    if not isinstance(model, Llama):
        raise WorkbookError(f"with_int8_kv needs the hand-written model (utils.llama.Llama), got {type(model).__name__}.")
    twin = Int8KVLlama.__new__(Int8KVLlama)
    twin.__dict__.update(model.__dict__)  # the same modules, parameters and buffers
    return twin


# ----------------------------------------------------------------------------- sliding window


class WindowKVCache(KVCache):
    """A sliding-window cache: ``window`` slots written round-robin (position ``p`` in slot ``p % W``).

    Memory is ``W`` slots whatever the context; a decode step reads ``W`` slots, so its time stops
    growing past ``W``. Each token attends to itself and the ``W - 1`` tokens before it (Mistral's
    rule); a chunk of ``T > 1`` tokens (prefill) attends to the window before it plus itself, so a
    prompt longer than ``W`` is handled exactly. ``max_len`` is how many positions it may serve
    (the model's context), not what it stores. Rows share positions (left padding), so ``slots`` are [T].
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, window: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, max_len: int) -> None:
        super().__init__(n_layers, batch, n_kv_heads, check_count(window, "window"), head_dim, dtype, device)
        self.window, self.n_layers, self._max_len = window, n_layers, check_count(max_len, "max_len")
        self.valid = torch.ones(batch, max_len, dtype=torch.bool, device=device)  # per position, not per slot
        self.register_buffer("pos", torch.full((window,), -1, dtype=torch.long, device=device), persistent=False)

    @property
    def max_len(self) -> int:
        return self._max_len

    def _key_positions(self, slots: Tensor) -> Tensor:
        """Positions of the keys ``update`` returns: the ring after writing one token, or the ring before
        a chunk followed by the chunk."""
        if slots.dim() != 1:
            raise WorkbookError("A WindowKVCache serves rows that share positions (slots [T]), not rows of their own.")
        if len(slots) == 1:
            return self.pos.index_copy(0, slots % self.window, slots)
        before = torch.where(self.pos < slots[0], self.pos, -1)  # a new prompt (slot 0) sees no earlier request
        return torch.cat([before, slots])

    def mask(self, slots: Tensor, kv_len: int, window: int | None = None) -> Tensor:
        w = self.window if window is None else min(window, self.window)
        key = self._key_positions(slots)  # [S]
        q = slots[:, None]  # [T, 1]
        allowed = (key <= q) & (q - key < w) & (key >= 0)  # [T, S]
        allowed = allowed & self.valid[:, key.clamp(min=0)][:, None, :]  # [B, T, S]
        return (allowed | (key == q))[:, None]  # [B, 1, T, S]

    def update(self, i: int, k: Tensor, v: Tensor, slots: Tensor, kv_len: int) -> tuple[Tensor, Tensor]:
        k_ring, v_ring = self.layer(i)
        keep = slice(max(0, len(slots) - self.window), None)  # the chunk's last W tokens stay
        if len(slots) > 1:
            k_all, v_all = torch.cat([k_ring, k], dim=2), torch.cat([v_ring, v], dim=2)
        ring_slots = slots[keep] % self.window
        k_ring.index_copy_(2, ring_slots, k[:, :, keep])
        v_ring.index_copy_(2, ring_slots, v[:, :, keep])
        if i == self.n_layers - 1:  # the step's mask was made before layer 0: move the ring's positions last
            self.pos.index_copy_(0, ring_slots, slots[keep])
        return (k_ring, v_ring) if len(slots) == 1 else (k_all, v_all)

    def rows(self, start: int, stop: int) -> "KVCache":
        raise NotImplementedError("a WindowKVCache serves whole batches")


def window_cache(model: Llama, batch: int, window: int, max_len: int | None = None) -> WindowKVCache:
    """A zeroed :class:`WindowKVCache` of ``window`` slots for ``model`` (clear error if it will not fit)."""
    a = model.args
    check_fits(kv_bytes_per_token(a.n_layers, a.n_kv_heads, a.head_dim, model.dtype.itemsize) * window * batch,
               model.device, what=f"a {window}-slot window cache for {batch} sequence(s)")
    return WindowKVCache(a.n_layers, batch, a.n_kv_heads, window, a.head_dim, model.dtype, model.device,
                         max_len or a.max_context)


@contextmanager
def windowed(model: Llama, window: int | None) -> Iterator[Llama]:
    """Within the block, every layer of ``model`` attends to at most ``window`` tokens (a mask over a
    full cache: the reference a :class:`WindowKVCache` must equal); restored on exit."""
    before = [b.attn.window for b in model.layers]
    for b in model.layers:
        b.attn.window = window
    try:
        yield model
    finally:
        for b, w in zip(model.layers, before):
            b.attn.window = w


# ----------------------------------------------------------------------------- tiled attention


def _tile_scores(q: Tensor, k: Tensor, q0: int, k0: int, offset: int, causal: bool) -> Tensor:
    """Scaled scores of a query tile against a key tile, causal positions masked with -inf."""
    s = (q @ k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])  # [B, Hkv, G, bq, bk]
    if causal:
        qi = torch.arange(q0, q0 + q.shape[-2], device=q.device)[:, None] + offset
        ki = torch.arange(k0, k0 + k.shape[-2], device=q.device)[None, :]
        s = s.masked_fill(ki > qi, float("-inf"))
    return s


def tiled_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, block: int = 128) -> Tensor:
    """``softmax(q kᵀ / √D) v`` in tiles of ``block`` queries x ``block`` keys, with an online softmax.

    q [B, H, T, D]; k, v [B, Hkv, S, D] (``H % Hkv == 0``: grouped-query, each group of ``H / Hkv`` query
    heads reads its KV head in place, no copies). Causal: the T queries are the last T positions of the S keys.
    Per query it keeps a running max ``m``, a running sum ``l`` of ``exp(score - m)`` and an unnormalised
    output; each new key tile rescales them by ``exp(m_old - m_new)``. The largest temporary is one
    ``block x block`` tile per head, never ``T x S``.
    """
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[-2]
    if Hkv == 0 or H % Hkv:
        raise WorkbookError(f"{H} query heads cannot share {Hkv} KV heads evenly.")
    q5, k5, v5 = q.view(B, Hkv, H // Hkv, T, D), k[:, :, None], v[:, :, None]  # [B, Hkv, G, *, D]
    offset, out = S - T, torch.empty_like(q5)
    for q0 in range(0, T, check_count(block, "block")):
        qt = q5[..., q0:q0 + block, :]
        m = torch.full(qt.shape[:-1] + (1,), float("-inf"), device=q.device)
        l, acc = torch.zeros_like(m), torch.zeros(qt.shape, device=q.device)
        k_end = min(S, q0 + qt.shape[-2] + offset) if causal else S  # later keys are all masked
        for k0 in range(0, k_end, block):
            s = _tile_scores(qt, k5[..., k0:k0 + block, :], q0, k0, offset, causal)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            p, rescale = torch.exp(s - m_new), torch.exp(m - m_new)
            l = l * rescale + p.sum(dim=-1, keepdim=True)
            acc = acc * rescale + p @ v5[..., k0:k0 + block, :].float()
            m = m_new
        out[..., q0:q0 + block, :] = (acc / l).to(q.dtype)
    return out.view(B, H, T, D)


def full_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
    """The textbook version: the whole ``T x S`` score matrix, then its softmax (the reference)."""
    H, Hkv = q.shape[1], k.shape[1]
    k, v = (x.repeat_interleave(H // Hkv, dim=1) for x in (k, v))
    s = (q @ k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])  # [B, H, T, S]
    if causal:
        T, S = q.shape[-2], k.shape[-2]
        s = s.masked_fill(torch.ones(T, S, dtype=torch.bool, device=q.device).triu(S - T + 1), float("-inf"))
    return (torch.softmax(s, dim=-1) @ v.float()).to(q.dtype)


def score_matrix_bytes(batch: int, n_heads: int, q_len: int, k_len: int, bytes_per_elem: int = 4) -> int:
    """Bytes of the full score matrix ``[B, H, T, S]``: what tiling avoids holding."""
    return batch * n_heads * q_len * k_len * bytes_per_elem


class PeakMemory(TorchDispatchMode):
    """``with PeakMemory() as pm: ...`` then ``pm.peak``: the high-water mark (bytes) of the tensors the
    block's operators allocated and still held, counted as torch dispatches them (any device).

    Inputs that existed before the block are not counted; scratch memory a fused kernel allocates inside
    itself (e.g. SDPA's own tiles) is invisible to it: only the tensors the operators return are seen.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live, self.peak, self._seen = 0, 0, set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor) and not t.is_meta:
                self._track(t)
        return out

    def _track(self, t: Tensor) -> None:
        key = t.untyped_storage().data_ptr()
        if key in self._seen or key == 0:
            return  # a view, or an in-place result: its memory is already counted
        n = t.untyped_storage().nbytes()
        self._seen.add(key)
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._release, key, n)

    def _release(self, key: int, n: int) -> None:
        self._seen.discard(key)
        self.live -= n
