"""The transformers backend's cache, read back: the tensors a prefill leaves behind."""

from __future__ import annotations

from utils import phases, roofline
from utils.tokens import filler_ids


def test_kv_tensors_hold_the_predicted_bytes(lm):
    s, n = lm.spec, 24
    cache = phases.new_cache(lm.model, 1, n)
    phases.prefill(lm.model, cache, filler_ids(lm.tokenizer, n, lm.device))
    kv = phases.kv_tensors(cache)
    assert len(kv) == s.n_layers
    assert all(tuple(k.shape) == tuple(v.shape) == (1, s.n_kv_heads, n, s.head_dim) for k, v in kv)
    stored = sum(t.numel() * t.element_size() for pair in kv for t in pair)
    assert stored == roofline.kv_cache_bytes(s.n_layers, s.n_kv_heads, s.head_dim, s.bytes_per_param, n)
    assert phases.kv_tensors(cache.kv)[0][0] is kv[0][0]  # transformers' own cache object works too
