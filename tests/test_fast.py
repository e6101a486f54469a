"""The fast path: same greedy tokens as the eager loop, one compile per cache shape, clear errors."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import torch
from test_batching import tiny_hf

from utils import cpu_attention, cpu_linear, decode_table, engine, fast, quant
from utils.llama_phases import forward_no_cache
from utils.errors import WorkbookError
from utils.llama import Llama

IDS = torch.randint(1, 96, (1, 12), generator=torch.Generator().manual_seed(5))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts with no compiled code: a decoder compiled by an earlier test (the same
    DecodeStep.forward) would otherwise show up as a recompile in this one's log."""
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def model() -> Llama:
    return Llama.from_hf(tiny_hf())


def test_static_length_rounds_up_to_the_bucket():
    assert fast.static_length(128, 64) == 256
    assert fast.static_length(200, 56) == 256 and fast.static_length(200, 57) == 512
    assert fast.static_length(5, 3, bucket=4) == 8


def test_hot_loop_makes_the_eager_loops_tokens(model):
    want = engine.generate(model, IDS, 20)
    decoder = fast.FastDecoder.build(model, 64, compiled=False)
    assert torch.equal(decoder.generate(IDS, 20), want)
    assert torch.equal(decoder.generate(IDS, 20), want)  # a second request reuses the cache


def test_batch_rows_decode_like_single_rows(model):
    ids = torch.cat([IDS, IDS.flip(1)])
    decoder = fast.FastDecoder.build(model, 64, batch=2, compiled=False)
    both = decoder.generate(ids, 10)
    assert torch.equal(both[1:], engine.generate(model, IDS.flip(1), 10))


def test_compiled_step_compiles_once_over_whole_generations(model):
    decoder = fast.FastDecoder.build(model, 64, compiled=True, backend="eager")
    before = fast.compile_count()
    reasons = fast.explain_recompiles(lambda: [decoder.generate(IDS, 24) for _ in range(3)])
    assert fast.compile_count() - before == 1, reasons
    assert reasons == []
    assert torch.equal(decoder.generate(IDS, 24), engine.generate(model, IDS, 24))


def test_the_compile_time_leaves_out_the_prefill(model, monkeypatch):
    """compile_s is the first decode steps' time (the compile or load): a slow prefill before them is not in it."""
    decoder = fast.FastDecoder.build(model, 64, compiled=True, backend="eager")
    prefill = decoder.prefill
    monkeypatch.setattr(decoder, "prefill", lambda ids: (time.sleep(0.5), prefill(ids))[1])
    t0 = time.perf_counter()
    decoder.warm_up(IDS)
    assert 0 < decoder.compile_s <= time.perf_counter() - t0 - 0.5


def test_only_the_most_recently_used_precompiled_headers_are_kept(tmp_path):
    for i in range(6):  # header i last used i hours ago
        (tmp_path / f"h{i}.h").write_text("#include <x.h>\n")
        (tmp_path / f"h{i}.h.gch").write_bytes(b"pch")
        os.utime(tmp_path / f"h{i}.h.gch", (time.time() - 3600 * i, time.time() - 3600 * (i + 10)))
    removed = fast.keep_recent_headers(tmp_path, keep=4)
    assert sorted(p.name for p in removed) == ["h4.h.gch", "h5.h.gch"]
    assert sorted(p.name for p in tmp_path.glob("*.gch")) == [f"h{i}.h.gch" for i in range(4)]
    assert len(list(tmp_path.glob("*.h"))) == 6  # the headers' text stays for a compile already running


def test_a_recompile_is_explained(model):
    decoder = fast.FastDecoder.build(model, 64, compiled=True, backend="eager")
    decoder.generate(IDS, 4)
    step = decoder.step
    with torch.inference_mode():
        reasons = fast.explain_recompiles(lambda: step(torch.tensor([[3]], dtype=torch.int32), torch.tensor([20])))
    assert reasons and any("token" in r for r in reasons), reasons  # int32 ids: a new dtype, a new graph


@pytest.mark.parametrize("length", [64, 128])
def test_inductor_compiled_step_makes_the_eager_tokens(model, length, tmp_path, monkeypatch):
    """The real compiler, on a tiny model (the short test setting), at two cache lengths: same greedy tokens,
    one compile; on a CPU the step is packaged once and a second decoder loads it instead of compiling, and (at the
    shorter length) the profile of the loaded step splits its time by kind of operator."""
    monkeypatch.setenv("WORKBOOK_STEP_CACHE", str(tmp_path))
    decoder = fast.FastDecoder.build(model, length, compiled=True)
    before = fast.compile_count()
    assert torch.equal(decoder.generate(IDS, 16), engine.generate(model, IDS, 16))
    assert torch.equal(decoder.generate(IDS.flip(1), 16), engine.generate(model, IDS.flip(1), 16))
    assert fast.compile_count() - before == 1
    if model.device.type == "cpu":
        assert decoder.step.source == "built" and len(list(tmp_path.glob("*.pt2"))) == 1
        again = fast.FastDecoder.build(model, length, compiled=True)
        assert torch.equal(again.generate(IDS, 16), engine.generate(model, IDS, 16))
        assert again.step.source == "loaded"
        if length != 64:
            return  # the profile's twin (one more build, ~13 s on one core) is checked at one length
        per_kind = fast.profile_step(again, IDS)  # a twin that records its kernels: matmuls and attention seen
        assert per_kind.get("matmul", 0) > 0 and per_kind.get("attention", 0) > 0, per_kind
        assert 0 < sum(per_kind.values()) < 1.0  # scaled to the decoder's own step: seconds, not the twin's
        given = fast.profile_step(again, IDS, step_s=0.0123)  # a step time the caller measured (a table's row)
        assert sum(given.values()) == pytest.approx(0.0123) and given.keys() == per_kind.keys()


def test_a_packaged_step_is_keyed_by_the_gemm_backends_a_user_picks(model, monkeypatch):
    step = fast.DecodeStep(model, model.new_cache(1, 64, static=True))
    settings = fast.inductor_settings(step)
    monkeypatch.delenv("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS", raising=False)
    default = fast.step_key(step, settings)
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS", "ATEN")  # not in settings: inductor reads it
    assert fast.step_key(step, settings) != default
    monkeypatch.delenv("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")  # where inductor keeps its cache is not what it built
    assert fast.step_key(step, settings) == default


def test_a_packaged_step_is_keyed_by_weights_and_shapes_not_the_caches_contents(model):
    settings = fast.inductor_settings(fast.DecodeStep(model, model.new_cache(1, 64, static=True)))
    key = fast.step_key(fast.DecodeStep(model, model.new_cache(1, 64, static=True)), settings)
    filled = model.new_cache(1, 64, static=True)
    filled.layer(0)[0].fill_(1.0)
    assert fast.step_key(fast.DecodeStep(model, filled), settings) == key
    assert fast.step_key(fast.DecodeStep(model, model.new_cache(1, 128, static=True)), settings) != key
    other = quant.quantized_copy(model, bits=8, head_bits=8, dtype=torch.float32)
    assert fast.step_key(fast.DecodeStep(other, other.new_cache(1, 64, static=True)), settings) != key
    with torch.no_grad():
        changed = Llama.from_hf(tiny_hf())
        next(changed.parameters()).add_(1e-3)
    assert fast.step_key(fast.DecodeStep(changed, changed.new_cache(1, 64, static=True)), settings) != key


def test_the_step_cache_keeps_the_most_recently_used_packages(tmp_path):
    import os

    for i, name in enumerate(["old", "middle", "new"]):
        (tmp_path / f"{name}.pt2").write_bytes(b"x" * 100)
        os.utime(tmp_path / f"{name}.pt2", (1000 + i, 1000 + i))
    fast.keep_recent_packages(tmp_path, max_bytes=250)
    assert sorted(p.stem for p in tmp_path.glob("*.pt2")) == ["middle", "new"]
    fast.keep_recent_packages(tmp_path, max_bytes=0)
    assert [p.stem for p in tmp_path.glob("*.pt2")] == ["new"]  # the newest stays, whatever the limit


def test_a_build_parses_each_kernel_template_once_and_then_restores_the_parser():
    from torch._inductor.codegen.common import KernelTemplate

    source = "{% for i in range(n) %}{{ i }},{% endfor %}"
    assert KernelTemplate._template_from_string(source) is not KernelTemplate._template_from_string(source)
    with fast.templates_parsed_once():
        once = KernelTemplate._template_from_string(source)
        assert KernelTemplate._template_from_string(source) is once  # parsed once, reused
        assert once.render(n=3) == once.render(n=3) == "0,1,2,"  # renders the same each time
    assert KernelTemplate._template_from_string(source) is not once  # inductor's own parser is back


def test_a_packaged_step_compiles_its_wrapper_at_O0_and_is_keyed_by_it(model):
    step = fast.DecodeStep(model, model.new_cache(1, 64, static=True))
    packaged = fast.PackagedStep(step, fast.inductor_settings(step))
    assert packaged.settings["aot_inductor.compile_wrapper_opt_level"] == "O0"
    assert fast.step_key(step, packaged.settings) != fast.step_key(step, fast.inductor_settings(step))


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_fast_path_matches_its_own_eager_loop(model, bits):
    copy = quant.quantized_copy(model, bits=bits, head_bits=bits, dtype=torch.float32)
    decoder = fast.FastDecoder.build(copy, 64, compiled=True, backend="eager")
    assert torch.equal(decoder.generate(IDS, 16), engine.generate(copy, IDS, 16))


def test_decode_past_the_static_cache_is_refused(model):
    decoder = fast.FastDecoder.build(model, 16, compiled=False)
    with pytest.raises(WorkbookError, match="do not fit the static cache of 16 slots"):
        decoder.generate(IDS, 8)


def test_projections_seconds_times_every_projection(model):
    seconds = fast.projections_seconds(model, repeats=3)
    assert 0 < seconds < 1
    row = decode_table.Row("x", "float32", 12, tok_s=10.0, bytes_per_token=2e6)
    assert row.share(4e7) == pytest.approx(0.5)
    assert row.as_dict(4e7, baseline_tok_s=5.0)["speedup"] == 2.0


@pytest.mark.parametrize("kernel", fast.ATTENTION_KERNELS)
def test_attention_seconds_times_the_kernel_it_is_asked_for(model, monkeypatch, kernel):
    seen, real_pytorch, real_workbook = [], torch.nn.functional.scaled_dot_product_attention, cpu_attention.decode_attention

    def pytorch(q, k, v, **kw):
        seen.append(("pytorch", q.dtype, k.shape[2]))
        return real_pytorch(q, k, v, **kw)

    def workbook(q, k, v, mask):
        seen.append(("workbook", q.dtype, k.shape[2]))
        return real_workbook(q, k, v, mask)

    monkeypatch.setattr(fast.F, "scaled_dot_product_attention", pytorch)
    monkeypatch.setattr(cpu_attention, "decode_attention", workbook)
    bf16 = Llama.from_hf(tiny_hf()).to(torch.bfloat16)
    seconds = fast.attention_seconds(bf16, 96, kernel, calls=3, repeats=2)
    assert 0 < seconds < 1
    want = {"pytorch": ("pytorch", torch.bfloat16), "pytorch in float32": ("pytorch", torch.float32),
            "workbook": ("workbook", torch.bfloat16)}[kernel]
    assert set(seen) == {(*want, 96)}
    assert len(seen) >= 3 * 3  # warm-up and two repeats of three calls
    with pytest.raises(WorkbookError, match="unknown attention kernel 'flash'"):
        fast.attention_seconds(bf16, 96, "flash")


def test_many_decoders_in_one_process_stay_under_the_recompile_limit(model):
    """A lab builds one decoder per model, dtype and context: more than dynamo's default of 8 per code."""
    for length in range(16, 16 + 10 * 4, 4):  # ten cache shapes
        decoder = fast.FastDecoder.build(model, length, compiled=True, backend="eager")
        assert torch.equal(decoder.generate(IDS[:, :4], 3), engine.generate(model, IDS[:, :4], 3))


def test_divergence_finds_where_two_streams_part_and_the_logit_gap_there(model):
    want = engine.generate(model, IDS, 6)[0].tolist()
    assert decode_table.divergence(model, IDS, want, want) is None
    wrong = want[:3] + [(want[3] + 1) % 90] + want[4:]
    i, gap = decode_table.divergence(model, IDS, wrong, want)
    # the gap is the eager model's own: recomputed here by hand
    row = forward_no_cache(model, torch.cat([IDS, torch.tensor([want[:3]])], 1), last_only=True)[0, -1]
    assert i == 3 and gap == pytest.approx(float((row[want[3]] - row[wrong[3]]).abs() / row.abs().max()), rel=1e-5)
    assert gap > 0


def test_a_row_that_parts_from_its_reference_says_where_and_by_what_gap(model):
    want = engine.generate(model, IDS, 6)[0]
    decoder = fast.FastDecoder.build(model, 32, compiled=False)
    same = decode_table.decoder_row("static", decoder, IDS, 6, weights="float32", reference=want, what="eager", repeats=1)
    assert same.agree == "6/6 vs eager" and same.split is None
    wrong = want.clone()
    wrong[3] = (wrong[3] + 1) % 90
    i, gap = decode_table.divergence(model, IDS, want.tolist(), wrong.tolist())
    parted = decode_table.decoder_row("static", decoder, IDS, 6, weights="float32", reference=wrong, what="eager", repeats=1)
    assert parted.split == (i, gap) and parted.agree.startswith(f"3/6 vs eager (at token 3 the picks' logits differ by {gap:.2%} of the largest: ")
    assert parted.agree.endswith("a near-tie)" if gap < decode_table.NEAR_TIE else "NOT a near-tie, over 2%)")


def test_float_weights_on_a_wide_cpu_compile_with_the_gemm_templates_only(model, monkeypatch):
    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa

    wide = cpu_vec_isa.pick_vec_isa().bit_width() >= 512
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS", raising=False)
    assert fast.cpu_gemm_backends(model) == ("CPP" if wide else None)
    assert fast.cpu_gemm_backends(quant.quantized_copy(model, 8, 8)) is None  # int8: the default, measured
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS", "ATEN")
    assert fast.cpu_gemm_backends(model) is None  # the user's own choice stands
    seen = []
    run = fast._first_call_with(lambda x: seen.append(inductor_config.max_autotune_gemm_backends) or x,
                                max_autotune_gemm_backends="CPP")
    run(1), run(2)
    assert seen[0] == "CPP" and seen[1] == inductor_config.max_autotune_gemm_backends != "CPP"


def test_an_imitated_cpu_compiles_without_gemm_templates(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("WORKBOOK_COMPILE_MODE", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert fast.compile_options(cpu)["mode"] == "max-autotune-no-cudagraphs"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert fast.compile_options(cpu)["mode"] == "default"
    assert fast.compile_options(cpu, mode="max-autotune")["mode"] == "max-autotune"


def test_the_phase_speeds_have_one_shape(lm, model):
    """prefill_speed, decode_speed and fast_decode_speed: a model (or decoder) and a prompt in, a PhaseResult out."""
    ids = torch.cat([IDS, IDS.flip(1)])  # two rows
    pre = engine.prefill_speed(model, ids, repeats=2)
    dec = engine.decode_speed(model, ids, 4, repeats=2)
    fast_dec = fast.fast_decode_speed(fast.FastDecoder.build(model, 64, batch=2, compiled=False), ids, 4, repeats=2)
    assert (pre.phase, pre.tokens) == ("prefill", ids.numel())
    assert (dec.phase, dec.tokens) == (fast_dec.phase, fast_dec.tokens) == ("decode", 8)
    assert all(isinstance(r, engine.PhaseResult) and r.tok_s > 0 for r in (pre, dec, fast_dec))
    assert engine.measure_prefill(lm, 8, repeats=1).tokens == 8


def test_decode_copies_each_token_out_before_the_next_step(model):
    """A step compiled with CUDA graphs returns the same output buffer at every replay: the loop must never hand
    that buffer back as the next step's input (on a GPU the replay overwrote it: 'accessing tensor output of
    CUDAGraphs that has been overwritten'). Here a step that returns one buffer, as a graph replay does."""
    decoder = fast.FastDecoder.build(model, 64, compiled=False)
    real, buffer = decoder.step, torch.zeros(1, dtype=torch.long)

    def replay(token, slot):
        assert token.data_ptr() != buffer.data_ptr(), "the last step's output buffer came back as its input"
        return buffer.copy_(real(token, slot))

    decoder.step = replay
    assert torch.equal(decoder.generate(IDS, 8), engine.generate(model, IDS, 8))


def test_a_step_on_the_workbooks_kernels_compiles_without_freezing(model):
    """Freezing pre-packs float weights; a model whose projections all call the workbook's kernels has none, and
    skips it (a sixth of the build on 2 cores); one float projection left brings it back."""
    own = quant.quantized_copy(model, 4, 8, dtype=torch.float32)
    assert not fast.has_weights_to_pack(own)
    assert not fast.inductor_settings(fast.DecodeStep(own, own.new_cache(1, 64, static=True)))["freezing"]
    assert fast.inductor_settings(fast.DecodeStep(model, model.new_cache(1, 64, static=True)))["freezing"]
    assert fast.has_weights_to_pack(quant.quantized_copy(model, 4, None, dtype=torch.float32))  # float head
    assert fast.has_weights_to_pack(quant.quantized_copy(model, 8, 8, dtype=torch.float32, kernel="aten"))


def test_group_size_divides_the_layers():
    assert [fast.group_size(n, 5) for n in (30, 32, 28, 22, 7, 1)] == [5, 4, 4, 2, 1, 1]
    assert fast.group_size(30, 3) == 3 and fast.group_size(30) == fast.group_size(30, fast.LAYER_GROUP)


def test_a_step_is_compiled_by_layer_groups_only_where_nothing_is_pre_packed(model):
    own = quant.quantized_copy(model, 4, 8, dtype=torch.float32)
    if not fast.has_weights_to_pack(own):  # the workbook's kernels are built here
        assert fast.compiles_by_layer(own) and fast.compiles_by_layer(own, by_layer=True) and fast.layers_alike(own)
        assert not fast.compiles_by_layer(own, by_layer=False)  # the whole step, asked for
    assert not fast.compiles_by_layer(model)  # float weights: the whole step, pre-packed
    mixed = quant.quantized_copy(model, 4, 8, dtype=torch.float32)
    mixed.layers[1].mlp.down_proj.kernel = "aten"  # one block unlike the others
    assert not fast.layers_alike(mixed) and not fast.compiles_by_layer(mixed)


@pytest.fixture(scope="module")
def layered_int4(model, tmp_path_factory):
    """One layered int4 step built once for the tests that need a built one (each build costs ~11 s on one core):
    after fast.build_headers, with the compiler's outputs recorded, into a step
    cache of its own, one block per group (the tiny model's 2 blocks: two groups through one package)."""
    from torch._inductor import cpp_builder

    torch._dynamo.reset()
    path, outputs = tmp_path_factory.mktemp("steps"), []
    headers_s = fast.build_headers()
    original = cpp_builder._run_compile_cmd

    def recorded(cmd_line: str, cwd: str) -> None:
        outputs.append(cmd_line.split(" -o ")[-1].split()[0])
        original(cmd_line, cwd)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORKBOOK_STEP_CACHE", str(path))
        mp.setattr(fast, "LAYER_GROUP", 1)
        mp.setattr(cpp_builder, "_run_compile_cmd", recorded)
        own = quant.quantized_copy(model, 4, 8, dtype=torch.float32)
        decoder = fast.FastDecoder.build(own, 64, compiled=True)
        first = decoder.generate(IDS, 16)  # the packages, built by its first call
    return SimpleNamespace(path=path, own=own, decoder=decoder, first=first, outputs=outputs, headers_s=headers_s)


@pytest.mark.skipif(not quant.kernel_here(torch.device("cpu")) == "workbook", reason="the workbook's kernels are not built")
def test_layer_groups_make_the_eager_tokens_and_bind_each_models_own_weights(layered_int4, monkeypatch, recwarn):
    """A layered step (one group of blocks compiled, called per group with that group's weights and cache) makes
    its own eager loop's tokens; a second model of the same shapes loads the same packages and makes ITS tokens
    (the packages hold no weights). (The roofline lab profiles one: its fastest row.)"""
    monkeypatch.setenv("WORKBOOK_STEP_CACHE", str(layered_int4.path))
    monkeypatch.setattr(fast, "LAYER_GROUP", 1)
    own, decoder = layered_int4.own, layered_int4.decoder
    assert isinstance(decoder.step, fast.LayeredStep) and len(decoder.step.groups) == 2
    assert torch.equal(layered_int4.first, engine.generate(own, IDS, 16))
    assert torch.equal(decoder.generate(IDS.flip(1), 16), engine.generate(own, IDS.flip(1), 16))
    assert decoder.step.source == "built" and len(list(layered_int4.path.glob("part-*.pt2"))) == 2  # a group, the head
    with torch.no_grad():
        other_hf = tiny_hf()
        for p in other_hf.parameters():
            p.mul_(1.5)
    other = quant.quantized_copy(Llama.from_hf(other_hf), 4, 8, dtype=torch.float32)
    again = fast.FastDecoder.build(other, 64, compiled=True)
    want = engine.generate(other, IDS, 16)
    assert not torch.equal(want, engine.generate(own, IDS, 16))  # the two models do differ
    assert torch.equal(again.generate(IDS, 16), want) and again.step.source == "loaded"
    assert not [w for w in recwarn if "LeafSpec" in str(w.message)]  # torch's own notice, hidden from the lab's output


def test_inductor_does_not_copy_weights_laid_out_by_thread_but_copies_the_rest():
    """A weight laid out by thread is handed to inductor as it is (its copy would span the thread buffer); any other
    buffer, e.g. a KV cache the step writes, is still copied; outside the block inductor's copy is back."""
    from torch._inductor import compile_fx

    from utils import cpu_linear

    laid, cache = cpu_linear.laid_out_by_thread([torch.ones(4, 3)], 2)[0], torch.zeros(2, 3)
    original = compile_fx.clone_preserve_strides
    with fast.laid_out_not_copied():
        assert compile_fx.clone_preserve_strides(laid) is laid
        copied = compile_fx.clone_preserve_strides(cache)
        assert copied is not cache and torch.equal(copied, cache)
    assert compile_fx.clone_preserve_strides is original and not cpu_linear.is_laid_out(cache)


@pytest.mark.skipif(not quant.kernel_here(torch.device("cpu")) == "workbook", reason="the workbook's kernels are not built")
def test_after_build_headers_a_layered_step_builds_no_precompiled_header(layered_int4):
    """fast.build_headers builds the headers a layered step's packages use (the benchmark times them apart from its
    steps): a step built after it compiles no header of its own (its wrapper, yes), and makes its eager tokens."""
    assert layered_int4.headers_s > 0
    outputs = layered_int4.outputs
    assert torch.equal(layered_int4.first, engine.generate(layered_int4.own, IDS, 16))
    assert layered_int4.decoder.step.source == "built" and any(o.endswith(".wrapper.o") for o in outputs)
    assert not [o for o in outputs if o.endswith(".gch")]


def test_a_build_hands_on_its_python_turn_only_while_a_wrapper_or_kernels_compile(monkeypatch):
    """Two builds side by side (fast.package_steps): while one's C++ compiler makes a package's wrapper or kernels,
    the other's Python may run; a precompiled header, a CPU check or a link keeps the turn (inductor holds a file
    lock there that the other build may wait for). Outside the block inductor's own compile call is back."""
    from torch._inductor import cpp_builder

    held_during: dict[str, bool] = {}

    def fake_compile(cmd_line: str, cwd: str) -> None:
        held_during[cmd_line.split("/")[-1]] = fast._PYTHON_TURN.locked()

    monkeypatch.setattr(cpp_builder, "_run_compile_cmd", fake_compile)
    with fast.compilers_side_by_side(), fast.python_turn():
        for out in ("a.wrapper.o", "b.kernel.o", "h.gch", "h.i", "a.wrapper.so", "w.weights.o"):
            cpp_builder._run_compile_cmd(f"g++ x.cpp -c -o /t/{out}", "/t")
        assert fast._PYTHON_TURN.locked()  # taken back after each
    assert held_during == {"a.wrapper.o": False, "b.kernel.o": False, "h.gch": True, "h.i": True,
                           "a.wrapper.so": True, "w.weights.o": True}
    assert cpp_builder._run_compile_cmd is fake_compile and not fast._PYTHON_TURN.locked()


@pytest.mark.skipif(not quant.kernel_here(torch.device("cpu")) == "workbook", reason="the workbook's kernels are not built")
def test_a_loaded_package_leaves_nothing_in_the_temp_dir(layered_int4, tmp_path, monkeypatch):
    """The loader unpacks a package into the temp dir and removes that folder only when it is destroyed (never, in
    a kernel killed at exit): load_package has it unpack into a folder of its own, gone once loaded, and the step
    still makes its tokens."""
    monkeypatch.setenv("WORKBOOK_STEP_CACHE", str(layered_int4.path))  # the packages, built once for this module
    monkeypatch.setattr(fast, "LAYER_GROUP", 1)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # where the loader's C++ unpacks, unless told otherwise
    again = fast.FastDecoder.build(layered_int4.own, 64, compiled=True)
    assert torch.equal(again.generate(IDS, 16), engine.generate(layered_int4.own, IDS, 16))  # its first call loads
    assert again.step.source == "loaded" and os.environ["TMPDIR"] == str(temp)  # loaded, and TMPDIR given back
    assert list(temp.iterdir()) == []


@pytest.mark.skipif(not quant.kernel_here(torch.device("cpu")) == "workbook", reason="the workbook's kernels are not built")
def test_a_bf16_step_on_the_workbook_kernels_is_built_by_layer_groups_and_makes_its_eager_tokens(model, tmp_path,
                                                                                                 monkeypatch):
    """Float projections on the workbook's kernel (utils.cpu_linear: AMX tiles where the CPU has them, else rows)
    leave nothing to pre-pack: the step is a LayeredStep, and requests of two lengths make its eager loop's tokens
    without a second build."""
    monkeypatch.setenv("WORKBOOK_STEP_CACHE", str(tmp_path))
    own = cpu_linear.on_workbook_kernels(Llama.from_hf(tiny_hf()).to(torch.bfloat16))
    decoder, eager = fast.FastDecoder.build(own, 64, compiled=True), fast.FastDecoder.build(own, 64, compiled=False)
    assert isinstance(decoder.step, fast.LayeredStep)
    for ids in (IDS, IDS[:, :7]):
        assert torch.equal(decoder.generate(ids, 16), eager.generate(ids, 16))
    assert decoder.step.source == "built" and len(list(tmp_path.glob("part-*.pt2"))) == 2  # one group, one head


def test_a_layer_groups_package_is_keyed_by_shapes_not_weights(model):
    own = quant.quantized_copy(model, 4, 8, dtype=torch.float32)
    cache = own.new_cache(1, 64, static=True)
    settings = fast.inductor_settings(fast.DecodeStep(own, cache))
    x, slot = torch.zeros(1, 1, own.args.hidden_size), torch.tensor([3])
    key = fast.part_key(fast.LayerGroup(own, cache, 0, 1), (x, slot), settings)
    assert fast.part_key(fast.LayerGroup(own, cache, 1, 1), (x, slot), settings) == key  # the other block
    longer = own.new_cache(1, 128, static=True)
    assert fast.part_key(fast.LayerGroup(own, longer, 0, 1), (x, slot), settings) != key
    assert fast.part_key(fast.LayerGroup(own, cache, 0, 2), (x, slot), settings) != key
    assert fast.part_key(fast.LayerGroup(own, cache, 0, 1), (x, slot), {**settings, "freezing": True}) != key
