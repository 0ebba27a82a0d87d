"""What a user sees of fnkernel in JupyterLab (docs/protocol.md, "Kernel"): registration cells,
handler prints and errors, big results, tables, colours in both themes, the toolbar interrupt,
Run All on the bundled notebooks, the launcher's logo. Each test names the sentence it checks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from playwright.sync_api import Browser, Page

from tests_ui.conftest import FAILURES, ROOT, copy_notebook
from tests_ui.lab import ALIGNMENTS_JS, CONTRASTS_JS, WATERFALL_JS, Lab, NotebookPage

STDOUT = "application/vnd.jupyter.stdout"
STDERR = "application/vnd.jupyter.stderr"  # stderr streams and errors alike

CELLS = [
    # 0: a registration, 1: a call whose handler prints
    '%%function etl\ndef handler(event):\n    print("processing", len(event["rows"]), "rows")\n'
    '    return {"total": sum(event["rows"])}',
    'etl({"rows": [1, 2, 3]})',
    # 2-4: a handler that raises, and %fn_debug
    '%%function fails\ndef handler(event):\n    print("about to divide")\n    return event / 0',
    "fails(1)",
    "%fn_debug",
    # 5-6: a 300-item result
    "%%function many\ndef handler(event):\n"
    '    return [{"item": i, "name": f"item {i}"} for i in range(event)]',
    "%invoke many 300",
    # 7: the functions table; 8-10: the trace table
    "%functions",
    "%fn_trace on",
    'etl({"rows": [4]})',
    "%fn_trace show",
    # 11: a KRM render whose validator fails, shown with its results (no cell error)
    "from fnkernel.kernel import krm\n"
    'krm.render_package("""\n'
    "apiVersion: kpt.dev/v1\nkind: Kptfile\nmetadata: {name: shop}\npipeline:\n"
    "  mutators:\n  - image: set-labels\n    configMap: {app: shop}\n"
    "  validators:\n  - image: set-namespace\n    configMap: {}\n"
    "---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: cart}\n"
    '""")',
    # 12: a KRM eval that succeeds: its output resources table
    "%%krm eval set-labels -- team=shop\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}",
    # 13-15: a slow handler for the interrupt
    "%%function slow\nimport time\nfrom pathlib import Path\ndef handler(event):\n"
    '    Path(event["mark"]).touch()\n    time.sleep(event["s"])\n    return event["s"]',
    "slow({'s': 30, 'mark': MARK})",
    "slow({'s': 0, 'mark': MARK})",
    # 16-17: a function of two replicas, mapped over 40 items
    "%%function sq --replicas 2\nimport time\ndef handler(event):\n    time.sleep(0.05)\n"
    "    return event * event",
    "squares = sq.map(range(40))",
    # 18-19: a handler that prints, then waits for the file GO before it ends
    "%%function waits\nimport os, time\ndef handler(event):\n    print('started')\n"
    "    while not os.path.exists(event):\n        time.sleep(0.01)\n    print('finished')",
    "waits(GO)",
    # 20-21: a traced call (%fn_trace is on since cell 8) and its waterfall
    'etl({"rows": [5]})',
    "%fn_trace waterfall",
    # 22: a map of slow calls, interrupted; 23: another, cut off by a kernel restart
    "slow.map([{'s': 30, 'mark': MARK}] * 3)",
    "slow.map([{'s': 30, 'mark': MARK}] * 4)",
]
SHOWN = range(0, 13)  # the cells the display tests look at, run once in order


@pytest.fixture(scope="module")
def mark(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The file the slow handler touches once it runs (the notebook's MARK)."""
    return tmp_path_factory.mktemp("marks") / "started"


@pytest.fixture(scope="module")
def go(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The file the waiting handler waits for (the notebook's GO)."""
    return tmp_path_factory.mktemp("go") / "go"


@pytest.fixture(scope="module")
def notebook(lab: Lab, browser: Browser, mark: Path, go: Path) -> Iterator[NotebookPage]:
    name = lab.write_notebook("ui.ipynb", [f"MARK, GO = {str(mark)!r}, {str(go)!r}", *CELLS])
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    notebook = lab.open(page, name)
    try:
        notebook.run(0)
        for index in SHOWN:
            notebook.run(cell(index))
    except BaseException:
        FAILURES.mkdir(exist_ok=True)
        page.screenshot(path=str(FAILURES / "notebook-setup.png"), full_page=True)
        raise
    yield notebook
    context.close()


def cell(index: int) -> int:
    """The notebook's index of CELLS[index] (the first cell sets MARK and GO)."""
    return index + 1


def test_a_registration_cell_has_one_output_area(notebook: NotebookPage) -> None:
    # docs/protocol.md, "Kernel": the card updates in place while registering.
    assert notebook.output_children(cell(0)).count() == 1
    assert "state READY" in notebook.outputs(cell(0)).inner_text()


def test_a_handlers_prints_are_visible_in_its_cell(notebook: NotebookPage) -> None:
    # docs/protocol.md, "Kernel": a handler's stdout is the cell's stream output.
    assert notebook.text(cell(1), STDOUT).strip() == "processing 3 rows"
    assert "{'total': 6}" in notebook.outputs(cell(1)).inner_text()


def test_a_handler_error_shows_its_own_frames_and_the_line_naming_the_exception(
    notebook: NotebookPage,
) -> None:
    # docs/protocol.md, "Kernel": the handler's traceback as IPython shows a local error (its
    # frames, the cell's line numbers), then one line naming the exception and the cell line.
    error = notebook.text(cell(3), STDERR).strip()
    assert error.splitlines()[-1] == "ZeroDivisionError: division by zero (fails, cell line 4)"
    assert "Cell fails, line 4, in handler" in error and "---->" in error
    assert "fnkernel" not in error and "Traceback (most recent call last)" in error
    assert notebook.text(cell(3), STDOUT).strip() == "about to divide"


def test_fn_debug_shows_the_traceback_without_json_escapes(notebook: NotebookPage) -> None:
    # docs/protocol.md, "Kernel": %fn_debug renders the traceback as IPython does.
    text = notebook.outputs(cell(4)).inner_text()
    assert "Cell fails, line 4, in handler" in text
    assert "---->" in text
    assert '\\"' not in text and "\\n" not in text


def test_a_300_item_result_is_at_most_800_px_tall(notebook: NotebookPage) -> None:
    # docs/protocol.md, "Kernel": a big result scrolls.
    box = notebook.outputs(cell(6)).bounding_box()
    assert box is not None and box["height"] <= 800, box
    assert '"item": 299' in notebook.outputs(cell(6)).inner_text()  # all of it, scrolled


def test_every_table_aligns_its_headers_and_cells_alike(notebook: NotebookPage) -> None:
    # docs/protocol.md, "Kernel": %functions, %fn_trace show, KRM results and resources.
    for index in (cell(7), cell(10), cell(11), cell(12)):
        assert notebook.cell(index).locator("table").count() >= 1, index
    tables = notebook.page.evaluate(ALIGNMENTS_JS)
    assert tables
    for columns in tables:
        for alignments in columns:
            assert len(alignments) == 1, tables


def test_the_trace_table_lists_the_calls_the_cells_caused(notebook: NotebookPage) -> None:
    text = notebook.outputs(cell(10)).inner_text()
    assert "POST /v1/runs/etl:invoke" in text
    assert "404" not in text


def test_the_krm_failure_view_says_each_thing_once(notebook: NotebookPage) -> None:
    text = notebook.outputs(cell(11)).inner_text()
    assert text.count("should not be empty") == 1, text
    assert "no builtin" not in text  # set-labels and set-namespace are builtin here


def test_a_map_shows_one_bar_that_fills_in_place(notebook: NotebookPage) -> None:
    # docs/protocol.md, "Replicas": NAME.map shows a bar updated in place while it runs, and
    # says the end in a line (what a log keeps). Run before the theme test, which checks its
    # colours in both themes with every other output's.
    notebook.run(cell(16))
    notebook.run(cell(17))
    bars = notebook.cell(cell(17)).locator("progress")
    assert bars.count() == 1
    assert bars.get_attribute("value") == bars.get_attribute("max") == "40"
    text = notebook.outputs(cell(17)).inner_text()
    assert text.count("sq.map: 40/40 done") == 2  # the bar's label and the closing line


def test_a_long_calls_prints_appear_while_it_runs(notebook: NotebookPage, go: Path) -> None:
    # docs/protocol.md, "Live output": a handler's prints are in the cell as they are written,
    # each once. The handler waits for GO, which only a line seen in the running cell creates.
    # Run before the theme test, which reads every output in both themes.
    notebook.run(cell(18))
    notebook.start(cell(19))
    notebook.wait(lambda: "started" in notebook.text(cell(19), STDOUT), 15)
    assert not notebook.finished(cell(19))
    go.touch()
    notebook.wait(lambda: notebook.finished(cell(19)), 15)
    assert notebook.text(cell(19), STDOUT).split() == ["started", "finished"]


def test_the_waterfall_draws_every_hop_on_one_time_axis(notebook: NotebookPage) -> None:
    # docs/protocol.md, "Tracing": %fn_trace waterfall, a bar per span (the kernel's and every
    # hop's) on one time axis, each hop's attributes on hover. Run before the theme test, which
    # checks its colours in both themes.
    notebook.run(cell(20))
    notebook.run(cell(21))
    rows = notebook.cell(cell(21)).locator(".fnk-wf-row")
    assert rows.count() == 7
    assert "runtimed server: FunctionRuntime/InvokeFunction" in rows.nth(3).inner_text()
    assert "worker server: " in rows.nth(6).inner_text()
    assert "fnkernel.registration_id = reg_" in (rows.nth(3).get_attribute("title") or "")
    bars = notebook.page.evaluate(WATERFALL_JS)
    assert len(bars) == 7
    assert len({(round(b["axisLeft"]), round(b["axisRight"])) for b in bars}) == 1, bars
    for bar in bars:
        assert bar["axisLeft"] - 0.5 <= bar["left"] <= bar["right"] <= bar["axisRight"] + 2.5
    assert bars[0]["left"] <= min(b["left"] for b in bars) + 0.5  # the kernel's span is first


@pytest.mark.parametrize("theme", ["JupyterLab Light", "JupyterLab Dark"])
def test_coloured_text_reads_at_4_5_to_1_in_both_themes(
    lab: Lab, notebook: NotebookPage, theme: str
) -> None:
    # docs/protocol.md, "Kernel": WCAG AA for every text element fnkernel colours.
    page = notebook.page
    notebook.save()  # the outputs survive the reload that applies the theme
    lab.set_theme(theme)
    try:
        page.reload()
        notebook.wait_idle()
        light = page.evaluate("document.body.dataset.jpThemeLight")
        assert light == ("true" if theme.endswith("Light") else "false")
        page.wait_for_selector(".fnk .fnk-error", state="attached")
        contrasts = page.evaluate(CONTRASTS_JS)
        assert len(contrasts) >= 10
        low = [c for c in contrasts if c["ratio"] < 4.5]
        assert not low, low
        bars = page.evaluate(WATERFALL_JS)  # the waterfall's bars: 3:1 against their axis
        assert bars and all(bar["ratio"] >= 3 for bar in bars), bars
    finally:
        lab.set_theme("JupyterLab Light")


def test_the_toolbar_interrupt_ends_a_30_s_call(notebook: NotebookPage, mark: Path) -> None:
    # docs/protocol.md, "Kernel": an interrupt cancels the call in flight; the function stays.
    page = notebook.page
    notebook.run(cell(13))
    mark.unlink(missing_ok=True)
    notebook.start(cell(14))
    notebook.wait(mark.exists, 30)  # the handler is running
    page.locator(".jp-NotebookPanel-toolbar [data-command='notebook:interrupt-kernel']").click()
    notebook.wait(lambda: notebook.finished(cell(14)), 10)  # the call's 30 s, had it run on
    assert "KeyboardInterrupt" in notebook.text(cell(14), STDERR)
    notebook.run(cell(15))
    assert notebook.outputs(cell(15)).inner_text().strip().endswith("0")


# The computed left edge of the cell's map bar, and what the busy and muted edges compute to.
BAR_EDGES_JS = """
(cell) => {
  const card = [...cell.querySelectorAll('.fnk-card')].find(c => c.querySelector('progress'));
  const probe = document.createElement('div');
  card.parentElement.appendChild(probe);
  const edge = (name) => { probe.className = 'fnk-card ' + name;
                           return getComputedStyle(probe).borderLeftColor; };
  const found = {bar: getComputedStyle(card).borderLeftColor,
                 busy: edge('fnk-edge-busy'), muted: edge('fnk-edge-muted')};
  probe.remove();
  return found;
}
"""


def _ends_grey(notebook: NotebookPage, index: int) -> None:
    """The map bar of cell `index` says "cancelled" and its edge is grey, not the running
    orange."""
    notebook.wait(lambda: "cancelled" in notebook.outputs(index).inner_text(), 20)
    edges = notebook.cell(index).evaluate(BAR_EDGES_JS)
    assert edges["bar"] == edges["muted"] != edges["busy"], edges


def _mid_map(notebook: NotebookPage, index: int, mark: Path, command: str) -> None:
    """Start cell `index`'s map of slow calls, and once one runs, click the toolbar's
    `command`."""
    mark.unlink(missing_ok=True)
    notebook.start(index)
    notebook.wait(mark.exists, 30)
    notebook.page.locator(f".jp-NotebookPanel-toolbar [data-command='{command}']").click()


def test_an_interrupted_map_ends_its_bar_grey(notebook: NotebookPage, mark: Path) -> None:
    # docs/protocol.md, "Kernel": a map's bar ends grey "cancelled" after an interrupt, never
    # left orange "running"; its one line says so once.
    _mid_map(notebook, cell(22), mark, "notebook:interrupt-kernel")
    notebook.wait(lambda: notebook.finished(cell(22)), 10)
    _ends_grey(notebook, cell(22))
    assert notebook.text(cell(22), STDOUT).count("slow.map: 0/3 cancelled") == 1


def test_a_restart_mid_map_ends_its_bar_grey(notebook: NotebookPage, mark: Path) -> None:
    # docs/protocol.md, "Kernel": the kernel's shutdown mid-map (a restart) ends the bar as
    # cancelled too, though JupyterLab drops what the restarting kernel sends last: the bar
    # expires grey. Last of the tests on this notebook: its kernel is a new one after it.
    _mid_map(notebook, cell(23), mark, "notebook:restart-kernel")
    notebook.page.locator(".jp-Dialog .jp-mod-accept").click()
    _ends_grey(notebook, cell(23))


@pytest.mark.parametrize(
    "source", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda path: path.name
)
def test_run_all_on_a_bundled_notebook_shows_no_error(lab: Lab, page: Page, source: Path) -> None:
    name = copy_notebook(lab, source)
    notebook = lab.open(page, name)
    notebook.run_all()
    notebook.save()  # what Run All produced, as the notebook file records it
    saved = nbformat.read(lab.root / name, as_version=4)
    ran = [cell for cell in saved.cells if cell.cell_type == "code"]
    assert ran and all(cell.execution_count for cell in ran)
    errors = [o for cell in ran for o in cell.outputs if o.output_type == "error"]
    assert not errors, [f"{o.ename}: {o.evalue}" for o in errors]


def test_the_launcher_tile_shows_our_logo(lab: Lab, page: Page) -> None:
    page.goto(f"{lab.url}/lab?reset&token={lab.token}")
    tile = page.locator(".jp-LauncherCard[title='Python 3 (fnkernel)']").first
    logo = tile.locator("img")
    assert logo.get_attribute("src", timeout=60_000).endswith("/kernelspecs/fnkernel/logo-svg.svg")
    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=logo.element_handle())
