"""Helpers for the prefill/decode workbook.

One module per concept:

- ``models``    load the embedded default model (offline) or another one; its spec
- ``errors``    the clear errors raised on bad input
- ``timing``    warm-up, repeats, median and spread, synchronized on CUDA
- ``phases``    prefill / TTFT and decode measured through transformers with a cache
- ``meter``     a per-request log line in the style of an inference engine
- ``hardware``  measured bandwidth and FLOP/s, and a table of accelerators
- ``roofline``  the arithmetic: ceilings, intensity, the total-time model, KV bytes
- ``plotting``  one consistent plot style
- ``llama``     a hand-written Llama forward pass with a preallocated KV cache
- ``quant``     weight-only int8 / int4 quantization (reference and PyTorch kernels)
- ``checks``    the labs' check functions: a verdict that says what is wrong
- ``bench``     the reference benchmark (``make bench``; last line JSON)
"""

import logging as _logging

# torchao (used by the quantization lab) tries to load its CUDA extensions on import
# and logs each failure on a CPU build; torch warns about its enums. Both are noise here.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)

__version__ = "0.1.0"
