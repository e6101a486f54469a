"""The workbook's CPU decode-attention kernel (utils/cpu_attention.py, utils/csrc/decode_attention.cpp)."""

from __future__ import annotations

import pytest
import torch

from utils import cpu_attention, cpu_extension


def pytorch_attention(q, k, v, mask):
    """PyTorch's attention in float32: what the kernel must agree with."""
    out = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                           enable_gqa=True)
    return out.to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 32, 40, 64, 128])
@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (8, 1), (32, 1)])
def test_cpu_decode_attention_kernel_agrees_with_pytorch(dtype, head_dim, heads, kv_heads):
    """Two sequences, 3, 8 or 32 (multi-query, the kernel's most) query heads per KV head, a slice of a longer cache (as the static cache hands it over),
    more slots than one chunk, a mask with left padding and a window (slot counts that fill no whole vector): the
    kernel's answer is PyTorch's. Head sizes: the vector paths' unrolled ones (64, 128), ones they take with a loop
    (16, and 32: two AVX-512 vectors, which bf16 keys meet as pairs where the CPU has AVX512-BF16), one that is no
    multiple of an AVX-512 vector (40)."""
    assert cpu_attention.available(), "this machine has a C++ compiler: the kernel must build"
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, heads, 1, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(2, kv_heads, 700, head_dim, generator=g).to(dtype)[:, :, :600] for _ in range(2))
    slot = torch.arange(600)
    mask = torch.stack([slot >= 37, (slot >= 100) & (slot < 550)])[:, None, None]  # [2, 1, 1, 600]
    got = cpu_attention.decode_attention(q, k, v, mask)
    assert got.shape == q.shape and got.dtype == dtype
    # In the cache's dtype, with its tolerance: both round a float32 answer, and may land one unit apart.
    torch.testing.assert_close(got, pytorch_attention(q, k, v, mask),
                               **({"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}))


@pytest.mark.parametrize("allowed", [1, 15, 16, 17, 63, 257, 1000])
def test_cpu_decode_attention_over_any_number_of_allowed_slots(allowed):
    """However many slots the mask allows (one; around a vector's 16 slots; past one chunk of 256 and over several),
    in a cache with unfilled slots after them: PyTorch's answer, in float32."""
    g = torch.Generator().manual_seed(allowed)
    q = torch.randn(1, 9, 1, 64, generator=g)
    k, v = (torch.randn(1, 3, 1024, 64, generator=g) for _ in range(2))
    mask = (torch.arange(1024) < allowed)[None, None, None]
    torch.testing.assert_close(cpu_attention.decode_attention(q, k, v, mask), pytorch_attention(q, k, v, mask),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("allowed", [1, 200, 1000])
def test_cpu_decode_attention_on_any_number_of_threads(threads, allowed):
    """The kernel cuts each KV head's allowed slots into as many runs as make every thread's share equal, so the runs
    depend on the thread count (3 KV heads, 200 slots: one run each on 1 or 3 threads, two on 2): on each, in bf16 as
    in float32, the answer is PyTorch's."""
    assert cpu_attention.available()
    g = torch.Generator().manual_seed(threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype, tol in ((torch.float32, {"atol": 1e-5, "rtol": 1e-5}), (torch.bfloat16, {})):
            q = torch.randn(1, 9, 1, 64, generator=g).to(dtype)
            k, v = (torch.randn(1, 3, 1100, 64, generator=g).to(dtype) for _ in range(2))
            mask = (torch.arange(1100) < allowed)[None, None, None]
            torch.testing.assert_close(cpu_attention.decode_attention(q, k, v, mask),
                                       pytorch_attention(q, k, v, mask), **tol)
    finally:
        torch.set_num_threads(before)


def test_cpu_decode_attention_refuses_shapes_it_does_not_handle():
    q, kv = torch.randn(1, 6, 1, 16), torch.randn(1, 2, 30, 16)
    mask = torch.ones(1, 1, 1, 30, dtype=torch.bool)
    with pytest.raises(RuntimeError, match=r"q must be \[B, H, 1, D\]"):
        cpu_attention.decode_attention(torch.randn(1, 6, 2, 16), kv, kv, mask)
    with pytest.raises(RuntimeError, match="mask must be bool"):
        cpu_attention.decode_attention(q, kv, kv, mask.float())
    with pytest.raises(RuntimeError, match="H must be a multiple of Hkv"):
        cpu_attention.decode_attention(torch.randn(1, 5, 1, 16), kv, kv, mask)
    with pytest.raises(RuntimeError, match="float32, bf16 or fp16 only"):
        cpu_attention.decode_attention(q.double(), kv.double(), kv.double(), mask)
    assert not cpu_attention.handles(q.double(), kv.double(), kv.double(), mask)  # float64 keeps PyTorch's kernel
    nothing = cpu_attention.decode_attention(q, kv, kv, torch.zeros_like(mask))  # no slot allowed: zeros
    assert torch.equal(nothing, torch.zeros_like(q))


def test_a_machine_without_a_compiler_gets_a_warning_not_a_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.warns(UserWarning, match="could not be built, PyTorch's own kernels are used"):
        assert cpu_extension.build(tmp_path / "kernel.so") is False
    assert not (tmp_path / "kernel.so").exists()


def test_an_imitated_cpu_gets_a_kernel_for_its_instruction_sets(monkeypatch):
    """Under ATEN_CPU_CAPABILITY=avx2 (a laptop imitated) the kernel is compiled for AVX2, not for this CPU, and
    kept under another name."""
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)  # this run's own setting aside
    native = cpu_extension.library_path()
    assert "-march=native" in cpu_extension.compile_command(native)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    command = cpu_extension.compile_command(native)
    assert "-mavx2" in command and "-march=native" not in command
    assert cpu_extension.library_path() != native


def test_shapes_beyond_the_kernel_go_to_pytorch():
    """33 query heads on one KV head is more than the kernel's group limit: attention answers with PyTorch's."""
    from utils import llama

    q, kv = torch.randn(1, 33, 1, 16).bfloat16(), torch.randn(1, 1, 30, 16).bfloat16()
    mask = torch.ones(1, 1, 1, 30, dtype=torch.bool)
    assert not cpu_attention.handles(q, kv, kv, mask)
    assert cpu_attention.handles(q[:, :32], kv, kv, mask)
    assert torch.equal(llama.attention(q, kv, kv, mask), pytorch_attention(q, kv, kv, mask))
