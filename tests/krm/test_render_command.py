"""``fnkernel render``, ``fnkernel eval`` and ``fnkernel bench`` as a user runs them (README, "CLI";
docs/krm.md): their exit codes, the progress line a step, the report of a failed render, its
JSON form, and the evaluator chain the flags assemble."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.krm.packages import app_package, fnkernel_render, kptfile, snapshot, write


@pytest.fixture
def package(tmp_path: Path) -> Path:
    return app_package(tmp_path / "app")


def test_fnkernel_render_prints_a_line_per_step_and_eval_takes_key_values(package: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "render", str(package)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith(
        "[1] db/: mutator ghcr.io/kptdev/krm-functions-catalog/set-annotations (builtin)"
    )
    # set-annotations reports each place it annotated: the Kptfiles, the Deployment and its pod
    # template, the Service and the ConfigMap. The subpackage's resources reach the top
    # package's function with their own package's paths (docs/krm.md, "Where resources are
    # written"), so the two Kptfiles are one file and one result, as kpt reports them.
    assert lines[3].startswith("[4] validator") and lines[3].endswith("ok (5 info)")
    assert "files changed: Kptfile, db/Kptfile, db/configmap.yaml, deploy.yaml" in done.stdout
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fnkernel.runtime_server.cli",
            "eval",
            "set-annotations",
            str(package),
            "--",
            "owner=ops",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "owner: ops" in (package / "deploy.yaml").read_text()
    missing = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "render", str(package / "nope")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "is not a directory" in missing.stderr


def test_fnkernel_bench_refuses_an_unknown_benchmark() -> None:
    # docs/protocol.md, "CLI": `bench` is a subcommand; usage errors exit 2 and name the choices.
    done = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "bench", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "choose from invoke, gateway, throughput, map, kernel, krm" in done.stderr


def test_a_dry_run_names_the_files_it_would_change_and_writes_none(package: Path) -> None:
    # README, "CLI": `fnkernel render --dry-run` runs the pipeline and writes no file; it says
    # what would change, as the render itself says what did.
    before = snapshot(package)
    said = fnkernel_render(package, "--dry-run")
    assert said.returncode == 0, said.stderr
    assert "; dry run, nothing written; would change: " in said.stdout
    assert "deploy.yaml" in said.stdout.rpartition("would change: ")[2]
    as_json = json.loads(fnkernel_render(package, "--dry-run", "--output", "json").stdout)
    assert as_json["dryRun"] is True and "deploy.yaml" in as_json["written"]
    assert snapshot(package) == before
    done = fnkernel_render(package)
    assert "files changed: " in done.stdout and "deploy.yaml" in done.stdout


def test_a_steps_stderr_is_in_its_progress_line_and_the_json(tmp_path: Path) -> None:
    # docs/krm.md, "starlark": print() writes the function's stderr (kpt records it); the
    # render's progress shows it under its step, and --output json carries it.
    package = write(tmp_path / "pkg", {
        "Kptfile": "apiVersion: kpt.dev/v1\nkind: Kptfile\nmetadata: {name: p}\npipeline:\n"
        "  mutators:\n  - image: starlark\n    configMap:\n      source: print('hello class')\n",
        "cm.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n",
    })  # fmt: skip
    said = fnkernel_render(package, "--dry-run")
    assert said.returncode == 0, said.stderr
    assert "\n    stderr: hello class" in said.stderr
    as_json = json.loads(fnkernel_render(package, "--dry-run", "--output", "json").stdout)
    assert as_json["steps"][0]["stderr"].strip() == "hello class"


def test_what_a_script_printed_is_kept_when_its_memory_bound_stops_it(tmp_path: Path) -> None:
    # docs/krm.md, "starlark" and "Limits": print() output is the step's stderr also when the
    # script is stopped at its memory bound — the prints before are how a student finds where.
    package = write(tmp_path / "pkg", {
        "Kptfile": "apiVersion: kpt.dev/v1\nkind: Kptfile\nmetadata: {name: p}\npipeline:\n"
        "  mutators:\n  - image: starlark\n    configMap:\n      source: |\n"
        "        print('before the big list')\n        x = [i for i in range(50000000)]\n",
        "cm.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n",
    })  # fmt: skip
    stopped = fnkernel_render(package, "--memory", "128")
    assert stopped.returncode == 1
    assert "\n    stderr: before the big list\n" in stopped.stderr
    assert "the script needed more than the step's memory bound of 128 MiB" in stopped.stderr


@pytest.mark.parametrize(
    ("image", "says"),
    [
        ("set-label", "set-label is not a builtin function (did you mean set-labels?)"),
        ("kubeconfrm:v0.1", "(did you mean kubeconform?)"),
        ("fn://stmap", "fn://NAME is a notebook's `%%function NAME --krm` cell, run first"),
    ],
)
def test_a_mistyped_function_says_what_it_likely_meant(
    tmp_path: Path, image: str, says: str
) -> None:
    # docs/krm.md, "Builtin functions": a name near a builtin's is a typo more often than an
    # image to pull; the chain's not-found message says which (it goes on to exec and pod).
    package = write(tmp_path / "pkg", {
        "Kptfile": "apiVersion: kpt.dev/v1\nkind: Kptfile\nmetadata: {name: p}\npipeline:\n"
        f"  mutators:\n  - image: {image}\n",
        "cm.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n",
    })  # fmt: skip
    failed = fnkernel_render(package)
    assert failed.returncode == 1 and says in failed.stderr, failed.stderr


def test_a_failed_render_reports_its_results_as_kpt_prints_them_and_in_json(
    tmp_path: Path,
) -> None:
    # docs/krm.md, "Results": a failed step's results print as kpt prints them, `[severity]
    # apiVersion/kind/namespace/name field: message`; --output json is the report of a failed
    # render too (its steps, their results, and the failure), for a script to read.
    files = {
        "Kptfile": "apiVersion: kpt.dev/v1\nkind: Kptfile\nmetadata: {name: p}\npipeline:\n"
        "  validators:\n  - image: set-namespace\n    configMap: {}\n",
        "cm.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n",
    }
    # Each render on a package of its own: a failed one writes its Kptfile's status, as kpt
    # does, which drops the empty configMap (omitempty).
    package = write(tmp_path / "pkg", files)
    failed = fnkernel_render(package)
    assert failed.returncode == 1
    assert "FAILED (1 error)\n" in failed.stderr
    assert "\n    [error] v1/ConfigMap/function-input: `data.namespace` should not be empty" in (
        failed.stderr
    )
    report = json.loads(
        fnkernel_render(write(tmp_path / "again", files), "--output", "json").stdout
    )
    [step] = report["steps"]
    assert step["results"][0]["message"] == "`data.namespace` should not be empty"
    assert "should not be empty" in report["error"] and report["written"] == []


def test_fnkernel_render_runs_builtin_then_exec_then_pod_as_configured(
    package: Path, tmp_path: Path
) -> None:
    # docs/architecture.md, "The KRM chain": fnkernel render's chain is builtin → exec (cached
    # binaries, with --functions) → pod (with --image-catalog), assembled in krm/chain.py.
    functions = write(
        tmp_path / "functions",
        {"stamp.sh": "#!/bin/sh\nsed 's/^kind: ResourceList/kind: ResourceList/'\n"},
    )
    store = tmp_path / "functions.yaml"
    store.write_text("- image: example.com/fn/stamp\n  path: stamp.sh\n")
    (package / "Kptfile").write_text(
        kptfile(
            "app",
            mutators="- image: example.com/fn/stamp:v1\n- image: set-labels\n  configMap: {a: b}\n",
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "render", str(package),
         "--functions", str(functions), "--function-config", str(store)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert any("example.com/fn/stamp:v1 (exec)" in line for line in lines), lines
    assert any("set-labels (builtin)" in line for line in lines), lines
    without = fnkernel_render(package)  # no --functions: nothing serves the image
    assert without.returncode == 1 and "not found" in without.stderr


def test_a_chain_flag_that_needs_another_is_a_usage_error(package: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "render", str(package),
         "--function-config", "x.yaml"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--function-config needs --functions" in done.stderr
