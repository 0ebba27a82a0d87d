"""kpt's behaviour, case by case (docs/krm.md): a package, the command a kpt user types
(``fnkernel fn render`` / ``fn eval`` / ``fn source`` / ``fn sink``), the exit code and the
files that must come out. Every case runs twice, each time on a fresh copy, and must come out
the same (kpt's runner does the same); a refusal must leave every file byte-identical."""

from __future__ import annotations

import contextlib
import io
import os
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fnkernel.runtime_server.cli import main
from fnkernel.runtime_server.krm.resources.resourcelist import yaml
from tests.support import but_kptfile

DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
spec:
  replicas: 3
"""
CUSTOM = """\
apiVersion: custom.io/v1
kind: Custom
metadata:
  name: custom
spec:
  image: nginx:1.2.3
"""


def kptfile(body: str = "", name: str = "app") -> str:
    return f"apiVersion: kpt.dev/v1\nkind: Kptfile\nmetadata:\n  name: {name}\n" + textwrap.dedent(
        body
    )


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str
    files: dict[str, str]


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if name.endswith(".sh"):
            path.chmod(0o755)
    return root


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): p.read_text()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


@contextlib.contextmanager
def inside(directory: Path) -> Iterator[None]:
    before = Path.cwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(before)


def fnkernel(*argv: str, stdin: str = "") -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with (
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        pytest.MonkeyPatch.context() as patch,
    ):
        patch.setattr("sys.stdin", io.StringIO(stdin))
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def twice(tmp_path: Path, files: dict[str, str], *argv: str, stdin: str = "") -> Run:
    """Run `argv` in a fresh copy of the package, twice; both runs must agree."""
    runs = []
    for attempt in ("first", "second"):
        package = write(tmp_path / attempt / "pkg", files)
        with inside(package):
            code, out, err = fnkernel(*argv, stdin=stdin)
        runs.append(Run(code, out, err, snapshot(package)))
    first, second = runs
    assert (first.code, first.files) == (second.code, second.files), "not the same twice"
    return first


def render(tmp_path: Path, files: dict[str, str], *flags: str) -> Run:
    return twice(tmp_path, files, "fn", "render", ".", *flags)


def documents(text: str) -> list[dict]:
    return [d for d in yaml().load_all(text) if d is not None]


def status(run: Run) -> dict:
    return documents(run.files["Kptfile"])[0]["status"]


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


# 8. Resource paths (docs/krm.md, "Where resources are written").


STARLARK = """\
apiVersion: fn.kpt.dev/v1alpha1
kind: StarlarkRun
metadata:
  name: gen
  annotations:
    config.kubernetes.io/local-config: "true"
source: |
{script}"""


def starlark_package(script: str, *, sub: bool = False) -> dict[str, str]:
    where = "db/" if sub else ""
    files = {
        "Kptfile": kptfile(),
        f"{where}Kptfile": kptfile(
            "pipeline:\n  mutators:\n  - image: starlark\n    configPath: gen.yaml\n",
            name="db" if sub else "app",
        ),
        f"{where}gen.yaml": STARLARK.format(script=textwrap.indent(script, "  ")),
        f"{where}resources.yaml": DEPLOYMENT,
    }
    return files


NEW_CONFIGMAP = 'ctx.resource_list["items"].append({{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {{"name": "made"{notes}}}}})\n'


@pytest.mark.parametrize(
    ("annotations", "sub", "written"),
    [
        ("", True, "db/configmap_made.yaml"),
        (', "namespace": "prod"', False, "prod/configmap_made.yaml"),  # kpt's default path
        (
            ', "annotations": {"config.kubernetes.io/path": "/abs/made.yaml"}',
            False,
            "abs/made.yaml",
        ),
        (
            ', "annotations": {"internal.config.kubernetes.io/path": "x/made.yaml"}',
            False,
            "x/made.yaml",
        ),
    ],
    ids=["generated-in-a-subpackage", "namespaced", "absolute-path", "internal-path"],
)
def test_where_a_generated_resource_is_written(
    tmp_path: Path, annotations: str, sub: bool, written: str
) -> None:
    run = render(tmp_path, starlark_package(NEW_CONFIGMAP.format(notes=annotations), sub=sub))
    assert run.code == 0, run.stderr
    assert documents(run.files[written])[0]["metadata"]["name"] == "made"


@pytest.mark.parametrize(
    ("notes", "says"),
    [
        (
            ', "annotations": {"config.kubernetes.io/path": "../out.yaml"}',
            "function must not modify resources outside of package: resource has path ../out.yaml",
        ),
        (
            ', "annotations": {"config.kubernetes.io/path": "resources.yaml", "config.kubernetes.io/index": "0"}',
            'resource at path "resources.yaml" and index "0" already exists',
        ),
    ],
    ids=["outside", "duplicate"],
)
def test_a_path_out_of_the_package_or_taken_is_refused(
    tmp_path: Path, notes: str, says: str
) -> None:
    files = starlark_package(NEW_CONFIGMAP.format(notes=notes))
    run = render(tmp_path, files)
    assert run.code == 1
    assert says in run.stderr
    assert but_kptfile(run.files) == but_kptfile(files)


def test_a_legacy_path_annotation_change_moves_the_resource(tmp_path: Path) -> None:
    script = (
        'for r in ctx.resource_list["items"]:\n'
        '  if r["kind"] == "Deployment":\n'
        '    r["metadata"]["annotations"]["config.kubernetes.io/path"] = "moved.yaml"\n'
    )
    run = render(tmp_path, starlark_package(script))
    assert run.code == 0, run.stderr
    assert "resources.yaml" not in run.files
    assert run.files["moved.yaml"] == DEPLOYMENT


# 9. Function features (docs/krm.md, "Builtin functions").


def test_starlark_print_is_stderr_and_a_configmap_config_works(tmp_path: Path) -> None:
    files = {
        "Kptfile": kptfile(
            "pipeline:\n  mutators:\n  - image: starlark\n    configPath: fn.yaml\n"
        ),
        "fn.yaml": (
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: fn\n  annotations:\n"
            "    config.kubernetes.io/local-config: 'true'\ndata:\n  replicas: '5'\n"
            "  source: |\n"
            "    load('encoding/json.star', 'json')\n"
            "    n = json.decode(ctx.resource_list['functionConfig']['data']['replicas'])\n"
            "    for r in ctx.resource_list['items']:\n"
            "      if r['kind'] == 'Deployment':\n"
            "        r['spec']['replicas'] = n\n"
            "    print('set', n)\n"
        ),
        "resources.yaml": DEPLOYMENT,
    }
    results = tmp_path / "results"
    run = render(tmp_path, files, "--results-dir", str(results))
    assert run.code == 0, run.stderr
    assert "replicas: 5" in run.files["resources.yaml"]
    assert run.files["fn.yaml"] == files["fn.yaml"]  # an untouched file is not rewritten
    item = documents((results / "results.yaml").read_text())[0]["items"][0]
    assert item["stderr"] == "set 5" and "results" not in item


def test_set_annotations_additional_fields(tmp_path: Path) -> None:
    config = (
        "apiVersion: fn.kpt.dev/v1alpha1\nkind: SetAnnotations\nmetadata:\n  name: a\n"
        "  annotations:\n    config.kubernetes.io/local-config: 'true'\n"
        "annotations: {owner: ops}\nadditionalAnnotationFields:\n"
        "- path: spec/extra/annotations\n  kind: Custom\n  create: true\n"
    )
    files = {
        "Kptfile": kptfile(
            "pipeline:\n  mutators:\n  - image: set-annotations\n    configPath: a.yaml\n"
        ),
        "a.yaml": config,
        "custom.yaml": CUSTOM,
    }
    run = render(tmp_path, files)
    assert run.code == 0, run.stderr
    custom = documents(run.files["custom.yaml"])[0]
    assert custom["spec"]["extra"]["annotations"] == {"owner": "ops"}
    results = status(run)["renderStatus"]["mutationSteps"][0]["results"]
    assert {
        "message": 'set annotations: {"owner":"ops"}',
        "field": {"path": "spec.extra.annotations"},
        "file": {"path": "custom.yaml"},
    } in results


# 11. kpt's command line (docs/krm.md, "CLI").


def test_fn_eval_takes_kpt_flags_anywhere_and_key_values(tmp_path: Path) -> None:
    files = {
        "Kptfile": kptfile(),
        "resources.yaml": DEPLOYMENT + "---\n" + CUSTOM,
        "ns.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: ns}\ndata: {namespace: prod}\n",
    }
    run = twice(
        tmp_path,
        files,
        "fn",
        "eval",
        ".",
        "--image",
        "set-namespace:latest",
        "--fn-config",
        "ns.yaml",
    )
    assert run.code == 0, run.stderr
    assert "namespace: prod" in run.files["resources.yaml"]
    assert run.files["ns.yaml"] == files["ns.yaml"]  # its own config is not its input
    assert '[RUNNING] "ghcr.io/kptdev/krm-functions-catalog/set-namespace:latest"' in run.stderr
    run = twice(
        tmp_path / "kv",
        files,
        "fn",
        "eval",
        "-i",
        "set-labels:latest",
        "--match-kind",
        "Custom",
        "--",
        "tier=web",
    )
    assert run.code == 0, run.stderr
    deployment, custom = documents(run.files["resources.yaml"])
    assert "labels" not in deployment["metadata"] and custom["metadata"]["labels"] == {
        "tier": "web"
    }
    assert "on 1 resource(s)" in run.stderr


def test_fn_eval_save_adds_the_function_to_the_kptfile(tmp_path: Path) -> None:
    files = {"Kptfile": kptfile(), "resources.yaml": DEPLOYMENT}
    run = twice(
        tmp_path,
        files,
        "fn",
        "eval",
        "-s",
        "-t",
        "mutator",
        "-i",
        "set-namespace:latest",
        "--",
        "namespace=prod",
    )
    assert run.code == 0, run.stderr
    assert run.files["Kptfile"] == kptfile(
        "pipeline:\n  mutators:\n    - image: ghcr.io/kptdev/krm-functions-catalog/set-namespace:latest\n"
        "      configMap:\n        namespace: prod\n"
    )
    assert (
        'Added "ghcr.io/kptdev/krm-functions-catalog/set-namespace:latest" as mutator' in run.stderr
    )


def test_a_bad_package_exits_1_as_kpt_does(tmp_path: Path) -> None:
    run = twice(tmp_path, {"resources.yaml": DEPLOYMENT}, "fn", "render", ".")
    assert run.code == 1 and 'No Kptfile found at "' in run.stderr


def test_source_eval_sink_and_output_forms(tmp_path: Path) -> None:
    files = {
        "Kptfile": kptfile(),
        "resources.yaml": "# the web tier\n" + DEPLOYMENT,
    }
    package = write(tmp_path / "pkg", files)
    code, source, _ = fnkernel("fn", "source", str(package))
    assert code == 0 and source.startswith(
        "apiVersion: config.kubernetes.io/v1\nkind: ResourceList\n"
    )
    assert "config.kubernetes.io/path: 'resources.yaml'" in source
    code, evaluated, err = fnkernel(
        "fn", "eval", "-", "-i", "set-namespace", "--", "namespace=prod", stdin=source
    )
    assert code == 0, err
    code, _, err = fnkernel("fn", "sink", str(tmp_path / "out"), stdin=evaluated)
    assert code == 0, err
    assert (tmp_path / "out" / "resources.yaml").read_text() == (
        "# the web tier\n" + DEPLOYMENT.replace("  name: web\n", "  name: web\n  namespace: prod\n")
    )
    code, unwrapped, _ = fnkernel("fn", "render", str(package), "-o", "unwrap")
    assert code == 0 and "internal.config" not in unwrapped and "kind: Kptfile" in unwrapped
    assert snapshot(package) == files  # -o: the package itself is not written
    code, _, err = fnkernel("fn", "render", str(package), "-o", str(tmp_path / "out"))
    assert code == 1 and 'directory "' in err and "already exists" in err


def test_a_documents_comment_is_printed_where_kpt_prints_it(tmp_path: Path) -> None:
    """kpt's fn-eval/output-to-stdout and out-of-place-fnchain-stdout: a comment that touches
    the object's first key is the object's, printed after its dash in a ResourceList; one set
    off by a blank line is the document's, printed before the dash. Each stays where it is
    through a chain of ``fn eval -``, and the annotations a function adds come after the ones
    the package was read with."""
    files = {
        "touching.yaml": "# touching\n" + DEPLOYMENT,
        "apart.yaml": "# apart\n\n" + CUSTOM,
    }
    package = write(tmp_path / "pkg", files)
    code, source, err = fnkernel("fn", "source", str(package))
    assert code == 0, err
    apart, touching = source.split("items:\n", 1)[1].split("- apiVersion: custom.io/v1\n")
    assert apart == "# apart\n"
    assert touching.startswith("  kind: Custom\n") and "- # touching\n  apiVersion: apps/v1\n" in (
        touching
    )
    code, chained, err = fnkernel(
        "fn", "eval", "-", "-i", "set-annotations", "--", "foo=bar", stdin=source
    )
    assert code == 0, err
    code, chained, err = fnkernel("fn", "eval", "-", "-i", "no-op", stdin=chained)
    assert code == 0, err
    assert "items:\n# apart\n- apiVersion: custom.io/v1\n" in chained
    assert "- # touching\n  apiVersion: apps/v1\n" in chained
    assert "      internal.config.kubernetes.io/seqindent: 'compact'\n      foo: bar\n" in chained


def test_pkg_init_adds_only_the_missing_files(tmp_path: Path) -> None:
    """docs/krm.md, "CLI": kpt pkg init writes a Kptfile, README.md and the package context
    (a ConfigMap named kptfile.kpt.dev that set-namespace can read), each only if missing."""
    files = {"Kptfile": kptfile(), "resources.yaml": DEPLOYMENT}
    run = twice(tmp_path, files, "pkg", "init")
    assert run.code == 0, run.stderr
    assert run.files["Kptfile"] == files["Kptfile"]
    context = documents(run.files["package-context.yaml"])[0]
    assert (context["kind"], context["metadata"]["name"]) == ("ConfigMap", "kptfile.kpt.dev")
    assert run.files["README.md"].startswith("# pkg\n")
    fresh = tmp_path / "fresh"
    code, _, err = fnkernel("pkg", "init", str(fresh))
    assert code == 0, err
    assert documents((fresh / "Kptfile").read_text())[0]["metadata"]["name"] == "fresh"
