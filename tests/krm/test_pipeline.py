"""Pipelines with kpt's semantics (docs/protocol.md, "Pipelines"): real packages on disk, the
builtin evaluator, real executables for `exec` steps, and what a render writes (the commands
themselves: test_render_command.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fnkernel.runtime_server.krm.evaluators.builtin import BuiltinEvaluator
from fnkernel.runtime_server.krm.pipeline import PipelineError, Step, qualified, render
from fnkernel.runtime_server.krm.resources.resourcelist import load
from tests.krm.packages import DB, app_package, fnkernel_render, kptfile, snapshot, write
from tests.support import but_kptfile


@pytest.fixture
def package(tmp_path: Path) -> Path:
    return app_package(tmp_path / "app")


def test_render_runs_subpackages_first_then_mutators_in_order_then_validators(
    package: Path,
) -> None:
    outcome = render(package, BuiltinEvaluator())
    assert [(s.package, s.stage, s.function) for s in outcome.steps] == [
        ("db/", "mutator", qualified("set-annotations")),
        ("", "mutator", qualified("set-namespace:v0.4.1")),
        ("", "mutator", "gcr.io/kpt-fn/set-labels:v0.2"),
        ("", "validator", qualified("set-annotations")),
    ]
    assert all(step.evaluator == "builtin" for step in outcome.steps)
    db = load((package / "db/configmap.yaml").read_text())
    # the parent's mutators also ran over the subpackage's resources, after its own pipeline
    assert db["metadata"]["namespace"] == "prod"
    assert db["metadata"]["annotations"]["team"] == "data"
    assert db["metadata"]["labels"]["app"] == "web"
    # a validator's output is discarded
    assert "validated" not in (package / "deploy.yaml").read_text()
    # kpt gives each package's Kptfile to its functions and records the render in the top one
    # (docs/krm.md, "The Kptfile")
    assert sorted(outcome.written) == ["Kptfile", "db/Kptfile", "db/configmap.yaml", "deploy.yaml"]
    top = load((package / "Kptfile").read_text())
    assert dict(top["status"]["conditions"][0]) == {
        "type": "Rendered",
        "status": "True",
        "reason": "RenderSuccess",
    }
    status = top["status"]["renderStatus"]
    # kpt records an image with neither tag nor digest as it runs it: `:latest`
    assert [s["image"] for s in status["mutationSteps"]] == [
        qualified("set-annotations:latest"),
        qualified("set-namespace:v0.4.1"),
        "gcr.io/kpt-fn/set-labels:v0.2",
    ]
    assert [s["exitCode"] for s in status["validationSteps"]] == [0]
    assert load((package / "db/Kptfile").read_text())["metadata"]["labels"]["app"] == "web"


def test_render_keeps_comments_key_order_and_layout(package: Path) -> None:
    render(package, BuiltinEvaluator())
    text = (package / "deploy.yaml").read_text()
    assert text.startswith("# The web tier: two replicas\napiVersion: apps/v1\nkind: Deployment\n")
    assert "  name: web # keep this name\n  namespace: prod\n" in text
    assert "  replicas: 2           # aligned comment\n" in text
    assert "metadata: {name: web, namespace: prod, labels: {app: web}}" in text
    assert text.count("\n---\n") == 1
    assert "internal.config.kubernetes.io" not in text and "fnkernel.dev" not in text
    assert (
        "  url: postgres://db # where the data lives\n"
        in (package / "db/configmap.yaml").read_text()
    )


def test_a_second_render_changes_nothing_but_the_status(package: Path) -> None:
    """The resources are a fixed point; the Kptfile's status records the second render (whose
    results say that nothing changed), as kpt's does."""
    render(package, BuiltinEvaluator())
    once = snapshot(package)
    outcome = render(package, BuiltinEvaluator())
    assert outcome.written == ["Kptfile"]
    again = snapshot(package)
    assert but_kptfile(again) == but_kptfile(once)
    assert all(step.diff == "" for step in outcome.steps)
    status = load(again["Kptfile"])["status"]["renderStatus"]["mutationSteps"][1]
    assert (
        status["results"][0]["message"]
        == 'all matching namespaces are already "prod". no value changed'
    )
    render(package, BuiltinEvaluator())
    assert snapshot(package) == again


def test_each_step_records_its_diff(package: Path) -> None:
    before = snapshot(package)
    outcome = render(package, BuiltinEvaluator(), dry_run=True)
    namespace_step = outcome.steps[1]
    assert "-  namespace: dev\n+  namespace: prod\n" in namespace_step.diff
    assert "--- a/deploy.yaml" in namespace_step.diff
    # A dry run writes nothing, and names what it would write (README, "CLI").
    assert snapshot(package) == before
    assert "deploy.yaml" in outcome.written


def test_a_failing_step_writes_nothing_but_the_kptfile_status(
    package: Path, tmp_path: Path
) -> None:
    """docs/krm.md, "Failures": a failed render changes no resource; the top Kptfile records
    the failure (condition False, the failed step's results and stderr), as kpt's does."""
    kpt = package / "Kptfile"
    kpt.write_text(
        kpt.read_text()
        .replace("configMap: {app: web}", "configMap: {}")
        .replace("gcr.io/kpt-fn/set-labels:v0.2", "set-namespace")
    )
    before = snapshot(package)
    with pytest.raises(PipelineError) as caught:
        render(package, BuiltinEvaluator(), results_dir=tmp_path / "results")
    after = snapshot(package)
    assert but_kptfile(after) == but_kptfile(before)
    status = load(after["Kptfile"])["status"]
    condition = status["conditions"][0]
    assert (condition["status"], condition["reason"]) == ("False", "RenderFailed")
    assert condition["message"] == "pkg.render: pkg .:\n\tpipeline.run: already handled error"
    failed_step = status["renderStatus"]["mutationSteps"][-1]
    assert failed_step["exitCode"] == 1
    assert failed_step["errorResults"][0]["message"] == "`data.namespace` should not be empty"
    assert (
        status["renderStatus"]["errorSummary"]
        == f"{qualified('set-namespace:latest')}: exit code 1"
    )
    failed = caught.value.steps[-1]
    assert not failed.ok and failed.results[-1]["severity"] == "error"
    results = load((tmp_path / "results" / "results.yaml").read_text())
    assert results["kind"] == "FunctionResultList" and results["apiVersion"] == "kpt.dev/v1"
    assert results["exitCode"] == 1
    assert results["items"][-1]["exitCode"] == 1


def test_save_on_render_failure_keeps_what_succeeded(package: Path) -> None:
    """docs/krm.md, "Failures": with kpt.dev/save-on-render-failure, the steps before the
    failure are written; the failure is still reported."""
    kpt = package / "Kptfile"
    kpt.write_text(
        kpt.read_text()
        .replace(
            "  name: app\n",
            "  name: app\n  annotations:\n    kpt.dev/save-on-render-failure: 'true'\n",
        )
        .replace("configMap: {app: web}", "configMap: {}")
        .replace("gcr.io/kpt-fn/set-labels:v0.2", "set-namespace")
    )
    with pytest.raises(PipelineError):
        render(package, BuiltinEvaluator())
    deploy = load_all(package / "deploy.yaml")[0]
    assert deploy["metadata"]["namespace"] == "prod"  # the first mutator's work is kept
    assert load_all(package / "db/configmap.yaml")[0]["metadata"]["annotations"]["team"] == "data"
    assert load(kpt.read_text())["status"]["conditions"][0]["status"] == "False"


def test_exec_steps_need_allow_exec_and_get_a_function_input_configmap(
    package: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/krm.md, "exec steps": refused without --allow-exec (recorded in the status as an
    execution error); the path is the current directory's, as in kpt."""
    capture = tmp_path / "seen.yaml"
    write(package, {"capture.sh": f"#!/bin/sh\ntee {capture}\n"})
    monkeypatch.chdir(package)
    kpt = package / "Kptfile"
    kpt.write_text(
        kptfile(
            "app",
            mutators="""\
            - exec: ./capture.sh
              configMap: {greeting: hello}
            """,
        )
    )
    before = snapshot(package)
    with pytest.raises(PipelineError, match="must run with `--allow-exec` option"):
        render(package, BuiltinEvaluator())
    assert not capture.exists()
    after = snapshot(package)
    assert but_kptfile(after) == but_kptfile(before)
    step = load(after["Kptfile"])["status"]["renderStatus"]["mutationSteps"][-1]
    assert dict(step) == {
        "exec": "./capture.sh",
        "executionError": "must run with `--allow-exec` option to allow running function binaries",
        "exitCode": 1,
    }
    outcome = render(package, BuiltinEvaluator(), allow_exec=True)
    assert outcome.steps[-1].evaluator == "exec"
    seen = load(capture.read_text())
    config = seen["functionConfig"]
    assert (config["kind"], config["metadata"]["name"]) == ("ConfigMap", "function-input")
    assert config["data"]["greeting"] == "hello"


def test_a_parent_function_sees_subpackage_paths_relative_to_their_package(
    package: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/krm.md, "Where resources are written": until the render ends, a resource's path is
    its own package's, with the package in kpt's package-path annotation; what an exec function
    gives back goes back to that package."""
    capture = tmp_path / "seen.yaml"
    write(package, {"capture.sh": f"#!/bin/sh\ntee {capture}\n"})
    monkeypatch.chdir(package)
    (package / "Kptfile").write_text(kptfile("app", mutators="- exec: ./capture.sh\n"))
    before = snapshot(package)
    render(package, BuiltinEvaluator(), allow_exec=True)
    seen = {
        (item["kind"], item["metadata"]["name"]): item["metadata"]["annotations"]
        for item in load(capture.read_text())["items"]
    }
    db = seen[("Kptfile", "db")]
    assert db["internal.config.kubernetes.io/path"] == db["config.kubernetes.io/path"] == "Kptfile"
    assert db["internal.config.kubernetes.io/package-path"] == "db/"
    top = seen[("Kptfile", "app")]
    assert top["internal.config.kubernetes.io/path"] == "Kptfile"
    assert "internal.config.kubernetes.io/package-path" not in top
    after = snapshot(package)
    assert sorted(after) == sorted(before)  # every resource back in the file it came from
    assert after["deploy.yaml"] == before["deploy.yaml"]
    assert "team: data" in after["db/configmap.yaml"]  # the subpackage's own step
    assert "package-path" not in "".join(after.values())


def test_selectors_and_exclude_run_a_function_on_a_subset(package: Path) -> None:
    (package / "Kptfile").write_text(
        kptfile(
            "app",
            mutators="""\
            - image: set-labels
              configMap: {picked: "yes"}
              selectors:
              - kind: Deployment
              - kind: ConfigMap
              exclude:
              - name: db
            """,
        )
    )
    render(package, BuiltinEvaluator())
    documents = list(load_all(package / "deploy.yaml")) + list(
        load_all(package / "db/configmap.yaml")
    )
    picked = {
        d["metadata"]["name"] + "/" + d["kind"]: "picked" in (d["metadata"].get("labels") or {})
        for d in documents
    }
    assert picked == {"web/Deployment": True, "web/Service": False, "db/ConfigMap": False}


def load_all(path: Path) -> list[object]:
    from fnkernel.runtime_server.krm.resources.resourcelist import yaml

    return [d for d in yaml().load_all(path.read_text()) if d is not None]


def test_config_path_names_a_resource_of_the_package(package: Path) -> None:
    write(
        package,
        {
            "ns-config.yaml": """\
            apiVersion: fn.kpt.dev/v1alpha1
            kind: SetNamespace
            metadata:
              name: ns
              annotations: {config.kubernetes.io/local-config: "true"}
            namespace: staging
            """
        },
    )
    (package / "Kptfile").write_text(
        kptfile("app", mutators="- image: set-namespace\n  configPath: ns-config.yaml\n")
    )
    render(package, BuiltinEvaluator())
    assert "namespace: staging" in (package / "deploy.yaml").read_text()
    assert "namespace: staging" in (package / "ns-config.yaml").read_text()  # its own field


def test_wide_sequence_indentation_is_kept_and_untouched_files_are_not_rewritten(
    tmp_path: Path,
) -> None:
    root = write(
        tmp_path / "pkg",
        {
            "Kptfile": kptfile(
                "pkg",
                mutators="- image: set-labels\n  configMap: {app: web}\n  selectors: [{kind: Deployment}]\n",
            ),
            "deploy.yaml": """\
            apiVersion: apps/v1
            kind: Deployment
            metadata:
              name: web
            spec:
              template:
                spec:
                  containers:
                    - name: web
                      image: nginx
            """,
            "other.yaml": """\
            apiVersion: v1
            kind: ConfigMap
            metadata:
              name: keep   # spaced   comment
            data:
              list: |
                  kept as is
            """,
        },
    )
    other_before = (root / "other.yaml").read_text()
    outcome = render(root, BuiltinEvaluator())
    assert outcome.written == ["Kptfile", "deploy.yaml"]  # the Kptfile: its status
    assert (root / "other.yaml").read_text() == other_before
    text = (root / "deploy.yaml").read_text()
    assert "      containers:\n        - name: web\n          image: nginx\n" in text


@pytest.mark.parametrize(
    ("link", "target", "why"),
    [
        ("self", "self", "symlink loop"),
        ("gone.yaml", "nowhere.yaml", "dangling symlink"),
    ],
)
def test_a_symlink_loop_or_dangling_link_fails_naming_it_and_writes_nothing(
    package: Path, link: str, target: str, why: str
) -> None:
    # README, "KRM pipelines and the evaluator chain": symlinks inside a package are not followed (kpt ignores them);
    # a loop or a dangling one is an error naming its path, exit 1, every file untouched.
    (package / link).parent.mkdir(exist_ok=True)
    (package / link).symlink_to(target)
    before = snapshot(package)
    done = fnkernel_render(package)
    assert done.returncode == 1, done.stderr
    assert f"{link}: {why}" in done.stderr
    assert snapshot(package) == before


@pytest.mark.parametrize(("link", "target"), [("here", "."), ("sub/up", "..")])
def test_a_symlink_back_to_the_package_is_ignored(package: Path, link: str, target: str) -> None:
    """docs/krm.md, "Reading a package": kpt ignores symlinks inside a package, one that points
    back up included; the render goes on as without it."""
    (package / link).parent.mkdir(exist_ok=True)
    (package / link).symlink_to(target)
    done = fnkernel_render(package)
    assert done.returncode == 0, done.stderr
    assert "namespace: prod" in (package / "deploy.yaml").read_text()


def test_a_symlink_to_a_directory_outside_is_not_followed(package: Path, tmp_path: Path) -> None:
    elsewhere = write(tmp_path / "elsewhere", {"cm.yaml": DB.replace("name: db", "name: other")})
    (package / "linked").symlink_to(elsewhere)
    (package / "linked.yaml").symlink_to(elsewhere / "cm.yaml")
    outcome = render(package, BuiltinEvaluator())
    names = {name for _, _, name in outcome.resources}
    assert "other" not in names
    assert "namespace: dev" in (elsewhere / "cm.yaml").read_text()  # never written through


@pytest.mark.parametrize(
    ("failure", "raised"),
    [
        (OSError(28, "No space left on device"), PipelineError),
        (KeyboardInterrupt(), KeyboardInterrupt),
    ],
)
def test_a_failure_while_writing_puts_every_file_back(
    package: Path, monkeypatch: pytest.MonkeyPatch, failure: BaseException, raised: type
) -> None:
    # All or nothing on every path: the second rename of a staged file fails (a full disk, a
    # Ctrl-C) and the first file, already in place, is put back byte for byte; no temporary
    # file is left behind.
    from fnkernel.runtime_server.krm.pipeline import writer

    before = snapshot(package)
    real_replace = os.replace
    renames = []

    def failing_replace(source: os.PathLike[str], target: os.PathLike[str]) -> None:
        if str(source).endswith(".fnkernel-tmp"):
            renames.append(source)
            if len(renames) == 2:
                raise failure
        real_replace(source, target)

    monkeypatch.setattr(writer.os, "replace", failing_replace)
    with pytest.raises(raised):
        render(package, BuiltinEvaluator())
    assert len(renames) == 2
    assert snapshot(package) == before
    assert not [p for p in package.rglob("*") if ".fnkernel-" in p.name]


def test_a_steps_results_are_counted_in_words() -> None:
    # What the terminal's progress line and the notebook's view say of a step's results:
    # `FAILED (2 errors, 1 info)`, never "2 error".
    step = Step("", "validator", "kubeconform", results=[
        {"severity": "error"}, {"severity": "warning"}, {"severity": "error"}, {"message": "x"},
    ])  # fmt: skip
    assert step.tally == "2 errors, 1 info, 1 warning"
    assert Step("", "mutator", "set-labels").tally == ""
