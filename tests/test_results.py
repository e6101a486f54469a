"""utils.results: record() is cheap and persists only when asked; the schema round-trips;
bad files get clear errors that name them; older versions are read or refused by name."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from utils import results
from utils.errors import WorkbookError
from utils.results import ResultsError, figure, load, record, save, validate


def document(figures: list[dict], machine_id: str = "host-cpu-float32") -> dict:
    """A minimal valid current-version document around ``figures``."""
    return {"schema": results.SCHEMA, "schema_version": results.SCHEMA_VERSION, "machine_id": machine_id,
            "machine": {"device": "cpu", "device_name": "Test CPU", "dtype": "float32"}, "model": {"name": "m"},
            "settings": {"quick": True}, "notebooks": [{"name": "00_setup", "status": "ok"}], "figures": figures, "checks": []}


def test_record_returns_the_value_keeps_it_and_writes_nothing_unasked(monkeypatch, tmp_path):
    monkeypatch.delenv(results.ENV_FILE, raising=False)
    monkeypatch.chdir(tmp_path)
    before = len(results.RECORDED)
    assert record("decode_tok_s", 12.5, unit="tok/s", predicted=50.0, context_tokens=32) == 12.5
    kept = results.RECORDED[-1]
    assert len(results.RECORDED) == before + 1
    assert kept["ratio"] == 0.25 and kept["context"] == {"context_tokens": 32}
    assert list(tmp_path.iterdir()) == []


def test_record_appends_one_json_line_per_figure_when_the_runner_asks(monkeypatch, tmp_path):
    out = tmp_path / "figs.jsonl"
    monkeypatch.setenv(results.ENV_FILE, str(out))
    monkeypatch.setenv(results.ENV_NOTEBOOK, "04_decode")
    record("decode_tok_s", np.float64(20.0), unit="tok/s", predicted=torch.tensor(40.0), context_tokens=np.int64(64))
    record("bandwidth_gb_s", 31, unit="GB/s")
    lines = results.read_lines(out)
    assert [line["name"] for line in lines] == ["decode_tok_s", "bandwidth_gb_s"]
    assert lines[0] == {"kind": "figure", "notebook": "04_decode", "name": "decode_tok_s", "value": 20.0,
                        "unit": "tok/s", "predicted": 40.0, "ratio": 0.5, "context": {"context_tokens": 64}}
    assert lines[1]["predicted"] is None and lines[1]["ratio"] is None


def test_every_bandwidth_probe_is_published_under_one_name(monkeypatch):
    from utils.hardware import BandwidthProbe
    monkeypatch.delenv(results.ENV_FILE, raising=False)
    probe = BandwidthProbe((29.2e9, 51.3e9, 40.0e9))
    assert results.record_bandwidth(probe) == 51.3e9  # the reading the ceilings use, in B/s
    kept = results.RECORDED[-1]
    assert (kept["name"], kept["value"], kept["context"]) == ("bandwidth_gb_s", 51.3, {"probe": "best of 3"})


@pytest.mark.parametrize("name, value, predicted", [
    ("Decode speed", 1.0, None), ("decode_tok_s", float("nan"), None), ("decode_tok_s", "fast", None),
    ("decode_tok_s", 1.0, float("inf")), ("decode_tok_s", True, None)])
def test_bad_figures_are_refused_clearly(name, value, predicted):
    with pytest.raises(WorkbookError):
        figure(name, value, predicted=predicted)


def test_a_document_round_trips(tmp_path):
    doc = document([figure("prefill_tok_s", 512.0, "tok/s", 2048.0, "03_prefill", prompt_tokens=256),
                    figure("chars_per_token", 4.4, "chars/token", 4, "01_tokens", text="English")])
    path = save(doc, tmp_path / "results.json")
    again = load(path)
    assert again == doc
    assert again["figures"][0]["ratio"] == 0.25


def test_validate_catches_a_ratio_that_is_not_value_over_prediction():
    doc = document([figure("decode_tok_s", 10.0, "tok/s", 20.0, "00_setup")])
    doc["figures"][0]["ratio"] = 0.9
    with pytest.raises(ResultsError, match="ratio"):
        validate(doc, "here.json")


@pytest.mark.parametrize("text, says", [
    ("{not json", "not valid JSON"),
    ('{"name": "my-package", "version": "1.0"}', "not a workbook results file"),
    ("[1, 2, 3]", "not a workbook results file"),
    (json.dumps({"schema": results.SCHEMA, "schema_version": 99}), "update the workbook"),
    (json.dumps({"schema": results.SCHEMA, "schema_version": 1, "machine_id": "x"}), "'machine' is missing"),
])
def test_corrupt_or_foreign_files_get_an_error_naming_the_file(tmp_path, text, says):
    path = tmp_path / "student-07.json"
    path.write_text(text)
    with pytest.raises(ResultsError) as e:
        load(path)
    assert str(path) in str(e.value) and says in str(e.value)


BENCH_LINE = {  # what `make bench | tail -1` printed before reports existed: schema version 0
    "machine": {"device": "cpu", "device_name": "Old CPU", "torch_threads": 2},
    "model": {"name": "SmolLM2-135M-Instruct", "dtype": "float32"},
    "bandwidth_GBps": 35.0, "bandwidth_probes_GBps": [30.0, 35.0], "matmul_GFLOPs": 130.0,
    "prefill_tok_s": {"128": 600.0, "512": 633.0}, "decode_context_tokens": 128, "decode_new_tokens": 64,
    "decode_tok_s_transformers": 15.7, "decode_tok_s_hand_written": 15.4, "decode_tokens_agree": "64/64",
    "decode_ceiling_tok_s": 65.4, "decode_share_of_ceiling": 0.24,
}


def test_a_make_bench_line_is_read_as_schema_version_0(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(BENCH_LINE))
    doc = load(path)
    assert doc["schema_version"] == results.SCHEMA_VERSION and doc["machine"]["dtype"] == "float32"
    by_name = {(f["name"], f["context"].get("prompt_tokens")): f for f in doc["figures"]}
    assert by_name[("prefill_tok_s", 512)]["value"] == 633.0
    assert math.isclose(by_name[("decode_tok_s", None)]["ratio"], 0.24)


def test_an_incomplete_old_version_says_what_it_is(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({**{k: v for k, v in BENCH_LINE.items() if k != "decode_share_of_ceiling"},
                                "schema": results.SCHEMA, "schema_version": 0}))
    with pytest.raises(ResultsError, match="schema version 0 file, but incomplete"):
        load(path)
