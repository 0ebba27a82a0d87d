"""kpt's behaviour, case by case (docs/krm.md): a package, the command a kpt user types
(``fnkernel fn render`` / ``fn eval`` / ``fn source`` / ``fn sink``), the exit code and the
files that must come out. Every case runs twice, each time on a fresh copy, and must come out
the same (kpt's runner does the same); a refusal must leave every file byte-identical."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.krm.kpt_cases import (
    CUSTOM,
    DEPLOYMENT,
    documents,
    kptfile,
    render,
    status,
    twice,
)
from tests.support import but_kptfile

# 1. The Kptfile is part of the function input (docs/krm.md, "The Kptfile").


def test_the_kptfile_is_given_to_the_functions_and_the_render_recorded(tmp_path: Path) -> None:
    files = {
        "Kptfile": kptfile(
            """\
            pipeline:
              mutators:
              - image: set-labels:latest
                configMap: {tier: backend}
            """
        ),
        "resources.yaml": DEPLOYMENT,
    }
    run = render(tmp_path, files)
    assert run.code == 0, run.stderr
    assert run.files["Kptfile"] == (
        "apiVersion: kpt.dev/v1\n"
        "kind: Kptfile\n"
        "metadata:\n"
        "  name: app\n"
        "  labels:\n"
        "    tier: backend\n"
        "pipeline:\n"
        "  mutators:\n"
        "    - image: set-labels:latest\n"
        "      configMap:\n"
        "        tier: backend\n"
        "status:\n"
        "  conditions:\n"
        "    - type: Rendered\n"
        '      status: "True"\n'
        "      reason: RenderSuccess\n"
        "  renderStatus:\n"
        "    mutationSteps:\n"
        "      - image: ghcr.io/kptdev/krm-functions-catalog/set-labels:latest\n"
        "        exitCode: 0\n"
        "        results:\n"
        "          - message: set 3 labels in total\n"
        "            severity: info\n"
    )
    # the Deployment: its labels and its required selector, but no pod template invented
    assert (
        run.files["resources.yaml"]
        == DEPLOYMENT.replace("  name: web\n", "  name: web\n  labels:\n    tier: backend\n")
        + "  selector:\n    matchLabels:\n      tier: backend\n"
    )


def test_an_exec_step_sees_the_kptfile_and_its_path_is_the_current_directorys(
    tmp_path: Path,
) -> None:
    seen = tmp_path / "seen.yaml"
    files = {
        "Kptfile": kptfile("pipeline:\n  mutators:\n  - exec: ./capture.sh\n"),
        "capture.sh": f"#!/bin/sh\ntee {seen}\n",
        "resources.yaml": DEPLOYMENT,
    }
    run = render(tmp_path, files, "--allow-exec")
    assert run.code == 0, run.stderr
    kinds = [item["kind"] for item in documents(seen.read_text())[0]["items"]]
    assert kinds == ["Deployment", "Kptfile"]


COMMENTED = """\
# the file's own comment
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web # the name
spec:
  # how many
  replicas: 3
"""


@pytest.mark.parametrize(
    "step",
    [
        "- image: drop-comments:latest\n",  # kpt's fn-render/preserve-comments
        "- exec: ./uncomment.sh\n",  # any function that loses them
    ],
)
def test_comments_a_function_drops_come_back(tmp_path: Path, step: str) -> None:
    """docs/krm.md, "Comments": kpt puts back the comments a function's output lacks, so
    drop-comments (or an exec function that writes none) leaves the files as they were."""
    files = {
        "Kptfile": kptfile("pipeline:\n  mutators:\n  " + step),
        "uncomment.sh": "#!/bin/sh\nsed -e '/^ *#/d' -e 's/ # .*$//'\n",
        "resources.yaml": COMMENTED,
    }
    run = render(tmp_path, files, "--allow-exec")
    assert run.code == 0, run.stderr
    assert run.files["resources.yaml"] == COMMENTED


def test_a_render_drops_the_blank_lines_of_a_leading_comment_in_every_file(
    tmp_path: Path,
) -> None:
    """docs/krm.md, "Writing files": kpt writes every file of the package back, and its writer
    loses the blank lines in and after a document's leading comment (kpt's
    fn-render/modify-path-annotation and krm-check-exclude-kustomize), in a file no function
    changed too; nothing else of an unchanged file changes."""
    licensed = "# Licensed\n\n# about the object\n\n" + CUSTOM.replace(
        "  name: custom\n", "  name: custom # kept\n"
    )
    files = {
        "Kptfile": kptfile("pipeline:\n  mutators:\n  - image: no-op:latest\n"),
        "licensed.yaml": licensed,
        "plain.yaml": "# plain\n" + DEPLOYMENT,
    }
    run = render(tmp_path, files)
    assert run.code == 0, run.stderr
    assert run.files["licensed.yaml"] == licensed.replace("\n\n", "\n")
    assert run.files["plain.yaml"] == files["plain.yaml"]


# 2.-3. set-namespace and set-labels as the catalog's functions (docs/krm.md, "Builtin functions").


def test_set_namespace_leaves_a_custom_kind_without_namespace_alone(tmp_path: Path) -> None:
    files = {
        "Kptfile": kptfile(
            "pipeline:\n  mutators:\n  - image: set-namespace:latest\n    configMap: {namespace: prod}\n"
        ),
        "resources.yaml": DEPLOYMENT + "---\n" + CUSTOM,
    }
    run = render(tmp_path, files)
    assert run.code == 0, run.stderr
    deployment, custom = documents(run.files["resources.yaml"])
    assert deployment["metadata"]["namespace"] == "prod"
    assert "namespace" not in custom["metadata"]
    step = status(run)["renderStatus"]["mutationSteps"][0]
    assert step["results"][0]["message"] == (
        'namespace [default] updated to "prod", 1 value(s) changed'
    )


# 4. The render status, and what a failure writes (docs/krm.md, "Failures").


def test_a_failed_render_writes_only_the_kptfile_status(tmp_path: Path) -> None:
    files = {
        "Kptfile": kptfile(
            """\
            pipeline:
              mutators:
              # a comment kpt does not keep
              - image: set-labels:latest
                configMap: {tier: backend}
              - image: set-namespace:latest
            """
        ),
        "resources.yaml": DEPLOYMENT,
    }
    run = render(tmp_path, files)
    assert run.code == 1
    assert run.files["resources.yaml"] == DEPLOYMENT  # the first step's work is not kept
    kpt = documents(run.files["Kptfile"])[0]
    assert "# a comment" not in run.files["Kptfile"]  # kpt writes the Kptfile from its schema
    condition = kpt["status"]["conditions"][0]
    assert (condition["status"], condition["reason"]) == ("False", "RenderFailed")
    assert condition["message"] == "pkg.render: pkg .:\n\tpipeline.run: already handled error"
    failed = kpt["status"]["renderStatus"]["mutationSteps"][1]
    assert failed["exitCode"] == 1
    assert failed["stderr"] == "failed to evaluate function: error: function failure"
    assert (
        failed["errorResults"][0]["message"]
        == "FunctionConfig is missing. Expect `ConfigMap.v1` or `SetNamespace.v1alpha1.fn.kpt.dev`"
    )
    assert "[FAIL]" in run.stderr and "Exit code: 1" in run.stderr


# Image tags (docs/krm.md, "Image tags"): kpt resolves a step's semver `tag:` to the newest
# release that satisfies it; with no registry here, among the releases our builtins declare.


def tagged_package(tag: str) -> dict[str, str]:
    kpt = kptfile(
        f"""\
        pipeline:
          mutators:
          - image: set-namespace
            tag: "{tag}"
            configMap: {{namespace: staging}}
        """
    )
    return {"Kptfile": kpt, "resources.yaml": DEPLOYMENT}


@pytest.mark.parametrize(
    ("tag", "resolved"),
    [
        ("0.4.1 - 0.4.3", "v0.4.3"),  # a range: the newest inside it
        (">= 0.3, < 0.4", "v0.3.4"),  # Masterminds' comma-separated AND
        ("~0.1", "v0.1.4"),
        ("v0.1.9", "v0.1.9"),  # a version is used as it is, listed or not
        ("latest", "latest"),  # and so is any other tag
    ],
)
def test_a_step_tag_resolves_to_the_release_kpt_would_run(
    tmp_path: Path, tag: str, resolved: str
) -> None:
    run = render(tmp_path, tagged_package(tag))
    assert run.code == 0, run.stderr
    step = status(run)["renderStatus"]["mutationSteps"][0]
    assert step["image"] == f"ghcr.io/kptdev/krm-functions-catalog/set-namespace:{resolved}"
    assert f'"ghcr.io/kptdev/krm-functions-catalog/set-namespace:{resolved}"' in run.stderr
    assert "namespace: staging" in run.files["resources.yaml"]


@pytest.mark.parametrize(
    ("tag", "message"),
    [
        ("~9.1", 'no tag could be found matching the version constraint "~9.1"'),
        ("not a tag", '`function.tag` "not a tag" must be a valid image tag'),
    ],
)
def test_a_tag_nothing_satisfies_fails_the_step_before_it_runs(
    tmp_path: Path, tag: str, message: str
) -> None:
    run = render(tmp_path, tagged_package(tag))
    assert run.code == 1
    assert run.files["resources.yaml"] == DEPLOYMENT
    step = status(run)["renderStatus"]["mutationSteps"][0]
    assert step["executionError"].startswith(message)
    assert step["exitCode"] == 1


def test_fn_eval_tag_resolves_the_same_way(tmp_path: Path) -> None:
    files = {"Kptfile": kptfile(), "resources.yaml": DEPLOYMENT}
    run = twice(
        tmp_path, files, "fn", "eval", ".", "-i", "set-labels", "--tag", "~0.2", "--", "a=b"
    )
    assert run.code == 0, run.stderr
    assert '"ghcr.io/kptdev/krm-functions-catalog/set-labels:v0.2.5"' in run.stderr
    assert "a: b" in run.files["resources.yaml"]


@pytest.mark.parametrize("order", ["depth-first", "breadth-first"])
def test_save_on_render_failure_keeps_what_succeeded(tmp_path: Path, order: str) -> None:
    annotations = "  annotations:\n    kpt.dev/save-on-render-failure: 'true'\n"
    if order == "breadth-first":
        annotations += "    kpt.dev/bfs-rendering: 'true'\n"
    files = {
        "Kptfile": kptfile(
            "pipeline:\n  mutators:\n  - image: set-labels:latest\n    configMap: {tier: web}\n"
        ).replace("  name: app\n", "  name: app\n" + annotations),
        "resources.yaml": DEPLOYMENT,
        "sub/Kptfile": kptfile(
            "pipeline:\n  mutators:\n  - image: set-namespace:latest\n", name="sub"
        ),
        "sub/cm.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: c\n",
    }
    run = render(tmp_path, files)
    assert run.code == 1
    # Depth first, the subpackage fails before the top's pipeline runs: nothing succeeded.
    # Breadth first, the top's pipeline ran first, over the subpackage's resources too: kept.
    for path in ("resources.yaml", "sub/cm.yaml"):
        assert ("tier: web" in run.files[path]) == (order == "breadth-first"), path
    assert "namespace" not in run.files["sub/cm.yaml"]  # the failed step's work is not there
    message = status(run)["conditions"][0]["message"]
    expected = "pkg ./sub:" if order == "depth-first" else "pipeline.run: pkg ./sub:"
    assert expected in message


# 5. Invalid input is refused, and nothing is written (docs/krm.md, "The Kptfile").


@pytest.mark.parametrize(
    ("kptfile_text", "extra", "says"),
    [
        (
            "apiVersion: kpt.dev/v1alpha2\nkind: Kptfile\nmetadata:\n  name: app\n",
            {},
            'has an old version ("v1alpha2") of the Kptfile schema',
        ),
        (
            kptfile("pipeline:\n  mutators:\n  - image: set-labels\n    targets: []\n"),
            {},
            "line 8: field targets not found in type v1.Function",
        ),
        (
            kptfile(
                "pipeline:\n  mutators:\n  - image: set-labels\n    configMap: {a: b}\n"
                "    configPath: c.yaml\n"
            ),
            {"c.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n"},
            "must not specify both `configMap` and `configPath`",
        ),
        (
            kptfile("pipeline:\n  mutators:\n  - image: set-labels\n    configPath: c.yaml\n"),
            {"c.yaml": "apiVersion: v1\nkind: ConfigMap\ndata: {a: b}\n"},
            "resource must have `metadata.name`",
        ),
        (
            kptfile("pipeline:\n  mutators:\n  - image: set-labels\n    configPath: c.yaml\n"),
            {"c.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n---\n" * 2},
            'functionConfig "c.yaml" must not contain more than one config, got 2',
        ),
        (
            kptfile("pipeline:\n  mutators:\n  - image: set-labels\n    configPath: /etc/c.yaml\n"),
            {},
            "path must be relative",
        ),
        (
            kptfile(
                "pipeline:\n  mutators:\n  - image: set-labels\n    configMap:\n      env: [a, b]\n"
            ),
            {},
            "line 9: cannot unmarshal !!seq into string",
        ),
        (
            kptfile(
                "pipeline:\n  mutators:\n  - image: set-namespace\n    configMap:\n      namespace: {a: b}\n"
            ),
            {},
            "line 9: cannot unmarshal !!map into string",
        ),
        ("apiVersion: kpt.dev/v1\nkind Kptfile\nmetadata: [\n", {}, "can't be read"),
    ],
    ids=[
        "old-version",
        "unknown-field",
        "configmap-and-configpath",
        "config-without-name",
        "two-configs-in-one-file",
        "absolute-config-path",
        "list-value",
        "map-value",
        "not-yaml",
    ],
)
def test_an_invalid_package_is_refused_and_nothing_is_written(
    tmp_path: Path, kptfile_text: str, extra: dict[str, str], says: str
) -> None:
    files = {"Kptfile": kptfile_text, "resources.yaml": DEPLOYMENT, **extra}
    run = render(tmp_path, files)
    assert run.code == 1
    assert says in run.stderr
    assert run.files == files  # byte-identical


def test_an_unreadable_subpackage_kptfile_is_recorded_in_the_top_kptfile(tmp_path: Path) -> None:
    """docs/krm.md, "Failures": the render stops before any step, and kpt records why in the
    top Kptfile's Rendered condition; every other file is left as it was."""
    broken = kptfile(  # kpt's fn-render/subpkg-has-invalid-kptfile: a key out of its list
        "pipeline:\n  mutators:\n    - image: set-labels\n  configPath: x.yaml\n"
        "    - image: set-namespace\n",
        "db",
    )
    files = {
        "Kptfile": kptfile(
            "pipeline:\n  mutators:\n  - image: set-labels\n    configMap: {a: b}\n"
        ),
        "resources.yaml": DEPLOYMENT,
        "db/Kptfile": broken,
        "db/resources.yaml": CUSTOM,
    }
    run = render(tmp_path, files)
    assert run.code == 1
    assert 'Kptfile at "./db" can\'t be read' in run.stderr
    assert {name: text for name, text in run.files.items() if name != "Kptfile"} == {
        name: text for name, text in files.items() if name != "Kptfile"
    }
    (condition,) = status(run)["conditions"]
    assert (condition["status"], condition["reason"]) == ("False", "RenderFailed")
    assert condition["message"] == (
        'pkg.render: pkg .:\n\tpkg.Subpackages: pkg ./db: error reading Kptfile at "./db": '
        "yaml: line 9: mapping values are not allowed in this context"
    )
    assert "renderStatus" not in status(run)  # no step ran


def test_a_config_path_into_a_subpackage_is_refused_when_the_pipeline_starts(
    tmp_path: Path,
) -> None:
    files = {
        "Kptfile": kptfile(
            "pipeline:\n  mutators:\n  - image: set-labels\n    configPath: db/c.yaml\n"
        ),
        "db/Kptfile": kptfile(name="db"),
        "db/c.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata: {a: b}\n",
    }
    run = render(tmp_path, files)
    assert run.code == 1
    assert 'is missing from path "db/c.yaml", this also occurs if' in run.stderr
    assert but_kptfile(run.files) == but_kptfile(files)
    assert status(run)["conditions"][0]["reason"] == "RenderFailed"


def test_a_document_that_is_not_krm_fails_the_render(tmp_path: Path) -> None:
    files = {"Kptfile": kptfile(), "notes.yaml": "just: text\n"}
    run = render(tmp_path, files)
    assert run.code == 1
    assert (
        "input resource list must contain only KRM resources: notes.yaml: resource must have "
        "`apiVersion`"
    ) in run.stderr
    assert run.files["notes.yaml"] == files["notes.yaml"]


# 7. Reading the package (docs/krm.md, "Reading a package").


def test_krmignore_and_kustomization_files(tmp_path: Path) -> None:
    files = {
        "Kptfile": kptfile(
            "pipeline:\n  mutators:\n  - image: set-annotations\n    configMap: {team: a}\n"
        ),
        ".krmignore": "ignored/\n",
        "ignored/cm.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n",
        "kustomization.yaml": "resources:\n- resources.yaml\n",
        "resources.yaml": DEPLOYMENT,
    }
    run = render(tmp_path, files)
    assert run.code == 0, run.stderr
    assert run.files["ignored/cm.yaml"] == files["ignored/cm.yaml"]
    assert "team: a" in run.files["resources.yaml"]
