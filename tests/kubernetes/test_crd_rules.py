"""The Run CRD's CEL validation rules (docs/kubernetes.md, "The Run's validation rules"),
evaluated as the API server would, with cel-python (a maintained CEL implementation; the API
server itself is not here): each rule passes a good Run and refuses the create or the update it
exists to refuse, and everything a rule reads is bounded, so its estimated cost is."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import celpy
import pytest
from celpy import celtypes

from fnkernel.runtime_server import limits
from fnkernel.runtime_server.lifecycle.kubernetes import objects
from tests.kubernetes.conftest import kustomize_build

Path_ = tuple[str, ...]  # properties from the root of the object, "*" for a map's values


@pytest.fixture(scope="module")
def schema(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    built = kustomize_build("a-token", tmp_path_factory.mktemp("k") / "deploy")
    (crd,) = [o for o in built if o["kind"] == "CustomResourceDefinition"]
    (version,) = crd["spec"]["versions"]
    return dict(version["schema"]["openAPIV3Schema"])


def rules(node: dict[str, Any], path: Path_ = ()) -> Iterator[tuple[Path_, dict[str, Any]]]:
    """Every x-kubernetes-validations rule of the schema, with where it applies."""
    for rule in node.get("x-kubernetes-validations", []):
        yield path, rule
    for name, child in (node.get("properties") or {}).items():
        yield from rules(child, (*path, name))
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        yield from rules(extra, (*path, "*"))
    if isinstance(node.get("items"), dict):
        yield from rules(node["items"], (*path, "*"))


def unbounded(node: dict[str, Any], path: str) -> Iterator[str]:
    """The parts of `node` whose size no schema keyword bounds."""
    kind = node.get("type")
    if kind == "string" and "maxLength" not in node and "enum" not in node:
        yield path
    if kind == "object" and "additionalProperties" in node and "maxProperties" not in node:
        yield path
    if kind == "array" and "maxItems" not in node:
        yield path
    for name, child in (node.get("properties") or {}).items():
        yield from unbounded(child, f"{path}.{name}")
    for key in ("additionalProperties", "items"):
        if isinstance(node.get(key), dict):
            yield from unbounded(node[key], f"{path}[*]")


def _split(text: celtypes.StringType, separator: celtypes.StringType) -> celtypes.ListType:
    """Kubernetes' CEL strings library's split, which cel-python's standard set lacks."""
    return celtypes.ListType([celtypes.StringType(p) for p in str(text).split(str(separator))])


def holds(rule: str, value: Any, old: Any = None) -> bool:
    environment = celpy.Environment()
    program = environment.program(environment.compile(rule), functions={"split": _split})
    activation = {"self": celpy.json_to_cel(value)}
    if old is not None:
        activation["oldSelf"] = celpy.json_to_cel(old)
    return bool(program.evaluate(activation))


def at(obj: dict[str, Any], path: Path_) -> Any:
    for name in path:
        obj = obj[name]
    return obj


GOOD: dict[str, Any] = {
    "apiVersion": objects.API_VERSION,
    "kind": "Run",
    "metadata": {"name": "fn"},
    "spec": {
        "runtime": "python",
        "handler": "h.handle",
        "env": {"REGION": "eu", "_X1": ""},
        "files": {"h.py": "def handle(e):\n    return e\n", "data/lookup.csv": "a\n"},
    },
}


def changed(**spec: Any) -> dict[str, Any]:
    return {**GOOD, "spec": {**GOOD["spec"], **spec}}


# A Run as the gateway makes it: its files in ConfigMaps it owns.
FILES_FROM = {"configMaps": ["fn-files-0a1b2c3d-0"], "sha256": "0" * 64}
GOOD_FROM = {**GOOD, "spec": {k: v for k, v in GOOD["spec"].items() if k != "files"}
             | {"filesFrom": FILES_FROM}}  # fmt: skip

# What each rule (by the start of its message) refuses: (a create it must refuse, an update it
# must refuse) — where a rule compares with oldSelf, the update from the create.
REFUSED: dict[str, list[tuple[dict[str, Any], dict[str, Any] | None]]] = {
    "a Run's object name": [
        ({**GOOD, "metadata": {"name": "My_Fn"}}, None),
        ({**GOOD, "metadata": {"name": "-a"}}, None),
    ],
    "a Run's spec never changes": [
        (GOOD, changed(handler="h.other")),
        (GOOD, changed(env={"REGION": "us"})),
        (GOOD_FROM, GOOD),
    ],
    "a Run's files are in": [(changed(filesFrom=FILES_FROM), None), (changed(files=None), None)],
    "env keys": [(changed(env={"1A": "x"}), None), (changed(env={"A-B": "x"}), None)],
    "file paths": [
        (changed(files={"../h.py": ""}), None),
        (changed(files={"/etc/h.py": ""}), None),
        (changed(files={"a/../../h.py": ""}), None),
    ],
}


def _without_nulls(obj: Any) -> Any:
    """`obj` as the API server keeps it: a field set to null is absent."""
    if isinstance(obj, dict):
        return {k: _without_nulls(v) for k, v in obj.items() if v is not None}
    return obj


def test_every_rule_passes_a_good_run_and_refuses_what_it_exists_to(
    schema: dict[str, Any],
) -> None:
    found = list(rules(schema))
    named = {next(m for m in REFUSED if rule["message"].startswith(m)) for _, rule in found}
    assert named == set(REFUSED) and len(found) == len(REFUSED), found
    for path, rule in found:
        text = rule["rule"]
        transition = "oldSelf" in text
        for good in (GOOD, GOOD_FROM):
            if path and path[-1] not in at(good, path[:-1]):
                continue  # a rule of a field applies where the field is
            assert holds(text, at(good, path), at(good, path) if transition else None), text
        (refused,) = [cases for m, cases in REFUSED.items() if rule["message"].startswith(m)]
        for create, update in refused:
            create, update = _without_nulls(create), _without_nulls(update)
            if transition:
                assert update is not None
                assert not holds(text, at(update, path), at(create, path)), (text, update)
            else:
                assert not holds(text, at(create, path)), (text, create)


def test_everything_a_rule_reads_is_bounded(schema: dict[str, Any]) -> None:
    # docs/kubernetes.md, "The Run's validation rules": the API server refuses a CRD whose
    # rules' estimated cost is past its budget; the estimate is bounded when every string, map
    # and list a rule reads is. (A map's keys cannot be bounded by a schema: their number is.)
    for path, rule in rules(schema):
        if path == ():  # over the whole object it reads metadata.name, the API server's own
            assert rule["rule"].startswith("self.metadata.name.matches("), rule
            assert rule["rule"].count("self") == 1, rule
            continue
        node = schema
        for name in path:
            node = node["properties"][name] if name != "*" else node["additionalProperties"]
        assert list(unbounded(node, ".".join(path))) == []
    spec = schema["properties"]["spec"]["properties"]
    assert spec["env"]["additionalProperties"]["maxLength"] == limits.MAX_ENV_BYTES
    assert spec["files"]["additionalProperties"]["maxLength"] == objects.MAX_OBJECT_BYTES
