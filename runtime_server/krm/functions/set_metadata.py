"""``set-labels`` and ``set-annotations`` (krm-functions-catalog, written from their documentation).

Each label/annotation is added or replaced on every object's metadata and, as kustomize's
commonLabels / commonAnnotations field specs say, in the selectors and pod templates that must
agree with it (a Service's selector, a Deployment's matchLabels and template, ...). A field spec
with ``create`` makes missing maps; without it only existing ones change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime_server.krm.resources.resourcelist import (
    ERROR,
    INFO,
    ResourceList,
    Result,
    api_group,
    kind,
    walk,
)


@dataclass(frozen=True)
class FieldSpec:
    path: str
    create: bool = False
    kind: str = ""
    group: str | None = None  # None: any group

    def applies(self, obj: Mapping[str, Any]) -> bool:
        if self.kind and kind(obj) != self.kind:  # type: ignore[arg-type]
            return False
        return self.group is None or api_group(obj) == self.group  # type: ignore[arg-type]


_AFFINITY = [
    f"spec/template/spec/affinity/{affinity}/{when}/{term}labelSelector/matchLabels"
    for affinity in ("podAffinity", "podAntiAffinity")
    for when, term in (
        ("preferredDuringSchedulingIgnoredDuringExecution", "podAffinityTerm/"),
        ("requiredDuringSchedulingIgnoredDuringExecution", ""),
    )
]
_TOPOLOGY = "spec/template/spec/topologySpreadConstraints/labelSelector/matchLabels"

LABEL_SPECS = (
    FieldSpec("metadata/labels", create=True),
    FieldSpec("spec/selector", True, "Service", ""),
    FieldSpec("spec/selector", True, "ReplicationController", ""),
    FieldSpec("spec/template/metadata/labels", True, "ReplicationController", ""),
    FieldSpec("spec/selector/matchLabels", True, "Deployment"),
    FieldSpec("spec/template/metadata/labels", True, "Deployment"),
    *(FieldSpec(path, False, "Deployment", "apps") for path in (*_AFFINITY, _TOPOLOGY)),
    FieldSpec("spec/selector/matchLabels", True, "ReplicaSet"),
    FieldSpec("spec/template/metadata/labels", True, "ReplicaSet"),
    FieldSpec("spec/selector/matchLabels", True, "DaemonSet"),
    FieldSpec("spec/template/metadata/labels", True, "DaemonSet"),
    FieldSpec("spec/selector/matchLabels", True, "StatefulSet", "apps"),
    FieldSpec("spec/template/metadata/labels", True, "StatefulSet", "apps"),
    *(FieldSpec(path, False, "StatefulSet", "apps") for path in (*_AFFINITY, _TOPOLOGY)),
    FieldSpec("spec/volumeClaimTemplates[]/metadata/labels", True, "StatefulSet", "apps"),
    FieldSpec("spec/selector/matchLabels", False, "Job", "batch"),
    FieldSpec("spec/template/metadata/labels", True, "Job", "batch"),
    FieldSpec("spec/jobTemplate/spec/selector/matchLabels", False, "CronJob", "batch"),
    FieldSpec("spec/jobTemplate/metadata/labels", True, "CronJob", "batch"),
    FieldSpec("spec/jobTemplate/spec/template/metadata/labels", True, "CronJob", "batch"),
    FieldSpec("spec/selector/matchLabels", False, "PodDisruptionBudget", "policy"),
    FieldSpec("spec/podSelector/matchLabels", False, "NetworkPolicy", "networking.k8s.io"),
    FieldSpec(
        "spec/ingress/from/podSelector/matchLabels", False, "NetworkPolicy", "networking.k8s.io"
    ),
    FieldSpec(
        "spec/egress/to/podSelector/matchLabels", False, "NetworkPolicy", "networking.k8s.io"
    ),
)

ANNOTATION_SPECS = (
    FieldSpec("metadata/annotations", create=True),
    FieldSpec("spec/template/metadata/annotations", True, "ReplicationController", ""),
    FieldSpec("spec/template/metadata/annotations", True, "Deployment"),
    FieldSpec("spec/template/metadata/annotations", True, "ReplicaSet"),
    FieldSpec("spec/template/metadata/annotations", True, "DaemonSet"),
    FieldSpec("spec/template/metadata/annotations", True, "StatefulSet", "apps"),
    FieldSpec("spec/template/metadata/annotations", True, "Job", "batch"),
    FieldSpec("spec/jobTemplate/metadata/annotations", True, "CronJob", "batch"),
    FieldSpec("spec/jobTemplate/spec/template/metadata/annotations", True, "CronJob", "batch"),
)


def read_pairs(config: Mapping[str, Any] | None, custom_kind: str, field: str) -> dict[str, str]:
    """The key/value pairs from a ConfigMap's ``data`` or a ``fn.kpt.dev`` custom resource."""
    if not config:
        raise ValueError(f"FunctionConfig is missing. Expect `ConfigMap.v1` or `{custom_kind}`")
    if kind(config) == "ConfigMap":  # type: ignore[arg-type]
        pairs = config.get("data") or {}
    elif kind(config) == custom_kind:  # type: ignore[arg-type]
        pairs = config.get(field) or {}
    else:
        raise ValueError(
            f"unknown functionConfig Kind={kind(config)}, expect `ConfigMap.v1` or `{custom_kind}`"  # type: ignore[arg-type]
        )
    if not isinstance(pairs, Mapping):
        raise ValueError(f"`{field}` must be a map of strings")
    return {str(key): str(value) for key, value in pairs.items()}


def apply_pairs(rl: ResourceList, pairs: Mapping[str, str], specs: tuple[FieldSpec, ...]) -> int:
    """Write `pairs` at every field spec that applies; how many values changed."""
    changed = 0
    for obj in rl.items:
        for spec in specs:
            if not spec.applies(obj):
                continue
            for target in walk(obj, spec.path.split("/"), create=spec.create):
                for key, value in pairs.items():
                    if target.get(key) != value:
                        target[key] = value
                        changed += 1
    return changed


def _run(rl: ResourceList, custom_kind: str, field: str, specs: tuple[FieldSpec, ...]) -> None:
    try:
        pairs = read_pairs(rl.function_config, custom_kind, field)
    except ValueError as exc:
        rl.add_results([Result(str(exc), ERROR)])
        return
    changed = apply_pairs(rl, pairs, specs)
    what = "label" if field == "labels" else "annotation"
    rl.add_results([Result(f"set {len(pairs)} {what}(s): {changed} value(s) changed", INFO)])


def set_labels(rl: ResourceList) -> None:
    _run(rl, "SetLabels", "labels", LABEL_SPECS)


def set_annotations(rl: ResourceList) -> None:
    _run(rl, "SetAnnotations", "annotations", ANNOTATION_SPECS)
