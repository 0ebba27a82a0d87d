"""kpt's behaviour, continued (docs/krm.md): where a render writes the resources a function makes
or moves, the builtin functions' kpt features, and kpt's command line (``fn eval`` flags,
``--save``, ``fn source`` / ``fn sink``, ``pkg init``). As in tests/krm/test_kpt_behaviour.py,
every case runs twice on a fresh copy and must come out the same."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.krm.kpt_cases import (
    CUSTOM,
    DEPLOYMENT,
    documents,
    fnkernel,
    kptfile,
    render,
    snapshot,
    starlark_package,
    status,
    twice,
    write,
)
from tests.support import but_kptfile

# 8. Resource paths (docs/krm.md, "Where resources are written").


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


@pytest.mark.parametrize("image", ["no-op", "set-namespace"])
def test_fnkernel_eval_keeps_every_kptfile_as_fn_eval_does(tmp_path: Path, image: str) -> None:
    # docs/krm.md, "The Kptfile": `fn eval` passes the Kptfiles to the function, and `fnkernel
    # eval IMAGE DIR` is the same evaluation ("CLI"): a function that leaves a Kptfile alone
    # leaves it in the package, the subpackage's too.
    files = {
        "Kptfile": kptfile(),
        "deploy.yaml": DEPLOYMENT,
        "db/Kptfile": kptfile(name="db"),
        "db/cm.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: db}\n",
    }
    run = twice(tmp_path, files, "eval", image, ".", "--", "namespace=prod")
    assert run.code == 0, run.stderr
    assert kptfile() in run.files["Kptfile"] and run.files["db/Kptfile"].startswith(
        kptfile(name="db")
    )
    if image == "set-namespace":
        assert "namespace: prod" in run.files["db/cm.yaml"]


def test_an_evaluation_without_the_kptfiles_leaves_them_alone(tmp_path: Path) -> None:
    # A file whose resources a function was not given is not the function's to remove.
    from fnkernel.runtime_server.krm.evaluators.builtin import BuiltinEvaluator
    from fnkernel.runtime_server.krm.pipeline import PipelineFunction, evaluate_one

    root = write(tmp_path / "pkg", {"Kptfile": kptfile(), "deploy.yaml": DEPLOYMENT,
                                     "db/Kptfile": kptfile(name="db")})  # fmt: skip
    outcome = evaluate_one(root, PipelineFunction(image="no-op"), BuiltinEvaluator())
    assert outcome.removed == [] and snapshot(root)["db/Kptfile"] == kptfile(name="db")
    assert snapshot(root)["Kptfile"] == kptfile()


def test_a_failed_step_says_why_in_each_report(tmp_path: Path) -> None:
    # docs/krm.md, "CLI": a failed step's line is followed by what the function said of it
    # (its results), and kpt's report shows why a command could not run at all.
    files = {"Kptfile": kptfile(), "deploy.yaml": DEPLOYMENT}
    run = twice(tmp_path / "eval", files, "eval", "set-labels", ".")
    assert run.code == 1 and run.files == files
    assert "FAILED (1 info)\n" in run.stderr
    assert "\n    [info]: `FunctionConfig` is not given\n" in run.stderr
    run = twice(tmp_path / "exec", files, "fn", "eval", ".", "--exec", "./no-such-binary")
    assert run.code == 1 and run.files == files
    assert "  Stderr:\n    failed to execute ./no-such-binary: [Errno 2] No such file" in run.stderr


@pytest.mark.parametrize("command", [["fn", "render"], ["render"]])
def test_a_results_dir_that_cannot_be_written_is_refused_before_anything_runs(
    tmp_path: Path, command: list[str]
) -> None:
    # A usage error names the flag at once, not an errno once every function has run.
    files = {"Kptfile": kptfile("pipeline:\n  mutators:\n    - image: set-namespace\n"
                                "      configMap: {namespace: prod}\n"), "deploy.yaml": DEPLOYMENT}  # fmt: skip
    package = write(tmp_path / "pkg", files)
    (tmp_path / "afile").write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", *command, str(package),
         "--results-dir", str(tmp_path / "afile")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert f"argument --results-dir: {tmp_path / 'afile'} is a file, not a directory" in done.stderr
    assert snapshot(package) == files  # nothing ran: not even the Kptfile's render status
