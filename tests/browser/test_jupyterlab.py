"""The workbook as a learner sees it: JupyterLab in headless Chromium, real clicks.

Run alone with ``pytest tests/browser -m browser``; ``make test`` runs it after the
notebooks. Screenshots land in ``reports/browser/`` (outside git).
"""

from __future__ import annotations

import re
import time

import pytest

pytestmark = pytest.mark.browser

RUN_TIMEOUT_MS = 240_000


def open_from_file_browser(page, folder: str, name: str) -> None:
    """Double-click the folder, then the notebook, in the file browser; wait for its kernel."""
    page.locator(".jp-DirListing-item", has_text=folder).first.dblclick()
    page.locator(".jp-DirListing-item", has_text=name).first.dblclick()
    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell", timeout=60_000)
    dialog = page.locator(".jp-Dialog", has_text="Select Kernel")
    try:  # JupyterLab may ask which kernel to start; a learner clicks "Select" (the notebook's own)
        dialog.get_by_role("button", name="Select").click(timeout=5_000)
    except Exception:  # noqa: BLE001 - no dialog: the kernel started by itself
        pass
    page.get_by_text(re.compile(r"\| Idle")).first.wait_for(timeout=120_000)  # status bar: kernel up


def run_all_cells(page) -> None:
    """Run › Run All Cells, with the mouse."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.get_by_role("menuitem", name=re.compile(r"^Run All Cells")).click()


def wait_until_done(page, timeout_ms: int = RUN_TIMEOUT_MS) -> None:
    """Until the run is over: no cell queued or running ([*]), the kernel idle, and either every
    code cell run or an error shown (Run All stops there); seen twice, a second apart."""
    panel = ".jp-NotebookPanel:not(.lm-mod-hidden)"
    done = """(panel) => {
        const prompts = [...document.querySelectorAll(panel + ' .jp-CodeCell .jp-InputPrompt')];
        const texts = prompts.map(p => p.textContent);
        const ind = document.querySelector(panel + ' .jp-Notebook-ExecutionIndicator');
        const error = [...document.querySelectorAll(panel + ' .jp-OutputArea-output')]
            .some(o => o.textContent.includes('Traceback'));
        return texts.length > 0 && !texts.some(t => t.includes('*')) && ind && ind.dataset.status === 'idle'
            && (error || texts.every(t => /\[\d+\]/.test(t)));
    }"""
    for _ in range(2):
        page.wait_for_function(done, arg=panel, timeout=timeout_ms, polling=500)
        page.wait_for_timeout(1000)
    page.wait_for_function(done, arg=panel, timeout=timeout_ms, polling=500)


def cell_texts(page, selector: str) -> list[str]:
    return page.locator(f".jp-NotebookPanel:not(.lm-mod-hidden) {selector}").all_inner_texts()


def error_outputs(page) -> list[str]:
    return [t for t in cell_texts(page, ".jp-OutputArea-output") if "Traceback" in t]


def test_chapter_02_runs_with_widgets_and_plots(page):
    open_from_file_browser(page, "notebooks", "02_forward_pass.ipynb")
    run_all_cells(page)
    wait_until_done(page)
    prompts = cell_texts(page, ".jp-CodeCell .jp-InputPrompt")
    assert prompts and all(re.search(r"\[\d+\]", p) for p in prompts), f"cells not run: {prompts}"
    assert not error_outputs(page), error_outputs(page)[0][:2000]
    body = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)").inner_text()
    assert "Error displaying widget" not in body, "ipywidgets did not render (widget manager missing?)"
    sliders = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jupyter-widgets.widget-slider")
    assert sliders.count() >= 2, "the sampling sliders did not render as widgets"
    images = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-RenderedImage img")
    assert images.count() >= 2, "the plots did not render as images"


def test_lab_stub_shows_the_exercise_message(page):
    open_from_file_browser(page, "labs", "quantization.ipynb")
    run_all_cells(page)  # stops at the first cell that raises: the first exercise's check
    wait_until_done(page)
    errors = error_outputs(page)
    page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output", has_text="Traceback").first \
        .scroll_into_view_if_needed()  # the screenshot shows what the student sees
    assert len(errors) == 1, f"expected exactly one error (the first stub), got {len(errors)}"
    assert "NotImplementedError" in errors[0] and re.search(r"[Ee]xercise", errors[0]), errors[0][:2000]


def test_chapter_06_calculator_slider_moves_the_result(page):
    open_from_file_browser(page, "notebooks", "06_whole_request.ipynb")
    run_all_cells(page)
    wait_until_done(page)
    slider = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jupyter-widgets.widget-slider").first
    slider.scroll_into_view_if_needed()
    output = slider.locator("xpath=ancestor::div[contains(@class, 'widget-interact')]").locator(".widget-output")
    before = output.inner_text()
    handle = slider.locator(".noUi-handle").first
    box = handle.bounding_box()
    assert box, "the slider has no handle on screen"
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] / 2 + 80, box["y"] + box["height"] / 2, steps=8)
    page.mouse.up()
    deadline = time.monotonic() + 30
    while output.inner_text() == before and time.monotonic() < deadline:
        time.sleep(0.3)
    assert output.inner_text() != before, "moving the slider did not change the printed result"
