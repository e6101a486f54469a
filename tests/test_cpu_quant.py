"""The workbook's CPU int8/int4 decode kernels (utils/cpu_quant.py, utils/csrc/decode_linear.cpp) and the layers
and quantized models that call them (utils/quant.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from test_batching import tiny_hf

from utils import cpu_quant, engine, quant
from utils.llama import Llama, iter_linears
from utils.llama_phases import forward_no_cache

IDS = torch.randint(1, 96, (1, 12), generator=torch.Generator().manual_seed(5))
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def int8_weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return quant.quantize_int8(w)


@pytest.fixture(autouse=True)
def kernels_built():
    assert cpu_quant.available(), "this machine has a C++ compiler: the kernels must build"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 6])  # one pass of x's rows, a partial one, one full pass and a partial one
@pytest.mark.parametrize("n, k", [(40, 576), (17, 100), (300, 1536)])  # K with a tail past the 32-wide loop
def test_int8_kernel_agrees_with_the_float32_product(dtype, rows, n, k):
    q, scale = int8_weights(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = cpu_quant.int8_linear(x, q, scale)
    want = x.float() @ quant.dequantize_int8(q, scale).T
    assert got.shape == (rows, n) and got.dtype == dtype
    # float32: only the summation order differs; bf16/fp16: the answer is rounded to x's dtype
    torch.testing.assert_close(got, want.to(dtype), **({"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {}))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("n, k, g", [(40, 576, 32), (17, 1536, 64), (3, 128, 128),  # blocks in pairs, and
                                     (9, 96, 32), (5, 544, 32), (4, 288, 96)])  # an odd block count (a lone last one)
def test_int4_kernel_agrees_with_its_weights(dtype, rows, n, k, g):
    """The kernel computes x @ (q * d + m).T with d, m as stored (float16) and x in 16 bits per block."""
    gen = torch.Generator().manual_seed(2)
    q, scales, zeros = quant.quantize_int4_unpacked(torch.randn(n, k, generator=gen), g)
    packed, dm = cpu_quant.int4_pack(q), cpu_quant.int4_dm(scales, zeros)
    weight = (q.float().reshape(n, k // g, g) * dm[..., :1].float() + dm[..., 1:].float()).reshape(n, k)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    got = cpu_quant.int4_linear(x, packed, dm, g)
    want = x.float() @ weight.T
    assert got.shape == (rows, n) and got.dtype == dtype
    # x in 16 bits per block: ~1e-5 of the largest output; then the answer's rounding to x's dtype
    limit = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert (got.float() - want).abs().max() <= limit * want.abs().max()


def laid_out(t: torch.Tensor, parts: int) -> torch.Tensor:
    """``t [N, ...]`` copied into a ``[parts, N / parts, ...]`` view whose parts lie 37 elements further apart than
    their size, others' data in between (as a buffer laid out by thread holds other projections' rows)."""
    rows = t.shape[0] // parts
    each = t[:rows].numel() + 37
    buffer = torch.zeros(parts * each + 5, dtype=t.dtype)
    inner = t[:rows].stride()
    view = buffer.as_strided((parts, rows, *t.shape[1:]), (each, *inner), 5)
    return view.copy_(t.reshape(parts, rows, *t.shape[1:]))


@pytest.mark.parametrize("parts, threads", [(2, 2), (2, 1), (3, 2)])  # as many parts as threads, or not
def test_the_quantized_kernels_read_weights_laid_out_by_thread_and_make_the_same_sums(parts, threads):
    """int8 ``q`` and int4 ``packed``/``dm`` laid out by thread (utils.cpu_linear.pack_by_thread): bit for bit the
    sums of the ``[N, K]`` layout, whichever thread reads which part; x may be a float32 slice (copied first)."""
    gen = torch.Generator().manual_seed(3)
    q8, scale = int8_weights(24 * parts, 576)
    q4, scales, zeros = quant.quantize_int4_unpacked(torch.randn(24 * parts, 576, generator=gen), 32)
    packed, dm = cpu_quant.int4_pack(q4), cpu_quant.int4_dm(scales, zeros)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 3, 6):
            x = torch.randn(rows, 600, generator=gen)[:, :576]  # a slice of a wider x: not contiguous
            want8 = x.contiguous() @ quant.dequantize_int8(q8, scale).T
            torch.testing.assert_close(cpu_quant.int8_linear(x, q8, scale), want8, atol=1e-4, rtol=1e-5)
            assert torch.equal(cpu_quant.int8_linear(x, laid_out(q8, parts), scale), cpu_quant.int8_linear(x, q8, scale))
            got = cpu_quant.int4_linear(x, laid_out(packed, parts), laid_out(dm, parts), 32)
            assert got.shape == (rows, 24 * parts) and torch.equal(got, cpu_quant.int4_linear(x, packed, dm, 32))
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="dm \\[P, N / P, K / g, 2\\]"):  # packed laid out, dm not
        torch.ops.workbook.int4_linear(torch.randn(1, 576), laid_out(packed, parts), dm, 32)


def test_int4_packing_is_blocks_of_32_low_then_high_nibbles():
    q = torch.arange(64, dtype=torch.uint8).remainder(16).reshape(1, 64)
    packed = cpu_quant.int4_pack(q)
    assert packed.shape == (1, 32)
    assert packed[0, 0].item() == q[0, 0] | (q[0, 16] << 4)  # weights 0 and 16 share the first byte
    assert torch.equal(cpu_quant.int4_unpack(packed), q)
    with pytest.raises(ValueError, match="blocks of 32"):
        cpu_quant.int4_pack(q[:, :48])


def test_the_kernels_refuse_what_they_cannot_read():
    q, scale = int8_weights(8, 64)
    with pytest.raises(RuntimeError, match=r"x must be \[M, 64\]"):
        torch.ops.workbook.int8_linear(torch.randn(2, 32), q, scale)
    with pytest.raises(RuntimeError, match="scale must be float32"):
        torch.ops.workbook.int8_linear(torch.randn(2, 64), q, scale.double())
    packed = torch.zeros(8, 32, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="group size must be a multiple of 32"):
        torch.ops.workbook.int4_linear(torch.randn(2, 64), packed, torch.zeros(8, 4, 2, dtype=torch.float16), 16)
    with pytest.raises(RuntimeError, match="x must be float32, bf16 or fp16"):
        torch.ops.workbook.int4_linear(torch.randn(2, 64).double(), packed, torch.zeros(8, 2, 2, dtype=torch.float16), 32)


@pytest.mark.parametrize("bits", [8, 4])
def test_layers_on_the_workbook_kernel_say_so_and_match_aten(bits):
    """The same quantized weights through either kernel give the same outputs (to bf16 rounding), and the
    layer's note names the kernel that runs."""
    linear = torch.nn.Linear(576, 200)
    make = ((lambda k: quant.Int8Linear.from_linear(linear, dtype=torch.bfloat16, kernel=k)) if bits == 8
            else (lambda k: quant.Int4Linear.from_linear(linear, 32, dtype=torch.bfloat16, kernel=k)))
    own, aten = make("workbook"), make("aten")
    assert (own.kernel_note, aten.kernel_note) == ("workbook kernel", "aten kernel")
    x = torch.randn(4, 576).bfloat16()
    torch.testing.assert_close(own(x).float(), aten(x).float(), atol=0.02, rtol=0.02)
    with pytest.raises(ValueError, match="unknown kernel 'fast'"):
        make("fast")


def test_a_quantized_copy_calls_the_workbook_kernel_on_a_cpu_and_aten_when_asked(monkeypatch):
    model = Llama.from_hf(tiny_hf())
    own = quant.quantized_copy(model, 4, 8)
    assert {m.kernel for _, m in iter_linears(own)} == {"workbook"}
    monkeypatch.setenv("WORKBOOK_CPU_QUANT", "0")  # the comparison's switch: PyTorch's kernels
    assert quant.kernel_here("cpu") == "aten"
    aten = quant.quantized_copy(model, 4, 8)
    assert {m.kernel for _, m in iter_linears(aten)} == {"aten"}


@pytest.mark.parametrize("bits", [8, 4])
def test_greedy_tokens_match_between_the_kernels_in_float32(bits):
    """A tiny model quantized once, decoded through the workbook's kernel and through aten's: the same weights in
    float32 activations: int8's greedy tokens are the same; int4's logits stay within the rounding of d and m to
    float16 (the workbook's kernel stores them so, aten's keeps float32)."""
    model = Llama.from_hf(tiny_hf())
    own, aten = (quant.quantized_copy(model, bits, bits, dtype=torch.float32, kernel=k) for k in ("workbook", "aten"))
    with torch.no_grad():
        lo, la = forward_no_cache(own, IDS), forward_no_cache(aten, IDS)
    assert F.cosine_similarity(lo.flatten().float(), la.flatten().float(), dim=0) > 0.9999
    if bits == 8:
        assert torch.equal(engine.generate(own, IDS, 12), engine.generate(aten, IDS, 12))
