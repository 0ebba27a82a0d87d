"""The notebook as users see it (docs/architecture.md, "Testing in a browser"): a real JupyterLab
on 127.0.0.1 with a token, Debian's Chromium driven by Playwright, the fnkernel kernelspec
installed into a private Jupyter path. Assertions are on the DOM and computed styles, never on
pixels; a failing test leaves a screenshot in ui-failures/."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, Playwright, sync_playwright

from tests_ui.lab import Lab

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("FNKERNEL_CHROMIUM", "/usr/bin/chromium")
# Chromium as root in a closed network: no sandbox, no GPU, no calls home.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
FAILURES = ROOT / "ui-failures"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """JupyterLab serving a fresh directory, with the fnkernel kernelspec and no news popups."""
    base = tmp_path_factory.mktemp("lab")
    prefix, root, settings = base / "prefix", base / "root", base / "settings"
    root.mkdir()
    subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "install", "--prefix", str(prefix)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    # The user's settings: no announcements, no update checks (the machine has no network).
    notification = (
        settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    )
    notification.parent.mkdir(parents=True)
    notification.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    # Every cell in the DOM (JupyterLab 4 renders only the cells in view by default).
    tracker = settings / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text(json.dumps({"windowingMode": "none"}))
    token = secrets.token_hex(16)
    port = _free_port()
    env = {
        **os.environ,
        "JUPYTER_PATH": str(prefix / "share" / "jupyter"),
        "JUPYTERLAB_SETTINGS_DIR": str(settings),
        "JUPYTERLAB_WORKSPACES_DIR": str(base / "workspaces"),
        "JUPYTER_CONFIG_DIR": str(base / "config"),
        "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
    }
    log = (base / "lab.log").open("w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            "--ServerApp.allow_root=True",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2):
                break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"JupyterLab did not start; see {log.name}") from None
            time.sleep(0.1)
    try:
        yield Lab(url, token, root)
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


@pytest.fixture(scope="session")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as driver:
        yield driver


@pytest.fixture(scope="session")
def browser(playwright: Playwright) -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"no Chromium at {CHROMIUM}: apt-get install -y chromium (or FNKERNEL_CHROMIUM)"
        )
    browser = playwright.chromium.launch(
        executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
    )
    yield browser
    browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    yield context.new_page()
    context.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """A failed test leaves a screenshot of its page in ui-failures/."""
    report = yield
    if report.when == "call" and report.failed:
        for name in ("page", "notebook"):
            shown = getattr(item, "funcargs", {}).get(name)
            shown = getattr(shown, "page", shown)
            if isinstance(shown, Page):
                FAILURES.mkdir(exist_ok=True)
                shown.screenshot(path=str(FAILURES / f"{item.name}.png"), full_page=True)
    return report


def copy_notebook(lab: Lab, source: Path) -> str:
    shutil.copy(source, lab.root / source.name)
    return source.name
