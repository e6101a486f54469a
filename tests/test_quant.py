"""utils.quant: error bounds, exact packing, layers ≈ nn.Linear, kernels ≈ reference, honest bytes.

Tolerances, and why:
- int8 absmax: every de-quantized weight is within half a step, ``scale_o / 2 = max|W_o| / 254``.
- int4 (group g, asymmetric): within half a step of its group, ``(max - min) / 30``.
- layer outputs on Gaussian weights and inputs: int8 within 1% relative (Frobenius) error
  (measured ~0.4%), int4 at group 32 within 10% (measured ~6%).
- kernel vs reference: 1e-4 relative in float32, 2% in bfloat16 (bf16 keeps 8 bits).
- any width: the test model's down_proj (in_features 344, not a multiple of 32, 64 or 16)
  and prime sizes (131 in, 37 out) must quantize with the same bounds, on the kernel path
  too (zero-padded), never crash the int8 kernel.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from utils.quant import (Int4Linear, Int8Linear, dequantize_int4, dequantize_int8, int8_matmul_kernel,
                         pack_int4, pad_to_multiple, padded_width, quantize_int4, quantize_int4_unpacked,
                         quantize_int8, stored_bytes, unpack_int4)

IN, OUT = 256, 96  # OUT a multiple of 16: the CPU int4 kernel needs it


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.fixture
def linear() -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(IN, OUT)
    nn.init.normal_(layer.weight, std=0.05)
    return layer


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(2, 3, IN, generator=torch.Generator().manual_seed(1))


def test_int8_shapes_dtypes_and_error_bound(linear: nn.Linear) -> None:
    w = linear.weight.detach()
    q, scale = quantize_int8(w)
    assert q.shape == (OUT, IN) and q.dtype == torch.int8
    assert scale.shape == (OUT,) and scale.dtype == torch.float32
    assert int(q.abs().max()) == 127  # each row's largest weight uses the full range
    err = (dequantize_int8(q, scale) - w).abs()
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-5) + 1e-8).all())
    torch.testing.assert_close(scale, w.abs().amax(dim=1) / 127)


def test_int8_zero_row_does_not_divide_by_zero() -> None:
    w = torch.zeros(2, 8)
    w[1] = torch.linspace(-1, 1, 8)
    q, scale = quantize_int8(w)
    assert torch.isfinite(scale).all() and bool((q[0] == 0).all())
    assert torch.equal(dequantize_int8(q, scale)[0], torch.zeros(8))


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_error_bound_and_range(linear: nn.Linear, group_size: int) -> None:
    w = linear.weight.detach()
    q, scales, zeros = quantize_int4_unpacked(w, group_size)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert scales.shape == zeros.shape == (OUT, IN // group_size)
    packed, scales2, zeros2 = quantize_int4(w, group_size)
    assert packed.shape == (OUT, IN // 2) and packed.dtype == torch.uint8
    assert torch.equal(scales, scales2) and torch.equal(zeros, zeros2)
    err = (dequantize_int4(packed, scales, zeros, group_size) - w).abs()
    bound = (scales / 2).repeat_interleave(group_size, dim=1)
    assert bool((err <= bound * (1 + 1e-4) + 1e-7).all())
    groups = w.reshape(OUT, -1, group_size)  # each group's min -> 0 and max -> 15
    idx_min, idx_max = groups.argmin(-1, keepdim=True), groups.argmax(-1, keepdim=True)
    qg = q.reshape(OUT, -1, group_size)
    assert bool((qg.gather(-1, idx_min) == 0).all()) and bool((qg.gather(-1, idx_max) == 15).all())


def test_padding_helpers() -> None:
    assert [padded_width(w, 32) for w in (1, 32, 33, 344)] == [32, 32, 64, 352]
    w = torch.randn(3, 5)
    assert pad_to_multiple(w, 5) is w
    p = pad_to_multiple(w, 4)
    assert p.shape == (3, 8) and torch.equal(p[:, :5], w) and not p[:, 5:].any()
    rows = pad_to_multiple(w, 16, dim=0)
    assert rows.shape == (16, 5) and torch.equal(rows[:3], w) and not rows[3:].any()
    with pytest.raises(ValueError, match="even"):
        quantize_int4(torch.randn(4, 48), group_size=33)


@pytest.mark.parametrize("width", [344, 131])  # the test model's down_proj; a prime
@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_pads_the_last_group(width: int, group_size: int) -> None:
    w = torch.randn(37, width, generator=torch.Generator().manual_seed(2))
    q, scales, zeros = quantize_int4_unpacked(w, group_size)
    padded = padded_width(width, group_size)
    assert q.shape == (37, padded) and scales.shape == zeros.shape == (37, padded // group_size)
    packed = pack_int4(q)
    assert packed.shape == (37, padded // 2)
    assert dequantize_int4(packed, scales, zeros, group_size).shape == (37, padded)
    w_hat = dequantize_int4(packed, scales, zeros, group_size, in_features=width)
    assert w_hat.shape == w.shape
    bound = (scales / 2).repeat_interleave(group_size, dim=1)[:, :width]
    assert bool(((w_hat - w).abs() <= bound * (1 + 1e-4) + 1e-7).all())
    last = pad_to_multiple(w, group_size)[:, -group_size:]  # the padded group: weights, then zeros
    assert torch.allclose(scales[:, -1], (last.amax(-1) - last.amin(-1)) / 15)


@pytest.mark.parametrize("in_f, out_f", [(344, 128), (131, 37)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.02)])
def test_any_width_on_the_kernel_path(in_f: int, out_f: int, dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(in_f, out_f)
    nn.init.normal_(lin.weight, std=0.05)
    xs = torch.randn(2, 3, in_f).to(dtype)
    # the reference int8 layer stores q as is; the int4 one stores whole groups (K_p columns)
    for make, ref_padding in ((lambda k: Int8Linear.from_linear(lin, dtype=dtype, use_kernel=k), ""),
                              (lambda k: Int4Linear.from_linear(lin, 32, dtype=dtype, use_kernel=k),
                               f"stored as [{out_f}, {padded_width(in_f, 32)}] (zero-padded from [{out_f}, {in_f}])")):
        fast, ref = make(None), make(False)
        assert (fast.in_features, fast.out_features) == (in_f, out_f) and ref.padding == ref_padding
        if not fast.use_kernel:
            assert fast.kernel_note.startswith("reference path")
            continue
        assert "zero-padded" in fast.padding  # every one of these sizes needs a pad for some kernel
        with torch.no_grad():
            a, b = fast(xs), ref(xs)
            assert a.shape == b.shape == (2, 3, out_f)
            assert rel_err(a, b) < tol and rel_err(b.float(), lin(xs.float())) < 0.1
    k4 = Int4Linear.from_linear(lin, 32, dtype=torch.bfloat16)
    if k4.use_kernel:  # the padded rows and columns are stored: their bytes are counted
        n_p, k_p = padded_width(out_f, 16), padded_width(in_f, 32)
        assert stored_bytes(k4) == n_p * k_p // 2 + 2 * 2 * n_p * k_p // 32 + out_f * 2


def test_the_int8_kernel_refuses_a_width_it_would_read_past() -> None:
    q, scale = quantize_int8(torch.randn(128, 344))
    with pytest.raises(ValueError, match="multiple of 16"):
        int8_matmul_kernel(torch.randn(2, 344, dtype=torch.bfloat16), q, scale)


def test_pack_unpack_round_trip() -> None:
    q = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (7, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    assert int(pack_int4(torch.tensor([3, 12]))[0]) == 3 | (12 << 4)  # even index: low nibble
    every_byte = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_int4(unpack_int4(every_byte)), every_byte)
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.zeros(3, 5))


@pytest.mark.parametrize("cls, kwargs, tol", [(Int8Linear, {}, 0.01),
                                              (Int4Linear, {"group_size": 32}, 0.10)])
@pytest.mark.parametrize("use_kernel", [None, False])
def test_quantized_linear_matches_nn_linear(linear: nn.Linear, x: torch.Tensor, cls: type,
                                            kwargs: dict, tol: float, use_kernel: bool | None) -> None:
    layer = cls.from_linear(linear, use_kernel=use_kernel, **kwargs)
    with torch.no_grad():
        want, got = linear(x), layer(x)
    assert got.shape == want.shape == (2, 3, OUT)
    assert rel_err(got, want) < tol
    assert (layer.in_features, layer.out_features) == (IN, OUT)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.02)])
@pytest.mark.parametrize("make", [lambda lin, dt, k: Int8Linear.from_linear(lin, dtype=dt, use_kernel=k),
                                  lambda lin, dt, k: Int4Linear.from_linear(lin, 32, dtype=dt, use_kernel=k)],
                         ids=["int8", "int4"])
def test_kernel_path_equals_reference_path(linear: nn.Linear, x: torch.Tensor, make,
                                           dtype: torch.dtype, tol: float) -> None:
    fast, ref = make(linear, dtype, None), make(linear, dtype, False)
    assert ref.path == "reference"
    if not fast.use_kernel:  # e.g. a torch build without the kernel: the fallback must say why
        assert fast.kernel_note.startswith("reference path")
        pytest.skip(f"no kernel here: {fast.kernel_note}")
    with torch.no_grad():
        a, b = fast(x.to(dtype)), ref(x.to(dtype))
    assert a.dtype == b.dtype == dtype
    assert rel_err(a, b) < tol


def test_kernel_falls_back_cleanly_or_raises_when_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    from utils import quant

    def missing(q: torch.Tensor, device: torch.device) -> torch.Tensor:
        raise NotImplementedError("no int4 kernel in this build")

    monkeypatch.setattr(quant, "int4_kernel_pack", missing)
    odd = nn.Linear(64, 40)
    layer = Int4Linear.from_linear(odd, 32)
    assert layer.path == "reference" and "no int4 kernel in this build" in layer.kernel_note
    inputs = torch.randn(3, 64)
    with torch.no_grad():
        assert rel_err(layer(inputs), odd(inputs)) < 0.1
    with pytest.raises(RuntimeError, match="kernel was asked for"):
        Int4Linear.from_linear(odd, 32, use_kernel=True)


def test_dequantized_weights_are_inspectable(linear: nn.Linear) -> None:
    w = linear.weight.detach()
    assert rel_err(Int8Linear.from_linear(linear).dequantized_weight(), w) < 0.01
    assert rel_err(Int4Linear.from_linear(linear, 32, use_kernel=False).dequantized_weight(), w) < 0.1


def test_stored_bytes_counts_real_storage(linear: nn.Linear) -> None:
    fp32 = stored_bytes(linear)
    assert fp32 == (IN * OUT + OUT) * 4
    int8 = Int8Linear.from_linear(linear)  # q + fp32 scale + fp32 bias
    assert stored_bytes(int8) == IN * OUT + OUT * 4 + OUT * 4
    assert stored_bytes(int8) / fp32 == pytest.approx(0.25, abs=0.01)
    for use_kernel in (None, False):  # same bytes in either layout
        int4 = Int4Linear.from_linear(linear, 32, dtype=torch.bfloat16, use_kernel=use_kernel)
        assert stored_bytes(int4) == IN * OUT // 2 + 2 * 2 * OUT * IN // 32 + OUT * 2


def test_weight_bytes_counts_tied_once_and_skips_non_persistent() -> None:
    model = nn.Module()
    model.embed = nn.Embedding(100, 16)
    model.head = nn.Linear(16, 100, bias=False)
    model.head.weight = model.embed.weight  # tied
    model.register_buffer("rope_table", torch.zeros(1000), persistent=False)
    assert stored_bytes(model) == 100 * 16 * 4


def test_weight_bytes_of_torchao_weights(linear: nn.Linear) -> None:
    import utils  # noqa: F401  (quiets torchao's import-time logging)
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = nn.Sequential(nn.Linear(IN, OUT, bias=False)).to(torch.bfloat16)
    quantize_(model, Int8WeightOnlyConfig())
    got = stored_bytes(model)
    assert IN * OUT <= got <= IN * OUT + OUT * 8  # int8 data plus per-row scale (and zero point)


def test_a_wrong_kernel_is_caught_by_the_probe(linear: nn.Linear, monkeypatch: pytest.MonkeyPatch) -> None:
    from utils import quant

    monkeypatch.setattr(quant, "int8_matmul_kernel", lambda x, q, scale: -int8_reference(x, q, scale))
    layer = Int8Linear.from_linear(linear)
    assert layer.path == "reference" and "disagrees" in layer.kernel_note
    with pytest.raises(RuntimeError, match="disagrees"):
        Int8Linear.from_linear(linear, use_kernel=True)


def int8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from utils.quant import int8_matmul_reference

    return int8_matmul_reference(x, q, scale)
