"""JupyterLab started the way ``make lab`` starts it, and headless Chromium driven by Playwright.

Skipped with a one-line reason when Chromium or Playwright is missing (``.ci/run`` installs both).
Every process started here is stopped by its process group, also when a test fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHOTS = REPO / "reports" / "browser"
TOKEN = "workbook-browser-test"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                  "--disable-background-networking", "--disable-component-update"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _settings(root: Path) -> Path:
    """User settings for this run only: every cell rendered (no windowing), no news pop-up, no autosave."""
    tracker = root / "settings" / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text(json.dumps({"windowingMode": "none"}))
    news = root / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    docs = root / "settings" / "@jupyterlab" / "docmanager-extension" / "plugin.jupyterlab-settings"
    docs.parent.mkdir(parents=True)
    docs.write_text(json.dumps({"autosave": False}))  # never write executed outputs into the repo
    return root / "settings"


@pytest.fixture(scope="session")
def lab_url(tmp_path_factory):
    """A JupyterLab server on the project root (as ``make lab``), a fixed token, a free loopback port."""
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed (apt-get install chromium): browser tests skipped")
    pytest.importorskip("playwright.sync_api", reason="Playwright is not installed: browser tests skipped")
    tmp, port = tmp_path_factory.mktemp("lab"), _free_port()
    env = dict(os.environ, WORKBOOK_QUICK="1", JUPYTER_RUNTIME_DIR=str(tmp / "runtime"))
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={port}",
           "--ServerApp.ip=127.0.0.1", f"--ServerApp.token={TOKEN}", f"--ServerApp.root_dir={REPO}",
           f"--LabApp.user_settings_dir={_settings(tmp)}", f"--LabApp.workspaces_dir={tmp / 'workspaces'}"]
    log = open(tmp / "jupyterlab.log", "w")
    server = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(url, server, tmp / "jupyterlab.log")
        yield url
    finally:
        _stop(server)
        log.close()


def _wait_until_up(url: str, server: subprocess.Popen, log: Path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"JupyterLab exited early:\n{log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"JupyterLab did not answer within {seconds:.0f} s:\n{log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group (server and kernels), then SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture
def page(lab_url, request):
    """A fresh headless Chromium page, logged in to the lab; its last view is saved as a screenshot."""
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        try:
            pg = browser.new_page(viewport={"width": 1400, "height": 1000})
            # a workspace of its own, reset: no layout or file-browser folder left from another test
            pg.goto(f"{lab_url}/lab/workspaces/{request.node.name}?reset&token={TOKEN}")
            pg.wait_for_selector(".jp-DirListing-content", timeout=60_000)
            yield pg
            pg.screenshot(path=str(SHOTS / f"{request.node.name}.png"))
        finally:
            browser.close()
