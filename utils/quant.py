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

Kernels, checked against the reference when a module is built (``kernel`` picks them; ``kernel_note`` says which ran)
    - ``"workbook"`` (CPU): the workbook's own decode kernels (:mod:`utils.cpu_quant`): int8 as stored, int4 in
      blocks of 32 with a float16 scale and offset per group (GGUF's Q4_1 idea). On a CPU they read the weights
      faster than PyTorch's for decode's few rows; :func:`quantized_copy` picks them where they are built.
    - ``"aten"``, PyTorch's own (``torch.ops.aten``):
    - ``_weight_int8pack_mm(x, q, scales)``: ``x @ (q * scales).T``, scales in x's dtype.
    - CPU int4: ``_convert_weight_to_int4pack_for_cpu(q int32 [N, K], 1)`` and
      ``_weight_int4pack_mm_for_cpu(x, packed, g, scales_and_zeros)``, where
      ``scales_and_zeros`` is ``[K / g, N, 2]`` in x's dtype and the kernel computes
      ``W = (q - 8) * scale + zero8``, so ``zero8 = (8 - zero) * scale``. N must be a
      multiple of 16. CUDA/MPS: ``_convert_weight_to_int4pack`` + ``_weight_int4pack_mm``.
    With fp32 activations they work but are slow; with bf16 they are the fast path.
    When a kernel is missing or disagrees with the reference, the module falls back
    to the reference path and says why in ``kernel_note``.

Any width (a layer whose sizes do not fit the groups or the kernels)
    - int4 groups: when ``in_features`` is not a multiple of ``g``, W's columns are
      **zero-padded** to the next multiple (:func:`pad_to_multiple`) and quantized; the
      last group is then part weights, part zeros. The quantized matrix keeps the padded
      width ``K_p`` (its extra columns are stored: honest bytes) and the layer keeps the
      true ``in_features``: the reference path cuts the de-quantized matrix back to it,
      the kernel path pads ``x`` with zeros instead (a zero input times any weight is 0).
    - int8 kernel: ``_weight_int8pack_mm`` on CPU reads K in blocks of 16 and gives
      garbage (or crashes) otherwise, so the kernel path zero-pads q's columns (and x)
      to a multiple of 16; :func:`int8_matmul_kernel` refuses any other width.
    - int4 kernel: the CPU kernel needs ``N`` (out_features) a multiple of 16; the
      kernel path zero-pads the rows and cuts the output back to ``out_features``.
    Padding only happens where a size needs it: the default model's sizes need none.

:func:`stored_bytes` counts what a module really stores (each tensor once, tied ones
once), so tables of bytes against tokens/s are honest.

Judging a quantized copy against its baseline (perplexity, agreement, speed) is
:mod:`utils.variants`.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cpu_quant
from .llama import Llama, iter_linears, replace_linear

INT8_MAX = 127
INT4_MAX = 15  # 4 bits: levels 0 .. 15
KERNEL_RTOL = 0.05  # kernel vs reference, relative to the largest output: bf16 rounding passes
PROBE_ROWS = 256  # the probe compares the first outputs only: cheap even for a 49k-row LM head
INT8_KERNEL_K_MULTIPLE = 16  # aten._weight_int8pack_mm (CPU) reads K in blocks of 16
INT4_KERNEL_N_MULTIPLE = 16  # aten._convert_weight_to_int4pack_for_cpu needs N % 16 == 0
_TINY = 1e-12


# ----------------------------------------------------------------------------- padding


def padded_width(width: int, multiple: int) -> int:
    """``width`` rounded up to a multiple of ``multiple``: ``padded_width(344, 32) == 352``."""
    if width < 1 or multiple < 1:
        raise ValueError(f"width and multiple must be >= 1, got {width} and {multiple}.")
    return -(-width // multiple) * multiple


def pad_to_multiple(t: Tensor, multiple: int, dim: int = -1) -> Tensor:
    """``t`` with zeros appended along ``dim`` up to a multiple of ``multiple`` (``t`` itself if none are needed).

    ``pad_to_multiple(w [out, 344], 32)`` is ``[out, 352]``, its last 8 columns zero.
    """
    dim = dim % t.dim()
    extra = padded_width(t.shape[dim], multiple) - t.shape[dim]
    if not extra:
        return t
    return F.pad(t, [0, 0] * (t.dim() - 1 - dim) + [0, extra])


def _pad_input(x: Tensor, width: int) -> Tensor:
    """``x [..., in]`` with zero columns up to ``width`` (a kernel's padded K)."""
    if x.shape[-1] > width:
        raise ValueError(f"the input has {x.shape[-1]} features, the weight only {width}.")
    return F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x


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
    """The same product through ``aten._weight_int8pack_mm`` (inputs flattened to 2-D).

    ``q``'s width must be a multiple of 16 (pad it with :func:`pad_to_multiple`); ``x`` may
    be narrower (the true ``in_features``) and is zero-padded to match.
    """
    if q.shape[1] % INT8_KERNEL_K_MULTIPLE:
        raise ValueError(f"the int8 kernel needs in_features a multiple of {INT8_KERNEL_K_MULTIPLE} "
                         f"(got {q.shape[1]}: it would read past the weight); pad q with "
                         f"pad_to_multiple(q, {INT8_KERNEL_K_MULTIPLE}).")
    x2 = _pad_input(x.reshape(-1, x.shape[-1]), q.shape[1])
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
    """``w [out, in]`` zero-padded to ``K_p`` columns (a multiple of g), as ``[out, K_p / g, g]``."""
    if group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be an even number >= 2 (two values per byte), got {group_size}.")
    w = pad_to_multiple(w, group_size)
    return w.reshape(w.shape[0], -1, group_size)


def quantize_int4_unpacked(w: Tensor, group_size: int = 32) -> tuple[Tensor, Tensor, Tensor]:
    """Group-wise asymmetric int4, one value per byte: ``(q uint8 [out, K_p], scales, zeros)``.

    ``K_p`` = in_features rounded up to a multiple of ``group_size`` (the last group
    zero-padded when needed); ``scales``, ``zeros``: float32 ``[out, K_p / group_size]``;
    ``w ≈ ((q - zero) * scale)[:, :in_features]``.
    """
    wg = _groups(w.detach().float(), group_size)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # [out, K_p/g]
    scales = (hi - lo).clamp(min=_TINY) / INT4_MAX
    zeros = -lo / scales
    q = torch.round((wg - lo[..., None]) / scales[..., None]).clamp(0, INT4_MAX)  # = round(w/s + zero)
    return q.to(torch.uint8).flatten(1), scales, zeros


def quantize_int4(w: Tensor, group_size: int = 32) -> tuple[Tensor, Tensor, Tensor]:
    """Group-wise int4, packed two per byte: ``(packed uint8 [out, K_p/2], scales, zeros)``."""
    q, scales, zeros = quantize_int4_unpacked(w, group_size)
    return pack_int4(q), scales, zeros


def dequantize_int4(packed: Tensor, scales: Tensor, zeros: Tensor, group_size: int = 32,
                    dtype: torch.dtype = torch.float32, in_features: int | None = None) -> Tensor:
    """``(q - zero) * scale`` group by group: a float matrix ``[out, in_features]`` in ``dtype``.

    Without ``in_features``, the padded width ``K_p`` (padding columns included).
    """
    q = unpack_int4(packed).float()
    qg = _groups(q, group_size)
    w = ((qg - zeros.float()[..., None]) * scales.float()[..., None]).flatten(1)
    return w[:, :in_features].to(dtype) if in_features is not None else w.to(dtype)


def int4_kernel_pack(q: Tensor, device: torch.device) -> Tensor:
    """Re-lay unpacked int4 values ``q [N, K]`` for the device's int4 kernel.

    CPU: N a multiple of 16. CUDA (tinygemm): N a multiple of 8 and K of 16 x the inner
    K tiles, taken as large as K allows (8, 4 or 2: K a multiple of 128, 64 or 32).
    """
    if device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    high_first = ((q[:, 0::2].to(torch.uint8) << 4) | q[:, 1::2].to(torch.uint8)).to(device)
    inner_k_tiles = next((t for t in (8, 4, 2) if q.shape[1] % (16 * t) == 0), 8)
    return torch.ops.aten._convert_weight_to_int4pack(high_first, inner_k_tiles)


def int4_scales_and_zeros(scales: Tensor, zeros: Tensor, dtype: torch.dtype) -> Tensor:
    """The kernels' ``[K / g, N, 2]`` table: scale and ``zero8 = (8 - zero) * scale``."""
    zero8 = (8 - zeros.float()) * scales.float()
    return torch.stack([scales.float(), zero8], dim=-1).transpose(0, 1).contiguous().to(dtype)


def int4_matmul_kernel(x: Tensor, packed: Tensor, group_size: int, scales_and_zeros: Tensor) -> Tensor:
    """``x @ W.T`` through the device's int4 kernel (inputs flattened to 2-D).

    The weight's width is ``K / g`` groups (``scales_and_zeros.shape[0]``) x g; a narrower
    ``x`` (the true ``in_features``) is zero-padded to it.
    """
    x2 = _pad_input(x.reshape(-1, x.shape[-1]), scales_and_zeros.shape[0] * group_size)
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


KERNELS = ("workbook", "aten")
"""The kernels a quantized layer may call: the workbook's own (CPU, :mod:`utils.cpu_quant`) or PyTorch's."""


def kernel_here(device: torch.device | str) -> str:
    """The kernel a layer on ``device`` calls by default: the workbook's on a CPU where it is built, else aten's."""
    return "workbook" if torch.device(device).type == "cpu" and cpu_quant.available() else "aten"


def _check_kernel(kernel: str, device: torch.device) -> tuple[str, str]:
    """``(kernel to use, why not the one asked for)``: the workbook's falls back to aten's off a CPU or unbuilt."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}: choose one of {', '.join(KERNELS)}")
    if kernel == "workbook" and kernel_here(device) != "workbook":
        return "aten", "; the workbook's kernel runs on a CPU where it is built (utils.cpu_quant), not here"
    return kernel, ""


def _decide_kernel(use_kernel: bool | None, agrees: tuple[bool, str], name: str, kernel: str = "aten") -> tuple[bool, str]:
    """Resolve ``use_kernel`` (None = when it works) into (use it, note)."""
    if use_kernel is False:
        return False, "reference path (asked for)"
    ok, why = agrees
    if not ok and use_kernel:
        raise RuntimeError(f"{name}: the {kernel} kernel was asked for but cannot be used here: {why}")
    return ok, (f"{kernel} kernel" if ok else f"reference path: {why}")


# ----------------------------------------------------------------------------- modules


class Int8Linear(nn.Module):
    """A linear layer with int8 weights (per-output-channel scales); same call as nn.Linear.

    Buffers: ``q`` int8 [out, in], ``scale`` [out] and ``bias`` (if any) in the
    activation dtype (float32 for the workbook's kernel); ``q_parts``: a copy of ``q`` laid out by
    thread that the workbook's kernel reads instead where it is set (:func:`utils.cpu_linear.pack_by_thread`).
    ``forward`` uses ``kernel`` (:data:`KERNELS`) when it runs here (``path == "kernel"``; aten's needs ``q``
    zero-padded to a multiple of 16 columns where ``in_features`` is not one, see ``padding``), else
    :func:`int8_matmul_reference`.
    """

    def __init__(self, q: Tensor, scale: Tensor, bias: Tensor | None = None,
                 dtype: torch.dtype = torch.float32, use_kernel: bool | None = None, kernel: str = "aten") -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.kernel, fell_back = _check_kernel(kernel, q.device)
        own = self.kernel == "workbook" and use_kernel is not False
        scale = scale.float() if own else scale.to(dtype)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        q_kernel = q.contiguous() if own else pad_to_multiple(q, INT8_KERNEL_K_MULTIPLE)
        product = cpu_quant.int8_linear if own else int8_matmul_kernel
        agrees = (False, "not probed") if use_kernel is False else kernel_agrees(
            lambda x: product(x, q_kernel, scale),
            lambda x: int8_matmul_reference(x, q[:PROBE_ROWS], scale[:PROBE_ROWS]),
            self.in_features, dtype, q.device)
        self.use_kernel, self.kernel_note = _decide_kernel(use_kernel, agrees, "Int8Linear", self.kernel)
        self.kernel_note += fell_back if self.use_kernel else ""
        self.kernel = self.kernel if self.use_kernel else "aten"  # the reference path calls neither (as Int4Linear)
        self.register_buffer("q", q_kernel if self.use_kernel else q)
        self.padding = _padding_note(q.shape, self.q.shape)
        self.register_buffer("q_parts", None, persistent=False)  # q laid out by thread (cpu_linear.pack_by_thread)

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype | None = None,
                    use_kernel: bool | None = None, kernel: str = "aten") -> "Int8Linear":
        """Quantize ``linear``'s weight; ``dtype``: the activations' dtype (default: the weight's)."""
        q, scale = quantize_int8(linear.weight)
        return cls(q, scale, linear.bias, dtype or linear.weight.dtype, use_kernel, kernel)

    @property
    def path(self) -> str:
        return "kernel" if self.use_kernel else "reference"

    def dequantized_weight(self) -> Tensor:
        """The float matrix this layer stands for, [out, in] float32."""
        return dequantize_int8(self.q[:, : self.in_features], self.scale)

    def forward(self, x: Tensor) -> Tensor:
        if self.use_kernel and self.kernel == "workbook":
            y = cpu_quant.int8_linear(x, self.q if self.q_parts is None else self.q_parts, self.scale)
        elif self.use_kernel:
            y = int8_matmul_kernel(x, self.q, self.scale)
        else:
            y = int8_matmul_reference(x, self.q, self.scale)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, path={self.path}, kernel={self.kernel}"


def _padding_note(true_shape: tuple[int, ...], stored_shape: tuple[int, ...]) -> str:
    """"" when nothing was padded, else e.g. "stored as [128, 352] (zero-padded from [128, 344])"."""
    if tuple(true_shape) == tuple(stored_shape):
        return ""
    return f"stored as {list(stored_shape)} (zero-padded from {list(true_shape)})"


class Int4Linear(nn.Module):
    """A linear layer with group-wise int4 weights; same call as nn.Linear.

    Reference path: buffers ``packed`` uint8 [out, K_p/2] (:func:`pack_int4`), ``scales`` and
    ``zeros`` [out, K_p/g], and the weight is de-quantized at every call (slow), then cut
    to ``in_features``. aten kernel path: ``packed`` holds the kernel's own layout and
    ``scales_and_zeros`` [K_p/g, N_p, 2], the rows zero-padded to ``N_p``, a multiple of 16
    (``padding`` says when); the output is cut back to ``out_features``. Both keep
    scales/zeros in the activation dtype. Workbook kernel path (CPU, ``g`` a multiple of 32):
    ``packed`` [out, K_p/2] in blocks of 32 and ``dm`` [out, K_p/g, 2] float16
    (:func:`utils.cpu_quant.int4_pack`, :func:`utils.cpu_quant.int4_dm`); nothing padded; ``packed_parts``
    and ``dm_parts``: their copies laid out by thread, read instead where set
    (:func:`utils.cpu_linear.pack_by_thread`).
    Build it on the device it will run on.
    """

    def __init__(self, q: Tensor, scales: Tensor, zeros: Tensor, group_size: int,
                 bias: Tensor | None = None, dtype: torch.dtype = torch.float32,
                 use_kernel: bool | None = None, in_features: int | None = None, kernel: str = "aten") -> None:
        """``q``: unpacked values [out, K_p] in [0, 15] (K_p a multiple of ``group_size``);
        ``scales``, ``zeros``: [out, K_p/g]; ``in_features``: the true width (default K_p)."""
        super().__init__()
        self.out_features, width = q.shape
        self.in_features = in_features or width
        if width % group_size or scales.shape != (q.shape[0], width // group_size) or self.in_features > width:
            raise ValueError(f"q {tuple(q.shape)} and scales {tuple(scales.shape)} do not make groups of "
                             f"{group_size} covering in_features={self.in_features}: use quantize_int4_unpacked.")
        self.group_size, self.dtype = group_size, dtype
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.kernel, fell_back = _check_kernel(kernel, q.device)
        if self.kernel == "workbook" and group_size % cpu_quant.INT4_BLOCK:
            self.kernel, fell_back = "aten", f"; the workbook's kernel needs groups of a multiple of {cpu_quant.INT4_BLOCK}"
        if self.kernel == "workbook" and use_kernel is not False:
            self._init_workbook(q, scales, zeros, use_kernel, fell_back)
            return
        scales, zeros = scales.to(dtype), zeros.to(dtype)
        rows = [pad_to_multiple(t, INT4_KERNEL_N_MULTIPLE, dim=0) for t in (q, scales, zeros)]
        agrees = (False, "not probed") if use_kernel is False else self._probe(q, scales, zeros, *rows)
        self.use_kernel, self.kernel_note = _decide_kernel(use_kernel, agrees, "Int4Linear")
        self.kernel_note += fell_back if self.use_kernel else ""
        if self.use_kernel:
            self.register_buffer("packed", int4_kernel_pack(rows[0], q.device))
            self.register_buffer("scales_and_zeros", int4_scales_and_zeros(rows[1], rows[2], dtype))
        else:
            self.register_buffer("packed", pack_int4(q))
            self.register_buffer("scales", scales)
            self.register_buffer("zeros", zeros)
        self.padding = _padding_note((self.out_features, self.in_features),
                                     (rows[0] if self.use_kernel else q).shape)

    def _init_workbook(self, q: Tensor, scales: Tensor, zeros: Tensor, use_kernel: bool | None, fell_back: str) -> None:
        """The workbook kernel's buffers, probed against the reference; the reference path's where it disagrees."""
        packed, dm = cpu_quant.int4_pack(q), cpu_quant.int4_dm(scales, zeros)
        rows = slice(0, PROBE_ROWS)
        weight = dequantize_int4(pack_int4(q[rows]), scales[rows], zeros[rows], self.group_size, self.dtype,
                                 self.in_features)
        agrees = kernel_agrees(lambda x: cpu_quant.int4_linear(_pad_input(x, q.shape[1]), packed, dm, self.group_size),
                               lambda x: F.linear(x, weight), self.in_features, self.dtype, q.device)
        self.use_kernel, self.kernel_note = _decide_kernel(use_kernel, agrees, "Int4Linear", "workbook")
        if self.use_kernel:
            self.register_buffer("packed", packed)
            self.register_buffer("dm", dm)
            self.register_buffer("packed_parts", None, persistent=False)  # both laid out by thread
            self.register_buffer("dm_parts", None, persistent=False)  # (utils.cpu_linear.pack_by_thread)
        else:
            self.kernel = "aten"
            self.register_buffer("packed", pack_int4(q))
            self.register_buffer("scales", scales.to(self.dtype))
            self.register_buffer("zeros", zeros.to(self.dtype))
        self.padding = _padding_note((self.out_features, self.in_features), q.shape)

    def _probe(self, q: Tensor, scales: Tensor, zeros: Tensor, q_rows: Tensor, scales_rows: Tensor,
               zeros_rows: Tensor) -> tuple[bool, str]:
        """Does the int4 kernel build (rows padded to ``N_p``) and agree with the reference?"""
        try:
            packed = int4_kernel_pack(q_rows, q.device)
        except (RuntimeError, NotImplementedError, AttributeError) as exc:
            return False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        table = int4_scales_and_zeros(scales_rows, zeros_rows, self.dtype)
        rows = slice(0, PROBE_ROWS)
        weight = dequantize_int4(pack_int4(q[rows]), scales[rows], zeros[rows], self.group_size, self.dtype,
                                 self.in_features)
        return kernel_agrees(lambda x: int4_matmul_kernel(x, packed, self.group_size, table),
                             lambda x: F.linear(x, weight), self.in_features, self.dtype, q.device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 32, dtype: torch.dtype | None = None,
                    use_kernel: bool | None = None, kernel: str = "aten") -> "Int4Linear":
        """Quantize ``linear``'s weight in groups of ``group_size``; ``dtype``: the activations'."""
        q, scales, zeros = quantize_int4_unpacked(linear.weight, group_size)
        return cls(q, scales, zeros, group_size, linear.bias, dtype or linear.weight.dtype, use_kernel,
                   linear.in_features, kernel)

    @property
    def path(self) -> str:
        return "kernel" if self.use_kernel else "reference"

    def dequantized_weight(self) -> Tensor:
        """The float matrix the reference path uses, [out, in] float32 (reference path only)."""
        if self.use_kernel:
            raise RuntimeError("the kernel layout is opaque: build with use_kernel=False to inspect weights")
        return dequantize_int4(self.packed, self.scales, self.zeros, self.group_size, in_features=self.in_features)

    def forward(self, x: Tensor) -> Tensor:
        if self.use_kernel and self.kernel == "workbook":
            packed, dm = (self.packed, self.dm) if self.packed_parts is None else (self.packed_parts, self.dm_parts)
            y = cpu_quant.int4_linear(_pad_input(x, 2 * self.packed.shape[1]), packed, dm, self.group_size)
        elif self.use_kernel:
            y = int4_matmul_kernel(x, self.packed, self.group_size, self.scales_and_zeros)
            y = y[..., : self.out_features]
        else:
            w = dequantize_int4(self.packed, self.scales, self.zeros, self.group_size, x.dtype, self.in_features)
            y = F.linear(x, w)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, path={self.path}, kernel={self.kernel}")


# ----------------------------------------------------------------------------- a quantized model


def _quantized_layer(linear: nn.Linear, bits: int | None, group_size: int, dtype: torch.dtype,
                     kernel: str) -> nn.Module:
    if bits == 8:
        return Int8Linear.from_linear(linear, dtype=dtype, kernel=kernel)
    if bits == 4:
        return Int4Linear.from_linear(linear, group_size, dtype=dtype, kernel=kernel)
    if bits is None:
        return copy.deepcopy(linear).to(dtype)
    raise ValueError(f"bits must be 8, 4 or None (kept in {dtype}), got {bits!r}")


def quantized_copy(model: Llama, bits: int | None = 4, head_bits: int | None = 8, group_size: int = 32,
                   dtype: torch.dtype = torch.bfloat16, kernel: str | None = None) -> Llama:
    """A copy of ``model`` in ``dtype`` whose layer projections have ``bits``-bit weights (int4 in groups
    of ``group_size``, or int8) and whose LM head has ``head_bits`` (None: kept in ``dtype``), calling
    ``kernel`` (:data:`KERNELS`; default :func:`kernel_here`: the workbook's on a CPU where it is built).

    The default, int4 layers with an int8 head, is the quantization lab's best variant: about a
    sixth of the bytes and nearly the same greedy tokens (an int4 head changes them within a few).
    ``model`` itself is not changed.
    """
    new = copy.deepcopy(model).to(dtype)
    kernel = kernel or kernel_here(model.device)
    for name, linear in iter_linears(model):
        replace_linear(new, name, _quantized_layer(linear, head_bits if name == "lm_head" else bits,
                                                   group_size, dtype, kernel))
    return new.eval()


# ----------------------------------------------------------------------------- bytes


def _plain_tensors(t: Tensor) -> list[Tensor]:
    """The plain tensors that hold ``t``'s data: ``t`` itself, or the insides of a tensor
    subclass (torchao's quantized weights flatten into their int data and scales)."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [leaf for n in names for leaf in _plain_tensors(getattr(t, n))]
    return [t]


def stored_bytes(module: nn.Module) -> int:
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
