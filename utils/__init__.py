"""Helpers for the prefill/decode workbook.

One module per concept, from the bottom of the dependency order up: a module imports only
modules listed before it (``tests/test_layering.py`` checks it).

- ``errors``        the clear errors raised on bad input, and the one validator of counts and sizes
- ``results``       the figures a run measured: ``record()`` for the notebooks, the results schema, load
- ``roofline``      the arithmetic: ceilings, intensity, attention FLOPs, KV bytes, time and price
- ``shapes``        a model's shape: one type for every model (published, loaded, hand-written), one registry
- ``device``        device and dtype policy; device memory and whether something fits
- ``timing``        warm-up, repeats, median and spread, noise flagged; interleaved A/B; profiles
- ``decide``        the one rule for timing checks: decided when the prediction clears the noise, else "not decided here"
- ``hardware``      measured bandwidth and FLOP/s, the machine's description, a table of accelerators
- ``plotting``      one consistent plot style
- ``tokens``        byte-level BPE pieces, chat prompts, filler prompts of exact length
- ``sampling``      greedy, temperature, top-k, top-p, seeded
- ``models``        load the embedded default model (offline) or another one; its spec; the test model; shape-only models
- ``peer``          llama.cpp, the peer engine, on the embedded GGUF file (optional; built on first use)
- ``cpu_extension`` the workbook's own CPU kernels (C++, ``csrc/``): built once per machine into one library, loaded on first use
- ``cpu_attention`` decode attention over a KV cache on a CPU: the workbook's C++ kernel
- ``cpu_quant``     int8 / int4 weight-only matrix products for decode on a CPU: the workbook's C++ kernels
- ``llama``         a hand-written Llama forward pass and its preallocated KV cache
- ``phases``        prefill / decode / extend through transformers (one backend)
- ``llama_phases``  prefill / decode / extend through the hand-written model (the other backend)
- ``engine``        one request engine over either backend: generate, stream, time each phase
- ``requests``      what a server knows of each request (torch-free): requests, sequences, token times, traces
- ``blocks``        KV memory as blocks (torch-free): allocation, reference counts, prefix sharing
- ``scheduler``     the serving core (torch-free): the scheduler, its policy, the one continuous-batching loop
- ``executors``     run a scheduled step on the model: contiguous rows or paged blocks, mixed batches
- ``batching``      many requests at once: static batches, continuous batching, what a chunk costs in a decode step
- ``simulator``     a serving cluster simulated with measured step costs: colocated vs disaggregated, goodput
- ``paged``         a paged KV cache (blocks and block tables) and a prefix cache over it
- ``long_context``  long context: the KV/weights crossover, an int8 KV cache, a sliding window, tiled attention
- ``meter``         a per-request log line in the style of an inference engine, and its diagnosis
- ``openai_client`` any OpenAI-compatible server, streamed and timed from outside (torch-free): TTFT, gaps, decode tok/s
- ``load_generator`` a real server under load (torch-free): fixed concurrency or arrival times; throughput, p50/p99, goodput
- ``llama_server`` llama.cpp's own server on the embedded file: built once per machine, started and stopped on 127.0.0.1
- ``verdicts``      conclusions computed from this run's numbers (which is faster, what bounds decode)
- ``quant``         weight-only int8 / int4 quantization (reference and PyTorch kernels), any layer width
- ``cpu_linear``    float32 / bf16 decode projections on the workbook's CPU kernel; all of them laid out by thread
- ``variants``      judging a model variant against its baseline: bytes, perplexity, agreement, speed-up
- ``fast``          the fast path: static cache, hot loop, the one-token step compiled once
- ``decode_table`` the roofline table: each way of decoding measured as a row (tok/s, bytes, ceiling, tokens), llama.cpp's row
- ``speculative``   speculative decoding: drafts (prompt lookup, early exit, int4 copy), verify, accept, roll back
- ``checks``        the labs' check functions: a verdict that says what is wrong
- ``chapter``       the first cell of every chapter: load the model, print the setup
- ``bench``         the reference benchmark (``make bench``; last line JSON)
- ``report``        the reference report: run every notebook, write HTML, results.json, index.html; compare
- ``grade``         the gradebook: run submitted labs in fresh kernels, grade their check cells, write feedback
"""

import logging as _logging

# torchao (used by the quantization lab) tries to load its CUDA extensions on import
# and logs each failure on a CPU build; torch warns about its enums. Both are noise here.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)

__version__ = "0.1.0"

MODULE_ORDER = ("errors", "results", "roofline", "shapes", "device", "timing", "decide", "hardware", "plotting", "tokens", "sampling",
                "models", "peer", "cpu_extension", "cpu_attention", "cpu_quant", "llama", "phases", "llama_phases", "engine", "requests", "blocks", "scheduler", "executors", "batching", "simulator", "paged", "long_context", "meter", "openai_client", "load_generator", "llama_server", "verdicts", "quant", "cpu_linear", "variants", "fast", "decode_table", "speculative", "checks",
                "chapter", "bench", "report", "grade")
"""The package's modules, bottom to top: each imports only modules before it."""
