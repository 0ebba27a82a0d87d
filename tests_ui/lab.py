"""Driving JupyterLab as a user does: open a notebook on the fnkernel kernel, run a cell or all of
them, read what the output areas show (text, sizes, computed styles)."""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat
from playwright.sync_api import Locator, Page

CELL_SECONDS = 90  # a cell that registers starts the embedded runtime first


@dataclass(frozen=True)
class Lab:
    url: str
    token: str
    root: Path

    def write_notebook(self, name: str, cells: list[str]) -> str:
        """A notebook on the fnkernel kernel in the server's root; returns its name."""
        notebook = nbformat.v4.new_notebook(
            cells=[nbformat.v4.new_code_cell(source) for source in cells],
            metadata={
                "kernelspec": {
                    "name": "fnkernel",
                    "display_name": "Python 3 (fnkernel)",
                    "language": "python",
                }
            },
        )
        nbformat.write(notebook, self.root / name)
        return name

    def set_theme(self, theme: str) -> None:
        """JupyterLab's theme setting ("JupyterLab Light" or "JupyterLab Dark"), as the
        Settings menu writes it; it applies at the next page load."""
        body = json.dumps({"raw": json.dumps({"theme": theme})}).encode()
        request = urllib.request.Request(
            f"{self.url}/lab/api/settings/@jupyterlab/apputils-extension:themes",
            data=body,
            method="PUT",
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10):
            pass

    def open(self, page: Page, name: str) -> NotebookPage:
        """`name` alone in a fresh workspace (``reset``: no tabs restored from another test)."""
        page.goto(f"{self.url}/lab/tree/{name}?reset&token={self.token}")
        notebook = NotebookPage(page)
        notebook.wait_idle()
        return notebook


class NotebookPage:
    def __init__(self, page: Page) -> None:
        self.page = page

    @property
    def cells(self) -> Locator:
        return self.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell")

    def cell(self, index: int) -> Locator:
        return self.cells.nth(index)

    def wait_idle(self, timeout: float = 60) -> None:
        """The notebook is shown and its kernel is idle."""
        panel = ".jp-NotebookPanel:not(.lm-mod-hidden)"
        self.page.wait_for_selector(f"{panel} .jp-Notebook .jp-Cell", timeout=timeout * 1000)
        self.page.wait_for_selector(
            f"{panel} .jp-Notebook-ExecutionIndicator[data-status='idle']",
            timeout=timeout * 1000,
        )

    def prompt(self, index: int) -> str:
        return self.cell(index).locator(".jp-InputPrompt").inner_text().strip()

    def start(self, index: int) -> None:
        """Run cell `index` (click it, Shift+Enter, as a user does) without waiting for it."""
        self.wait(lambda: self.prompt(index).startswith("["), 10)
        before = self.prompt(index)
        # Right after a page load JupyterLab may not act on the first key press yet; a press it
        # did not act on left the prompt as it was, so pressing again cannot run a cell twice.
        for _ in range(6):
            self.cell(index).locator(".jp-InputPrompt").click()
            self.page.keyboard.press("Shift+Enter")
            try:
                self.wait(lambda: "*" in self.prompt(index) or self.finished(index, before), 5)
                return
            except AssertionError:
                continue
        raise AssertionError(f"cell {index} did not start")

    def finished(self, index: int, before: str = "") -> bool:
        """Cell `index` has run (its prompt has a number, another than `before`)."""
        prompt = self.prompt(index)
        return prompt != before and "*" not in prompt and any(ch.isdigit() for ch in prompt)

    def run(self, index: int, timeout: float = CELL_SECONDS) -> Locator:
        """Run cell `index` and wait for it to finish; returns its output area."""
        before = self.prompt(index)
        self.start(index)
        self.wait(lambda: self.finished(index, before), timeout)
        return self.outputs(index)

    def run_all(self, timeout: float = 240) -> None:
        """Run → Run All Cells, and wait until every cell has run."""
        code = [
            i
            for i in range(self.cells.count())
            if "jp-CodeCell" in (self.cell(i).get_attribute("class") or "")
        ]
        for _ in range(6):  # as in start(): a command JupyterLab did not act on is repeated
            self.page.get_by_role("menuitem", name="Run", exact=True).click()
            self.page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
            try:
                self.wait(lambda: any("*" in self.prompt(i) or self.finished(i) for i in code), 5)
                break
            except AssertionError:
                continue
        self.wait(lambda: all(self.finished(i) for i in code), timeout)

    def save(self) -> None:
        """Ctrl+S, and wait until the file on disk has what the page shows."""
        self.page.keyboard.press("Control+s")
        self.page.wait_for_selector(
            ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook", timeout=10_000
        )
        self.wait(
            lambda: not self.page.locator(".lm-TabBar-tab.jp-mod-current.jp-mod-dirty").count(),
            10,
        )

    def outputs(self, index: int) -> Locator:
        return self.cell(index).locator(".jp-OutputArea").first

    def output_children(self, index: int) -> Locator:
        return self.cell(index).locator(".jp-OutputArea-child")

    def text(self, index: int, mime: str) -> str:
        """What the cell's outputs of `mime` show, e.g. application/vnd.jupyter.stderr (errors
        and stderr), application/vnd.jupyter.stdout, text/html."""
        found = self.cell(index).locator(f".jp-OutputArea-output[data-mime-type='{mime}']")
        return "\n".join(found.nth(i).inner_text() for i in range(found.count()))

    def wait(self, condition: Any, timeout: float) -> None:
        """Poll `condition` (through the page's own timer) until it holds; fail after `timeout` s."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {timeout}s")
            self.page.wait_for_timeout(50)


# The contrast of every text element fnkernel colours (WCAG 2.x: relative luminance, alpha
# blended over the first opaque background behind the element).
CONTRASTS_JS = """
() => {
  const parse = (c) => {
    const m = c.match(/rgba?\\(([^)]+)\\)/);
    if (!m) return null;
    const p = m[1].split(/[ ,/]+/).filter(Boolean).map(Number);
    return {r: p[0], g: p[1], b: p[2], a: p.length > 3 ? p[3] : 1};
  };
  const over = (top, bottom) => ({
    r: top.r * top.a + bottom.r * (1 - top.a),
    g: top.g * top.a + bottom.g * (1 - top.a),
    b: top.b * top.a + bottom.b * (1 - top.a), a: 1});
  const background = (el) => {
    const layers = [];
    for (let e = el; e; e = e.parentElement) {
      const c = parse(getComputedStyle(e).backgroundColor);
      if (c && c.a > 0) { layers.push(c); if (c.a >= 1) break; }
    }
    let colour = {r: 255, g: 255, b: 255, a: 1};
    for (const layer of layers.reverse()) colour = over(layer, colour);
    return colour;
  };
  const luminance = (c) => {
    const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); };
    return 0.2126 * f(c.r) + 0.7152 * f(c.g) + 0.0722 * f(c.b);
  };
  const coloured = document.querySelectorAll(
    ".fnk [class*='fnk-error'], .fnk [class*='fnk-ok'], .fnk [class*='fnk-warn'], " +
    ".fnk [class*='fnk-info'], .fnk [class*='fnk-pod'], .fnk .fnk-muted, .fnk [style*='color']");
  return [...coloured].filter(el => el.innerText.trim()).map(el => {
    const bg = background(el);
    const fg = over(parse(getComputedStyle(el).color), bg);
    const [hi, lo] = [luminance(fg), luminance(bg)].sort((a, b) => b - a);
    return {text: el.innerText.trim().slice(0, 40), cls: el.className,
            colour: getComputedStyle(el).color, ratio: (hi + 0.05) / (lo + 0.05)};
  });
}
"""

# For each bar of a %fn_trace waterfall: where its time axis starts and ends on the page, where
# the bar is, and the contrast of the bar's colour against the axis behind it (WCAG 1.4.11 asks
# 3:1 of a graphical object).
WATERFALL_JS = """
() => {
  const parse = (c) => c.match(/rgba?\\(([^)]+)\\)/)[1].split(/[ ,/]+/).filter(Boolean).map(Number);
  const luminance = (p) => {
    const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); };
    return 0.2126 * f(p[0]) + 0.7152 * f(p[1]) + 0.0722 * f(p[2]);
  };
  return [...document.querySelectorAll('.fnk .fnk-wf-bar')].map(bar => {
    const axis = bar.parentElement, a = axis.getBoundingClientRect(), b = bar.getBoundingClientRect();
    const [hi, lo] = [luminance(parse(getComputedStyle(bar).backgroundColor)),
                      luminance(parse(getComputedStyle(axis).backgroundColor))].sort((x, y) => y - x);
    return {axisLeft: a.left, axisRight: a.right, left: b.left, right: b.right,
            ratio: (hi + 0.05) / (lo + 0.05)};
  });
}
"""

# For each table in the outputs: per column, the set of text-align values of its header and cells.
ALIGNMENTS_JS = """
() => [...document.querySelectorAll('.jp-OutputArea table')].map(table => {
  const columns = {};
  for (const row of table.rows) {
    [...row.cells].forEach((cell, i) => {
      (columns[i] = columns[i] || new Set()).add(getComputedStyle(cell).textAlign);
    });
  }
  return Object.values(columns).map(set => [...set]);
})
"""
