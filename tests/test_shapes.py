"""Shape-only models: a real architecture's sizes with random weights, offline; clear errors."""

from __future__ import annotations

import pytest
import torch

from utils import device as D
from utils.errors import OutOfMemoryError, UnknownModelError
from utils.models import SHAPES, load_model, shape_config


def test_every_shape_builds_a_config_with_its_published_sizes():
    one_b = shape_config("shape:llama-3.2-1b")
    assert (one_b.hidden_size, one_b.num_hidden_layers, one_b.num_key_value_heads) == (2048, 16, 8)
    assert one_b.rope_parameters["rope_type"] == "llama3" and one_b.workbook_random_weights
    for name in SHAPES:
        assert shape_config(name).vocab_size in (49152, 128256)


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
