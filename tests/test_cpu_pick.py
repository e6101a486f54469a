"""The workbook's greedy pick on a CPU (utils/fast.py's greedy_pick, utils/csrc/decode_pick.cpp): argmax's index."""

from __future__ import annotations

import pytest
import torch

from utils import fast


def tricky_rows(dtype: torch.dtype) -> list[torch.Tensor]:
    """Rows where a pick can go wrong: ties (the first wins), NaN (the first NaN wins), -0 beside +0, infinities,
    every value -inf, all negative, a single value, a length that fills no whole vector."""
    g = torch.Generator().manual_seed(7)
    rows = [torch.randn(3, 1000, generator=g), torch.randn(2, 1001, generator=g).round(),
            -torch.rand(2, 777, generator=g)]
    nan = torch.randn(2, 300, generator=g)
    nan[:, 17] = nan[:, 200] = float("nan")
    zeros = torch.zeros(2, 130)
    zeros[:, 3], zeros[:, 9] = -0.0, 0.0
    zeros[1, :] = -0.0
    zeros[1, 5] = 0.0  # equal to the -0 before it: index 0 wins
    inf = torch.randn(2, 65, generator=g)
    inf[:, 40] = inf[:, 50] = float("inf")
    rows += [nan, zeros, inf, torch.full((2, 64), float("-inf")), torch.randn(1, 1, generator=g)]
    return [r.to(dtype) for r in rows]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_greedy_pick_is_argmax(dtype):
    assert fast.cpu_pick_available(), "this machine has a C++ compiler: the kernel must build"
    for row in tricky_rows(dtype):
        assert torch.equal(torch.ops.workbook.greedy_argmax(row), row.argmax(dim=-1)), row
    logits = torch.randn(4, 3, 5000).to(dtype)  # [B, T, V]: greedy_pick reads the last position, a strided view
    assert torch.equal(fast.greedy_pick(logits), logits[:, -1].argmax(dim=-1))


def test_the_greedy_pick_refuses_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="V > 0"):
        torch.ops.workbook.greedy_argmax(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match="float32, bf16 or fp16"):
        torch.ops.workbook.greedy_argmax(torch.zeros(2, 5, dtype=torch.float64))
    doubles = torch.randn(2, 1, 50, dtype=torch.float64)  # greedy_pick leaves these to PyTorch's argmax
    assert torch.equal(fast.greedy_pick(doubles), doubles[:, -1].argmax(dim=-1))
