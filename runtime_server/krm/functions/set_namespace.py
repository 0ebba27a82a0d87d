"""``set-namespace`` (krm-functions-catalog v0.4.1 semantics, written from its documentation).

- functionConfig: a ConfigMap with ``data.namespace`` (and optional ``data.namespaceMatcher``), the
  ``kptfile.kpt.dev`` ConfigMap with ``data.name``, or ``fn.kpt.dev/v1alpha1 SetNamespace`` with
  ``namespace`` (and optional ``namespaceMatcher``).
- Namespace-scoped objects get ``metadata.namespace`` (an unset one counts as ``default``); a
  kind not known to be cluster-scoped is namespace-scoped. ``Namespace`` objects are renamed.
  RoleBinding/ClusterRoleBinding ServiceAccount subjects, the CRD conversion webhook service and
  the APIService service have their namespace replaced where it is set.
- With a matcher, only namespaces equal to it change; without one, all do, provided the objects
  come from one upstream namespace (``internal.kpt.dev/upstream-identifier``).
- ``config.kubernetes.io/depends-on`` annotations that name a namespaced object of the package
  follow its move. Local-config objects are skipped.
"""

from __future__ import annotations

from typing import Any

from fnkernel.runtime_server.krm.resources.resourcelist import (
    ERROR,
    INFO,
    ResourceList,
    Result,
    annotations_of,
    api_group,
    is_local_config,
    kind,
    metadata,
)

DEFAULT_NAMESPACE = "default"
DEPENDS_ON = "config.kubernetes.io/depends-on"
UPSTREAM = "internal.kpt.dev/upstream-identifier"  # group|Kind|namespace|name
PACKAGE_CONTEXT = "kptfile.kpt.dev"
# The scope of the Kubernetes kinds the catalog's function knows, by apiVersion. Any other kind
# is namespace-scoped exactly when it already has a ``metadata.namespace`` (docs/krm.md,
# "set-namespace"): a custom resource without one is left alone.
_NAMESPACED = {
    "apps/v1": "ControllerRevision DaemonSet Deployment ReplicaSet StatefulSet",
    "autoscaling/v1": "HorizontalPodAutoscaler Scale",
    "autoscaling/v2beta1": "HorizontalPodAutoscaler",
    "autoscaling/v2beta2": "HorizontalPodAutoscaler",
    "batch/v1": "CronJob Job",
    "batch/v1beta1": "CronJob",
    "coordination.k8s.io/v1": "Lease",
    "coordination.k8s.io/v1beta1": "Lease",
    "discovery.k8s.io/v1": "EndpointSlice",
    "discovery.k8s.io/v1beta1": "EndpointSlice",
    "events.k8s.io/v1": "Event",
    "events.k8s.io/v1beta1": "Event",
    "extensions/v1beta1": "Ingress",
    "networking.k8s.io/v1": "Ingress NetworkPolicy",
    "networking.k8s.io/v1beta1": "Ingress",
    "policy/v1": "PodDisruptionBudget",
    "policy/v1beta1": "PodDisruptionBudget",
    "rbac.authorization.k8s.io/v1": "Role RoleBinding",
    "rbac.authorization.k8s.io/v1beta1": "Role RoleBinding",
    "storage.k8s.io/v1beta1": "CSIStorageCapacity",
    "v1": "ConfigMap Endpoints Event LimitRange PersistentVolumeClaim Pod PodAttachOptions "
    "PodExecOptions PodPortForwardOptions PodProxyOptions PodTemplate ReplicationController "
    "ResourceQuota Secret Service ServiceAccount ServiceProxyOptions",
}
_CLUSTER = {
    "admissionregistration.k8s.io/v1": "MutatingWebhookConfiguration ValidatingWebhookConfiguration",
    "admissionregistration.k8s.io/v1beta1": "MutatingWebhookConfiguration "
    "ValidatingWebhookConfiguration",
    "apiextensions.k8s.io/v1": "CustomResourceDefinition",
    "apiextensions.k8s.io/v1beta1": "CustomResourceDefinition",
    "apiregistration.k8s.io/v1": "APIService",
    "apiregistration.k8s.io/v1beta1": "APIService",
    "certificates.k8s.io/v1": "CertificateSigningRequest",
    "certificates.k8s.io/v1beta1": "CertificateSigningRequest",
    "flowcontrol.apiserver.k8s.io/v1beta1": "FlowSchema PriorityLevelConfiguration",
    "networking.k8s.io/v1": "IngressClass",
    "networking.k8s.io/v1beta1": "IngressClass",
    "node.k8s.io/v1": "RuntimeClass",
    "node.k8s.io/v1beta1": "RuntimeClass",
    "policy/v1beta1": "PodSecurityPolicy",
    "rbac.authorization.k8s.io/v1": "ClusterRole ClusterRoleBinding",
    "rbac.authorization.k8s.io/v1beta1": "ClusterRole ClusterRoleBinding",
    "scheduling.k8s.io/v1": "PriorityClass",
    "scheduling.k8s.io/v1beta1": "PriorityClass",
    "storage.k8s.io/v1": "CSIDriver CSINode StorageClass VolumeAttachment",
    "storage.k8s.io/v1beta1": "CSIDriver CSINode StorageClass VolumeAttachment",
    "v1": "ComponentStatus Namespace Node NodeProxyOptions PersistentVolume",
}
KNOWN_SCOPE: dict[tuple[str, str], bool] = {
    **{(v, k): False for v, kinds in _CLUSTER.items() for k in kinds.split()},
    **{(v, k): True for v, kinds in _NAMESPACED.items() for k in kinds.split()},
}


class ConfigError(ValueError):
    pass


def reference(obj: dict[str, Any] | None) -> dict[str, str] | None:
    """A result's ``resourceRef`` to `obj` (apiVersion, kind, name, namespace as present)."""
    if not obj:
        return None
    meta = obj.get("metadata") or {}
    found = {
        "apiVersion": str(obj.get("apiVersion") or ""),
        "kind": kind(obj),
        "name": str(meta.get("name") or ""),
        "namespace": str(meta.get("namespace") or ""),
    }
    return {key: value for key, value in found.items() if value}


def read_config(config: dict[str, Any] | None) -> tuple[str, str]:
    """(new namespace, matcher) from the functionConfig."""
    if not config:
        raise ConfigError(
            "FunctionConfig is missing. Expect `ConfigMap.v1` or `SetNamespace.v1alpha1.fn.kpt.dev`"
        )
    if kind(config) == "ConfigMap" and config.get("apiVersion") == "v1":
        data = config.get("data") or {}
        matcher = str(data.get("namespaceMatcher", "") or "")
        if data.get("namespace"):
            return str(data["namespace"]), matcher
        name = (config.get("metadata") or {}).get("name")
        if name == PACKAGE_CONTEXT:
            if data.get("name"):
                return str(data["name"]), matcher
            raise ConfigError("`data.name` should not be empty")
        raise ConfigError("`data.namespace` should not be empty")
    if kind(config) == "SetNamespace" and api_group(config) == "fn.kpt.dev":
        if not config.get("namespace"):
            raise ConfigError("`namespace` should not be empty")
        return str(config["namespace"]), str(config.get("namespaceMatcher", "") or "")
    raise ConfigError(
        f"unknown functionConfig Kind={kind(config)} ApiVersion={config.get('apiVersion')}, "
        "expect `ConfigMap.v1` or `SetNamespace.v1alpha1.fn.kpt.dev`"
    )


def go_list(values: set[str]) -> str:
    """A sorted list as the Go functions print one in a message: ``[a b]``."""
    return "[" + " ".join(sorted(values)) + "]"


def namespace_scoped(obj: dict[str, Any]) -> bool:
    """Known kinds by their scope; any other by whether it has a namespace already."""
    known = KNOWN_SCOPE.get((str(obj.get("apiVersion", "")), kind(obj)))
    if known is not None:
        return known
    meta = obj.get("metadata")
    return isinstance(meta, dict) and "namespace" in meta


def cluster_scoped(obj: dict[str, Any]) -> bool:
    return not namespace_scoped(obj)


def _upstream_namespace(obj: dict[str, Any]) -> str | None:
    identifier = str(annotations_of(obj).get(UPSTREAM, ""))
    parts = identifier.split("|")
    return parts[2] if len(parts) == 4 else None


def _depends_on_key(group: str, kind_: str, namespace: str, name: str) -> str:
    return f"{group}/namespaces/{namespace}/{kind_}/{name}"


class _Replacer:
    """Applies the rule to each namespace value and counts what changed."""

    def __init__(self, new: str, matcher: str) -> None:
        self.new, self.matcher = new, matcher
        self.changed = 0
        self.old: set[str] = set()

    def __call__(self, current: str, origin: str | None = None) -> str:
        current = current or DEFAULT_NAMESPACE
        if current == self.new:
            return current
        if self.matcher and self.matcher not in (current, origin):
            return current
        self.old.add(current)
        self.changed += 1
        return self.new


def _set_nested(obj: dict[str, Any], path: list[str], replace: _Replacer) -> None:
    node: Any = obj
    for key in path[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict) and node.get(path[-1]):
        node[path[-1]] = replace(str(node[path[-1]]))


def set_namespace(rl: ResourceList) -> None:
    try:
        new, matcher = read_config(rl.function_config)
    except ConfigError as exc:
        rl.add_results([Result(str(exc), ERROR, resource=reference(rl.function_config))])
        return
    objects = [obj for obj in rl.items if not is_local_config(obj)]
    if not matcher:
        origins = {
            ns for obj in objects if not cluster_scoped(obj) if (ns := _upstream_namespace(obj))
        }
        if len(origins) > 1:
            rl.add_results(
                [
                    Result(
                        "unable to use origin `namespace` to match. expect a single upstream "
                        f"namespace, found {go_list(origins)}. please switch to use "
                        "`namespaceMatcher` to specify the namespace value you want to change",
                        ERROR,
                    )
                ]
            )
            return
    # Namespaced objects before the change, as depends-on names them.
    before = {
        _depends_on_key(
            api_group(obj),
            kind(obj),
            str(metadata(obj).get("namespace") or DEFAULT_NAMESPACE),
            str(metadata(obj).get("name", "")),
        )
        for obj in objects
        if not cluster_scoped(obj)
    }
    replace = _Replacer(new, matcher)
    # Cluster-scoped objects that name a namespace first, then the namespaced ones.
    for obj in objects:
        if namespace_scoped(obj):
            continue
        meta = metadata(obj)
        api_version = str(obj.get("apiVersion", ""))
        if (api_version, kind(obj)) == ("v1", "Namespace"):
            meta["name"] = replace(str(meta.get("name", "")))
        elif (api_version, kind(obj)) == ("apiextensions.k8s.io/v1", "CustomResourceDefinition"):
            _set_nested(
                obj,
                ["spec", "conversion", "webhook", "clientConfig", "service", "namespace"],
                replace,
            )
        elif (api_version, kind(obj)) == ("apiregistration.k8s.io/v1", "APIService"):
            _set_nested(obj, ["spec", "service", "namespace"], replace)
        elif kind(obj) in ("RoleBinding", "ClusterRoleBinding"):
            for subject in obj.get("subjects") or []:
                if isinstance(subject, dict) and "namespace" in subject:
                    subject["namespace"] = replace(str(subject["namespace"] or ""))
    for obj in objects:
        if namespace_scoped(obj):
            meta = metadata(obj)
            current = str(meta.get("namespace") or "")
            updated = replace(current, _upstream_namespace(obj))
            if updated != current:
                meta["namespace"] = updated
    results = [_summary(replace, new)]
    results.append(_update_depends_on(objects, before, new, matcher))
    rl.add_results(results)


def _summary(replace: _Replacer, new: str) -> Result:
    if not replace.changed:
        return Result(f'all matching namespaces are already "{new}". no value changed', INFO)
    return Result(
        f'namespace {go_list(replace.old)} updated to "{new}", {replace.changed} value(s) changed',
        INFO,
    )


def _update_depends_on(objects: list[Any], before: set[str], new: str, matcher: str) -> Result:
    changed, old = 0, set()
    for obj in objects:
        notes = annotations_of(obj)
        value = str(notes.get(DEPENDS_ON, ""))
        segments = value.split("/")
        if len(segments) != 5 or segments[1] != "namespaces" or value not in before:
            continue
        if segments[2] == new or (matcher and segments[2] != matcher):
            continue
        old.add(segments[2])
        segments[2] = new
        notes[DEPENDS_ON] = "/".join(segments)
        changed += 1
    if not changed:
        return Result("all `depends-on` annotations are up-to-date. no `namespace` changed", INFO)
    return Result(
        f'`depends-on` annotation namespace {go_list(old)} updated to "{new}", '
        f"{changed} value(s) changed",
        INFO,
    )
