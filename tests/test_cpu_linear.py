"""Float projections on the workbook's CPU kernel (utils/cpu_linear.py, utils/csrc/decode_linear.cpp): the product of
nn.Linear up to summation order, on either path (rows, AMX tiles); a model on them shares its tensors and its bytes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_batching import tiny_hf
from torch import nn

from utils import cpu_linear, cpu_quant, engine, fast, quant
from utils.errors import WorkbookError
from utils.llama import Llama, iter_linears
from utils.variants import bytes_read_per_token

AMX = cpu_linear.tiles_here()


@pytest.fixture(autouse=True)
def kernels_built():
    assert cpu_quant.available(), "this machine has a C++ compiler: the kernels must build"


def relative_error(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    want = x.double() @ w.double().T
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])  # bf16: its rounding
@pytest.mark.parametrize("rows", [1, 3, 6])  # one row, a partial pass of 4, a full pass and a partial one
@pytest.mark.parametrize("n, k", [(40, 576), (17, 100), (300, 1536)])  # K with a tail past the vector loop
def test_the_rows_kernel_is_the_linear_product(dtype, tolerance, rows, n, k):
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(n, k, generator=g).to(dtype), torch.randn(rows, k, generator=g).to(dtype)
    y = cpu_linear.float_linear(x, w)
    assert y.dtype == dtype and y.shape == (rows, n)
    assert relative_error(y, x, w) < tolerance


@pytest.mark.skipif(not AMX, reason="no AMX tile unit here")
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("n, k", [(16, 32), (80, 64), (960, 576), (576, 1536)])  # 1, 5 (4 + 1), 60, 36 blocks
def test_the_tiles_kernel_is_the_linear_product_and_the_rows_kernels_up_to_rounding(rows, n, k):
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(rows, k, generator=g).bfloat16()
    y = cpu_linear.bf16_tiles_linear(x, cpu_linear.bf16_tiles(w), n)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    assert relative_error(y, x, w) < 8e-3
    rows_kernel = cpu_linear.float_linear(x, w)  # both sum exact products in float32: rounding apart, equal
    assert (y != rows_kernel).float().mean() < 0.01


@pytest.mark.skipif(not AMX, reason="no AMX tile unit here")
def test_the_tiles_kernel_refuses_what_it_cannot_read():
    tiles = cpu_linear.bf16_tiles(torch.zeros(32, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x must be bf16"):
        torch.ops.workbook.bf16_tiles_linear(torch.zeros(1, 64), tiles, 32)
    with pytest.raises(RuntimeError, match="tiles must be"):
        torch.ops.workbook.bf16_tiles_linear(torch.zeros(1, 64, dtype=torch.bfloat16), tiles, 48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_float_linear_module_is_nn_linear_for_decode_rows_and_prefill_rows(dtype):
    linear = nn.Linear(64, 96, bias=True).to(dtype)
    module = cpu_linear.FloatLinear(linear)
    assert module.weight is linear.weight and module.bias is linear.bias  # not copied
    assert module.path == ("tiles" if AMX and dtype == torch.bfloat16 else "rows")
    for shape in [(1, 1, 64), (2, 1, 64), (1, 9, 64)]:  # decode rows (the kernel), a prefill's (PyTorch's GEMM)
        x = torch.randn(*shape).to(dtype)
        want = F.linear(x.float(), linear.weight.float(), linear.bias.float())
        assert ((module(x).float() - want).abs().max() / want.abs().max()) < (1e-5 if dtype == torch.float32 else 8e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_on_the_kernels_shares_its_tensors_and_bytes_and_keeps_the_tokens(dtype):
    model = Llama.from_hf(tiny_hf()).to(dtype)
    model.lm_head.weight = model.embed.weight  # tied, as SmolLM2's
    own = cpu_linear.on_workbook_kernels(model)
    assert all(type(m) is cpu_linear.FloatLinear for _, m in iter_linears(own))
    assert all(type(m) is nn.Linear for _, m in iter_linears(model))  # the original is untouched
    assert own.lm_head.weight is own.embed.weight is model.embed.weight  # shared, still tied
    assert bytes_read_per_token(own) == bytes_read_per_token(model)  # the tiles copy is not weight bytes
    assert not fast.has_weights_to_pack(own) and fast.compiles_by_layer(own)
    assert cpu_linear.on_workbook_kernels(own) is own  # nothing left to replace
    ids = torch.randint(1, 96, (1, 12), generator=torch.Generator().manual_seed(5))
    agreed = (engine.generate(own, ids, 12) == engine.generate(model, ids, 12)).long().cumprod(-1).sum()
    assert agreed >= (12 if dtype == torch.float32 else 4)  # bf16: a near-tie may round the other way


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_model_on_the_workbook_kernels_decodes_from_its_tensors_laid_out_by_thread(bits):
    """on_workbook_kernels lays out what each quantized projection streams (int4: packed and dm, int8: q) in one
    buffer per dtype, back to back, in a new tree that shares the model's tensors; its layers' sums are unchanged,
    and a second call has nothing left to do."""
    model = quant.quantized_copy(Llama.from_hf(tiny_hf()), bits, 8, dtype=torch.float32)
    own = cpu_linear.on_workbook_kernels(model)
    assert own is not model and cpu_linear.on_workbook_kernels(own) is own
    threads = torch.get_num_threads()
    pairs = list(zip((m for _, m in iter_linears(model)), (m for _, m in iter_linears(own))))
    laid = [(name, m, t) for _, m in pairs for name, t in cpu_linear.decode_tensors(m).items()]
    assert {name for name, *_ in laid} == ({"packed_parts", "dm_parts", "q_parts"} if bits == 4 else {"q_parts"})
    for name in {name for name, *_ in laid}:
        group = [(getattr(m, name), t) for n, m, t in laid if n == name]
        assert len({p.untyped_storage().data_ptr() for p, _ in group}) == 1  # one buffer per kind
        for (p, t), (after, _) in zip(group, group[1:]):
            assert p.shape[0] == threads and torch.equal(p.reshape(t.shape), t)
            assert after.storage_offset() == p.storage_offset() + p[0].numel()  # back to back
    x = torch.randn(1, 2, max(m.in_features for m, _ in pairs))
    for before, after in pairs:
        assert all(getattr(before, n) is None for n in cpu_linear.decode_tensors(before))  # the model is unchanged
        assert torch.equal(after(x[..., :after.in_features]), before(x[..., :before.in_features]))
    own.lm_head.q_parts.zero_()  # decode reads the laid-out copy
    assert not own.lm_head(x[..., :model.args.hidden_size]).any()


def test_no_float_module_where_the_kernels_are_off(monkeypatch):
    model = Llama.from_hf(tiny_hf())
    monkeypatch.setenv("WORKBOOK_CPU_QUANT", "0")
    assert cpu_linear.on_workbook_kernels(model) is model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts, threads", [(2, 2), (2, 1), (3, 2), (4, 2)])  # as many parts as threads, or not
def test_the_rows_kernel_reads_a_weight_laid_out_by_thread_and_makes_the_same_sums(dtype, parts, threads):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(24 * parts, 100, generator=g).to(dtype)
    buffer = torch.zeros(parts, 24 * 100 + 37, dtype=dtype)  # each part in a row of its own, with others' rows after
    laid_out = buffer[:, 5:5 + 24 * 100].view(parts, 24, 100)
    laid_out.copy_(w.view(parts, 24, 100))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 3, 6):
            x = torch.randn(rows, 100, generator=g).to(dtype)
            assert torch.equal(cpu_linear.float_linear(x, laid_out), cpu_linear.float_linear(x, w))
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        torch.ops.workbook.float_linear(torch.zeros(1, 100, dtype=dtype), w.t().contiguous().t())


@pytest.mark.parametrize("bits", [None, 8, 4])  # bf16, int8 and int4 weights laid out by thread
def test_asking_for_the_weights_ahead_changes_no_result_and_is_restored(bits):
    if AMX and bits is None:
        pytest.skip("bf16 goes through the tiles here")
    fp32 = Llama.from_hf(tiny_hf())
    model = cpu_linear.on_workbook_kernels(fp32.to(torch.bfloat16) if bits is None else quant.quantized_copy(fp32, bits, 8))
    laid = [m for _, m in iter_linears(model) if (names := cpu_linear.decode_tensors(m)) and
            all(cpu_linear.is_laid_out(getattr(m, name)) for name in names)]
    assert laid, "every tiny projection splits across the threads: laid out by thread"
    x = torch.randn(2, laid[0].in_features, generator=torch.Generator().manual_seed(3)).to(model.dtype)
    with cpu_linear.stream_ahead(0):
        plain = laid[0](x)
    for nbytes in (64, cpu_linear.STREAM_AHEAD, 1 << 20):  # one line, the default, far past the weights' end
        with cpu_linear.stream_ahead(nbytes):
            assert torch.equal(laid[0](x), plain)
    assert torch.ops.workbook.set_stream_ahead(cpu_linear.STREAM_AHEAD) == cpu_linear.STREAM_AHEAD  # restored
    with pytest.raises(WorkbookError, match="multiple of 64"):
        with cpu_linear.stream_ahead(100):
            pass


def test_packing_by_thread_puts_each_threads_rows_of_every_projection_back_to_back():
    model = Llama.from_hf(tiny_hf()).to(torch.bfloat16)
    own = cpu_linear.on_workbook_kernels(model)
    if AMX:
        pytest.skip("bf16 goes through the tiles here")
    linears = [m for _, m in iter_linears(own)]
    assert all(m.parts is not None for m in linears)  # 2 threads split every tiny projection evenly
    again = cpu_linear.on_workbook_kernels(model)
    assert cpu_linear.pack_by_thread(again, threads=3) == sum(m.out_features % 3 == 0 for m in linears)
    for threads, mods in ((torch.get_num_threads(), linears), (3, [m for _, m in iter_linears(again)])):
        laid = [m for m in mods if m.parts is not None]
        assert len({m.parts.untyped_storage().data_ptr() for m in laid}) == 1  # one buffer
        for m, after in zip(laid, laid[1:]):
            assert torch.equal(m.parts.reshape(m.weight.shape), m.weight)
            assert m.parts.shape[0] == threads and m.parts.stride(0) == laid[0].parts.stride(0)
            assert after.parts.storage_offset() == m.parts.storage_offset() + m.parts[0].numel()  # back to back
        assert laid[0].parts.data_ptr() % cpu_linear.HUGE_PAGE == 0  # on a 2 MiB page boundary
    x = torch.randn(1, 1, own.args.hidden_size, dtype=torch.bfloat16)
    head = own.lm_head
    assert torch.equal(head(x), cpu_linear.float_linear(x, head.weight))
    head.parts.zero_()  # decode reads the laid-out copy, prefill the weight
    assert not head(x).any() and torch.equal(head(x.expand(1, 9, -1)), F.linear(x.expand(1, 9, -1), head.weight))
