"""``ensure-name-substring``, as the catalog's function behaves (docs/krm.md, "Builtin functions").

Every resource's name (and the config's ``additionalNameFields``) gets the substring prepended or
appended unless it holds it already; the references other resources make to a renamed one follow
it (kustomize's name references: a Pod's ConfigMap volume, a RoleBinding's role, …), and so do
``config.kubernetes.io/depends-on`` annotations naming it. Like the catalog's function, which
passes the resources through kustomize, it returns them without their file annotations: kpt
writes each to ``[NAMESPACE/]KIND_NAME.yaml``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fnkernel.runtime_server.krm.functions.set_metadata import FieldSpec
from fnkernel.runtime_server.krm.resources.package import INTERNAL
from fnkernel.runtime_server.krm.resources.resourcelist import (
    FunctionFailure,
    ResourceList,
    annotations_of,
    api_group,
    kind,
)

DEPENDS_ON = "config.kubernetes.io/depends-on"
_SKIPPED = {("", "CustomResourceDefinition"), ("apiregistration.k8s.io", "APIService")}
_SKIPPED |= {("", "Namespace"), ("kpt.dev", "Kptfile")}
_NAMESPACED = re.compile(r"\A([-.\w]*)/namespaces/([-.\w]*)/([-.\w]*)/([-.\w]*)\Z")
_CLUSTER = re.compile(r"\A([-.\w]*)/([-.\w]*)/([-.\w]*)\Z")


@dataclass(frozen=True)
class Referral:
    """Fields of `referrer` kinds (path from the object) that name a `kind` resource."""

    kind: str
    group: str
    fields: tuple[tuple[str, str], ...]  # (referrer kind, path)


def _pod_fields(paths: tuple[str, ...], workloads: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """`paths` inside a pod spec, for a Pod, the pod template of each of `workloads` and a
    CronJob's job template."""
    where = [("Pod", "spec"), *((w, "spec/template/spec") for w in workloads)]
    where.append(("CronJob", "spec/jobTemplate/spec/template/spec"))
    return tuple((owner, f"{base}/{path}") for owner, base in where for path in paths)


_TEMPLATED = ("Deployment", "ReplicaSet", "DaemonSet", "StatefulSet", "Job")
_CONTROLLED = ("StatefulSet", "Deployment", "ReplicationController", "Job", "DaemonSet")
_CONTAINERS = ("containers", "initContainers")
_RULES = (("Role", "rules/resourceNames"), ("ClusterRole", "rules/resourceNames"))

# kustomize's default name references, by the kind referred to.
REFERRALS = (
    *(Referral(k, "", (("HorizontalPodAutoscaler", "spec/scaleTargetRef/name"),))
      for k in ("Deployment", "ReplicationController", "ReplicaSet", "StatefulSet")),
    Referral("ConfigMap", "", (
        *_pod_fields(("volumes/configMap/name", "volumes/projected/sources/configMap/name",
                      *(f"{c}/env/valueFrom/configMapKeyRef/name" for c in _CONTAINERS),
                      *(f"{c}/envFrom/configMapRef/name" for c in _CONTAINERS)), _TEMPLATED),
        ("Node", "spec/configSource/configMap"), *_RULES,
    )),
    Referral("Secret", "", (
        *_pod_fields(("volumes/secret/secretName", "volumes/projected/sources/secret/name",
                      "imagePullSecrets/name",
                      *(f"{c}/env/valueFrom/secretKeyRef/name" for c in _CONTAINERS),
                      *(f"{c}/envFrom/secretRef/name" for c in _CONTAINERS)), _TEMPLATED),
        ("Ingress", "spec/tls/secretName"), ("ServiceAccount", "imagePullSecrets/name"),
        *(("StorageClass", f"parameters/{p}")
          for p in ("secretName", "adminSecretName", "userSecretName", "secretRef")),
        ("PersistentVolume", "spec/azureFile/secretName"), *_RULES,
    )),
    Referral("Service", "", (
        ("StatefulSet", "spec/serviceName"), ("Ingress", "spec/backend/serviceName"),
        ("Ingress", "spec/rules/http/paths/backend/serviceName"),
        ("Ingress", "spec/rules/http/paths/backend/service/name"),
        ("Ingress", "spec/defaultBackend/service/name"), ("APIService", "spec/service/name"),
        ("ValidatingWebhookConfiguration", "webhooks/clientConfig/service"),
        ("MutatingWebhookConfiguration", "webhooks/clientConfig/service"),
    )),
    Referral("Role", "rbac.authorization.k8s.io", (("RoleBinding", "roleRef/name"),)),
    Referral("ClusterRole", "rbac.authorization.k8s.io",
             (("RoleBinding", "roleRef/name"), ("ClusterRoleBinding", "roleRef/name"))),
    Referral("ServiceAccount", "", (
        ("RoleBinding", "subjects"), ("ClusterRoleBinding", "subjects"),
        *_pod_fields(("serviceAccountName",), _CONTROLLED),
    )),
    Referral("PersistentVolumeClaim", "",
             _pod_fields(("volumes/persistentVolumeClaim/claimName",), _CONTROLLED)),
    Referral("PersistentVolume", "",
             (("PersistentVolumeClaim", "spec/volumeName"), ("ClusterRole", "rules/resourceNames"))),
    Referral("StorageClass", "storage.k8s.io", (
        ("PersistentVolume", "spec/storageClassName"),
        ("PersistentVolumeClaim", "spec/storageClassName"),
        ("StatefulSet", "spec/volumeClaimTemplates/spec/storageClassName"),
    )),
    Referral("PriorityClass", "scheduling.k8s.io",
             _pod_fields(("priorityClassName",), _CONTROLLED)),
    Referral("IngressClass", "networking.k8s.io", (("Ingress", "spec/ingressClassName"),)),
)  # fmt: skip


@dataclass
class Config:
    substring: str
    mode: str = "prepend"
    fields: list[FieldSpec] = field(default_factory=list)

    def apply(self, name: str) -> str:
        return self.substring + name if self.mode == "prepend" else name + self.substring


def read_config(config: Any) -> Config:
    """The substring, edit mode and extra name fields; ValueError with the catalog's
    message."""
    config = config if isinstance(config, dict) else {}
    api_version, kind_ = str(config.get("apiVersion", "")), kind(config)
    if (api_version, kind_) == ("v1", "ConfigMap"):
        data = config.get("data") or {}
        if len(data) != 1:
            raise ValueError(f"only 1 entry is allowed in the ConfigMap, but got: {len(data)}")
        [(mode, substring)] = data.items()
        if mode not in ("prepend", "append"):
            raise ValueError(f"unknown editMode: {mode}, only prepend and append are allowed")
        found = Config(str(substring or ""), str(mode))
    elif (api_version, kind_) == ("fn.kpt.dev/v1alpha1", "EnsureNameSubstring"):
        if config.get("fieldSpecs") and config.get("additionalNameFields"):
            raise ValueError(
                "`fieldSpecs` has been deprecated, please rename it to `additionalNameFields`"
            )
        extra = config.get("additionalNameFields") or config.get("fieldSpecs") or []
        found = Config(
            str(config.get("substring") or ""),
            str(config.get("editMode") or "prepend"),
            [FieldSpec.of(node, "additionalNameFields") for node in extra],
        )
    else:
        group, _, version = api_version.rpartition("/")
        raise ValueError(
            "function config must be either /v1, Kind=ConfigMap or fn.kpt.dev/v1alpha1, "
            f"Kind=EnsureNameSubstring, but we got: {group}/{version}, Kind={kind_}"
        )
    if not found.substring:
        raise ValueError("substring must not be empty")
    return found


def _meta(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _key(obj: dict[str, Any]) -> tuple[str, str, str, str]:
    meta = _meta(obj)
    return (
        api_group(obj),
        kind(obj),
        str(meta.get("namespace") or ""),
        str(meta.get("name") or ""),
    )


def _holders(node: Any, parts: list[str]) -> Iterator[tuple[dict[str, Any], str]]:
    """The (mapping, key) pairs at `parts` below `node`, entering lists element by element."""
    if isinstance(node, list):
        for element in node:
            yield from _holders(element, parts)
        return
    if not isinstance(node, dict) or not parts:
        return
    key = parts[0].replace("\\/", "/")
    if len(parts) == 1:
        if key in node:
            yield node, key
        return
    yield from _holders(node.get(key), parts[1:])


def _split(path: str) -> list[str]:
    return re.split(r"(?<!\\)/", path)


@dataclass
class _Renamer:
    config: Config
    before: set[tuple[str, str, str]]  # (group, kind, name) of every input resource
    renamed: dict[tuple[str, str, str, str], str] = field(default_factory=dict)

    def rename(self, obj: dict[str, Any]) -> None:
        old = _key(obj)
        for spec in [FieldSpec("metadata/name"), *self.config.fields]:
            if not spec.applies(obj):
                continue
            for holder, key in _holders(obj, _split(spec.path)):
                value = holder[key]
                if not isinstance(value, str) or self.config.substring in value:
                    continue
                holder[key] = self.config.apply(value)
                self._follow_depends_on(obj)
        self.renamed[old] = str(_meta(obj).get("name") or "")

    def _follow_depends_on(self, obj: dict[str, Any]) -> None:
        notes = annotations_of(obj)
        value = str(notes.get(DEPENDS_ON) or "")
        found = _NAMESPACED.match(value) or _CLUSTER.match(value)
        if not found:
            return
        segments = value.split("/")
        group, kind_, name = segments[0], segments[-2], segments[-1]
        if (group, kind_, name) in self.before:
            segments[-1] = self.config.apply(name)
            notes[DEPENDS_ON] = "/".join(segments)

    def new_name(self, referral: Referral, name: str, namespace: str) -> str | None:
        """The new name of the `referral` resource once called `name`, seen from `namespace`
        ("" for a cluster-scoped referrer): None unless exactly one matches."""
        matches = {
            new
            for (group, kind_, ns, old), new in self.renamed.items()
            if kind_ == referral.kind
            and (not referral.group or group == referral.group)
            and old == name
            and (not namespace or not ns or ns == namespace)
        }
        return matches.pop() if len(matches) == 1 else None

    def fix_references(self, obj: dict[str, Any]) -> None:
        namespace = str(_meta(obj).get("namespace") or "")
        for referral in REFERRALS:
            for owner, path in referral.fields:
                if kind(obj) != owner:
                    continue
                for holder, key in _holders(obj, _split(path)):
                    self._fix(referral, holder, key, namespace)

    def _fix(self, referral: Referral, holder: dict[str, Any], key: str, namespace: str) -> None:
        value = holder[key]
        if (
            key == "name"
            and isinstance(holder.get("kind"), str)
            and holder["kind"] != referral.kind
        ):
            return  # a roleRef naming the other kind of role
        if isinstance(value, str):
            new = self.new_name(referral, value, namespace)
            if new is not None:
                holder[key] = new
        elif isinstance(value, list):  # subjects, or rules' resourceNames
            for index, element in enumerate(value):
                if isinstance(element, dict):
                    if element.get("kind", referral.kind) == referral.kind and "name" in element:
                        ns = str(element.get("namespace") or namespace)
                        new = self.new_name(referral, str(element["name"]), ns)
                        if new is not None:
                            element["name"] = new
                elif isinstance(element, str):
                    new = self.new_name(referral, element, namespace)
                    if new is not None:
                        value[index] = new
        elif isinstance(value, dict) and "name" in value:  # a webhook's service
            ns = str(value.get("namespace") or namespace)
            new = self.new_name(referral, str(value["name"]), ns)
            if new is not None:
                value["name"] = new


def ensure_name_substring(rl: ResourceList) -> None:
    try:
        config = read_config(rl.function_config)
    except ValueError as exc:
        rl.stderr.append(f"failed to load the `functionConfig`: {exc}")
        raise FunctionFailure from None
    before = {(api_group(o), kind(o), str(_meta(o).get("name") or "")) for o in rl.items}
    renamer = _Renamer(config, before)
    for obj in rl.items:
        if (api_group(obj), kind(obj)) in _SKIPPED or ("", kind(obj)) in _SKIPPED:
            renamer.renamed[_key(obj)] = _key(obj)[3]
            continue
        renamer.rename(obj)
    for obj in rl.items:
        renamer.fix_references(obj)
    for obj in rl.items:  # kustomize's resource map keeps no file annotations
        notes = annotations_of(obj)
        for key in INTERNAL:
            notes.pop(key, None)
        if not notes and "annotations" in _meta(obj):
            del obj["metadata"]["annotations"]
