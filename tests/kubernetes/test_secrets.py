"""Named secrets on Kubernetes (docs/kubernetes.md, "Who may do what"; lifecycle/kubernetes/secrets.py):
each a labelled Secret of the namespace, against the emulated API server."""

from __future__ import annotations

import base64

import pytest
from kubernetes import client

from fnkernel.runtime_server.errors import NotAllowedHere, SecretNotFound
from fnkernel.runtime_server.lifecycle.kubernetes.secrets import (
    OBJECT_PREFIX,
    SECRET_LABEL,
    KubernetesSecrets,
)
from tests.kubernetes.runs import NS

VALUE = "s3cr3t-Value-8842"


def test_a_secret_is_a_labelled_secret_its_version_the_objects(
    api_client: client.ApiClient,
) -> None:
    secrets = KubernetesSecrets(api_client, NS)
    first = secrets.set("warehouse", {"DB_USER": "alice", "PASSWORD": VALUE})
    obj = client.CoreV1Api(api_client).read_namespaced_secret(OBJECT_PREFIX + "warehouse", NS)
    assert obj.metadata.labels[SECRET_LABEL] == "warehouse"
    assert base64.b64decode(obj.data["PASSWORD"]).decode() == VALUE
    assert first.version == obj.metadata.resource_version
    again = secrets.set("warehouse", {"PASSWORD": "other"})
    assert again.version != first.version
    assert dict(secrets.get("warehouse").data) == {"PASSWORD": "other"}
    (listed,) = secrets.list()
    assert (listed.name, listed.keys, dict(listed.data)) == ("warehouse", ("PASSWORD",), {})
    secrets.delete("warehouse")
    with pytest.raises(SecretNotFound):
        secrets.get("warehouse")


def test_a_secret_of_the_namespace_without_the_label_is_none_of_ours(
    api_client: client.ApiClient,
) -> None:
    # RBAC cannot grant by label: the store refuses every Secret it did not make, by its name.
    core = client.CoreV1Api(api_client)
    core.create_namespaced_secret(NS, {
        "metadata": {"name": OBJECT_PREFIX + "token"},
        "data": {"TOKEN": base64.b64encode(VALUE.encode()).decode()},
    })  # fmt: skip
    secrets = KubernetesSecrets(api_client, NS)
    with pytest.raises(SecretNotFound):
        secrets.get("token")
    with pytest.raises(SecretNotFound):
        secrets.delete("token")
    assert secrets.list() == []
    with pytest.raises(NotAllowedHere, match="did not make"):
        secrets.set("token", {"TOKEN": "replaced"})
    assert core.read_namespaced_secret(OBJECT_PREFIX + "token", NS).data  # untouched
