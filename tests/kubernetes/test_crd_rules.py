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


# What each rule refuses: (where it applies, a create it must refuse, an update it must refuse).
REFUSED: dict[Path_, list[tuple[dict[str, Any], dict[str, Any] | None]]] = {
    (): [
        ({**GOOD, "metadata": {"name": "My_Fn"}}, None),
        ({**GOOD, "metadata": {"name": "-a"}}, None),
    ],
    ("spec",): [(GOOD, changed(handler="h.other")), (GOOD, changed(env={"REGION": "us"}))],
    ("spec", "env"): [(changed(env={"1A": "x"}), None), (changed(env={"A-B": "x"}), None)],
    ("spec", "files"): [
        (changed(files={"../h.py": ""}), None),
        (changed(files={"/etc/h.py": ""}), None),
        (changed(files={"a/../../h.py": ""}), None),
    ],
}


def test_every_rule_passes_a_good_run_and_refuses_what_it_exists_to(
    schema: dict[str, Any],
) -> None:
    found = list(rules(schema))
    assert {path for path, _ in found} == set(REFUSED), found
    for path, rule in found:
        text = rule["rule"]
        transition = "oldSelf" in text
        assert holds(text, at(GOOD, path), at(GOOD, path) if transition else None), text
        for create, update in REFUSED[path]:
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
