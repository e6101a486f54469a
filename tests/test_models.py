"""The default model loads offline, its spec matches its config, bad names fail clearly."""

from __future__ import annotations

import json

import pytest
import torch

from utils import models
from utils.errors import UnknownModelError


def test_default_model_loads_offline_and_spec_matches_config(lm, monkeypatch):
    assert lm.name == models.EMBEDDED
    cfg = json.loads((models.cache_dir() / "models" / models.EMBEDDED / "config.json").read_text())
    s = lm.spec
    assert (s.n_layers, s.n_heads, s.n_kv_heads) == (cfg["num_hidden_layers"], cfg["num_attention_heads"],
                                                      cfg["num_key_value_heads"])
    assert s.head_dim == cfg["head_dim"] and s.hidden_size == cfg["hidden_size"]
    assert s.vocab_size == cfg["vocab_size"] and s.max_context == cfg["max_position_embeddings"]
    assert s.tied_embeddings is cfg["tie_word_embeddings"]
    # Facts from the design doc: 134.5 M parameters, 45 KiB of fp32 KV cache per token.
    assert s.n_params == sum(p.numel() for p in lm.model.parameters())
    assert 134e6 < s.n_params < 135e6
    assert s.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46_080
    assert s.weight_bytes == s.n_params * 4


def test_spec_follows_dtype():
    lm16 = models.load_model(device="cpu", dtype="bf16")
    assert lm16.dtype == torch.bfloat16 and lm16.spec.bytes_per_param == 2
    assert lm16.spec.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2


def test_embedded_aliases_and_env(monkeypatch):
    assert models.resolve_name(None) == models.EMBEDDED
    monkeypatch.setenv("WORKBOOK_MODEL", "embedded")
    assert models.resolve_name(None) == models.EMBEDDED
    monkeypatch.setenv("WORKBOOK_MODEL", "some/other-model")
    assert models.resolve_name(None) == "some/other-model"


def test_unknown_model_offline_says_how_to_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UnknownModelError) as err:
        models.load_model("no-such-org/no-such-model-xyz", device="cpu")
    msg = str(err.value)
    assert "no-such-org/no-such-model-xyz" in msg and "HF_HUB_OFFLINE" in msg
    assert "embedded default" in msg
    with pytest.raises(UnknownModelError):
        models.load_model(str(tmp_path / "empty-folder"), device="cpu")


def test_test_model_has_the_awkward_shapes():
    lm = models.load_model(str(models.prepare_test_model(verbose=False)), device="cpu")
    s = lm.spec
    assert lm.random_weights and not s.tied_embeddings and s.max_context == 512
    assert s.intermediate_size % 32 and s.intermediate_size % 64
    assert s.n_heads // s.n_kv_heads == 4 and s.vocab_size == len(lm.tokenizer)
    assert lm.model.config.rope_parameters["rope_theta"] != 10_000.0
    # untied: the input embedding is looked up, not read whole, per decode step
    assert s.weight_bytes - s.weight_bytes_read_per_token == s.vocab_size * s.hidden_size * 4
