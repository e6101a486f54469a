"""utils.report: a quick report runs real notebooks in fresh kernels and validates; a failing
notebook is named and the rest still written; compare lines reports up and flags outliers."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from utils import report
from utils.models import REPO_ROOT, TEST_MODEL, cache_dir
from utils.results import figure, load, save

TEST_MODEL_DIR = cache_dir() / "models" / TEST_MODEL

MEASURES = """from utils.chapter import setup_chapter
from utils.engine import measure_decode
from utils.results import record
lm, machine = setup_chapter()
d = measure_decode(lm, 4, prompt_tokens=8, repeats=1)
record("decode_tok_s", d.tok_s, unit="tok/s", predicted=2 * d.tok_s, context_tokens=10)
record("bandwidth_gb_s", 1.5, unit="GB/s")
from utils.decide import decide
decide("a clear effect", 3.0, bar=2.0, predicted=4.0, spread=0.05)
decide("an effect inside the noise", 1.0, bar=1.0, predicted=1.05, spread=0.2)"""


def notebook(path: Path, *sources: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    """One quick report on the test model: a notebook that measures, then one whose check fails."""
    if not (TEST_MODEL_DIR / "config.json").exists():
        pytest.skip(f"no test model at {TEST_MODEL_DIR}: run `make model`")
    tmp = tmp_path_factory.mktemp("report")
    good = notebook(tmp / "a_measures.ipynb", MEASURES)
    bad = notebook(tmp / "b_fails.ipynb", "from utils.results import record\nrecord('x_s', 1.0)",
                   "assert 1 + 1 == 3, 'a deliberate failure'", "record('never_s', 2.0)")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORKBOOK_MODEL", str(TEST_MODEL_DIR))
        mp.setenv("WORKBOOK_DEVICE", "cpu")
        mp.setenv("WORKBOOK_DTYPE", "float32")
        mp.chdir(tmp)  # a relative --out, as a learner types it (each kernel runs in its notebook's folder)
        status = report.main(["run", "--quick", "--out", "out", str(good), str(bad)])
    return status, tmp / "out"


def test_a_quick_report_validates_and_holds_only_what_its_notebooks_recorded(quick_report):
    status, out = quick_report
    doc = load(out / "results.json")  # validates against the schema
    assert [(f["notebook"], f["name"]) for f in doc["figures"]] == [
        ("a_measures", "decode_tok_s"), ("a_measures", "bandwidth_gb_s"), ("b_fails", "x_s")]
    decode = doc["figures"][0]
    assert decode["value"] > 0 and decode["ratio"] == pytest.approx(0.5)
    assert doc["machine"]["dtype"] == "float32" and doc["machine"]["torch_threads"] >= 1
    assert doc["settings"]["quick"] is True and Path(doc["model"]["name"]).name == TEST_MODEL
    assert doc["machine_id"] == "out"
    assert [(c["name"], c["outcome"]) for c in doc["checks"]] == [
        ("a clear effect", "passed"), ("an effect inside the noise", "undecided")]
    page = (out / "index.html").read_text()
    assert "Timing checks not decided here (1 of 2)" in page and "an effect inside the noise" in page


def test_a_failing_notebook_is_named_and_the_rest_still_written(quick_report):
    status, out = quick_report
    doc = load(out / "results.json")
    assert status == 1
    assert [(e["name"], e["status"]) for e in doc["notebooks"]] == [("a_measures", "ok"), ("b_fails", "failed")]
    assert "a deliberate failure" in doc["notebooks"][1]["error"]
    for name in ("a_measures.html", "b_fails.html", "index.html"):
        assert (out / name).stat().st_size > 1000, name
    index = (out / "index.html").read_text()
    assert "Headline figures" in index and "b_fails" in index and "failed" in index and "data:image/png" in index


def test_the_runner_finds_every_chapter_and_solved_lab():
    found = report.discover()
    expected = sorted((REPO_ROOT / "notebooks").glob("*.ipynb")) + sorted((REPO_ROOT / "solutions").glob("*.ipynb"))
    assert found == expected
    assert REPO_ROOT / "solutions" / "quantization.ipynb" in found and len(found) >= 8


def test_machine_id_is_readable_and_keeps_dtypes_and_models_apart(monkeypatch):
    monkeypatch.setenv("WORKBOOK_DEVICE", "cpu")
    monkeypatch.delenv("WORKBOOK_MODEL", raising=False)
    monkeypatch.setenv("WORKBOOK_DTYPE", "float32")
    assert report.machine_id(False, host="Lab PC.07") == "lab-pc-07-cpu-float32"
    monkeypatch.setenv("WORKBOOK_DTYPE", "bfloat16")
    assert report.machine_id(True, host="lab") == "lab-cpu-bfloat16-quick"
    monkeypatch.setenv("WORKBOOK_MODEL", "/x/models/workbook-test-llama")
    assert report.machine_id(True, host="lab") == "lab-cpu-bfloat16-workbook-test-llama-quick"


def synthetic(machine_id: str, decode: float, ceiling: float = 65.4, request_ratio: float = 1.0) -> dict:
    """A report as another machine would write it (the figures are made up here)."""
    figs = [figure("bandwidth_gb_s", 35.0, "GB/s", notebook="00_setup"),
            figure("matmul_gflop_s", 130.0, "GFLOP/s", notebook="03_prefill", dtype="float32"),
            figure("prefill_tok_s", 633.0, "tok/s", 2532.0, "03_prefill", prompt_tokens=512),
            figure("prefill_tok_s", 300.0, "tok/s", 2532.0, "03_prefill", prompt_tokens=16),
            figure("decode_tok_s", decode, "tok/s", ceiling, "04_decode", context_tokens=40),
            figure("request_total_s", 2.0 * request_ratio, "s", 2.0, "06_whole_request", prompt_tokens=64,
                   output_tokens=16)]
    return {"schema": "prefill-decode-workbook/results", "schema_version": 2, "machine_id": machine_id,
            "machine": {"device": "cpu", "device_name": "EPYC", "dtype": "float32"}, "model": {"name": "m"},
            "settings": {"quick": False}, "notebooks": [{"name": "00_setup", "status": "ok"}], "figures": figs, "checks": []}


def write(tmp_path: Path, *docs: dict) -> list[Path]:
    return [save(d, tmp_path / f"{d['machine_id']}.json") for d in docs]


def test_compare_two_synthetic_reports_gives_the_expected_table(tmp_path):
    paths = write(tmp_path, synthetic("lab-01-cpu-float32", 15.7), synthetic("lab-02-cpu-float32", 26.0, 89.0, 1.2))
    lines = report.compare(paths, tmp_path / "cmp").splitlines()
    assert lines[0].split() == ["machine", "device", "dtype", "bandwidth", "GB/s", "matmul", "GFLOP/s", "prefill",
                                "tok/s", "decode", "tok/s", "share", "of", "ceiling", "request", "meas/pred"]
    assert [line.split() for line in lines[2:4]] == [
        ["lab-01-cpu-float32", "EPYC", "float32", "35", "130", "633", "@512", "15.7", "0.24", "1"],
        ["lab-02-cpu-float32", "EPYC", "float32", "35", "130", "633", "@512", "26", "0.29", "1.2"]]
    assert "not judged" in lines[-1]
    assert "data:image/png" in (tmp_path / "cmp" / "compare.html").read_text()


def test_compare_a_real_quick_report_with_a_synthetic_one(quick_report, tmp_path):
    _, out = quick_report
    real = load(out / "results.json")
    lines = report.compare([out / "results.json", *write(tmp_path, synthetic("lab-01-cpu-float32", 15.7))]).splitlines()
    decode = real["figures"][0]["value"]
    assert lines[2].split()[0] == "out" and lines[2].split()[-6:] == ["1.5", "-", "-", report.fmt(decode), "0.5", "-"]
    assert lines[3].split()[0] == "lab-01-cpu-float32"


def test_compare_flags_the_machine_outside_the_others_spread(tmp_path):
    paths = write(tmp_path, synthetic("a", 15.7), synthetic("b", 17.0), synthetic("c", 40.0))
    flags = [line for line in report.compare(paths).splitlines() if line.startswith("FLAG")]
    assert flags == ["FLAG c: 04_decode/decode_tok_s (context_tokens 40) = 0.61, others 0.24 to 0.26"]


def test_compare_names_a_corrupt_file_and_exits_nonzero(tmp_path, capsys):
    good = write(tmp_path, synthetic("a", 15.7))[0]
    bad = tmp_path / "student-12.json"
    bad.write_text('{"schema": "prefill-decode-workbook/results", "schema_version": 1, "machine_id": ')
    assert report.main(["compare", str(good), str(bad), "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "not valid JSON" in err


def test_slow_cells_are_listed_with_whether_they_showed_a_progress_bar():
    import nbformat

    from utils.report import slow_cells

    def cell(seconds, outputs=()):
        c = nbformat.v4.new_code_cell(f"work({seconds})\nmore")
        c.metadata["execution"] = {"iopub.execute_input": "2026-12-01T16:00:00.000000Z",
                                   "shell.execute_reply": f"2026-12-01T16:00:{seconds:02d}.500000Z"}
        c.outputs = [nbformat.from_dict(o) for o in outputs]
        return c

    widget = {"output_type": "display_data", "metadata": {},
              "data": {"application/vnd.jupyter.widget-view+json": {"model_id": "x", "version_major": 2, "version_minor": 0}}}
    bar = {"output_type": "stream", "name": "stderr", "text": "measuring:  60%|######    | 3/5 [00:12<00:08]"}
    warning = {"output_type": "stream", "name": "stderr", "text": "UserWarning: something"}
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# title"), cell(3), cell(12, [widget]), cell(30, [bar]), cell(45, [warning])]
    got = slow_cells(nb)
    assert [(c["cell"], c["seconds"], c["progress_bar"]) for c in got] == [(2, 12.5, True), (3, 30.5, True), (4, 45.5, False)]
    assert got[0]["first_line"] == "work(12)"
