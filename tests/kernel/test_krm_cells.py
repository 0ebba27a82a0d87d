"""KRM cells in the kernel (docs/protocol.md, "Kernel" and "Pipelines"): %%krm render, eval and
export, notebook functions as fn://NAME, step by step. A real kernel through jupyter_client."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernel.kernels import Kernel, descendants
from tests.support import pid_alive, wait_until

pytestmark = pytest.mark.usefixtures("fnkernel_spec")


PACKAGE_CELL = """%%krm render
apiVersion: kpt.dev/v1
kind: Kptfile
metadata: {name: shop}
pipeline:
  mutators:
  - image: set-namespace:v0.4.1
    configMap: {namespace: prod}
  - image: fn://stamp
---
apiVersion: v1
kind: ConfigMap
metadata: {name: cart, namespace: dev} # the cart settings
data: {size: "3"}
"""
STAMP = """%%function stamp --krm
def handler(resource_list):
    for item in resource_list["items"]:
        item["metadata"].setdefault("labels", {})["stamped"] = "yes"
    return resource_list
"""


def test_krm_render_cell_runs_builtin_and_notebook_functions_step_by_step(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel" and "Pipelines": %%krm render (the body is a package) and fn://NAME from %%function --krm.
    assert kernel.run(STAMP).ok
    cell = kernel.run(PACKAGE_CELL)
    assert cell.ok, cell.error
    text = cell.result
    lines = text.splitlines()
    assert lines[0] == "render shop: 2 step(s)"
    assert lines[1].startswith(
        "[1] mutator ghcr.io/kptdev/krm-functions-catalog/set-namespace:v0.4.1"
    )
    # The evaluator once, the step's outcome apart from it (docs/protocol.md, "Kernel").
    assert " · builtin · " in lines[1] and lines[1].endswith(" · ok (2 info)")
    assert lines[1].count("builtin") == 1
    assert any(line.startswith("[2] mutator fn://stamp · builtin · ") for line in lines)
    assert "    -metadata: {name: cart, namespace: dev} # the cart settings" in text
    assert "    +metadata: {name: cart, namespace: prod} # the cart settings" in text
    assert "ConfigMap  prod       cart" in text  # the output resources table
    html = cell.htmls()[-1]
    assert "<details" in html and "fn://stamp" in html


FILES_CELL = """%%krm render
apiVersion: kpt.dev/v1
kind: Kptfile
metadata: {name: shop}
pipeline:
  mutators:
  - image: set-namespace
    configPath: ns.yaml
---
# file: ns.yaml
apiVersion: v1
kind: ConfigMap
metadata: {name: ns, annotations: {config.kubernetes.io/local-config: "true"}}
data: {namespace: prod}
---
apiVersion: v1
kind: ConfigMap
metadata:
  name: db-settings
  annotations: {config.kubernetes.io/path: db/settings.yaml}
---
apiVersion: v1
kind: Service
metadata: {name: web}
"""


def test_a_krm_render_cell_names_files_and_shows_its_tree(kernel: Kernel) -> None:
    """docs/protocol.md, "Kernel": a document says its file by its path annotation or a
    `# file: NAME` line; the others go to resources.yaml; the result shows the file tree."""
    cell = kernel.run(FILES_CELL)
    assert cell.ok, cell.error  # configPath: ns.yaml is found
    text = cell.result
    tree = text.split("files:\n")[1].split("\n\n")[0].splitlines()
    assert tree == [
        "  Kptfile (changed)",
        "  db/",
        "    settings.yaml (changed)",
        "  ns.yaml",  # the function config, local config: left alone
        "  resources.yaml (changed)",
    ]
    assert "ConfigMap  prod       db-settings" in text
    assert "config.kubernetes.io/path" not in text  # it said where; it is not written
    outside = kernel.run(FILES_CELL.replace("# file: ns.yaml", "# file: ../ns.yaml"))
    assert outside.reply["content"]["ename"] == "UsageError"
    assert "document 2 names '../ns.yaml', outside the package" in outside.stderr


def test_krm_export_writes_the_notebook_function_for_kpt(kernel: Kernel, tmp_path: Path) -> None:
    """docs/krm.md, "A notebook function kpt can run": ``%krm export NAME -o PATH`` writes the
    function as one executable that needs no fnkernel (run here by a bare interpreter)."""
    assert kernel.run(STAMP).ok
    out = tmp_path / "stamp.pyz"
    cell = kernel.run(f"%krm export stamp -o {out}")
    assert cell.ok, cell.error
    assert cell.stdout.startswith(f"exported stamp to {out}: run it as `kpt fn eval --exec {out}`")
    rl = b"apiVersion: config.kubernetes.io/v1\nkind: ResourceList\nitems:\n- {apiVersion: v1, kind: ConfigMap, metadata: {name: c}}\n"
    done = subprocess.run([sys.executable, "-I", "-S", str(out)], input=rl, capture_output=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert b"labels: {stamped: yes}" in done.stdout
    missing = kernel.run(f"%krm export nothing -o {tmp_path / 'n.pyz'}")
    assert missing.reply["content"]["ename"] == "UsageError"


def test_krm_eval_cell_with_key_values(kernel: Kernel) -> None:
    cell = kernel.run(
        "%%krm eval set-annotations -- owner=data-team\n"
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: api}\nspec: {template: {spec: {}}}\n"
    )
    assert cell.ok, cell.error
    assert "+metadata: {name: api, annotations: {owner: data-team}}" in cell.result
    assert "Deployment" in cell.result.split("output resources:")[1]


def test_a_failing_krm_step_shows_its_results_and_raises_one_line(kernel: Kernel) -> None:
    cell = kernel.run(
        "%%krm render\napiVersion: kpt.dev/v1\nkind: Kptfile\nmetadata: {name: bad}\n"
        "pipeline:\n  validators:\n  - image: set-namespace\n    configMap: {}\n---\n"
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n"
    )
    assert cell.error is not None and cell.error["ename"] == "PipelineFailed"
    [line] = cell.error["traceback"]
    assert "`data.namespace` should not be empty" in line
    # No gateway is involved in a render: the line names no gateway status (docs/protocol.md,
    # "Kernel": the gateway's errors end with their gRPC code).
    assert line.startswith("PipelineFailed: ") and not line.endswith(")"), line
    shown = cell.texts("display_data")[-1]
    assert "[error] v1/ConfigMap/function-input: `data.namespace` should not be empty" in shown
    # Said once in the view (its result), then once as the cell's error line.
    assert shown.count("should not be empty") == 1


def test_a_krm_handler_that_returns_no_resource_list_fails_its_step_in_one_line(
    kernel: Kernel,
) -> None:
    # docs/krm.md, "A notebook function kpt can run": the handler returns a ResourceList; what
    # is none fails the step saying why, as any failing step is one line.
    assert kernel.run("%%function hello --krm\ndef handler(rl):\n    return {'hello': 1}\n").ok
    cell = kernel.run(
        "%%krm eval fn://hello\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n"
    )
    assert cell.error is not None and cell.error["ename"] == "PipelineFailed"
    assert cell.error["traceback"] == [
        "PipelineFailed: fn://hello must return a ResourceList (a JSON object with items): it "
        "has no items (its keys: hello)"
    ]


def test_a_krm_handler_that_raises_shows_its_traceback_in_cell_lines_under_its_step(
    kernel: Kernel,
) -> None:
    # README, "Errors": a handler's failure is its traceback with the cell's line numbers and
    # one line naming the exception and the cell line; in a pipeline, under its step.
    assert kernel.run(
        "%%function raiser --krm\ndef handler(rl):\n    x = rl['items'][0]\n"
        "    return x['spec']['replicas']\n"
    ).ok
    cell = kernel.run(
        "%%krm eval fn://raiser\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n"
    )
    assert cell.error is not None
    assert cell.error["traceback"] == [
        "PipelineFailed: fn://raiser: KeyError: 'spec' (raiser, cell line 4)"
    ]
    shown = cell.texts("display_data")[-1]
    assert "    stderr: Cell raiser, line 4, in handler" in shown, shown
    assert "    stderr: ---->  4     return x['spec']['replicas']" in shown


def test_a_starlark_steps_print_is_shown_under_its_step(kernel: Kernel) -> None:
    # docs/krm.md, "starlark": print() writes the function's stderr, which kpt records; the
    # view shows it under its step, in text and HTML — how a script is debugged in class.
    cell = kernel.run(
        "%%krm render\napiVersion: kpt.dev/v1\nkind: Kptfile\nmetadata: {name: debug}\n"
        "pipeline:\n  mutators:\n  - image: starlark\n    configMap:\n      source: |\n"
        "        print('items seen:', len(ctx.resource_list['items']))\n---\n"
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n"
    )
    assert cell.ok, cell.error
    shown = cell.result
    assert "    stderr: items seen: 2" in shown, shown
    assert "items seen: 2" in cell.htmls()[-1]


SPINS = (
    "%%krm render\napiVersion: kpt.dev/v1\nkind: Kptfile\nmetadata: {name: spins}\n"
    "pipeline:\n  mutators:\n  - image: starlark\n    configMap:\n      source: |\n"
    "        def spin():\n          n = 0\n          for i in range(100000):\n"
    "            for j in range(100000):\n              n += 1\n          return n\n"
    "        print(spin())\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n"
)


def test_an_interrupted_krm_render_is_one_line_and_leaves_no_process(kernel: Kernel) -> None:
    # README, "Interrupts" and "Errors": an interrupt during a step (a starlark script that
    # runs long) stops it and is one line, as an interrupted call is; nothing is written.
    kernel.run("1")
    before = descendants(kernel.pid)
    msg_id = kernel.send(SPINS)
    # The step runs: its script's process, a new one below the kernel.
    started = wait_until(
        lambda: {p for p in descendants(kernel.pid) - before if pid_alive(p)}, timeout=30
    )
    kernel.manager.interrupt_kernel()
    cell = kernel.collect(msg_id, timeout=30)
    assert cell.error is not None
    assert cell.error["traceback"] == [
        "KeyboardInterrupt: %krm render interrupted; no file was written"
    ]
    assert isinstance(started, set)
    wait_until(lambda: not any(pid_alive(pid) for pid in started), timeout=10)


def test_an_interrupted_fn_step_says_no_file_was_written_and_what_became_of_its_call(
    kernel: Kernel, tmp_path: Path
) -> None:
    # README, "Interrupts": interrupting a %krm render is one line saying no file was written;
    # an fn:// step's call, cancelled, says what became of its handler too.
    started = tmp_path / "started"
    assert kernel.run(
        "%%function slowkrm --krm\nimport pathlib, time\ndef handler(rl):\n"
        f"    pathlib.Path({str(started)!r}).touch()\n    time.sleep(60)\n    return rl\n"
    ).ok
    msg_id = kernel.send(
        "%%krm render\napiVersion: kpt.dev/v1\nkind: Kptfile\nmetadata: {name: slow}\n"
        "pipeline:\n  mutators:\n  - image: fn://slowkrm\n---\n"
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n"
    )
    wait_until(started.exists, timeout=30)
    kernel.manager.interrupt_kernel()
    cell = kernel.collect(msg_id, timeout=30)
    assert cell.error is not None
    assert cell.error["traceback"] == [
        "KeyboardInterrupt: %krm render interrupted; no file was written (invocation of slowkrm "
        "cancelled; the handler was killed and slowkrm stays registered)"
    ]


def test_a_cells_kptfile_that_cannot_be_read_is_named_as_the_cells(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel": a %%krm render cell is the package; a misspelt field of its
    # Kptfile is refused naming the cell, never the temporary directory it was written to.
    cell = kernel.run(
        "%%krm render\napiVersion: kpt.dev/v1\nkind: Kptfile\nmetadata: {name: p}\n"
        "pipeline:\n  mutators:\n  - image: set-labels\n    confgMap: {app: x}\n"
    )
    assert cell.reply["content"]["ename"] == "UsageError"
    assert "%%krm render: Kptfile in the cell can't be read." in cell.stderr
    assert "field confgMap not found" in cell.stderr and "fnkernel-krm-" not in cell.stderr


def test_krm_render_of_a_directory_names_the_files_changed_or_would_with_dry_run(
    kernel: Kernel, tmp_path: Path
) -> None:
    # docs/protocol.md, "Kernel": as the CLI does, the view ends with the files changed; with
    # --dry-run nothing is written and it says what would change.
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "Kptfile").write_text(
        "apiVersion: kpt.dev/v1\nkind: Kptfile\nmetadata: {name: pkg}\npipeline:\n"
        "  mutators:\n  - image: set-labels\n    configMap: {app: shop}\n"
    )
    resources = package / "cm.yaml"
    resources.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n")
    dry = kernel.run(f"%krm render {package} --dry-run")
    assert dry.ok, dry.error
    [said] = [line for line in dry.result.splitlines() if line.startswith("dry run")]
    assert said.startswith("dry run, nothing written; would change: ") and "cm.yaml" in said
    assert "app: shop" not in resources.read_text()
    done = kernel.run(f"%krm render {package}")
    assert done.ok, done.error
    assert "files changed: " in done.result and "cm.yaml" in done.result
    assert "app: shop" in resources.read_text()


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("%krm", "expected `render DIR`"),
        ("%krm render", "expected exactly one DIR"),
        ("%krm render a b", "expected exactly one DIR"),
        ("%krm render a --dryrun", "unknown option --dryrun; it takes --dry-run"),
        (
            "%%krm render\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n",
            "exactly one Kptfile",
        ),
        ("%%krm eval set-labels app=web\n{}\n", "put key=value pairs after --"),
        ("%krm render /no/such/dir", "is not a directory"),
        ("%%krm render\nthis: is: not yaml\n", "not YAML"),  # the cell's own text, named
        ("%%krm eval set-labels -- app=web\nthis: is: not yaml\n", "not YAML"),
    ],
)
def test_krm_usage_errors_are_one_line(kernel: Kernel, code: str, message: str) -> None:
    cell = kernel.run(code)
    assert cell.reply["content"]["ename"] == "UsageError"
    assert message in cell.stderr and "\n" not in cell.stderr.strip()


def test_krm_exec_steps_need_allow_exec_in_the_notebook_too(kernel: Kernel) -> None:
    # docs/protocol.md, "Pipelines": `exec` needs --allow-exec; in the kernel, kernel.krm.configure(allow_exec=True).
    cell = kernel.run(
        "%%krm render\napiVersion: kpt.dev/v1\nkind: Kptfile\nmetadata: {name: x}\n"
        "pipeline:\n  mutators:\n  - exec: /bin/cat\n---\n"
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n"
    )
    assert cell.error is not None and cell.error["ename"] == "PipelineFailed"
    assert "must run with `--allow-exec` option" in cell.error["traceback"][0]
    assert kernel.run("from fnkernel.kernel import krm; krm.configure(allow_exec=True)").ok
    cell = kernel.run(
        "%%krm render\napiVersion: kpt.dev/v1\nkind: Kptfile\nmetadata: {name: x}\n"
        "pipeline:\n  mutators:\n  - exec: /bin/cat\n---\n"
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n"
    )
    assert cell.ok, cell.error
    assert "[1] mutator exec: /bin/cat · exec · " in cell.result
    assert kernel.run("krm.configure()").ok  # back to the default for the other tests
