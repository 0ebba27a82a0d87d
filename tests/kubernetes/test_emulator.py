"""Each API rule the emulated Kubernetes API server (a test double: KMock's emulator, extended in
tests/kubernetes/emulator.py) adds for our fences, checked on its own through the official
client — the rules are Kubernetes API behaviour, listed in docs/kubernetes.md."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from tests.kubernetes.conftest import EmulatedApi

G, V, NS, P = "fnkernel.dev", "v1alpha1", "ns", "runs"


def run(name: str, labels: dict[str, str] | None = None, **body: Any) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "labels": labels or {}}
    return {"apiVersion": f"{G}/{V}", "kind": "Run", "metadata": metadata, **body}


@pytest.fixture
def api(api_client: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api_client)


def create(api: client.CustomObjectsApi, obj: dict[str, Any]) -> dict[str, Any]:
    created: dict[str, Any] = api.create_namespaced_custom_object(G, V, NS, P, obj)
    return created


def test_every_write_gives_a_new_resource_version_and_a_list_says_the_latest(
    api: client.CustomObjectsApi,
) -> None:
    # Kubernetes API: resourceVersion changes on every write; a list's is the collection's.
    first = create(api, run("a", spec={"x": 1}))
    meta = first["metadata"]
    assert meta["uid"] and meta["creationTimestamp"].endswith("Z") and meta["namespace"] == NS
    second = api.patch_namespaced_custom_object(G, V, NS, P, "a", {"spec": {"x": 2}})
    assert int(second["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
    assert second["metadata"]["uid"] == meta["uid"] and second["metadata"]["generation"] == 2
    listed = api.list_namespaced_custom_object(G, V, NS, P)
    assert listed["metadata"]["resourceVersion"] == second["metadata"]["resourceVersion"]
    named = create(api, {"apiVersion": f"{G}/{V}", "kind": "Run",
                         "metadata": {"generateName": "run-"}})  # fmt: skip
    assert named["metadata"]["name"].startswith("run-") and len(named["metadata"]["name"]) > 4
    with pytest.raises(ApiException) as caught:
        create(api, run("a"))
    assert caught.value.status == 409 and "AlreadyExists" in str(caught.value.body)


def test_a_write_with_a_stale_resource_version_is_a_conflict_and_writes_nothing(
    api: client.CustomObjectsApi,
) -> None:
    # Kubernetes API, optimistic concurrency: an update with a stale resourceVersion is 409.
    stale = create(api, run("a", spec={"x": 1}))
    newer = api.patch_namespaced_custom_object(G, V, NS, P, "a", {"spec": {"x": 2}})
    for write in (
        lambda: api.replace_namespaced_custom_object(G, V, NS, P, "a", {**stale, "spec": {"x": 3}}),
        lambda: api.replace_namespaced_custom_object_status(
            G, V, NS, P, "a", {**stale, "status": {"phase": "Ready"}}
        ),
        lambda: api.patch_namespaced_custom_object(
            G,
            V,
            NS,
            P,
            "a",
            {
                "metadata": {"resourceVersion": stale["metadata"]["resourceVersion"]},
                "spec": {"x": 3},
            },
        ),
        lambda: api.delete_namespaced_custom_object(
            G,
            V,
            NS,
            P,
            "a",
            body={"preconditions": {"resourceVersion": stale["metadata"]["resourceVersion"]}},
        ),
    ):
        with pytest.raises(ApiException) as caught:
            write()
        assert caught.value.status == 409
    assert api.get_namespaced_custom_object(G, V, NS, P, "a") == newer
    current = {**newer, "spec": {"x": 3}}
    assert api.replace_namespaced_custom_object(G, V, NS, P, "a", current)["spec"] == {"x": 3}


def test_status_is_written_only_through_the_status_subresource(
    api: client.CustomObjectsApi,
) -> None:
    # Kubernetes API, CRD status subresource: /status changes only status, the object itself
    # never changes status, and a create drops it.
    created = create(api, run("a", spec={"x": 1}, status={"phase": "Ready"}))
    assert "status" not in created
    written = api.replace_namespaced_custom_object_status(
        G, V, NS, P, "a", {**created, "spec": {"x": 9}, "status": {"phase": "Pending"}}
    )
    assert (written["spec"], written["status"]) == ({"x": 1}, {"phase": "Pending"})
    replaced = api.replace_namespaced_custom_object(
        G, V, NS, P, "a", {**written, "spec": {"x": 2}, "status": {"phase": "Failed"}}
    )
    assert (replaced["spec"], replaced["status"]) == ({"x": 2}, {"phase": "Pending"})
    patched = api.patch_namespaced_custom_object_status(
        G, V, NS, P, "a", {"status": {"attempt": 2}}
    )
    assert patched["status"] == {"phase": "Pending", "attempt": 2}


def test_label_and_field_selectors_filter_lists_and_watches(
    api: client.CustomObjectsApi, api_client: client.ApiClient
) -> None:
    # Kubernetes API: labelSelector (equality and set based) and fieldSelector.
    create(api, run("a", {"runtime": "python", "tier": "x"}))
    create(api, run("b", {"runtime": "bash"}))
    create(api, run("c", {"runtime": "python"}))

    def names(**selectors: str) -> list[str]:
        listed = api.list_namespaced_custom_object(G, V, NS, P, **selectors)
        return [item["metadata"]["name"] for item in listed["items"]]

    assert names(label_selector="runtime=python") == ["a", "c"]
    assert names(label_selector="runtime!=python") == ["b"]
    assert names(label_selector="runtime in (bash, go)") == ["b"]
    assert names(label_selector="runtime notin (bash),tier") == ["a"]
    assert names(label_selector="!tier") == ["b", "c"]
    assert names(field_selector="metadata.name=c") == ["c"]
    assert names(field_selector="metadata.name!=c", label_selector="runtime=python") == ["a"]
    core = client.CoreV1Api(api_client)
    pod = {"metadata": {"name": "p", "labels": {"app": "x"}}, "spec": {"nodeName": "n1",
           "containers": [{"name": "c", "image": "i"}]}}  # fmt: skip
    core.create_namespaced_pod(NS, pod)
    core.create_namespaced_pod(NS, {**pod, "metadata": {"name": "q"}, "spec": {**pod["spec"],
                                                                               "nodeName": "n2"}})  # fmt: skip
    on_n1 = core.list_namespaced_pod(NS, field_selector="spec.nodeName=n1")
    assert [p.metadata.name for p in on_n1.items] == ["p"]
    events = watch.Watch().stream(
        api.list_namespaced_custom_object, G, V, NS, P, label_selector="runtime=bash",
        resource_version="0", timeout_seconds=1,
    )  # fmt: skip
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "b")]


def test_a_watch_resumes_from_a_resource_version_and_an_expired_one_is_410(
    api: client.CustomObjectsApi,
) -> None:
    # Kubernetes API, "Efficient detection of changes": a watch from a resourceVersion sends
    # every change after it, in order; too old is 410 Gone ("Expired").
    first = create(api, run("a"))
    since = first["metadata"]["resourceVersion"]
    api.patch_namespaced_custom_object_status(G, V, NS, P, "a", {"status": {"phase": "Pending"}})
    create(api, run("b"))
    api.delete_namespaced_custom_object(G, V, NS, P, "a")
    events = watch.Watch().stream(
        api.list_namespaced_custom_object, G, V, NS, P, resource_version=since, timeout_seconds=1
    )
    seen = [(e["type"], e["object"]["metadata"]["name"]) for e in events]
    assert seen == [("MODIFIED", "a"), ("ADDED", "b"), ("DELETED", "a")]
    # A change made while a watch runs arrives on it (the stream ends after timeoutSeconds).
    stream = watch.Watch().stream(
        api.list_namespaced_custom_object, G, V, NS, P,
        resource_version=api.list_namespaced_custom_object(G, V, NS, P)["metadata"]["resourceVersion"],
        timeout_seconds=2,
    )  # fmt: skip
    threading.Timer(0.3, lambda: create(api, run("c"))).start()
    assert [e["object"]["metadata"]["name"] for e in stream] == ["c"]


def test_a_watch_older_than_the_history_is_expired() -> None:
    # Kubernetes API: a watch from a resourceVersion the server no longer keeps is 410
    # ("Expired"); a client lists again. This one keeps 3 events.
    short = EmulatedApi("--history", "3")
    try:
        with short.client() as api_client:
            api = client.CustomObjectsApi(api_client)
            since = create(api, run("a"))["metadata"]["resourceVersion"]
            for n in range(4):
                api.patch_namespaced_custom_object(G, V, NS, P, "a", {"spec": {"n": n}})
            with pytest.raises(ApiException) as caught:
                list(watch.Watch().stream(api.list_namespaced_custom_object, G, V, NS, P,
                                          resource_version=since, timeout_seconds=1))  # fmt: skip
            assert caught.value.status == 410 and "Expired" in str(caught.value.reason)
    finally:
        short.stop()


def test_a_watch_asking_for_bookmarks_ends_with_one_at_the_latest_resource_version(
    api: client.CustomObjectsApi,
) -> None:
    # Kubernetes API, watch bookmarks: with allowWatchBookmarks the server sends BOOKMARK
    # events carrying its current resourceVersion, here once before the watch times out, even
    # when the change was to an object the watch does not select.
    since = create(api, run("a"))["metadata"]["resourceVersion"]
    other = api.create_namespaced_custom_object(G, V, "elsewhere", P, run("b"))["metadata"][
        "resourceVersion"
    ]
    response = api.list_namespaced_custom_object(
        G, V, NS, P, watch=True, resource_version=since, timeout_seconds=1,
        allow_watch_bookmarks=True, _preload_content=False,
    )  # fmt: skip
    events = [json.loads(line) for line in response.data.splitlines() if line.strip()]
    assert [e["type"] for e in events] == ["BOOKMARK"]
    assert events[0]["object"]["metadata"]["resourceVersion"] == other


def test_deleting_an_object_with_finalizers_waits_for_the_last_one(
    api: client.CustomObjectsApi,
) -> None:
    # Kubernetes API, finalizers: DELETE sets deletionTimestamp; removing the last finalizer
    # deletes the object.
    create(api, {**run("a"), "metadata": {"name": "a", "finalizers": ["fnkernel.dev/unregister"]}})
    api.delete_namespaced_custom_object(G, V, NS, P, "a")
    marked = api.get_namespaced_custom_object(G, V, NS, P, "a")
    assert marked["metadata"]["deletionTimestamp"]
    api.patch_namespaced_custom_object(G, V, NS, P, "a", {"metadata": {"finalizers": None}})
    with pytest.raises(ApiException) as caught:
        api.get_namespaced_custom_object(G, V, NS, P, "a")
    assert caught.value.status == 404


def test_a_request_over_3_mib_is_413(api: client.CustomObjectsApi) -> None:
    # Kubernetes API server: request bodies are limited to 3 MiB (413 beyond).
    with pytest.raises(ApiException) as caught:
        create(api, run("big", spec={"data": "x" * (3 * 1024 * 1024)}))
    assert caught.value.status == 413
    with pytest.raises(ApiException):
        api.get_namespaced_custom_object(G, V, NS, P, "big")


def test_a_service_accounts_token_is_authorized_by_its_roles_and_every_call_recorded(
    kube_api: EmulatedApi, api_client: client.ApiClient
) -> None:
    # Kubernetes API, TokenRequest and RBAC: a token of a ServiceAccount is that account's; a
    # call is allowed only by a rule of a Role bound to it in the namespace (the status
    # subresource a resource of its own), else 403 naming the verb and resource; an unknown
    # token is 401.
    core = client.CoreV1Api(api_client)
    with pytest.raises(ApiException) as caught:
        core.create_namespaced_service_account_token("reader", NS, {"spec": {}})
    assert caught.value.status == 404  # no such ServiceAccount yet
    core.create_namespaced_service_account(NS, {"metadata": {"name": "reader"}})
    rbac = client.RbacAuthorizationV1Api(api_client)
    rbac.create_namespaced_role(NS, {"metadata": {"name": "reader"}, "rules": [
        {"apiGroups": [G], "resources": ["runs"], "verbs": ["get", "list"]},
        {"apiGroups": [G], "resources": ["runs/status"], "verbs": ["update"]},
    ]})  # fmt: skip
    rbac.create_namespaced_role_binding(NS, {
        "metadata": {"name": "reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": NS}],
    })  # fmt: skip
    admin = client.CustomObjectsApi(api_client)
    create(admin, run("a", status={"phase": "x"}))
    answer = core.create_namespaced_service_account_token(
        "reader", NS, {"spec": {}}, _preload_content=False
    )
    token = json.loads(answer.data)["status"]["token"]

    def as_token(value: str) -> client.CustomObjectsApi:
        configuration = client.Configuration()
        configuration.host = kube_api.url
        configuration.api_key = {"authorization": f"Bearer {value}"}
        return client.CustomObjectsApi(client.ApiClient(configuration))

    reader = as_token(token)
    assert [
        i["metadata"]["name"] for i in reader.list_namespaced_custom_object(G, V, NS, P)["items"]
    ] == ["a"]
    current = reader.get_namespaced_custom_object(G, V, NS, P, "a")
    reader.replace_namespaced_custom_object_status(G, V, NS, P, "a", current)
    with pytest.raises(ApiException) as caught:
        reader.create_namespaced_custom_object(G, V, NS, P, run("b"))
    assert caught.value.status == 403
    assert f'{NS}:reader cannot create resource \\"runs\\" in API group' in str(caught.value.body)
    for refused in (
        lambda: reader.patch_namespaced_custom_object(G, V, NS, P, "a", {"spec": {}}),
        lambda: reader.list_namespaced_custom_object(G, V, "elsewhere", P),
    ):
        with pytest.raises(ApiException) as caught:
            refused()
        assert caught.value.status == 403
    with pytest.raises(ApiException) as caught:
        as_token("forged").list_namespaced_custom_object(G, V, NS, P)
    assert caught.value.status == 401
    calls = json.loads(urllib.request.urlopen(f"{kube_api.url}/emulator/calls").read())
    user = f"system:serviceaccount:{NS}:reader"
    assert [(c["user"], c["verb"], c["resource"], c["allowed"]) for c in calls] == [
        (user, "list", "runs", True),
        (user, "get", "runs", True),
        (user, "update", "runs/status", True),
        (user, "create", "runs", False),
        (user, "patch", "runs", False),
        (user, "list", "runs", False),
    ]


def test_writes_record_their_fields_and_a_stored_object_past_etcds_limit_is_refused(
    api: client.CustomObjectsApi,
) -> None:
    # Kubernetes API: managedFields names each writer's fields (a map's keys included), and
    # counts toward what etcd stores: an object whose stored form is past 1.5 MiB is refused,
    # though its request was within the 3 MiB a request may be. A strategic merge patch of a
    # custom resource is 415.
    created = create(api, run("a", spec={"files": {"a.py": "x", "b.py": "y"}}))
    (entry,) = created["metadata"]["managedFields"]
    assert entry["fieldsV1"]["f:spec"]["f:files"] == {"f:a.py": {}, "f:b.py": {}}
    big = "x" * (1_572_864 - 1000)
    with pytest.raises(ApiException) as caught:
        create(api, run("b", spec={"files": {"big.py": big, "more.py": "y" * 2000}}))
    assert caught.value.status == 500 and "etcdserver: request is too large" in caught.value.body
    patch = urllib.request.Request(
        f"{api.api_client.configuration.host}/apis/{G}/{V}/namespaces/{NS}/{P}/a",
        data=b'{"spec": {}}', method="PATCH",
        headers={"Content-Type": "application/strategic-merge-patch+json"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(patch, timeout=10)
    assert refused.value.code == 415


def test_a_watch_with_a_selector_sees_an_object_come_and_go_as_its_labels_change(
    api: client.CustomObjectsApi,
) -> None:
    # Kubernetes API, watch with a label selector: an object whose labels come to match is
    # ADDED, one whose labels stop matching is DELETED, though neither was created or deleted.
    since = create(api, run("a", labels={"pod": "one"}))["metadata"]["resourceVersion"]
    api.patch_namespaced_custom_object(G, V, NS, P, "a", {"metadata": {"labels": {"pod": "two"}}})
    api.patch_namespaced_custom_object(G, V, NS, P, "a", {"metadata": {"labels": {"pod": "one"}}})
    stream = watch.Watch().stream(
        api.list_namespaced_custom_object, G, V, NS, P, label_selector="pod=two",
        resource_version=since, timeout_seconds=1,
    )  # fmt: skip
    assert [(e["type"], e["object"]["metadata"]["labels"]["pod"]) for e in stream] == [
        ("ADDED", "two"),
        ("DELETED", "one"),
    ]


def test_a_list_with_a_limit_comes_in_pages_of_one_version(api: client.CustomObjectsApi) -> None:
    # Kubernetes API, list chunking: `limit` items a page and a `continue` token for the rest;
    # every page says the resourceVersion of the first.
    for name in ("a", "b", "c"):
        create(api, run(name))
    first = api.list_namespaced_custom_object(G, V, NS, P, limit=2)
    api.patch_namespaced_custom_object(G, V, NS, P, "a", {"spec": {"n": 1}})  # a new version
    second = api.list_namespaced_custom_object(G, V, NS, P, limit=2,
                                               _continue=first["metadata"]["continue"])  # fmt: skip
    assert [i["metadata"]["name"] for i in first["items"]] == ["a", "b"]
    assert [i["metadata"]["name"] for i in second["items"]] == ["c"]
    assert "continue" not in second["metadata"]
    assert second["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]


def owned_by(obj: dict[str, Any]) -> list[dict[str, Any]]:
    meta = obj["metadata"]
    return [{"apiVersion": f"{G}/{V}", "kind": "Run", "name": meta["name"], "uid": meta["uid"]}]


def test_the_garbage_collector_deletes_what_a_deleted_object_owned(
    api: client.CustomObjectsApi, api_client: client.ApiClient
) -> None:
    # Kubernetes, garbage collection: a dependent whose owners are all gone is deleted (in the
    # background, the default); one created naming only owners that do not exist is too.
    core = client.CoreV1Api(api_client)
    a, c = create(api, run("a")), create(api, run("c"))

    def config_map(name: str, owners: list[dict[str, Any]]) -> None:
        core.create_namespaced_config_map(
            NS, {"metadata": {"name": name, "ownerReferences": owners}}
        )

    def names() -> list[str]:
        return sorted(cm.metadata.name for cm in core.list_namespaced_config_map(NS).items)

    config_map("of-a", owned_by(a))
    config_map("of-a-and-c", owned_by(a) + owned_by(c))
    config_map("of-none", [])
    api.delete_namespaced_custom_object(G, V, NS, P, "a")
    assert names() == ["of-a-and-c", "of-none"]
    config_map("of-gone-a", owned_by(a))
    assert names() == ["of-a-and-c", "of-none"]
    api.delete_namespaced_custom_object(G, V, NS, P, "c")
    assert names() == ["of-none"]


def test_a_config_map_holds_at_most_1_mib_and_an_immutable_one_keeps_its_data(
    api_client: client.ApiClient,
) -> None:
    # Kubernetes, ConfigMaps: "The data stored in a ConfigMap cannot exceed 1 MiB"; one marked
    # immutable cannot have its data changed (its metadata can).
    core = client.CoreV1Api(api_client)
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_config_map(
            NS,
            {"metadata": {"name": "big"}, "data": {"k": "é" * 300_000 + "x" * 500_000}},  # 1.1 MB
        )
    assert refused.value.status == 422 and "at most 1048576 bytes" in str(refused.value.body)
    core.create_namespaced_config_map(
        NS, {"metadata": {"name": "fixed"}, "immutable": True, "data": {"k": "v"}}
    )
    for change in ({"data": {"k": "w"}}, {"immutable": False}):
        with pytest.raises(ApiException) as refused:
            core.patch_namespaced_config_map("fixed", NS, change)
        assert refused.value.status == 422, change
    labelled = core.patch_namespaced_config_map("fixed", NS, {"metadata": {"labels": {"l": "1"}}})
    assert labelled.metadata.labels == {"l": "1"} and labelled.data == {"k": "v"}
