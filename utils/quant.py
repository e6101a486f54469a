"""Weight-only quantization: int8 per output channel, int4 per group, and their kernels.

Why it speeds up decode: one decode step reads every weight once to produce one
token, so its time is ``bytes of weights ÷ memory bandwidth``. Storing a weight in
8 or 4 bits instead of 32 cuts the bytes, hence the time, by up to 4x or 8x, if the
matmul reads the small integers directly (a *kernel*) instead of first rebuilding
a float copy (the *reference* path here, correct but slow).

int8, per output channel, symmetric ("absmax")
    Row ``o`` of ``W [out, in]`` gets one scale ``s_o = max|W_o,:| / 127``;
    ``q = round(W / s)`` in [-127, 127] (int8) and ``W ≈ q * s``. Rounding moves
    each weight by at most ``s_o / 2``. Because ``s`` is per output row,
    ``x @ (q * s).T == (x @ q.T) * s``: multiply by the integers, scale the outputs.

int4, per group of ``g`` inputs, asymmetric (scale and zero point)
    Each row is cut into groups of ``g`` (32 or 64) consecutive weights; a group with
    minimum ``lo`` and maximum ``hi`` gets ``scale = (hi - lo) / 15`` and
    ``zero = -lo / scale``; ``q = round(W / scale + zero)`` in [0, 15] and
    ``W ≈ (q - zero) * scale``. ``lo`` lands on 0 and ``hi`` on 15 exactly, so the
    error is at most ``scale / 2``. The zero point is kept as a float, as the kernels
    keep it (GGUF's Q4_1 is the same idea: ``W ≈ q * d + m``). Two 4-bit values share
    one byte (:func:`pack_int4`: even index in the low nibble, odd in the high one).
    Storage per weight: 4 bits plus a scale and a zero per group, e.g. bf16 ones at
    g = 32 add 1 bit: 5 bits per weight.

Kernels (PyTorch's own, ``torch.ops.aten``), checked against the reference on first use
    - ``_weight_int8pack_mm(x, q, scales)``: ``x @ (q * scales).T``, scales in x's dtype.
    - CPU int4: ``_convert_weight_to_int4pack_for_cpu(q int32 [N, K], 1)`` and
      ``_weight_int4pack_mm_for_cpu(x, packed, g, scales_and_zeros)``, where
      ``scales_and_zeros`` is ``[K / g, N, 2]`` in x's dtype and the kernel computes
      ``W = (q - 8) * scale + zero8``, so ``zero8 = (8 - zero) * scale``. N must be a
      multiple of 16. CUDA/MPS: ``_convert_weight_to_int4pack`` + ``_weight_int4pack_mm``.
    With fp32 activations they work but are slow; with bf16 they are the fast path.
    When a kernel is missing or disagrees with the reference, the module falls back
    to the reference path and says why in ``kernel_note``.

:func:`weight_bytes` counts what a module really stores (each tensor once, tied ones
once), so tables of bytes against tokens/s are honest.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

INT8_MAX = 127
INT4_MAX = 15  # 4 bits: levels 0 .. 15
KERNEL_RTOL = 0.05  # kernel vs reference, relative to the largest output: bf16 rounding passes
PROBE_ROWS = 256  # the probe compares the first outputs only: cheap even for a 49k-row LM head
_TINY = 1e-12


# ----------------------------------------------------------------------------- int8


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """Per-output-channel absmax int8: ``(q int8 [out, in], scale float32 [out])``, ``w ≈ q * scale``."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=_TINY) / INT8_MAX  # [out]
    q = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``q * scale`` row by row, as a float matrix [out, in] in ``dtype``."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def int8_matmul_reference(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """``x @ (q * scale).T`` computed as ``(x @ q.T) * scale``: the integers, then the row scales."""
    return F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)


def int8_matmul_kernel(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """The same product through ``aten._weight_int8pack_mm`` (inputs flattened to 2-D)."""
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.ops.aten._weight_int8pack_mm(x2, q, scale.to(x.dtype))
    return y.reshape(*x.shape[:-1], q.shape[0])


# ----------------------------------------------------------------------------- int4


def pack_int4(q: Tensor) -> Tensor:
    """Two values in [0, 15] per byte along the last dim (even: low nibble, odd: high).

    ``[..., K]`` (K even) -> uint8 ``[..., K / 2]``.
    """
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even last dimension, got {tuple(q.shape)}.")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_int4`: uint8 ``[..., K / 2]`` -> uint8 ``[..., K]`` in [0, 15]."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def _groups(w: Tensor, group_size: int) -> Tensor:
    """``w [out, in]`` as ``[out, in / g, g]``; clear error when ``in`` is not a multiple of g."""
    out_f, in_f = w.shape
    if in_f % group_size:
        raise ValueError(f"in_features={in_f} is not a multiple of group_size={group_size}.")
    return w.reshape(out_f, in_f // group_size, group_size)


def quantize_int4_unpacked(w: Tensor, group_size: int = 32) -> tuple[Tensor, Tensor, Tensor]:
    """Group-wise asymmetric int4, one value per byte: ``(q uint8 [out, in], scales, zeros)``.

    ``scales``, ``zeros``: float32 ``[out, in / group_size]``; ``w ≈ (q - zero) * scale``.
    """
    wg = _groups(w.detach().float(), group_size)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # [out, in/g]
    scales = (hi - lo).clamp(min=_TINY) / INT4_MAX
    zeros = -lo / scales
    q = torch.round((wg - lo[..., None]) / scales[..., None]).clamp(0, INT4_MAX)  # = round(w/s + zero)
    return q.to(torch.uint8).reshape(w.shape), scales, zeros


def quantize_int4(w: Tensor, group_size: int = 32) -> tuple[Tensor, Tensor, Tensor]:
    """Group-wise int4, packed two per byte: ``(packed uint8 [out, in/2], scales, zeros)``."""
    q, scales, zeros = quantize_int4_unpacked(w, group_size)
    return pack_int4(q), scales, zeros


def dequantize_int4(packed: Tensor, scales: Tensor, zeros: Tensor, group_size: int = 32,
                    dtype: torch.dtype = torch.float32) -> Tensor:
    """``(q - zero) * scale`` group by group, as a float matrix [out, in] in ``dtype``."""
    q = unpack_int4(packed).float()
    qg = _groups(q, group_size)
    w = (qg - zeros.float()[..., None]) * scales.float()[..., None]
    return w.reshape(q.shape).to(dtype)


def int4_kernel_pack(q: Tensor, device: torch.device) -> Tensor:
    """Re-lay unpacked int4 values ``q [N, K]`` for the device's int4 kernel."""
    if device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    high_first = ((q[:, 0::2].to(torch.uint8) << 4) | q[:, 1::2].to(torch.uint8)).to(device)
    return torch.ops.aten._convert_weight_to_int4pack(high_first, 8)


def int4_scales_and_zeros(scales: Tensor, zeros: Tensor, dtype: torch.dtype) -> Tensor:
    """The kernels' ``[K / g, N, 2]`` table: scale and ``zero8 = (8 - zero) * scale``."""
    zero8 = (8 - zeros.float()) * scales.float()
    return torch.stack([scales.float(), zero8], dim=-1).transpose(0, 1).contiguous().to(dtype)


def int4_matmul_kernel(x: Tensor, packed: Tensor, group_size: int, scales_and_zeros: Tensor) -> Tensor:
    """``x @ W.T`` through the device's int4 kernel (inputs flattened to 2-D)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x.device.type == "cpu":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, group_size, scales_and_zeros)
    else:
        y = torch.ops.aten._weight_int4pack_mm(x2, packed, group_size, scales_and_zeros)
    return y.reshape(*x.shape[:-1], y.shape[-1])


# ----------------------------------------------------------------------------- kernel probe


def kernel_agrees(kernel: Callable[[Tensor], Tensor], reference: Callable[[Tensor], Tensor],
                  in_features: int, dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    """Run ``kernel`` and ``reference`` on the same random input; ``(agrees, why not)``.

    ``reference`` may compute only the first outputs (columns); the kernel's are cut to match.
    """
    x = torch.randn(2, in_features, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    try:
        with torch.no_grad():
            want = reference(x).float()
            got = kernel(x).float()[..., : want.shape[-1]]
    except (RuntimeError, NotImplementedError, AttributeError) as exc:  # op missing or refused
        return False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    err = (got - want).abs().max().item() / max(want.abs().max().item(), _TINY)
    if not err <= KERNEL_RTOL:
        return False, f"kernel disagrees with the reference (relative error {err:.3g})"
    return True, ""


def _decide_kernel(use_kernel: bool | None, agrees: tuple[bool, str], name: str) -> tuple[bool, str]:
    """Resolve ``use_kernel`` (None = when it works) into (use it, note)."""
    if use_kernel is False:
        return False, "reference path (asked for)"
    ok, why = agrees
    if not ok and use_kernel:
        raise RuntimeError(f"{name}: the kernel was asked for but cannot be used here: {why}")
    return ok, ("aten kernel" if ok else f"reference path: {why}")


# ----------------------------------------------------------------------------- modules


class Int8Linear(nn.Module):
    """A linear layer with int8 weights (per-output-channel scales); same call as nn.Linear.

    Buffers: ``q`` int8 [out, in], ``scale`` [out] and ``bias`` (if any) in the
    activation dtype. ``forward`` uses ``aten._weight_int8pack_mm`` when it runs here
    (``path == "kernel"``), else :func:`int8_matmul_reference`.
    """

    def __init__(self, q: Tensor, scale: Tensor, bias: Tensor | None = None,
                 dtype: torch.dtype = torch.float32, use_kernel: bool | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("q", q)
        self.register_buffer("scale", scale.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        agrees = (False, "not probed") if use_kernel is False else kernel_agrees(
            lambda x: int8_matmul_kernel(x, self.q, self.scale),
            lambda x: int8_matmul_reference(x, self.q[:PROBE_ROWS], self.scale[:PROBE_ROWS]),
            self.in_features, dtype, q.device)
        self.use_kernel, self.kernel_note = _decide_kernel(use_kernel, agrees, "Int8Linear")

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype | None = None,
                    use_kernel: bool | None = None) -> "Int8Linear":
        """Quantize ``linear``'s weight; ``dtype``: the activations' dtype (default: the weight's)."""
        q, scale = quantize_int8(linear.weight)
        return cls(q, scale, linear.bias, dtype or linear.weight.dtype, use_kernel)

    @property
    def path(self) -> str:
        return "kernel" if self.use_kernel else "reference"

    def dequantized_weight(self) -> Tensor:
        """The float matrix this layer stands for, [out, in] float32."""
        return dequantize_int8(self.q, self.scale)

    def forward(self, x: Tensor) -> Tensor:
        if self.use_kernel:
            y = int8_matmul_kernel(x, self.q, self.scale)
        else:
            y = int8_matmul_reference(x, self.q, self.scale)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, path={self.path}"


class Int4Linear(nn.Module):
    """A linear layer with group-wise int4 weights; same call as nn.Linear.

    Reference path: buffers ``packed`` uint8 [out, in/2] (:func:`pack_int4`), ``scales`` and
    ``zeros`` [out, in/g], and the weight is de-quantized at every call (slow).
    Kernel path: ``packed`` holds the kernel's own layout (same bytes) and
    ``scales_and_zeros`` [in/g, out, 2]. Both keep scales/zeros in the activation dtype.
    Build it on the device it will run on (the kernel layout is device-specific).
    """

    def __init__(self, q: Tensor, scales: Tensor, zeros: Tensor, group_size: int,
                 bias: Tensor | None = None, dtype: torch.dtype = torch.float32,
                 use_kernel: bool | None = None) -> None:
        """``q``: unpacked values [out, in] in [0, 15]; ``scales``, ``zeros``: [out, in/g]."""
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size, self.dtype = group_size, dtype
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        scales, zeros = scales.to(dtype), zeros.to(dtype)
        agrees = (False, "not probed") if use_kernel is False else self._probe(q, scales, zeros)
        self.use_kernel, self.kernel_note = _decide_kernel(use_kernel, agrees, "Int4Linear")
        if self.use_kernel:
            self.register_buffer("packed", int4_kernel_pack(q, q.device))
            self.register_buffer("scales_and_zeros", int4_scales_and_zeros(scales, zeros, dtype))
        else:
            self.register_buffer("packed", pack_int4(q))
            self.register_buffer("scales", scales)
            self.register_buffer("zeros", zeros)

    def _probe(self, q: Tensor, scales: Tensor, zeros: Tensor) -> tuple[bool, str]:
        """Does the int4 kernel build and agree with the reference for this weight?"""
        try:
            packed = int4_kernel_pack(q, q.device)
        except (RuntimeError, NotImplementedError, AttributeError) as exc:
            return False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        table = int4_scales_and_zeros(scales, zeros, self.dtype)
        rows = slice(0, PROBE_ROWS)
        weight = dequantize_int4(pack_int4(q[rows]), scales[rows], zeros[rows], self.group_size, self.dtype)
        return kernel_agrees(lambda x: int4_matmul_kernel(x, packed, self.group_size, table),
                             lambda x: F.linear(x, weight), self.in_features, self.dtype, q.device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 32, dtype: torch.dtype | None = None,
                    use_kernel: bool | None = None) -> "Int4Linear":
        """Quantize ``linear``'s weight in groups of ``group_size``; ``dtype``: the activations'."""
        q, scales, zeros = quantize_int4_unpacked(linear.weight, group_size)
        return cls(q, scales, zeros, group_size, linear.bias, dtype or linear.weight.dtype, use_kernel)

    @property
    def path(self) -> str:
        return "kernel" if self.use_kernel else "reference"

    def dequantized_weight(self) -> Tensor:
        """The float matrix the reference path uses, [out, in] float32 (reference path only)."""
        if self.use_kernel:
            raise RuntimeError("the kernel layout is opaque: build with use_kernel=False to inspect weights")
        return dequantize_int4(self.packed, self.scales, self.zeros, self.group_size)

    def forward(self, x: Tensor) -> Tensor:
        if self.use_kernel:
            y = int4_matmul_kernel(x, self.packed, self.group_size, self.scales_and_zeros)
        else:
            w = dequantize_int4(self.packed, self.scales, self.zeros, self.group_size, x.dtype)
            y = F.linear(x, w)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, path={self.path}")


# ----------------------------------------------------------------------------- bytes


def _plain_tensors(t: Tensor) -> list[Tensor]:
    """The plain tensors that hold ``t``'s data: ``t`` itself, or the insides of a tensor
    subclass (torchao's quantized weights flatten into their int data and scales)."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [leaf for n in names for leaf in _plain_tensors(getattr(t, n))]
    return [t]


def weight_bytes(module: nn.Module) -> int:
    """Bytes the module's parameters and persistent buffers really occupy.

    Each storage is counted once (tied or shared tensors once), in full; non-persistent
    buffers (RoPE tables, a KV cache) are not weights and are left out.
    """
    sizes: dict[tuple[str, int], int] = {}
    for sub in module.modules():
        skip = getattr(sub, "_non_persistent_buffers_set", set())
        tensors = [*sub._parameters.values(),
                   *(b for n, b in sub._buffers.items() if n not in skip)]
        for t in (leaf for t in tensors if t is not None for leaf in _plain_tensors(t)):
            if not t.is_meta:
                storage = t.untyped_storage()
                sizes[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(sizes.values())


__all__ = [
    "quantize_int8", "dequantize_int8", "int8_matmul_reference", "int8_matmul_kernel",
    "pack_int4", "unpack_int4", "quantize_int4", "quantize_int4_unpacked", "dequantize_int4",
    "int4_kernel_pack", "int4_scales_and_zeros", "int4_matmul_kernel", "kernel_agrees",
    "Int8Linear", "Int4Linear", "weight_bytes",
]
