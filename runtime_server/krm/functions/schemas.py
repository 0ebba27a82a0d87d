"""``kubeconform`` and ``kubeval``: schema validation offline (docs/krm.md, "Builtin functions").

Each resource is checked against its JSON schema: the Kubernetes OpenAPI schemas that
kubernetes-validate ships (the newest version it has; ``-strict`` ones with ``strict``), or the
``file://`` directories a config's ``schema_location`` / ``additional_schema_locations`` name
(``KIND-GROUP-VERSION.json`` files, as both tools lay them out), and a custom resource against
the ``openAPIV3Schema`` of a CustomResourceDefinition among the resources. One error result per
problem, worded as the catalog function's own validator words it: kubeconform's
(``missing properties 'selector', 'template'``, ``got string, want null or integer``) or
kubeval's (``Additional property templates is not allowed``, ``Invalid type. Expected:
[integer,null], given: string``); kinds other than these keep jsonschema's words.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fnkernel.runtime_server.krm.functions.processes import host_path
from fnkernel.runtime_server.krm.resources.package import INDEX_ANNOTATION, PATH_ANNOTATION
from fnkernel.runtime_server.krm.resources.resourcelist import (
    ERROR,
    ResourceList,
    Result,
    annotations_of,
    api_group,
    is_local_config,
    kind,
)

if TYPE_CHECKING:  # jsonschema loads only when a validator runs
    import jsonschema

_TYPE_ORDER = ("null", "boolean", "number", "integer", "string", "array", "object")


@dataclass(frozen=True)
class Config:
    strict: bool = False
    ignore_missing: bool = False
    skip: tuple[str, ...] = ()
    locations: tuple[str, ...] = ()


def read_config(config: Any) -> Config:
    """The config's keys, at its top level or in a ConfigMap's ``data``."""
    config = config if isinstance(config, dict) else {}
    data = config.get("data") if isinstance(config.get("data"), dict) else {}

    def text(key: str) -> str:
        value = config.get(key, data.get(key, ""))
        return str(value).lower() if isinstance(value, bool) else str(value or "")

    def listed(key: str) -> tuple[str, ...]:
        return tuple(part.strip() for part in text(key).split(",") if part.strip())

    return Config(
        strict=text("strict").lower() in ("true", "1"),
        ignore_missing=text("ignore_missing_schemas").lower() in ("true", "1"),
        skip=listed("skip_kinds"),
        locations=tuple(
            x for x in (text("schema_location"), *listed("additional_schema_locations")) if x
        ),
    )


def schema_file(obj: dict[str, Any]) -> str:
    """``deployment-apps-v1.json``: kind, the group's first label, version."""
    api_version = str(obj.get("apiVersion", ""))
    api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    return f"{kind(obj).lower()}-{api}.json"


def make_strict(schema: Any, root: bool = False) -> Any:
    """`schema` with additional properties refused wherever it names properties (what the
    ``-strict`` schemas are), unless it keeps unknown fields."""
    if isinstance(schema, list):
        return [make_strict(part) for part in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: make_strict(value) for key, value in schema.items()}
    keeps_unknown = out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and "additionalProperties" not in out and not keeps_unknown:
        out["additionalProperties"] = False
    if root and "properties" in out:  # a CRD's schema leaves out what every object has
        out["properties"] = {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            **out["properties"],
        }
    return out


class Schemas:
    """Validators by schema file, from the config's locations or kubernetes-validate's, and
    from the CustomResourceDefinitions among the resources."""

    def __init__(self, config: Config, items: list[dict[str, Any]]) -> None:
        self.config = config
        self.crds = dict(_crd_schemas(items))

    def validator(self, obj: dict[str, Any]) -> jsonschema.protocols.Validator | None:
        name = schema_file(obj)
        for location in self.config.locations:
            if not location.startswith("file://"):
                raise ValueError(
                    f"schema location {location} cannot be read: only file:// locations "
                    "are, as no network is used"
                )
            root = Path(location.removeprefix("file://"))
            # kubeval's layout puts the files under VERSION-standalone[-strict]/.
            for place in (root, *(root / f"master-standalone{s}" for s in ("-strict", ""))):
                directory = Path(host_path(str(place)))  # through fn eval's --mount
                if (directory / name).is_file():
                    return _file_validator(str(directory), name, self.config.strict)
        if not self.config.locations:
            found = _builtin_validator(name, self.config.strict)
            if found is not None:
                return found
        crd = self.crds.get((api_group(obj), kind(obj), _version(obj)))
        if crd is not None:
            return _validator_for(make_strict(crd, root=True) if self.config.strict else crd)
        return None


def _version(obj: dict[str, Any]) -> str:
    return str(obj.get("apiVersion", "")).rpartition("/")[2]


def _crd_schemas(items: list[dict[str, Any]]) -> Iterator[tuple[tuple[str, str, str], Any]]:
    for item in items:
        if kind(item) != "CustomResourceDefinition" or not isinstance(item.get("spec"), dict):
            continue
        spec = _plain(item["spec"])
        group, names = spec.get("group", ""), spec.get("names") or {}
        for version in spec.get("versions") or []:
            schema = (version.get("schema") or {}).get("openAPIV3Schema")
            if isinstance(schema, dict):
                yield (group, names.get("kind", ""), version.get("name", "")), schema


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _validator_for(schema: Any, read: Callable[[str], Any] | None = None) -> Any:
    """A validator of `schema`; `read(uri)` gives the documents its ``$ref``s name."""
    import jsonschema
    import referencing
    import referencing.jsonschema

    def retrieve(uri: str) -> referencing.Resource[Any]:
        assert read is not None
        spec = referencing.jsonschema.DRAFT202012
        return referencing.Resource.from_contents(read(uri), default_specification=spec)

    registry: referencing.Registry[Any] = (
        referencing.Registry(retrieve=retrieve) if read else referencing.Registry()  # type: ignore[call-arg]
    )
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, registry=registry)


def _document(uri: str) -> str:
    """The file a ``$ref`` names, beside the schema (``https://…/_definitions.json#/…``)."""
    return uri.split("#")[0].rsplit("/", 1)[-1]


@functools.lru_cache(maxsize=512)
def _file_validator(directory: str, name: str, strict: bool) -> Any:
    def read(file: str) -> Any:
        schema = json.loads((Path(directory) / _document(file)).read_text())
        return make_strict(schema) if strict else schema

    return _validator_for(read(name), read)


@functools.lru_cache(maxsize=512)
def _builtin_validator(name: str, strict: bool) -> Any:
    from kubernetes_validate import utils

    version = utils.latest_version()
    directory = f"kubernetes-json-schema/v{utils.all_versions()[-1]}-local" + (
        "-strict" if strict else ""
    )

    def read(file: str) -> Any:
        return utils.schema_contents(f"{directory}/{_document(file)}", version)

    try:
        schema = read(name)
    except FileNotFoundError:
        return None
    return _validator_for(schema, read)


# What the validators say


@dataclass(frozen=True)
class Problem:
    path: tuple[Any, ...]  # where in the object
    message: str
    field: str  # the result's field path


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in path)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _missing(error: Any) -> list[str]:
    return [
        p
        for p in error.validator_value
        if isinstance(error.instance, dict) and p not in error.instance
    ]


def _extra(error: Any) -> list[str]:
    known = error.schema.get("properties") or {}
    patterns = [re.compile(p) for p in error.schema.get("patternProperties") or {}]
    return [
        key
        for key in error.instance
        if key not in known and not any(p.search(key) for p in patterns)
    ]


def _types(error: Any) -> list[str]:
    wanted = error.validator_value
    return [wanted] if isinstance(wanted, str) else list(wanted)


def kubeconform_problems(error: Any) -> list[Problem]:
    path = tuple(error.absolute_path)
    quoted = lambda names: ", ".join(f"'{n}'" for n in names)  # noqa: E731
    if error.validator == "required":
        missing = _missing(error)
        noun = "property" if len(missing) == 1 else "properties"
        return [Problem(path, f"missing {noun} {quoted(missing)}", _dotted(path))]
    if error.validator == "type":
        wanted = sorted(
            _types(error), key=lambda t: _TYPE_ORDER.index(t) if t in _TYPE_ORDER else 9
        )
        message = f"got {_json_type(error.instance)}, want {' or '.join(wanted)}"
        return [Problem(path, message, _dotted(path))]
    if error.validator == "additionalProperties" and error.validator_value is False:
        message = f"additional properties {quoted(_extra(error))} not allowed"
        return [Problem(path, message, _dotted(path))]
    return [Problem(path, error.message, _dotted(path))]


def kubeval_problems(error: Any) -> list[Problem]:
    path = tuple(error.absolute_path)
    if error.validator == "required":
        return [Problem(path, f"{name} is required", name) for name in _missing(error)]
    if error.validator == "additionalProperties" and error.validator_value is False:
        return [
            Problem(path, f"Additional property {name} is not allowed", name)
            for name in _extra(error)
        ]
    if error.validator == "type":
        types = _types(error)
        expected = types[0] if len(types) == 1 else "[" + ",".join(types) + "]"
        given = _json_type(error.instance)
        message = f"Invalid type. Expected: {expected}, given: {given}"
        return [Problem(path, message, _dotted(path))]
    if error.validator == "enum":
        allowed = ", ".join(json.dumps(v) for v in error.validator_value)
        field = _dotted(path) or "(root)"
        return [Problem(path, f"{field} must be one of the following: {allowed}", _dotted(path))]
    return [Problem(path, error.message, _dotted(path))]


def _sort_key(path: tuple[Any, ...]) -> tuple[tuple[int, Any], ...]:
    """An object's own problems before those inside it (as both tools walk it)."""
    return tuple((0, p) if isinstance(p, int) else (1, str(p)) for p in path)


def _ref(obj: dict[str, Any]) -> dict[str, str]:
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    ref = {"apiVersion": str(obj.get("apiVersion", "")), "kind": kind(obj)}
    for key in ("name", "namespace"):
        if meta.get(key):  # type: ignore[union-attr]
            ref[key] = str(meta[key])  # type: ignore[index]
    return ref


def _skipped(obj: dict[str, Any], skip: tuple[str, ...]) -> bool:
    return kind(obj) in skip or f"{obj.get('apiVersion', '')}/{kind(obj)}" in skip


def validate(
    rl: ResourceList,
    problems: Callable[[Any], list[Problem]],
    missing: Callable[[dict[str, Any], Config], Result | None],
    *,
    local_config: bool = True,
) -> None:
    """Validate every resource (not local-config ones unless `local_config`); `problems`
    words a jsonschema error, `missing` says what a resource without a schema gets (or
    None)."""
    config = read_config(rl.function_config)
    try:
        schemas = Schemas(config, rl.items)
        results: list[Result] = []
        for obj in rl.items:
            if _skipped(obj, config.skip) or (not local_config and is_local_config(obj)):
                continue
            validator = schemas.validator(obj)
            if validator is None:
                result = missing(obj, config)
                if result is not None:
                    results.append(result)
                continue
            errors = validator.iter_errors(_plain(obj))
            # jsonschema reports each missing property apart; the tools say them once.
            found = list(dict.fromkeys(p for error in errors for p in problems(error)))
            notes = annotations_of(obj)
            index = str(notes.get(INDEX_ANNOTATION, "0") or "0")
            for problem in sorted(found, key=lambda p: _sort_key(p.path)):
                results.append(
                    Result(
                        problem.message,
                        ERROR,
                        resource=_ref(obj),
                        field_path=problem.field,
                        file_path=str(notes.get(PATH_ANNOTATION, "") or ""),
                        file_index=int(index) if index.isdigit() else 0,
                    )
                )
    except ValueError as exc:
        rl.add_results([Result(str(exc), ERROR)])
        return
    rl.add_results(results)


def kubeconform(rl: ResourceList) -> None:
    """A resource without a schema passes, as with kubeconform (it reports no error for it)."""
    validate(rl, kubeconform_problems, lambda obj, config: None)


def _kubeval_missing(obj: dict[str, Any], config: Config) -> Result | None:
    if config.ignore_missing:
        return None
    return Result(
        "Validating arbitrary CRDs is not supported yet. You can skip them by setting "
        "ignore_missing_schemas or skip_kinds in the function config:\n"
        f"Failed initializing schema file {schema_file(obj)}",
        ERROR,
        resource=_ref(obj),
        file_path=str(annotations_of(obj).get(PATH_ANNOTATION, "") or ""),
    )


def kubeval(rl: ResourceList) -> None:
    """A resource without a schema is an error unless ``ignore_missing_schemas``; local-config
    resources (a package's Kptfile, say) are left alone, as the catalog's kubeval leaves
    them."""
    validate(rl, kubeval_problems, _kubeval_missing, local_config=False)


# The catalog's kubeval (TypeScript) fails with its results alone, printing nothing.
kubeval.failure_stderr = ""  # type: ignore[attr-defined]
