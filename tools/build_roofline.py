"""Write solutions/roofline.ipynb (the roofline lab, solved) from the cells below.

    python -m tools.build_roofline && python -m tools.make_labs

Edit the cells here, not the notebook: the notebook is generated (outputs are never committed).
"""

from __future__ import annotations

from pathlib import Path

import nbformat

MD, CODE = "markdown", "code"

CELLS: list[tuple[str, str]] = [
(MD, r"""# Lab · The roofline: take decode to its ceiling

**The question:** decode reads every weight once per token, so its speed can never beat `bandwidth ÷ bytes read per token`. How close does the workbook's own loop get, step by step, and what stops it?

**The prediction.** One decode step at context `c` reads the weights once and the KV cache of `c` tokens:

$$\text{tok/s} \le \frac{\text{bandwidth}}{\text{weight bytes} + c \times \text{KV bytes per token}}$$

Fewer bytes per token (bf16, int8, int4) raise the ceiling. Measured speed falls short when something other than reading the weights takes time: Python and operator dispatch per step, a host sync per token, kernels that cannot stream at the memory's speed.

**What you build and measure, each a row of one table** (at 128 tokens of context, and 1,024 in the full run):
1. the baseline: transformers' decode loop and the hand-written eager loop;
2. a **static KV cache and a hot loop**: no allocation, no host sync and no Python work per step beyond the call;
3. **bf16** (and fp16 on a GPU): half the bytes; do this device's kernels read them at full speed?
4. **compiling the one-token step** (`torch.compile`; CUDA graphs on a GPU): first the recompile trap, then the fix; the compile time on its own column;
5. **weight-only int8 and int4 kernels**, compiled;

then llama.cpp on the same GGUF file when it is installed (`make bench` builds it), the plot, and a profile of what bounds the fastest row. Every row states its tok/s, bytes read per token, share of the measured-bandwidth ceiling, speed-up over transformers, and how many greedy tokens it shares with its reference."""),
(CODE, r"""import copy

import torch
from torch import Tensor, nn

import utils  # quiets torchao's import-time noise on CPU builds
from utils import engine, fast, peer, quant
from utils.chapter import fit_to_context, setup_chapter
from utils.checks import check_close, check_compiles_once, check_equal, check_hot_loop, check_true
from utils.hardware import accelerator, probe_bandwidth
from utils.llama import Llama
from utils.plotting import COLORS, finish, new_axes
from utils.results import record
from utils.timing import quick
from utils.tokens import filler_ids
from utils.verdicts import decode_bound

lm, machine = setup_chapter()
QUICK, RANDOM, DEVICE = quick(), lm.random_weights, lm.device
NEW = 16 if QUICK else 64  # new tokens per measured request
REPEATS = 2 if QUICK else 3
CONTEXTS = fit_to_context([128] if QUICK else [128, 1024], lm.spec.max_context, new_tokens=NEW, what="contexts",
                          add_longest=True)
probe = probe_bandwidth(DEVICE, probes=3)  # a probe can only under-read: the ceiling uses the best
BANDWIDTH = probe.best
print(f"bandwidth {BANDWIDTH / 1e9:.1f} GB/s (best of {[round(r / 1e9, 1) for r in probe.readings]}); "
      f"contexts {CONTEXTS}, {NEW} new tokens per request, {REPEATS} repeats")

# The hand-written model in each form the table measures, all from the float32 weights.
fp32 = Llama.from_hf(lm.model)
fp32 = fp32 if fp32.dtype == torch.float32 else copy.deepcopy(fp32).float()
FORMS = {"float32": fp32, "bfloat16": copy.deepcopy(fp32).to(torch.bfloat16)}
if DEVICE.type == "cuda":
    FORMS["float16"] = copy.deepcopy(fp32).to(torch.float16)
FORMS["int8"] = quant.quantized_copy(fp32, bits=8, head_bits=8)
FORMS["int4 g32 + int8 head"] = quant.quantized_copy(fp32, bits=4, head_bits=8)
COMPILED = ["bfloat16", "int4 g32 + int8 head"] if QUICK else list(FORMS)  # compiling costs ~1 min each on 2 cores
ROWS: dict[int, list[fast.Row]] = {c: [] for c in CONTEXTS}"""),
(MD, r"""## 1 · The prediction: a ceiling for each weight format

Write the ceiling: tokens per second when a step takes exactly the time to read its bytes once."""),
(CODE, r"""def ceiling_tok_s(bandwidth: float, weight_bytes: float, kv_bytes_per_token: float, context: int) -> float:
    '''Decode tok/s if a step only read its weights and the KV cache of ``context`` tokens, at ``bandwidth`` bytes/s.'''
    ### BEGIN SOLUTION
    return bandwidth / (weight_bytes + kv_bytes_per_token * context)
    ### END SOLUTION"""),
(CODE, r"""a = fp32.args
kv_per_token = {name: 2 * a.n_layers * a.n_kv_heads * a.head_dim * m.dtype.itemsize for name, m in FORMS.items()}
weights_read = {name: fast.bytes_read_per_token(m) for name, m in FORMS.items()}
check_close("ceiling_tok_s(50e9, 250e6, 40e3, 1000)", ceiling_tok_s(50e9, 250e6, 40e3, 1000), 50e9 / 290e6)
check_close("the ceiling at context 0 is bandwidth / weight bytes", ceiling_tok_s(1e9, 1e8, 1e3, 0), 10.0)
for c in CONTEXTS:
    for name in FORMS:
        print(f"context {c:>5}  {name:<22} {weights_read[name] / 1e6:7.1f} MB of weights -> ceiling "
              f"{ceiling_tok_s(BANDWIDTH, weights_read[name], kv_per_token[name], c + NEW // 2):7.1f} tok/s (prediction)")"""),
(MD, r"""## 2 · Row 1, the baseline: transformers and the hand-written eager loop

Both decode through `utils.engine`: a cache that grows with the request, each step attending to the filled slots. The transformers model is measured as loaded and in bf16; the hand-written one in float32 and bf16."""),
(CODE, r"""hf_bf16 = lm.model if lm.dtype == torch.bfloat16 else copy.deepcopy(lm.model).to(torch.bfloat16)
EAGER: dict[tuple[int, str], fast.Row] = {}
BASELINE: dict[int, fast.Row] = {}
for c in CONTEXTS:
    ids = filler_ids(lm.tokenizer, c, DEVICE)
    for hf in [lm.model] + ([hf_bf16] if hf_bf16 is not lm.model else []):
        name = str(hf.dtype).removeprefix("torch.")
        ROWS[c].append(fast.eager_row("transformers", hf, ids, NEW, weights=name, repeats=REPEATS,
                                      bytes_per_token=fast.step_bytes(FORMS[name], c + NEW // 2)))
    for name in ("float32", "bfloat16"):
        EAGER[c, name] = fast.eager_row("hand-written eager loop", FORMS[name], ids, NEW, weights=name,
                                        repeats=REPEATS, bytes_per_token=fast.step_bytes(FORMS[name], c + NEW // 2))
        ROWS[c].append(EAGER[c, name])
    BASELINE[c] = next(r for r in ROWS[c] if r.name == "transformers" and r.weights == "bfloat16")
    fast.print_rows(ROWS[c], BANDWIDTH, BASELINE[c])"""),
(MD, r"""## 3 · Row 2: a static KV cache and a hot loop

The eager loop does more than the model's arithmetic at every step: it makes a new position tensor, reads the token back to the host (`int()` waits for the device), and on a growing cache each step has new shapes. A **static** cache is allocated once for the request (rounded up to 256 slots, `fast.static_length`), and every step attends over all its slots with the unfilled ones masked: its shapes never change. The **hot loop** then does nothing per step but call the step:

- the position is **one** device tensor made before the loop and advanced in place (`slot += 1`);
- the greedy token is picked inside the step, fed straight back, and written into an output made before the loop;
- nothing reads a value back to the host until the loop ends.

Write it. `step(token [B, 1], slot [1])` returns the next token of each row, [B]."""),
(CODE, r"""def hot_decode(step, token: Tensor, start: int, n: int) -> Tensor:
    '''``n`` greedy steps after ``token`` [B], the first at cache slot ``start``: the new tokens [B, n].'''
    ### BEGIN SOLUTION
    out = token.new_empty(token.shape[0], n)
    slot = torch.tensor([start], device=token.device)
    token = token.view(-1, 1)
    for i in range(n):
        nxt = step(token, slot)
        out[:, i] = nxt
        token = nxt.view(-1, 1)
        slot += 1
    return out
    ### END SOLUTION"""),
(CODE, r"""check_hot_loop("hot_decode", hot_decode)
STATIC: dict[tuple[int, str], fast.Row] = {}
for c in CONTEXTS:
    ids = filler_ids(lm.tokenizer, c, DEVICE)
    length = fast.static_length(c, NEW)
    for name in ("float32", "bfloat16"):
        decoder = fast.FastDecoder.build(FORMS[name], length, compiled=False, label=f"static {name}")
        first = decoder.prefill(ids)
        mine = torch.cat([first[:, None], hot_decode(decoder.step, first, c, NEW - 1)], dim=1)
        check_equal(f"your hot loop's tokens = utils.fast's ({name}, context {c})", mine, decoder.generate(ids, NEW))
        STATIC[c, name] = fast.decoder_row("static cache + hot loop", decoder, ids, NEW, weights=name, repeats=REPEATS,
                                           reference=torch.tensor(EAGER[c, name].tokens), what=f"eager {name}")
        ROWS[c].append(STATIC[c, name])
        print(STATIC[c, name].agree, f"({name}: {STATIC[c, name].tok_s:.1f} tok/s static, "
              f"{EAGER[c, name].tok_s:.1f} eager)")"""),
(MD, r"""In float32 the static loop makes the eager loop's tokens. In bf16 it may part ways after a few dozen: attending over 256 slots instead of the filled ones sums the softmax in another order, bf16 rounds differently, and a near-tie flips. From here on, each faster row is compared with the **static eager loop in its own dtype**: the same shapes and order of operations, so the tokens must be identical."""),
(CODE, r"""for c in CONTEXTS:
    agreed = fast.tokens_agreed(STATIC[c, "float32"].tokens, EAGER[c, "float32"].tokens)
    check_true(f"float32, context {c}: the static loop keeps the eager loop's first tokens ({agreed}/{NEW})",
               agreed >= min(8, NEW), "a static cache changed float32 greedy tokens early: check the mask of unfilled slots.")"""),
(MD, r"""## 4 · Row 3: bf16 (and fp16 on a GPU): do this device's kernels read them at full speed?

Half the bytes should mean twice the speed, if the matmul kernels stream bf16 weights at the memory's bandwidth. Time the projections alone (every layer once on one row, nothing else) and divide the bytes they read by the time: the speed the *kernels* allow."""),
(CODE, r"""KERNEL_GBPS = {name: weights_read[name] / fast.projections_seconds(m) / 1e9 for name, m in FORMS.items()}
fig, ax = new_axes("How fast the matmul kernels read each weight format", "weights", "GB/s")
ax.bar(list(KERNEL_GBPS), list(KERNEL_GBPS.values()), color=COLORS["decode"], label="projections alone (measured)")
ax.axhline(BANDWIDTH / 1e9, color=COLORS["ceiling"], linestyle="--", label=f"bandwidth probe ({BANDWIDTH / 1e9:.1f} GB/s)")
ax.tick_params(axis="x", labelrotation=15)
ax.legend()
finish(fig, ax)
for name, v in KERNEL_GBPS.items():
    record("kernel_read_gb_s", round(v, 2), "GB/s", predicted=round(BANDWIDTH / 1e9, 2), weights=name)
    print(f"{name:<22} projections read {v:5.1f} GB/s = {v / (BANDWIDTH / 1e9):4.0%} of the probe -> "
          f"at most {1e9 * v / weights_read[name]:6.1f} tok/s from the matmuls alone")
half = "bfloat16" if "float16" not in FORMS else max(("bfloat16", "float16"), key=KERNEL_GBPS.get)
ms = {name: weights_read[name] / KERNEL_GBPS[name] / 1e6 for name in ("float32", half)}  # bytes / (GB/s) -> ms
faster = half if ms[half] < ms["float32"] else "float32"
print(f"\nOn this {DEVICE.type}, a step's projections take {ms['float32']:.1f} ms in float32 and {ms[half]:.1f} ms in "
      f"{half}: {faster} is the faster format for decode here"
      + ("." if faster == half else f": the {half} kernels read {KERNEL_GBPS[half]:.1f} GB/s against float32's "
                                    f"{KERNEL_GBPS['float32']:.1f}, so converting each weight costs more than the bytes it saves."))"""),
(MD, r"""## 5 · Row 4: compile the one-token step

`torch.compile` traces the step once into a graph, fuses its small operators into a few kernels, and replays it (on a GPU, `mode="reduce-overhead"` records it as a CUDA graph: one launch for the whole step). It guards what it assumed while tracing: when a guard fails, it **recompiles**. The trap: pass the position as a Python `int`. Dynamo bakes each value into the graph, so every new token is a new graph (here with the cheap `backend="eager"`, which traces but generates no code):"""),
(CODE, r"""class IntSlotStep(nn.Module):
    '''A one-token step that takes its position as a Python int: every value is a new graph.'''

    def __init__(self, model: Llama, cache) -> None:
        super().__init__()
        self.model, self.cache = model, cache

    def forward(self, token: Tensor, slot: int) -> Tensor:
        logits = self.model(token, torch.tensor([slot], device=token.device), self.cache, self.cache.max_len)
        return logits[:, -1].argmax(dim=-1)


small = FORMS["float32"]
ids = filler_ids(lm.tokenizer, 16, DEVICE)
trap = fast.FastDecoder.build(small, 64, compiled=False)
naive = torch.compile(IntSlotStep(small, trap.cache), backend="eager", fullgraph=True, dynamic=False)
token = trap.prefill(ids).view(-1, 1)
before = fast.compile_count()
with torch.inference_mode():
    reasons = fast.explain_recompiles(lambda: [naive(token, 16 + i) for i in range(5)])
compiles = fast.compile_count() - before
guards = [line.strip(" -").split("#")[0].strip() for line in reasons[-1].splitlines() if ": slot ==" in line]
print(f"5 steps -> {compiles} compiles. Why the last one recompiled, in dynamo's words (each graph's guard failed):")
print("\n".join(f"  {g}" for g in guards))
check_equal("compiles for 5 steps with a Python-int position", compiles, 5)"""),
(MD, r"""After 8 recompiles dynamo gives up (`recompile_limit`); with `fullgraph=True` that is an error (`FailOnRecompileLimitHit`), without it a silent fall back to eager. Every token paying for a compile decodes at a few tokens per second.

**The fix:** everything that changes from step to step must be a *tensor input* (its value is data, not part of the graph), and everything else a constant of the cache's shape. Write the step as a module: `forward(token [B, 1], slot [1])` returns the greedy next token [B], computed inside (only a [B] tensor leaves the step). The model's call is `model(tokens, slots, cache, kv_len)` with `kv_len = cache.max_len` for a static cache."""),
(CODE, r"""class OnceStep(nn.Module):
    '''One greedy decode step over a static cache that compiles once.'''

    def __init__(self, model: Llama, cache) -> None:
        super().__init__()
        self.model, self.cache = model, cache

    def forward(self, token: Tensor, slot: Tensor) -> Tensor:
        ### BEGIN SOLUTION
        logits = self.model(token, slot, self.cache, self.cache.max_len)  # [B, 1, V]
        return logits[:, -1].argmax(dim=-1)
        ### END SOLUTION"""),
(CODE, r"""check_compiles_once("OnceStep", OnceStep)"""),
(MD, r"""Now the real compiler (`utils.fast.compile_step`): inductor with `fullgraph=True`. On a CPU it uses `mode="max-autotune-no-cudagraphs"`, which times its own C++ matmul templates against oneDNN's for every projection and keeps the faster, and *freezing*, which treats the weights as constants (pre-packed once); on a GPU, CUDA graphs. Everywhere it rounds each intermediate as eager does (`emulate_precision_casts`), so the bf16 tokens stay exactly the eager loop's. Its first call traces and generates code: that cost is reported in its own column, not in the speed. The decoder is built once per cache shape and serves every request that fits."""),
(CODE, r"""DECODERS: dict[tuple[int, str], fast.FastDecoder] = {}


def compiled_row(c: int, name: str) -> fast.Row:
    '''Compile ``FORMS[name]``'s step for context ``c`` and measure it against its own static eager loop.'''
    ids, length = filler_ids(lm.tokenizer, c, DEVICE), fast.static_length(c, NEW)
    reference = (torch.tensor(STATIC[c, name].tokens) if (c, name) in STATIC
                 else fast.FastDecoder.build(FORMS[name], length, compiled=False).generate(ids, NEW)[0])
    before = fast.compile_count()
    decoder = DECODERS[c, name] = fast.FastDecoder.build(FORMS[name], length, compiled=True, label=name)
    row = fast.decoder_row("compiled step", decoder, ids, NEW, weights=name, repeats=REPEATS,
                           reference=reference, what=f"static eager {name}")
    check_equal(f"{name}, context {c}: compiles for a whole generation and its repeats", fast.compile_count() - before, 1)
    check_equal(f"{name}, context {c}: compiled greedy tokens = static eager {name}", row.tokens, reference.tolist())
    print(f"{name}: compiled in {row.compile_s:.0f} s, {row.tok_s:.1f} tok/s")
    return row


for c in CONTEXTS:
    for name in [n for n in COMPILED if not n.startswith("int")]:
        ROWS[c].append(compiled_row(c, name))"""),
(MD, r"""## 6 · Row 5: weight-only int8 and int4 kernels, compiled

The quantization lab's formats through PyTorch's own kernels (`utils.quant`: `_weight_int8pack_mm`; `_weight_int4pack_mm_for_cpu` or `_weight_int4pack_mm` on a GPU), activations in bf16, the LM head in int8 (an int4 head changes greedy tokens within a few). Each is compared with **its own** static eager loop (the de-quantized reference of the same integers); how far its tokens stay with float32's is the quantization lab's question."""),
(CODE, r"""for c in CONTEXTS:
    for name in [n for n in COMPILED if n.startswith("int")]:
        ROWS[c].append(compiled_row(c, name))
        q = ROWS[c][-1]
        print(f"  {name}: {fast.tokens_agreed(q.tokens, STATIC[c, 'float32'].tokens)}/{NEW} greedy tokens as float32's"
              + ("  [random weights: only the agreement with its own loop means anything]" if RANDOM else ""))"""),
(MD, r"""## 7 · The table, llama.cpp, and the plot

llama.cpp is the engine local users run. It reads the embedded GGUF file itself (Q4_1: 4-bit weights with a scale and a minimum per 32, activations quantized to 8 bits in its dot products). It is optional: `make bench` builds `llama-cpp-python` once (minutes); this lab measures it when it is installed."""),
(CODE, r"""PEER: dict[int, fast.Row] = {}
if peer.installed():
    for c in CONTEXTS:
        row, why = fast.llama_cpp_row(lm, c, NEW, REPEATS, STATIC[c, "float32"].tokens, "static eager float32")
        if row is None:
            print(f"llama.cpp: no row ({why})")
            break
        PEER[c] = row
        ROWS[c].append(row)
else:
    print("llama.cpp: no row. llama-cpp-python is not installed: `make bench` builds it once (4-6 minutes on 2 cores).")
for c in CONTEXTS:
    print(f"\ncontext {c} (ceiling = {BANDWIDTH / 1e9:.1f} GB/s ÷ MB per token; speed-up over transformers bf16)")
    fast.print_rows(ROWS[c], BANDWIDTH, BASELINE[c])
    for r in ROWS[c]:
        record("roofline_tok_s", round(r.tok_s, 2), "tok/s", predicted=round(BANDWIDTH / r.bytes_per_token, 2),
               row=r.name, weights=r.weights, context=c, compile_s=r.compile_s or 0.0, agree=r.agree)"""),
(CODE, r"""c = CONTEXTS[0]
fig, ax = new_axes(f"Decode, batch 1, context {c}, on {machine['device_name']}", "", "tok/s")
labels = [f"{r.name}\n{r.weights}" for r in ROWS[c]]
x = range(len(ROWS[c]))
ax.bar(x, [BANDWIDTH / r.bytes_per_token for r in ROWS[c]], color="none", edgecolor=COLORS["ceiling"],
       linestyle="--", label="ceiling: bandwidth ÷ bytes (prediction)")
ax.bar(x, [r.tok_s for r in ROWS[c]], color=COLORS["decode"], alpha=0.8, label=f"measured at context {c}")
ax.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=7)
ax.legend()
finish(fig, ax)"""),
(MD, r"""## 8 · What bounds the fastest row: a profile

Profile a few steps of the fastest compiled row and sort the time into matmuls, attention and everything else (the fused element-wise kernels, the cache update, the step's own overhead)."""),
(CODE, r"""c = CONTEXTS[0]
best = max((r for r in ROWS[c] if r.name == "compiled step"), key=lambda r: r.tok_s)
per_kind = fast.profile_step(DECODERS[c, best.weights], filler_ids(lm.tokenizer, c, DEVICE), 8)
step_s = 1 / best.tok_s
matmul_s = per_kind.get("matmul", 0.0)
for kind, s in per_kind.items():
    print(f"{kind:<16} {s * 1e3:6.2f} ms per step (profiled)")
matmul_gbps = weights_read[best.weights] / matmul_s / 1e9 if matmul_s else 0.0
verdict = decode_bound(best.share(BANDWIDTH), min(1.0, matmul_s / step_s), matmul_gbps, BANDWIDTH / 1e9)
print(f"\nfastest: compiled {best.weights}, {best.tok_s:.1f} tok/s = {step_s * 1e3:.1f} ms per step, "
      f"{best.share(BANDWIDTH):.0%} of its ceiling.\n{verdict}")
if PEER:
    ratio = best.tok_s / PEER[c].tok_s
    print(f"Against llama.cpp on the same file: {ratio:.2f}x ({best.tok_s:.1f} vs {PEER[c].tok_s:.1f} tok/s)"
          + (". llama.cpp's hand-written 4-bit kernels read their bytes faster than PyTorch's int4 kernel does here."
             if ratio < 1 else "."))"""),
(MD, r"""**On a datacenter GPU** (predicted from the hardware table, not measured here): the same model in bf16 reads ~270 MB per token, so an H100's 3.35 TB/s allows ~12,000 tok/s. No Python loop gets near that: at ~10 µs of launch overhead per kernel and a few hundred kernels per step, eager decode sits at a few hundred tok/s. That is why the GPU path records the whole step as one CUDA graph (`mode="reduce-overhead"`): one launch per token. The larger the model, the smaller that overhead against the bytes: a 8B model in bf16 (16 GB per token) is bandwidth-bound at ~200 tok/s even in eager mode."""),
(CODE, r"""gpu = accelerator("H100")
print(f"{gpu.name}: this model in bf16 -> ceiling {gpu.bandwidth_bytes_s / weights_read['bfloat16']:,.0f} tok/s (prediction)")
print(f"{gpu.name}: an 8B model in bf16 (16 GB) -> ceiling {gpu.bandwidth_bytes_s / 16e9:,.0f} tok/s (prediction)")"""),
(MD, r"""## Checks

What must hold whatever the machine: every compiled row compiled once and made exactly its eager loop's tokens (checked above, row by row); compiling does not make a step slower (a wide margin: a recompiling step is tens of times slower); fewer bytes never raise the ceiling less than the bytes say."""),
(CODE, r"""for c in CONTEXTS:
    bf16 = next(r for r in ROWS[c] if r.name == "compiled step" and r.weights == "bfloat16")
    if 1 / STATIC[c, "bfloat16"].tok_s >= 0.010:
        check_true(f"context {c}: the compiled bf16 step is not slower than the static eager one (margin 0.7x)",
                   bf16.tok_s > 0.7 * STATIC[c, "bfloat16"].tok_s,
                   f"compiled {bf16.tok_s:.1f} tok/s against {STATIC[c, 'bfloat16'].tok_s:.1f} eager: is it recompiling?")
    else:
        print(f"context {c}: a static eager step takes {1e3 / STATIC[c, 'bfloat16'].tok_s:.1f} ms, too short to compare speeds reliably")
    int4 = next(r for r in ROWS[c] if r.weights.startswith("int4"))
    check_true(f"context {c}: int4 + int8 head reads under 40% of float32's bytes per token",
               int4.bytes_per_token < 0.4 * fast.step_bytes(FORMS["float32"], c + NEW // 2),
               f"{int4.bytes_per_token / 1e6:.1f} MB per token against float32's {fast.step_bytes(FORMS['float32'], c) / 1e6:.1f}.")"""),
(MD, r"""**What you should take away.** Write it down, from *your* table:
- Which row gained the most over the one before it here, and why?
- What bounds the fastest row on this machine: the memory, the matmul kernels, or the rest of the step? Which measurement says so?

<!-- BEGIN SOLUTION -->
The answer depends on the machine; read it off the table and the profile. On a 2-core CPU, the compiled step removes most of the per-operator overhead of the eager loop, and what remains is usually the matmul kernels: if a format's projections alone read well below the bandwidth probe (section 4), no loop around them can reach the ceiling, and the only ways further are fewer bytes that the kernels read fast (a better int4 kernel, as llama.cpp's) or a better kernel for the same bytes. On a GPU the eager loop is launch-bound instead, and CUDA graphs are the step that matters.
<!-- END SOLUTION -->"""),
]


def build() -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for kind, source in CELLS:
        nb.cells.append(nbformat.v4.new_markdown_cell(source) if kind == MD else nbformat.v4.new_code_cell(source))
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"roofline-{i:02d}"
    return nb


if __name__ == "__main__":
    path = Path(__file__).resolve().parent.parent / "solutions" / "roofline.ipynb"
    nbformat.write(build(), path)
    print(f"wrote {path}")
