"""Named secrets on Kubernetes (``lifecycle/secrets.py``; docs/kubernetes.md, "Who may do what"): each is
a Secret of the namespace, ``fnkernel-secret-NAME``, labelled SECRET_LABEL=NAME; its version is
the object's resourceVersion. A Secret without the label is none of ours: it is not found by
its name (``--secret gateway-token`` reads nothing), listed, replaced nor deleted — Kubernetes
RBAC cannot grant by label, so this check is what keeps a Run from the namespace's other
Secrets.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from fnkernel.runtime_server.errors import NotAllowedHere, SecretNotFound
from fnkernel.runtime_server.lifecycle.kubernetes.informer import raw_answer
from fnkernel.runtime_server.lifecycle.secrets import Secret, check_secret, check_secret_name

SECRET_LABEL = "fnkernel.dev/secret"
OBJECT_PREFIX = "fnkernel-secret-"


def _secret_of(obj: Mapping[str, Any], *, values: bool) -> Secret:
    meta = obj.get("metadata") or {}
    data = {key: base64.b64decode(value).decode() for key, value in (obj.get("data") or {}).items()}
    name = (meta.get("labels") or {})[SECRET_LABEL]
    return Secret(
        name, str(meta.get("resourceVersion", "")), tuple(sorted(data)), data if values else {}
    )


class KubernetesSecrets:
    """The namespace's secrets of ours, through `api_client`."""

    def __init__(self, api_client: client.ApiClient, namespace: str) -> None:
        self._core = client.CoreV1Api(api_client)
        self.namespace = namespace

    def _read(self, name: str) -> dict[str, Any]:
        """Our Secret of `name`; SecretNotFound if there is none (or one without our label)."""
        check_secret_name(name)
        try:
            obj: dict[str, Any] = raw_answer(self._core.read_namespaced_secret(
                OBJECT_PREFIX + name, self.namespace, _preload_content=False
            ))  # fmt: skip
        except ApiException as exc:
            if exc.status != 404:
                raise
            obj = {}
        if ((obj.get("metadata") or {}).get("labels") or {}).get(SECRET_LABEL) != name:
            raise SecretNotFound(f"secret {name!r} does not exist")
        return obj

    def set(self, name: str, data: Mapping[str, str]) -> Secret:
        name, checked = check_secret(name, data)
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {
                "name": OBJECT_PREFIX + name,
                "labels": {SECRET_LABEL: name, "app.kubernetes.io/part-of": "fnkernel"},
            },
            "data": {
                key: base64.b64encode(value.encode()).decode() for key, value in checked.items()
            },
        }
        try:
            self._read(name)
        except SecretNotFound:
            try:
                # The client sends a dict as it is; its hints name only its model class.
                made = raw_answer(self._core.create_namespaced_secret(
                    self.namespace, body, _preload_content=False  # type: ignore[arg-type]
                ))  # fmt: skip
            except ApiException as exc:
                if exc.status != 409:
                    raise
                raise NotAllowedHere(
                    f"the namespace has a Secret {OBJECT_PREFIX}{name} that fnkernel did not "
                    "make; it is left alone: choose another name"
                ) from None
        else:
            made = raw_answer(self._core.replace_namespaced_secret(
                OBJECT_PREFIX + name, self.namespace, body, _preload_content=False  # type: ignore[arg-type]
            ))  # fmt: skip
        return _secret_of(made, values=True)

    def get(self, name: str) -> Secret:
        return _secret_of(self._read(name), values=True)

    def list(self) -> list[Secret]:
        listed = raw_answer(self._core.list_namespaced_secret(
            self.namespace, label_selector=SECRET_LABEL, _preload_content=False
        ))  # fmt: skip
        found = [_secret_of(obj, values=False) for obj in listed.get("items") or ()]
        return sorted(found, key=lambda secret: secret.name)

    def delete(self, name: str) -> None:
        self._read(name)
        try:
            self._core.delete_namespaced_secret(OBJECT_PREFIX + name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            raise SecretNotFound(f"secret {name!r} does not exist") from None
