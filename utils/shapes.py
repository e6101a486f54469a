"""A model's shape: one type, :class:`ModelShape`, and one registry, :data:`SHAPES` (torch-free).

The same numbers describe a model everywhere in the workbook:

- the roofline formulas and the simulator predict from them (``LLAMA3_8B.kv_bytes_per_token``, bf16);
- a loaded model carries them as ``lm.spec`` (:func:`utils.models.model_spec`), with its dtype;
- the hand-written forward pass is built from them (``utils.llama.Llama(shape)``);
- a shape-only model (``WORKBOOK_MODEL=shape:<name>``) is built from a registry entry with random weights.

Byte counts are at the shape's own ``bytes_per_param`` (its weights and its KV cache): a loaded model's
dtype, or 2 (bf16) for a published shape; ``shape.stored_in(0.5)`` is the same model at 4 bits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from . import roofline
from .errors import UnknownModelError, WorkbookError

DTYPE_OF_BYTES = {4: "float32", 2: "bfloat16", 1: "int8", 0.5: "int4"}
"""The dtype a published shape's bytes per parameter name (:meth:`ModelShape.stored_in`)."""

__all__ = ["DTYPE_OF_BYTES", "ModelShape", "SHAPES", "SHAPE_PREFIX", "LLAMA3_8B", "LLAMA3_70B", "by_name", "llama_param_count"]


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The numbers that define a decoder-only transformer (named as in a transformers config, shortened)."""

    name: str
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads; n_heads // n_kv_heads queries share each
    head_dim: int
    hidden_size: int  # d_model
    intermediate_size: int  # the MLP's inner width
    vocab_size: int
    max_context: int  # max_position_embeddings
    tied_embeddings: bool
    architecture: str = "LlamaForCausalLM"
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10_000.0})
    norm_eps: float = 1e-5
    qkv_bias: bool = False  # Qwen2: True
    o_bias: bool = False
    mlp_bias: bool = False
    windows: tuple[int | None, ...] = ()  # per layer: sliding-window size, or None (full); () = all full
    dtype: str = "bfloat16"
    bytes_per_param: float = 2
    n_params: int = 0  # 0: counted from the shape (:func:`llama_param_count`)

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise WorkbookError(f"{self.name}: n_kv_heads={self.n_kv_heads} must divide the {self.n_heads} query heads.")
        if not self.n_params:
            object.__setattr__(self, "n_params", llama_param_count(self))

    def changed(self, **fields: Any) -> "ModelShape":
        """This shape with some numbers changed and its parameters counted again (a slice, another GQA)."""
        return dataclasses.replace(self, n_params=0, **fields)

    def stored_in(self, bytes_per_param: float) -> "ModelShape":
        """This model with its weights and KV cache at ``bytes_per_param`` (4 float32, 2 bf16, 1 int8, 0.5 int4)."""
        return dataclasses.replace(self, bytes_per_param=bytes_per_param,
                                   dtype=DTYPE_OF_BYTES.get(bytes_per_param, f"{bytes_per_param:g} B per parameter"))

    @property
    def weight_bytes(self) -> float:
        """Bytes of all weights, each parameter counted once (tied ones once)."""
        return roofline.weight_bytes(self.n_params, self.bytes_per_param)

    @property
    def weight_bytes_read_per_token(self) -> float:
        """Weight bytes one decode step reads: all but an untied input embedding, a lookup
        (:func:`utils.roofline.weight_bytes_read_per_token`)."""
        return roofline.weight_bytes_read_per_token(self.n_params, self.bytes_per_param, self.vocab_size,
                                                    self.hidden_size, self.tied_embeddings)

    @property
    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes one token adds: 2 x layers x kv_heads x head_dim x bytes (:func:`utils.roofline.kv_bytes_per_token`)."""
        return roofline.kv_bytes_per_token(self.n_layers, self.n_kv_heads, self.head_dim, self.bytes_per_param)

    def prefill_params(self) -> float:
        """Parameters every prompt token goes through: all but the embedding and the LM head (:func:`utils.roofline.prefill_params`)."""
        return roofline.prefill_params(self.stored_in(1).weight_bytes_read_per_token, 1, self.vocab_size, self.hidden_size)

    def pass_flops(self, n_tokens: int) -> float:
        """FLOP of one pass over ``n_tokens`` with the last position's logits only (:func:`utils.roofline.pass_flops`)."""
        return roofline.pass_flops(self.prefill_params(), n_tokens, self.n_layers, self.hidden_size,
                                   self.vocab_size * self.hidden_size)

    def as_dict(self) -> dict[str, Any]:
        """Every field and the byte counts at the shape's own dtype (for results.json)."""
        return {**dataclasses.asdict(self), "weight_bytes": self.weight_bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "weight_bytes_read_per_token": self.weight_bytes_read_per_token}


def llama_param_count(shape: ModelShape) -> int:
    """Parameters of a Llama-family model of this shape: embedding (and an untied LM head), and per layer
    q/k/v/o, gate/up/down and two norms, then the final norm. Biases where the shape has them."""
    h, q, kv = shape.hidden_size, shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    attn = h * (q + 2 * kv) + q * h + (q + 2 * kv) * shape.qkv_bias + h * shape.o_bias
    mlp = 3 * h * shape.intermediate_size + (2 * shape.intermediate_size + h) * shape.mlp_bias
    embeddings = shape.vocab_size * h * (1 if shape.tied_embeddings else 2)
    return embeddings + shape.n_layers * (attn + mlp + 2 * h) + h


SHAPE_PREFIX = "shape:"
"""``WORKBOOK_MODEL=shape:<name>`` builds registered shape ``<name>`` with random weights."""

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_theta": 500_000.0}


def _rope(theta: float) -> dict:
    return {"rope_type": "default", "rope_theta": theta}


_SMOLLM2 = dict(vocab_size=49_152, tied_embeddings=True, max_context=8_192, head_dim=64)
SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    # the sizes of each model's published config.json
    ModelShape(name="smollm2-135m", hidden_size=576, intermediate_size=1_536, n_layers=30, n_heads=9, n_kv_heads=3,
               rope=_rope(100_000.0), **_SMOLLM2),
    ModelShape(name="smollm2-360m", hidden_size=960, intermediate_size=2_560, n_layers=32, n_heads=15, n_kv_heads=5,
               rope=_rope(100_000.0), **_SMOLLM2),
    ModelShape(name="smollm2-1.7b", hidden_size=2_048, intermediate_size=8_192, n_layers=24, n_heads=32, n_kv_heads=32,
               rope=_rope(130_000.0), **_SMOLLM2),
    ModelShape(name="llama-3.2-1b", hidden_size=2_048, intermediate_size=8_192, n_layers=16, n_heads=32, n_kv_heads=8,
               head_dim=64, vocab_size=128_256, tied_embeddings=True, rope=_LLAMA3_ROPE, max_context=131_072),
    ModelShape(name="llama-3.2-3b", hidden_size=3_072, intermediate_size=8_192, n_layers=28, n_heads=24, n_kv_heads=8,
               head_dim=128, vocab_size=128_256, tied_embeddings=True, rope=_LLAMA3_ROPE, max_context=131_072),
    ModelShape(name="llama-3.1-8b", hidden_size=4_096, intermediate_size=14_336, n_layers=32, n_heads=32, n_kv_heads=8,
               head_dim=128, vocab_size=128_256, tied_embeddings=False, rope={**_LLAMA3_ROPE, "factor": 8.0},
               max_context=131_072),
    ModelShape(name="llama-3-8b", hidden_size=4_096, intermediate_size=14_336, n_layers=32, n_heads=32, n_kv_heads=8,
               head_dim=128, vocab_size=128_256, tied_embeddings=False, rope=_rope(500_000.0), max_context=8_192),
    ModelShape(name="llama-3-70b", hidden_size=8_192, intermediate_size=28_672, n_layers=80, n_heads=64, n_kv_heads=8,
               head_dim=128, vocab_size=128_256, tied_embeddings=False, rope=_rope(500_000.0), max_context=8_192),
)}
"""Published shapes, by name: the chapters' reference models and the shape-only models (``shape:<name>``)."""

LLAMA3_8B = SHAPES["llama-3-8b"]
"""Meta-Llama-3-8B: 32 layers, 8 KV heads of 128, hidden 4,096, untied 128,256-token vocabulary (8.03 B parameters)."""

LLAMA3_70B = SHAPES["llama-3-70b"]
"""Meta-Llama-3-70B: 80 layers, 8 KV heads of 128, hidden 8,192, untied 128,256-token vocabulary (70.6 B parameters)."""


def by_name(name: str, **changes: Any) -> ModelShape:
    """The registered shape ``name`` (``llama-3.2-1b`` or ``shape:llama-3.2-1b``), optionally changed
    (``n_layers=4`` for a slice that fits a small machine, ``n_kv_heads=1`` for multi-query)."""
    key = name.removeprefix(SHAPE_PREFIX).strip().lower()
    if key not in SHAPES:
        raise UnknownModelError(f"No shape-only model {key!r}; known: {', '.join(SHAPES)} "
                                f"(as WORKBOOK_MODEL=shape:<name>).")
    return SHAPES[key].changed(**changes) if changes else SHAPES[key]
