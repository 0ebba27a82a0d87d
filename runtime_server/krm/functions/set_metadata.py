"""``set-labels`` and ``set-annotations``, as the catalog's functions behave (docs/krm.md,
"Builtin functions").

set-labels labels every object's metadata and, by kind, the selectors and pod templates that
must agree with it, creating a selector only where the kind requires one. set-annotations
annotates at kustomize's commonAnnotations field specs plus the config's
``additionalAnnotationFields``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fnkernel.runtime_server.krm.resources.package import INDEX_ANNOTATION, PATH_ANNOTATION
from fnkernel.runtime_server.krm.resources.resourcelist import (
    ERROR,
    INFO,
    WARNING,
    FunctionFailure,
    ResourceList,
    Result,
    annotations_of,
    api_group,
    is_local_config,
    kind,
    walk,
)


@dataclass(frozen=True)
class FieldSpec:
    """A kustomize field spec: the `path` (``/``-separated) in objects of a kind; an empty
    kind, group or version matches any. With `create`, missing maps on the path are made."""

    path: str
    create: bool = False
    kind: str = ""
    group: str = ""
    version: str = ""

    def applies(self, obj: Mapping[str, Any]) -> bool:
        api_version = str(obj.get("apiVersion", "") or "")
        group, _, version = api_version.rpartition("/")
        return all(
            not want or have == want
            for have, want in ((kind(obj), self.kind), (group, self.group), (version, self.version))  # type: ignore[arg-type]
        )

    @classmethod
    def of(cls, node: Any, field: str = "additionalAnnotationFields") -> FieldSpec:
        """From an entry of a config's `field` (``additionalAnnotationFields``, say)."""
        if not isinstance(node, Mapping) or not node.get("path"):
            raise ValueError(f"each of `{field}` needs a `path`")
        return cls(
            str(node["path"]),
            bool(node.get("create", False)),
            str(node.get("kind", "") or ""),
            str(node.get("group", "") or ""),
            str(node.get("version", "") or ""),
        )


_AFFINITY = [
    f"spec/template/spec/affinity/{affinity}/{when}/{term}labelSelector/matchLabels"
    for affinity in ("podAffinity", "podAntiAffinity")
    for when, term in (
        ("preferredDuringSchedulingIgnoredDuringExecution", "podAffinityTerm/"),
        ("requiredDuringSchedulingIgnoredDuringExecution", ""),
    )
]
_TOPOLOGY = "spec/template/spec/topologySpreadConstraints/labelSelector/matchLabels"

ANNOTATION_SPECS = (
    FieldSpec("metadata/annotations", create=True),
    FieldSpec("spec/template/metadata/annotations", True, "ReplicationController", "", "v1"),
    FieldSpec("spec/template/metadata/annotations", True, "Deployment"),
    FieldSpec("spec/template/metadata/annotations", True, "ReplicaSet"),
    FieldSpec("spec/template/metadata/annotations", True, "DaemonSet"),
    FieldSpec("spec/template/metadata/annotations", True, "StatefulSet", "apps"),
    FieldSpec("spec/template/metadata/annotations", True, "Job", "batch"),
    FieldSpec("spec/jobTemplate/metadata/annotations", True, "CronJob", "batch"),
    FieldSpec("spec/jobTemplate/spec/template/metadata/annotations", True, "CronJob", "batch"),
)


def _annotation_config(config: Mapping[str, Any] | None) -> tuple[dict[str, str], list[FieldSpec]]:
    """(annotations, extra field specs) from set-annotations' functionConfig: a ConfigMap's
    data, or ``fn.kpt.dev/v1alpha1 SetAnnotations`` (``annotations`` and
    ``additionalAnnotationFields``; ``fieldSpecs`` is the old name of the latter)."""
    config = config or {}
    api_version, kind_ = config.get("apiVersion"), config.get("kind")
    extra: list[FieldSpec] = []
    if (api_version, kind_) == ("v1", "ConfigMap"):
        pairs = config.get("data") or {}
    elif api_version == "fn.kpt.dev/v1alpha1" and kind_ in (
        "SetAnnotations",
        "SetAnnotationConfig",
    ):
        pairs = config.get("annotations") or {}
        fields, old_fields = config.get("additionalAnnotationFields"), config.get("fieldSpecs")
        if fields is not None and old_fields is not None:
            raise ValueError(
                "`fieldSpecs` has been deprecated, please rename it to `additionalAnnotationFields`"
            )
        extra = [
            FieldSpec.of(node) for node in (fields if fields is not None else old_fields) or []
        ]
    else:
        raise ValueError("`functionConfig` must be a `ConfigMap` or `SetAnnotations`")
    if not isinstance(pairs, Mapping):
        raise ValueError("`annotations` must be a map of strings")
    if not pairs:
        raise ValueError("input annotation list cannot be empty")
    return {str(k): str(v) for k, v in pairs.items()}, extra


def set_annotations(rl: ResourceList) -> None:
    """set-annotations as the catalog's function does it: every object (local-config ones too)
    at each field spec, with one result per file, document and field listing what was set."""
    try:
        annotations, extra = _annotation_config(rl.function_config)
    except ValueError as exc:
        rl.add_results([Result(str(exc), ERROR)])
        return
    specs = (*extra, *ANNOTATION_SPECS)
    applied: dict[tuple[str, int, str], dict[str, str]] = {}
    for obj in rl.items:
        notes = annotations_of(obj)
        path = str(notes.get(PATH_ANNOTATION, ""))
        index = int(str(notes.get(INDEX_ANNOTATION, "0")) or 0)
        for spec in specs:
            if not spec.applies(obj):
                continue
            parts = spec.path.split("/")
            for target in walk(obj, parts, create=spec.create):
                target.update(annotations)
                field = ".".join(part.removesuffix("[]") for part in parts)
                applied.setdefault((path, index, field), {}).update(annotations)
    if not applied:
        rl.add_results([Result("no annotations applied", "")])
        return
    results = []
    for (path, index, field), values in sorted(applied.items()):
        text = json.dumps(dict(sorted(values.items())), separators=(",", ":"))
        results.append(
            Result(
                f"set annotations: {text}", "", field_path=field, file_path=path, file_index=index
            )
        )
    rl.add_results(results)


def is_gvk(obj: Mapping[str, Any], group: str, version: str, kind_: str) -> bool:
    """The catalog's loose match: a part given on neither side is not compared (so
    ``("", "", "Deployment")`` is any Deployment, and an object without a kind matches all)."""
    api_version = str(obj.get("apiVersion", "") or "")
    have_group, _, have_version = api_version.rpartition("/")
    for have, want in ((kind(obj), kind_), (have_group, group), (have_version, version)):  # type: ignore[arg-type]
        if have and want and have != want:
            return False
    return True


class _LabelSetter:
    """set-labels as the catalog's function does it: ``metadata.labels`` always, and the
    selectors and templates of the kinds it knows; a selector is created only where the kind's
    selector is required (a Deployment's), otherwise only keys already there are updated. Every
    place visited counts toward "set N labels in total", changed or not."""

    def __init__(self, labels: Mapping[str, str]) -> None:
        self.labels = dict(sorted(labels.items()))
        self.count = 0

    def update(self, node: Any, path: tuple[str, ...], create: bool) -> None:
        if not isinstance(node, dict):
            return
        for key, value in self.labels.items():
            target: Any = node
            for part in path:
                target = target.get(part) if isinstance(target, dict) else None
            present = isinstance(target, dict) and key in target
            if (present and target[key] != value) or (not present and create):
                for place in walk(node, list(path), create=True):
                    place[key] = value
            self.count += 1

    def pod(self, template: Any) -> None:
        if not isinstance(template, dict):
            return
        self.update(template, ("metadata", "labels"), True)
        spec = template.get("spec")
        if not isinstance(spec, dict):
            return
        for constraint in _list(spec.get("topologySpreadConstraints")):
            self.update(constraint, ("labelSelector", "matchLabels"), False)
        affinity = spec.get("affinity")
        if isinstance(affinity, dict):
            for name in ("podAffinity", "podAntiAffinity"):
                if not isinstance(affinity.get(name), dict):
                    continue
                # As the catalog's function does, the terms are looked for under `affinity`.
                preferred = "preferredDuringSchedulingIgnoredDuringExecution"
                for term in _list(affinity.get(preferred)):
                    if isinstance(term, dict) and isinstance(term.get("podAffinityTerm"), dict):
                        self.update(
                            term["podAffinityTerm"], ("labelSelector", "matchLabels"), False
                        )
                required = "requiredDuringSchedulingIgnoredDuringExecution"
                for term in _list(affinity.get(required)):
                    self.update(term, ("labelSelector", "matchLabels"), False)

    def object(self, obj: Any) -> None:
        self.update(obj, ("metadata", "labels"), True)
        if is_gvk(obj, "", "v1", "Service") or is_gvk(obj, "", "v1", "ReplicationController"):
            self.update(obj, ("spec", "selector"), True)
        workload = any(is_gvk(obj, "", "", k) for k in ("Deployment", "ReplicaSet", "DaemonSet"))
        if workload or is_gvk(obj, "apps", "", "StatefulSet"):
            self.update(obj, ("spec", "selector", "matchLabels"), True)
        elif is_gvk(obj, "batch", "", "Job") or is_gvk(obj, "policy", "", "PodDisruptionBudget"):
            self.update(obj, ("spec", "selector", "matchLabels"), False)
        network_policy = is_gvk(obj, "networking.k8s.io", "", "NetworkPolicy")
        if network_policy:
            self.update(obj, ("spec", "podSelector", "matchLabels"), False)
        spec = obj.get("spec")
        if not isinstance(spec, dict):
            return
        has_pod = is_gvk(obj, "", "v1", "ReplicationController") or workload
        if has_pod or is_gvk(obj, "apps", "", "StatefulSet") or is_gvk(obj, "batch", "", "Job"):
            self.pod(spec.get("template"))
        if is_gvk(obj, "batch", "", "CronJob") and isinstance(spec.get("jobTemplate"), dict):
            job = spec["jobTemplate"]
            self.update(job, ("metadata", "labels"), True)
            if isinstance(job.get("spec"), dict):
                self.update(job["spec"], ("selector", "matchLabels"), False)
                self.pod(job["spec"].get("template"))
        if is_gvk(obj, "apps", "", "StatefulSet"):
            for claim in _list(spec.get("volumeClaimTemplates")):
                self.update(claim, ("metadata", "labels"), True)
                self.update(claim, ("selector", "matchLabels"), False)
        if network_policy:
            for rule in _list(spec.get("ingress")):
                for peer in _list(rule.get("from") if isinstance(rule, dict) else None):
                    self.update(peer, ("podSelector", "matchLabels"), False)
            for rule in _list(spec.get("egress")):
                for peer in _list(rule.get("to") if isinstance(rule, dict) else None):
                    self.update(peer, ("podSelector", "matchLabels"), False)


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


NO_CONFIG = "`FunctionConfig` is not given"


def config_pairs(
    config: Mapping[str, Any] | None, custom_kind: str, field: str
) -> dict[str, str] | None:
    """The pairs a catalog function built on the functions SDK reads from its functionConfig:
    a ConfigMap's ``data``, or the ``fn.kpt.dev`` kind's `field`; None when there is no config
    (nothing, or kpt's empty ``function-input`` ConfigMap)."""
    if not config or not (kind(config) or (config.get("metadata") or {}).get("name")):  # type: ignore[arg-type]
        return None
    if kind(config) == "ConfigMap":  # type: ignore[arg-type]
        data = config.get("data")
        if not data and (config.get("metadata") or {}).get("name") == "function-input":
            return None
        pairs = data or {}
    elif kind(config) == custom_kind and api_group(config) == "fn.kpt.dev":  # type: ignore[arg-type]
        pairs = config.get(field) or {}
    else:
        raise ValueError(f"unknown FunctionConfig `{kind(config)}`, expect {custom_kind}")  # type: ignore[arg-type]
    if not isinstance(pairs, Mapping) or not all(
        isinstance(v, str | int | float | bool) for v in pairs.values()
    ):
        raise ValueError(f"`{field}` must be a map of strings")
    return {str(key): str(value) for key, value in pairs.items()}


def set_labels(rl: ResourceList) -> None:
    """set-labels (the catalog's rules: ``_LabelSetter``)."""
    try:
        labels = config_pairs(rl.function_config, "SetLabels", "labels")
    except ValueError as exc:
        rl.add_results([Result(str(exc), ERROR)])
        return
    if labels is None:
        rl.add_results([Result(NO_CONFIG, INFO)])
    objects = [obj for obj in rl.items if not is_local_config(obj)]
    if not objects:
        rl.add_results([Result("no input resources", INFO)])
        return
    if labels is None:
        raise FunctionFailure()
    if not labels:
        rl.add_results([Result("no `labels` arguments are given in FunctionConfig", WARNING)])
        return
    setter = _LabelSetter(labels)
    for obj in objects:
        setter.object(obj)
    rl.add_results([Result(f"set {setter.count} labels in total", INFO)])
