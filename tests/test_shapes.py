"""utils.shapes: one type and one registry for a model's shape; shape-only models built from it, offline; clear errors."""

from __future__ import annotations

import pytest
import torch

from utils import device as D
from utils import roofline as rl
from utils import shapes as S
from utils.errors import OutOfMemoryError, UnknownModelError, WorkbookError
from utils.models import load_model, shape_config


def test_the_published_parameter_counts_follow_from_the_shapes():
    # the counts on each model's card, from the sizes alone
    assert S.LLAMA3_8B.n_params == 8_030_261_248 and S.LLAMA3_70B.n_params == 70_553_706_496
    assert S.SHAPES["smollm2-135m"].n_params == 134_515_008
    assert S.SHAPES["llama-3.2-1b"].n_params == 1_235_814_400
    assert S.by_name("shape:LLAMA-3.2-1B") is S.SHAPES["llama-3.2-1b"]


def test_reference_byte_counts():
    assert S.LLAMA3_8B.dtype == "bfloat16" and S.LLAMA3_8B.kv_bytes_per_token == 131_072  # 128 KiB per token
    assert 14.9e9 < S.LLAMA3_8B.weight_bytes_read_per_token < 15.1e9  # untied: ~15.0 of 16.06 GB read
    assert S.LLAMA3_8B.weight_bytes - S.LLAMA3_8B.weight_bytes_read_per_token == 128_256 * 4_096 * 2
    assert S.LLAMA3_70B.kv_bytes_per_token == 327_680  # 320 KiB per token
    assert S.LLAMA3_70B.weight_bytes > 141e9  # the real 70B's bf16 weights exceed an H200's 141 GB
    int4 = S.LLAMA3_8B.stored_in(0.5)
    assert int4.dtype == "int4" and int4.weight_bytes == S.LLAMA3_8B.weight_bytes / 4 and int4.n_params == S.LLAMA3_8B.n_params


def test_one_prefill_ceiling_for_llama3_8b():
    # every prompt token goes through all but the untied embedding and LM head; the head runs once
    P = S.LLAMA3_8B.prefill_params()
    assert P == S.LLAMA3_8B.n_params - 2 * 128_256 * 4_096
    assert round(rl.prefill_ceiling_tok_s(989.4e12, P)) == 70_878  # the H100 figure chapters 03, 06 and 07 print
    assert S.LLAMA3_8B.pass_flops(1000) == pytest.approx(
        2 * P * 1000 + rl.attention_flops(32, 4096, 1000) + 2 * 128_256 * 4_096)


def test_a_changed_shape_is_counted_again():
    one_b = S.SHAPES["llama-3.2-1b"]
    half = one_b.changed(n_layers=8)
    per_layer = (one_b.n_params - half.n_params) / 8
    assert per_layer == 2048 * (2048 + 2 * 512) + 2048 * 2048 + 3 * 2048 * 8192 + 2 * 2048
    assert one_b.changed(n_kv_heads=1).kv_bytes_per_token == one_b.kv_bytes_per_token / 8
    with pytest.raises(WorkbookError, match="must divide the 32 query heads"):
        one_b.changed(n_kv_heads=5)


def test_the_loaded_default_model_has_the_registered_shape(lm):
    registered, loaded = S.SHAPES["smollm2-135m"], lm.spec
    same = ("n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_size", "intermediate_size", "vocab_size",
            "max_context", "tied_embeddings", "architecture", "rope", "n_params")
    assert {f: getattr(loaded, f) for f in same} == {f: getattr(registered, f) for f in same}


def test_every_shape_builds_a_config_with_its_published_sizes():
    one_b = shape_config("shape:llama-3.2-1b")
    assert (one_b.hidden_size, one_b.num_hidden_layers, one_b.num_key_value_heads) == (2048, 16, 8)
    assert one_b.rope_parameters["rope_type"] == "llama3" and one_b.workbook_random_weights
    for name, shape in S.SHAPES.items():
        cfg = shape_config(name)
        assert (cfg.vocab_size, cfg.head_dim, cfg.rope_parameters["rope_theta"]) == (
            shape.vocab_size, shape.head_dim, shape.rope["rope_theta"])


def test_a_shape_model_loads_offline_with_the_counted_parameters():
    lm = load_model("shape:smollm2-135m", "cpu", "bfloat16")
    assert lm.random_weights and lm.name == "shape:smollm2-135m"
    assert lm.spec.n_params == 134_515_008  # the published SmolLM2-135M count, tied embeddings once
    assert lm.spec.bytes_per_param == 2 and lm.spec.n_layers == 30
    assert all(not p.is_meta for p in lm.model.parameters())
    assert torch.isfinite(lm.model(torch.tensor([[1, 2, 3]])).logits).all()


def test_an_unknown_shape_is_named():
    with pytest.raises(UnknownModelError, match="No shape-only model 'llama-9b'.*llama-3.2-1b"):
        load_model("shape:llama-9b", "cpu")


def test_a_shape_too_big_for_memory_is_refused_before_allocating(monkeypatch):
    small = D.DeviceMemory(total_bytes=4 * 10**9, available_bytes=2 * 10**9)
    monkeypatch.setattr(D, "device_memory_bytes", lambda device: small)
    with pytest.raises(OutOfMemoryError, match="llama-3.1-8b"):
        load_model("shape:llama-3.1-8b", "cpu", "float32")
