"""A Llama forward pass written by hand, and its preallocated KV cache.

The model (read it top to bottom, like nanoGPT's ``model.py``)::

    tokens ─ embed ─┬─ [ RMSNorm ─ attention (RoPE, grouped-query) ─ + ]  x n_layers ─ RMSNorm ─ lm_head ─ logits
                    └─ [ RMSNorm ─ SwiGLU MLP ─────────────────────── + ]

One call of :class:`Llama` runs ``T`` new tokens per row at cache positions ("slots"):
it writes their K and V into the :class:`KVCache` and attends to the first ``kv_len``
slots. The phases built on that call (prefill, decode, extend) live in
:mod:`utils.llama_phases`; the loops that generate with them in :mod:`utils.engine`.

The KV cache is allocated once per request, sized to what that request needs
(prompt + new tokens). Inside one step nothing branches in Python on a tensor's
*value*, and the cache is written by position, so a step can be compiled whole.

Batches use LEFT padding: every row's last prompt token sits in the same slot, so
the new tokens of all rows are written at the same position. Padded slots are masked
out, and RoPE positions are counted from each row's first real token, so every row
gives the same tokens as when run alone.

Every projection is an ``nn.Linear`` at a predictable name (:func:`iter_linears`),
so the quantization lab can swap them (:func:`replace_linear`).

Supported: LlamaForCausalLM, MistralForCausalLM (sliding window), Qwen2ForCausalLM
(q/k/v bias). RoPE types: default, linear, llama3.
"""

from __future__ import annotations

import math
import dataclasses
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cpu_attention
from .device import check_fits
from .errors import UnsupportedArchitectureError
from .models import model_spec
from .roofline import kv_cache_bytes
from .shapes import ModelShape

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# The projections of one block, as attribute paths inside ``layers.{i}``.
BLOCK_LINEARS = ("attn.qkv_proj", "attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


# ----------------------------------------------------------------------------- RoPE


def rope_inv_freq(head_dim: int, rope: dict) -> Tensor:
    """The rotation speed of each pair of channels: ``theta ** (-2i / head_dim)``.

    Pair ``i`` of a query/key at position ``p`` is rotated by the angle ``p * inv_freq[i]``;
    the dot product of a rotated query and key then depends only on their distance.
    ``linear`` divides every frequency by ``factor`` (positions stretched);
    ``llama3`` divides only the slow (long-wavelength) ones and blends in between.
    """
    kind = rope.get("rope_type", "default")
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"RoPE type {kind!r} is not implemented by the hand-written forward pass; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}.")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope["rope_theta"] ** exponent)  # [head_dim / 2]
    if kind == "linear":
        return inv_freq / rope["factor"]
    if kind == "llama3":
        return _llama3_scaling(inv_freq, rope)
    return inv_freq


def _llama3_scaling(inv_freq: Tensor, rope: dict) -> Tensor:
    """Llama 3.1's RoPE scaling: slow frequencies / factor, fast ones kept, a ramp between."""
    factor, old_len = rope["factor"], rope["original_max_position_embeddings"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, blended, scaled)


class Rotary(nn.Module):
    """cos and sin of ``position * inv_freq``, each frequency used for two channels."""

    def __init__(self, inv_freq: Tensor) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/2], float32

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, D/2], float32
        angles = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dim: a 90° turn of each pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each channel pair of ``x`` [B, H, T, D] by its angle (cos, sin: [B, T, D])."""
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, D]: same angle for every head
    return x * cos + rotate_half(x) * sin


# ----------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``: rescale each token's vector to unit root-mean-square.

    Computed in float32 (a bf16 sum of squares over 4,096 channels loses digits),
    then cast back before the learned per-channel gain, as transformers does.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """softmax(q kᵀ / √D + mask) v, with grouped-query attention.

    q: [B, H, T, D]; k, v: [B, Hkv, S, D]; mask: [B, 1, T, S] bool, True = may attend.
    Each group of ``H // Hkv`` query heads shares one K/V head: the cache holds only
    Hkv heads, which is what makes it ``H / Hkv`` times smaller than with full heads.

    On a CPU a decode step (T = 1) in float32, bf16 or fp16 uses the workbook's own kernel
    (:mod:`utils.cpu_attention`; float64 stays on PyTorch's, in float64): PyTorch's CPU kernel is built for
    prefill's many queries and is slow on one. Measured on a 2-core AMD EPYC (AVX2), one layer's attention over
    1,280 cached bf16 slots, 30 layers' caches cycled: 1,165 µs with PyTorch's kernel as is, 447 µs on a float32
    copy of the cache, 106 µs with the workbook's. On a 2-core Xeon, SmolLM2 over 1,024 float32 slots: 81.5 µs with
    PyTorch's, 27.6 with the workbook's; inside a compiled float32 step, PyTorch's took 5.8 ms of its 26.6 ms. The lab's attention cell measures them on the machine at hand.
    Both compute in float32, in a different order: their answers differ by float32 rounding, not more.
    Where the kernel cannot be built, a low-precision cache is read in float32 by PyTorch's kernel.
    GPUs keep their own (flash) kernels.
    """
    if q.device.type == "cpu" and cpu_attention.handles(q, k, v, mask) and cpu_attention.available():
        return cpu_attention.decode_attention(q, k, v, mask)
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
        return out.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class Attention(nn.Module):
    """Causal self-attention with RoPE, GQA and a KV cache written by position.

    ``qkv_proj`` is q, k and v fused into one matrix: one matmul reads the input once.
    """

    def __init__(self, args: ModelShape, window: int | None = None) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.window = window  # sliding-window size (Mistral, some Qwen2 layers), None = full
        qkv_out = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, qkv_out, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.hidden_size, bias=args.o_bias)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor,
                cache: "KVCache", layer: int, slots: Tensor) -> Tensor:
        """x [B, T, dim]; ``cache`` stores this layer's new K/V at ``slots`` ([T] or [B, T]) and
        hands back the first ``S = mask.shape[-1]`` positions of each row."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
        q = q.view(B, T, H, D).transpose(1, 2)  # [B, H, T, D]
        k = k.view(B, T, Hkv, D).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.view(B, T, Hkv, D).transpose(1, 2)  # [B, Hkv, T, D]
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        k_all, v_all = cache.update(layer, k, v, slots, mask.shape[-1])  # [B, Hkv, S, D] each
        y = attention(q, k_all, v_all, mask)  # [B, H, T, D]
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * D))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; gate and up fused into one matmul."""

    def __init__(self, args: ModelShape) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [B, T, intermediate_size] each
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, args: ModelShape, window: int | None = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.attn = Attention(args, window)
        self.mlp_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor,
                cache: "KVCache", layer: int, slots: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), rope, mask, cache, layer, slots)
        return x + self.mlp(self.mlp_norm(x))


# ----------------------------------------------------------------------------- KV cache


class KVCache(nn.Module):
    """Preallocated keys and values of every layer, written by position ("slot").

    ``k``, ``v``: [n_layers, batch, n_kv_heads, max_len, head_dim]. Size in bytes:
    ``2 x n_layers x n_kv_heads x head_dim x bytes/element x max_len x batch``.

    Per request it also keeps ``valid`` [batch, max_len] (False at left-padding slots),
    ``n_pad`` [batch] (RoPE position = slot - n_pad) and ``length`` (a Python int:
    slots filled so far; the same for every row, thanks to left padding).
    ``static=True`` makes each decode step attend over all ``max_len`` slots (masked)
    so that its shapes never change: what a compiled step needs. (With a sliding window
    the whole request is still kept: the window is a mask, not a ring buffer.)
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, static: bool = False) -> None:
        super().__init__()
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        # zeros, not empty: a static step reads unfilled slots (masked, but NaN x 0 = NaN)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("valid", torch.ones(batch, max_len, dtype=torch.bool, device=device),
                             persistent=False)
        self.register_buffer("n_pad", torch.zeros(batch, dtype=torch.long, device=device),
                             persistent=False)
        self.length = 0
        self.static = static

    @property
    def device(self) -> torch.device:
        return self.valid.device

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        """Bytes of the K and V tensors (the small ``valid``/``n_pad`` bookkeeping not counted)."""
        return self.k.nbytes + self.v.nbytes

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        """Layer ``i``'s (k, v), each [batch, n_kv_heads, max_len, head_dim] (views)."""
        return self.k[i], self.v[i]

    def update(self, i: int, k: Tensor, v: Tensor, slots: Tensor, kv_len: int) -> tuple[Tensor, Tensor]:
        """Write layer ``i``'s new keys and values (k, v: [B, Hkv, T, D]) at ``slots``; return the
        first ``kv_len`` slots of every row, [B, Hkv, kv_len, D] each (what attention reads).

        ``slots`` [T]: every row at the same positions (a left-padded batch); [B, T]: each row
        at its own (requests that started at different times).
        """
        k_cache, v_cache = self.layer(i)
        if slots.dim() == 1:
            k_cache.index_copy_(2, slots, k)
            v_cache.index_copy_(2, slots, v)
        else:
            where = slots[:, None, :, None].expand(k.shape)
            k_cache.scatter_(2, where, k)
            v_cache.scatter_(2, where, v)
        return k_cache[:, :, :kv_len], v_cache[:, :, :kv_len]

    def mask(self, slots: Tensor, kv_len: int, window: int | None = None) -> Tensor:
        """Which of the first ``kv_len`` slots each new token may attend to: [B, 1, T, kv_len].

        A token at slot q sees slot k if ``k <= q`` (causal), k holds a real token (not
        padding) and, with a sliding window, ``q - k < window``. It always sees itself,
        so that a padding query never has an all-masked row (softmax of nothing = NaN).
        ``slots`` is [T] (the same for every row) or [B, T] (each row its own).
        """
        k_slot = torch.arange(kv_len, device=slots.device)  # [S]
        q_slot = slots[..., None]  # [T, 1] or [B, T, 1]
        allowed = k_slot <= q_slot  # [T, S] or [B, T, S]
        if window is not None:
            allowed = allowed & (q_slot - k_slot < window)
        allowed = allowed & self.valid[:, None, :kv_len]  # [B, T, S]
        return (allowed | (k_slot == q_slot))[:, None]  # [B, 1, T, S]

    def positions(self, slots: Tensor) -> Tensor:
        """RoPE positions of the tokens at ``slots`` ([T] or [B, T]): counted from each row's first real token."""
        per_row = slots if slots.dim() == 2 else slots[None, :]  # [B or 1, T]
        return (per_row - self.n_pad[:, None]).clamp(min=0)  # [B, T]

    def rows(self, start: int, stop: int) -> "KVCache":
        """Rows ``start:stop`` as a cache of their own that SHARES this one's memory.

        Writing into the view writes into these rows: a scheduler prefills one request
        into its row, or decodes only the rows in use. ``length`` starts at 0.
        """
        view = KVCache.__new__(KVCache)
        nn.Module.__init__(view)
        for name in ("k", "v"):
            view.register_buffer(name, getattr(self, name)[:, start:stop], persistent=False)
        for name in ("valid", "n_pad"):
            view.register_buffer(name, getattr(self, name)[start:stop], persistent=False)
        view.length, view.static = 0, self.static
        return view


class StaticKVCache(KVCache):
    """A static cache (``static=True``) whose layers are separate tensors: what a compiled step needs.

    Each layer's keys and values are their own buffers ``k_{i}``, ``v_{i}`` [batch, n_kv_heads,
    max_len, head_dim], not views of one stacked tensor: a compiled step then writes each
    layer's new slot in place. (A write through a view of a stacked graph input makes the
    compiler rebuild the whole stack at every layer of every step: at 1,024 tokens of context
    that copying made the compiled step slower than eager.) Same interface as :class:`KVCache`.
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        nn.Module.__init__(self)
        self.n_layers = n_layers
        for i in range(n_layers):  # zeros: a static step reads unfilled slots (masked, but NaN x 0 = NaN)
            for name in ("k", "v"):
                self.register_buffer(f"{name}_{i}", torch.zeros(batch, n_kv_heads, max_len, head_dim, dtype=dtype,
                                                               device=device), persistent=False)
        self.register_buffer("valid", torch.ones(batch, max_len, dtype=torch.bool, device=device), persistent=False)
        self.register_buffer("n_pad", torch.zeros(batch, dtype=torch.long, device=device), persistent=False)
        self.length, self.static = 0, True

    @property
    def batch(self) -> int:
        return self.k_0.shape[0]

    @property
    def max_len(self) -> int:
        return self.k_0.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for i in range(self.n_layers) for t in self.layer(i))

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        return getattr(self, f"k_{i}"), getattr(self, f"v_{i}")

    def rows(self, start: int, stop: int) -> "KVCache":
        raise NotImplementedError("a static cache serves whole batches: use a KVCache for per-row views")


# ----------------------------------------------------------------------------- the model


class Llama(nn.Module):
    """Embedding, ``n_layers`` blocks, final norm, LM head (tied to the embedding or not)."""

    def __init__(self, args: ModelShape) -> None:
        super().__init__()
        self.args = args
        windows = args.windows or (None,) * args.n_layers
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.rope = Rotary(rope_inv_freq(args.head_dim, args.rope))
        self.layers = nn.ModuleList(Block(args, w) for w in windows)
        self.norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tied_embeddings:
            self.lm_head.weight = self.embed.weight

    @classmethod
    def from_hf(cls, hf_model: Any) -> "Llama":
        """Build from a loaded transformers model, on its device and in its dtype.

        Norms, embedding, o_proj, down_proj and an untied LM head share the transformers
        tensors; the fused qkv and gate_up weights are new tensors (a copy of ~2/3 of
        the layer weights). Raises :class:`UnsupportedArchitectureError` for others.
        """
        args = args_from_hf(hf_model)
        with torch.device("meta"):  # no memory, no random init: every weight is assigned below
            model = cls(args)
        _load_hf_weights(model, hf_model)
        return model.eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, batch: int, max_len: int, static: bool = False) -> KVCache:
        """A zeroed KV cache for ``batch`` sequences of up to ``max_len`` tokens.

        Raises :class:`~utils.errors.OutOfMemoryError`, with the numbers, when the cache
        would not fit in the device's free memory (instead of failing inside torch).
        """
        a = self.args
        nbytes = kv_cache_bytes(a.n_layers, a.n_kv_heads, a.head_dim, self.dtype.itemsize, max_len, batch)
        check_fits(nbytes, self.device, what=f"a KV cache for {batch} sequence(s) x {max_len} tokens")
        if static:
            return StaticKVCache(a.n_layers, batch, a.n_kv_heads, max_len, a.head_dim, self.dtype, self.device)
        return KVCache(a.n_layers, batch, a.n_kv_heads, max_len, a.head_dim, self.dtype, self.device)

    def forward(self, tokens: Tensor, slots: Tensor, cache: KVCache, kv_len: int,
                last_only: bool = False, keep: Tensor | None = None) -> Tensor:
        """One step: tokens [B, T] at cache ``slots`` -> logits [B, T, V] ([B, 1, V] if last_only).

        ``slots`` is [T] (every row at the same positions) or [B, T] (each row at its own:
        requests that started at different times). Writes the tokens' K/V into ``cache``
        and attends to its first ``kv_len`` slots. ``keep`` [K]: logits only at those of the
        T positions, [B, K, V] (a packed batch needs each sequence's last token only).
        """
        x = self.embed(tokens)  # [B, T, dim]
        rope = self.rope(cache.positions(slots), x.dtype)  # cos, sin: [B, T, head_dim]
        masks = {w: cache.mask(slots, kv_len, w) for w in {b.attn.window for b in self.layers}}
        for i, block in enumerate(self.layers):
            x = block(x, rope, masks[block.attn.window], cache, i, slots)
        if last_only:
            x = x[:, -1:]  # prefill needs only the next token: skip T-1 rows of the LM head
        elif keep is not None:
            x = x[:, keep]
        return self.lm_head(self.norm(x))  # [B, T, vocab]


def args_from_hf(hf_model: Any) -> ModelShape:
    """Read the shape off a transformers model (:func:`utils.models.model_spec`), with the biases its layers
    carry; refuse architectures we do not implement."""
    arch = type(hf_model).__name__
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{arch} is not supported by the hand-written forward pass (utils.llama); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}. Use transformers' own "
            "generate() for this model, or pick a Llama-family model.")
    cfg, layer0 = hf_model.config, hf_model.model.layers[0]
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise UnsupportedArchitectureError(f"{arch} with hidden_act={cfg.hidden_act!r}: only silu is implemented.")
    attn = layer0.self_attn
    return dataclasses.replace(
        model_spec(hf_model, getattr(cfg, "_name_or_path", "") or arch), architecture=arch,
        head_dim=attn.q_proj.out_features // cfg.num_attention_heads,
        qkv_bias=attn.q_proj.bias is not None, o_bias=attn.o_proj.bias is not None,
        mlp_bias=layer0.mlp.down_proj.bias is not None)


def _param(*tensors: Tensor | None) -> nn.Parameter | None:
    """One tensor shared as is, or several concatenated (fusion); None if there are none."""
    if tensors[0] is None:
        return None
    data = tensors[0].detach() if len(tensors) == 1 else torch.cat([t.detach() for t in tensors])
    return nn.Parameter(data, requires_grad=False)


def _load_hf_weights(model: Llama, hf_model: Any) -> None:
    """Point every weight of ``model`` at the transformers weights (fusing q/k/v and gate/up)."""
    hf = hf_model.model
    model.embed.weight = _param(hf.embed_tokens.weight)
    model.lm_head.weight = model.embed.weight if model.args.tied_embeddings else _param(hf_model.lm_head.weight)
    model.norm.weight = _param(hf.norm.weight)
    model.rope.inv_freq = rope_inv_freq(model.args.head_dim, model.args.rope).to(model.device)
    for block, layer in zip(model.layers, hf.layers):
        a, m = layer.self_attn, layer.mlp
        block.attn_norm.weight = _param(layer.input_layernorm.weight)
        block.mlp_norm.weight = _param(layer.post_attention_layernorm.weight)
        block.attn.qkv_proj.weight = _param(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)
        block.attn.qkv_proj.bias = _param(a.q_proj.bias, a.k_proj.bias, a.v_proj.bias)
        block.attn.o_proj.weight, block.attn.o_proj.bias = _param(a.o_proj.weight), _param(a.o_proj.bias)
        block.mlp.gate_up_proj.weight = _param(m.gate_proj.weight, m.up_proj.weight)
        block.mlp.gate_up_proj.bias = _param(m.gate_proj.bias, m.up_proj.bias)
        block.mlp.down_proj.weight, block.mlp.down_proj.bias = _param(m.down_proj.weight), _param(m.down_proj.bias)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not left, f"weights not loaded from the transformers model: {left}"


# ----------------------------------------------------------------------------- swapping projections


def iter_linears(model: Llama) -> Iterator[tuple[str, nn.Module]]:
    """Every projection as (name, module): ``layers.{i}.attn.qkv_proj``, ``.attn.o_proj``,
    ``.mlp.gate_up_proj``, ``.mlp.down_proj`` for each layer, then ``lm_head``.

    Names are stable, whatever the module currently is (nn.Linear or a quantized stand-in).
    """
    for i, block in enumerate(model.layers):
        for path in BLOCK_LINEARS:
            yield f"layers.{i}.{path}", block.get_submodule(path)
    yield "lm_head", model.lm_head


def replace_linear(model: Llama, name: str, new_module: nn.Module) -> nn.Module:
    """Put ``new_module`` (same call signature: [..., in] -> [..., out]) in place of ``name``.

    Returns the old module. Replacing a tied ``lm_head`` unties it: the embedding keeps
    its own weights.
    """
    current = dict(iter_linears(model))
    if name not in current:
        raise KeyError(f"{name!r} is not a projection of this model; see iter_linears(model), "
                       f"e.g. 'layers.0.attn.qkv_proj' or 'lm_head'.")
    old = current[name]
    for attr in ("in_features", "out_features"):
        want, got = getattr(old, attr, None), getattr(new_module, attr, None)
        if want is not None and got is not None and want != got:
            raise ValueError(f"{name}: {attr} is {want}, the new module has {got}.")
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new_module)
    return old
