"""The Run store over the Kubernetes API (docs/kubernetes.md), against the emulated API server
(a test double: tests/kubernetes/emulator.py) over real HTTP: what a Run and a Runtime Pod are
as objects, and the fence of every status write."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from fnkernel.runtime_server.errors import RunAlreadyExists, RunNotFound
from fnkernel.runtime_server.lifecycle.controlplane import ControlPlane
from fnkernel.runtime_server.lifecycle.kubernetes import informer as informer_module
from fnkernel.runtime_server.lifecycle.kubernetes import objects
from fnkernel.runtime_server.lifecycle.kubernetes.store import KubernetesRunStore
from fnkernel.runtime_server.wire import DELETING, FAILED, NEW, PENDING, READY, RETRYING
from tests.kubernetes.conftest import EmulatedApi
from tests.kubernetes.runs import HANDLER, NS, plane_with_pod, runtime_pod
from tests.support import wait_until

G, V, P = objects.GROUP, objects.VERSION, objects.PLURAL


@pytest.fixture
def custom(api_client: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api_client)


def test_a_created_run_is_an_object_with_its_spec_files_and_a_fenced_status(
    store: KubernetesRunStore, custom: client.CustomObjectsApi, api_client: client.ApiClient
) -> None:
    # docs/kubernetes.md, "The object model": the UID is metadata.uid, status.attempt the
    # registration attempt, the assigned pod in the status; a name Kubernetes does not allow
    # is kept in an annotation.
    plane = plane_with_pod(store, api_client)
    run = plane.create_run(name="etl_Job", runtime="python", handler="handler.handle",
                           files=HANDLER, env={"A": "1"})  # fmt: skip
    obj = custom.get_namespaced_custom_object(G, V, NS, P, objects.object_name("etl_Job"))
    assert obj["metadata"]["uid"] == run.uid
    assert obj["metadata"]["annotations"][objects.NAME_KEY] == "etl_Job"
    assert obj["metadata"]["finalizers"] == [objects.FINALIZER]
    assert obj["spec"]["env"] == {"A": "1"} and "files" not in obj["spec"]  # test_run_files
    assert obj["status"]["phase"] == PENDING and obj["status"]["attempt"] == 1
    assert obj["status"]["assignedPod"] == "python-abc"
    assert store.get("etl_Job") == run and store.files(run.uid) == HANDLER
    assert [r.name for r in store.runs(pod="python-abc")] == ["etl_Job"]
    assert store.load_by_pod() == {"python-abc": 1}
    with pytest.raises(RunAlreadyExists):
        plane.create_run(name="etl_Job", runtime="python", handler="handler.handle",
                         files={"handler.py": "def handle(e):\n    return 2\n"})  # fmt: skip
    # Another process's store sees it through its own watch.
    other = KubernetesRunStore(store._api_client, NS)
    try:
        assert other.get("etl_Job") == run
    finally:
        other.close()


def test_a_stale_writer_gets_a_conflict_reads_again_and_never_overwrites_a_newer_attempt(
    store: KubernetesRunStore, kube_api: EmulatedApi, api_client: client.ApiClient
) -> None:
    # docs/kubernetes.md, "Fences at the API level": every status write is conditional on the
    # resourceVersion it was computed from; on 409 the writer re-reads, and its fence (attempt, pod)
    # decides.
    plane = plane_with_pod(store, api_client)
    run = plane.create_run(name="fn", runtime="python", handler="handler.handle", files=HANDLER)
    late = KubernetesRunStore(kube_api.client(), NS)
    try:
        wait_until(lambda: late.get_uid(run.uid) == run, timeout=10)
        seen = late._runs.get(run.uid)  # the version the late writer computes from
        retried = store.update(run, phase=PENDING, attempt=2)  # the retry engine, first
        assert retried is not None and retried.status.attempt == 2
        assert seen is not None
        late._runs.items[run.uid] = seen  # its watch has not delivered the retry yet
        # runtimed of attempt 1 reports Ready: 409, read again, attempt 2 ≠ 1: nothing written.
        assert late.update(run, expect_phase=PENDING, phase=READY) is None
        assert store.get("fn").status.attempt == 2 and late.get_uid(run.uid).status.phase == PENDING  # type: ignore[union-attr]
        # A writer that saw attempt 2 writes through a conflict on an unrelated change.
        late._runs.items[run.uid] = seen
        current = store.get("fn")
        store.update(current, message="noted")  # a newer version that keeps the attempt
        late._runs.items[run.uid] = store._runs.get(run.uid) or seen
        ready = late.update(current, expect_phase=PENDING, phase=READY)
        assert ready is not None and (
            ready.status.phase,
            ready.status.attempt,
            ready.status.message,
        ) == (
            READY,
            2,
            "noted",
        )
    finally:
        late.close()


def test_delete_removes_the_object_and_kubectl_delete_asks_the_control_plane(
    store: KubernetesRunStore, custom: client.CustomObjectsApi, api_client: client.ApiClient
) -> None:
    plane = plane_with_pod(store, api_client)
    run = plane.create_run(name="fn", runtime="python", handler="handler.handle", files=HANDLER)
    # `kubectl delete run fn`: the finalizer keeps it; the control plane unregisters it first.
    custom.delete_namespaced_custom_object(G, V, NS, P, "fn")
    wait_until(lambda: store.get("fn").delete_requested, timeout=10)
    plane.reconcile()
    assert store.get("fn").status.phase == DELETING
    store.delete(run.uid)
    with pytest.raises(ApiException) as caught:
        custom.get_namespaced_custom_object(G, V, NS, P, "fn")
    assert caught.value.status == 404
    with pytest.raises(RunNotFound):
        store.get("fn")


def test_a_run_applied_with_kubectl_is_checked_and_assigned_like_a_create(
    store: KubernetesRunStore, custom: client.CustomObjectsApi, api_client: client.ApiClient
) -> None:
    # docs/kubernetes.md: a Run created with `kubectl apply` is reconciled exactly like one
    # created through POST /v1/runs — the same checks, the same scheduler.
    def apply(name: str, **spec: Any) -> None:
        custom.create_namespaced_custom_object(G, V, NS, P, {
            "apiVersion": objects.API_VERSION, "kind": "Run", "metadata": {"name": name},
            "spec": {"runtime": "python", "handler": "handler.handle", "files": HANDLER, **spec},
        })  # fmt: skip

    apply("applied")
    apply("bad-env", env={"1X": "v"})
    wait_until(lambda: len(store.runs()) == 2, timeout=10)
    plane = ControlPlane(store)
    plane.reconcile()  # no pod yet: it waits, saying so
    waiting = store.get("applied")
    assert (
        waiting.status.phase == NEW and "waiting for a live Runtime Pod" in waiting.status.message
    )
    failed = store.get("bad-env")
    assert failed.status.phase == FAILED and failed.status.message.startswith("env: key '1X'")
    plane_with_pod(store, api_client)
    plane.reconcile()
    admitted = store.get("applied")
    assert (admitted.status.phase, admitted.status.attempt, admitted.status.assigned_pod) == (
        PENDING,
        1,
        "python-abc",
    )
    assert admitted.status.message == ""
    # From its first status write on, a `kubectl delete` waits for its registration to go.
    held = custom.get_namespaced_custom_object(G, V, NS, P, "applied")
    assert held["metadata"]["finalizers"] == [objects.FINALIZER]


def test_runtime_pods_are_alive_while_ready_and_not_being_deleted(
    store: KubernetesRunStore, api_client: client.ApiClient
) -> None:
    # docs/kubernetes.md: a pod's liveness comes from the Pod object, not heartbeats.
    core = client.CoreV1Api(api_client)
    runtime_pod(core, "python-a", "127.0.0.5")
    runtime_pod(core, "python-b", "127.0.0.6", ready=False)
    core.create_namespaced_pod(NS, {"metadata": {"name": "other"},
                                    "spec": {"containers": [{"name": "c", "image": "i"}]}})  # fmt: skip
    # Both reported: each pod's status is a second write after its create.
    wait_until(lambda: [p.address for p in store.pods()] == ["127.0.0.5:50051", "127.0.0.6:50051"],
               timeout=10)  # fmt: skip
    pods = {pod.name: pod for pod in store.pods("python")}
    assert pods["python-a"].alive() and pods["python-a"].address == "127.0.0.5:50051"
    assert not pods["python-b"].alive()
    version = store.version()
    store.heartbeat("python-b", "python", "x", True)  # ignored: the Pod object says
    assert not store.pod("python-b").alive()  # type: ignore[union-attr]
    # Being deleted (its deletionTimestamp set, here held by a finalizer of the test's, as a
    # kubelet holds a terminating pod): no longer alive, though still Ready.
    core.patch_namespaced_pod("python-a", NS, {"metadata": {"finalizers": ["test/hold"]}})
    core.delete_namespaced_pod("python-a", NS)
    wait_until(lambda: not store.pod("python-a").alive(), timeout=10)  # type: ignore[union-attr]
    assert store.version() != version


def test_the_cache_follows_writes_made_elsewhere(
    store: KubernetesRunStore, custom: client.CustomObjectsApi, api_client: client.ApiClient
) -> None:
    plane = plane_with_pod(store, api_client)
    run = plane.create_run(name="fn", runtime="python", handler="handler.handle", files=HANDLER)
    version = store.version()
    obj = custom.get_namespaced_custom_object(G, V, NS, P, "fn")
    obj["status"]["phase"] = RETRYING
    custom.replace_namespaced_custom_object_status(G, V, NS, P, "fn", obj)
    wait_until(lambda: store.get_uid_fresh(run.uid).status.phase == RETRYING, timeout=10)  # type: ignore[union-attr]
    assert store.version() != version
    assert store.get_fresh("fn").status.phase == RETRYING


def _watches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The resourceVersion each watch request of every informer started from, as they start."""
    started: list[str] = []
    follow = informer_module.Informer._follow

    def counted(self: informer_module.Informer, since: str) -> str:
        started.append(since)
        return follow(self, since)

    monkeypatch.setattr(informer_module.Informer, "_follow", counted)
    return started


def test_an_expired_watch_lists_again_at_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # docs/kubernetes.md, "Fences at the API level": a watch from a resourceVersion the API server
    # no longer keeps is 410 Gone (an ERROR event): the informer lists again and watches from there,
    # at once and saying so, not as a failure a second later. The server here keeps 3 events.
    short = EmulatedApi("--history", "3")
    custom = client.CustomObjectsApi(short.client())
    listed = informer_module.Informer._list
    first = [True]

    def stale_list(self: informer_module.Informer) -> str:
        since = listed(self)
        if self.name == "runs" and first[0]:
            first[0] = False
            return "1"  # as if the informer had last seen the server long ago
        return since

    monkeypatch.setattr(informer_module.Informer, "_list", stale_list)
    started = _watches(monkeypatch)
    try:
        for n in range(5):
            _apply(custom, f"r{n}", namespace="elsewhere")
        with caplog.at_level("INFO", logger="fnkernel.kubernetes"):
            opened = KubernetesRunStore(short.client(), NS, watch_pods=False)
            try:
                wait_until(lambda: started.count("1") == 1 and len(started) >= 2, timeout=10)
                _apply(custom, "seen")
                wait_until(lambda: [run.name for run in opened.runs()] == ["seen"], timeout=10)
            finally:
                opened.close()
        messages = [record.getMessage() for record in caplog.records]
        assert "watch of runs expired; listing again" in messages
        assert not [m for m in messages if "failed" in m], messages
    finally:
        short.stop()


def _apply(custom: client.CustomObjectsApi, name: str, namespace: str = NS) -> None:
    custom.create_namespaced_custom_object(G, V, namespace, P, {
        "apiVersion": objects.API_VERSION, "kind": "Run", "metadata": {"name": name},
        "spec": {"runtime": "python", "handler": "handler.handle", "files": HANDLER},
    })  # fmt: skip


def test_a_quiet_watch_resumes_from_its_last_bookmark_without_expiring(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # docs/kubernetes.md, "Fences at the API level": the informer asks for bookmarks, so a watch
    # that saw no change of its own objects while others changed resumes from the server's latest
    # resourceVersion, not from one the server has since let go (which would be 410 and a whole list
    # again). The server here keeps 3 events; each watch lasts a second.
    monkeypatch.setattr(informer_module, "WATCH_SECONDS", 1)
    short = EmulatedApi("--history", "3")
    custom = client.CustomObjectsApi(short.client())
    started = _watches(monkeypatch)
    try:
        with caplog.at_level("INFO", logger="fnkernel.kubernetes"):
            opened = KubernetesRunStore(short.client(), NS, watch_pods=False)
            try:
                wait_until(lambda: len(started) == 1, timeout=10)
                for n in range(5):  # changes the Runs watch does not select
                    _apply(custom, f"r{n}", namespace="elsewhere")
                wait_until(lambda: len(started) >= 3, timeout=10)  # renewed twice since
                _apply(custom, "seen")
                wait_until(lambda: [run.name for run in opened.runs()] == ["seen"], timeout=10)
            finally:
                opened.close()
        assert int(started[-1]) >= int(started[0]) + 5  # moved on with the server
        messages = [record.getMessage() for record in caplog.records]
        assert not [m for m in messages if "expired" in m or "failed" in m], messages
    finally:
        short.stop()


def test_a_late_watch_event_does_not_bring_a_deleted_run_back(
    store: KubernetesRunStore, api_client: client.ApiClient
) -> None:
    # docs/kubernetes.md, "Fences at the API level": the cache forgets a Run it deleted for good. An
    # event of one of its earlier writes — still in the watch's stream when the delete answered —
    # must not put it back (a list would show a deleted Run until the DELETED event came).
    plane = plane_with_pod(store, api_client)
    run = plane.create_run(name="fn", runtime="python", handler="handler.handle", files=HANDLER)
    earlier = store._runs.get(run.uid)
    assert earlier is not None
    store.delete(run.uid)
    assert [r.name for r in store.runs()] == []
    store._runs.learn(earlier)  # as the watch delivers it late
    assert [r.name for r in store.runs()] == []


def test_a_delete_computed_from_a_stale_cache_keeps_anothers_finalizer(
    store: KubernetesRunStore, custom: client.CustomObjectsApi, api_client: client.ApiClient
) -> None:
    # docs/kubernetes.md, "Fences at the API level": every write that decides something carries the
    # resourceVersion it was computed from. Removing our finalizer from a cached version that
    # another writer has since changed (here: a finalizer of its own added) is a 409, and the
    # patch is computed again: the other finalizer stays, and holds the deleted object.
    plane = plane_with_pod(store, api_client)
    run = plane.create_run(name="fn", runtime="python", handler="handler.handle", files=HANDLER)
    stale = store._runs.get(run.uid)
    assert stale is not None and stale["metadata"]["finalizers"] == [objects.FINALIZER]
    theirs = "example.com/keep"
    current = custom.get_namespaced_custom_object(G, V, NS, P, "fn")
    custom.patch_namespaced_custom_object(G, V, NS, P, "fn", {"metadata": {
        "finalizers": [*current["metadata"]["finalizers"], theirs],
        "resourceVersion": current["metadata"]["resourceVersion"]}})  # fmt: skip
    wait_until(lambda: theirs in (store._runs.get(run.uid) or {})["metadata"]["finalizers"], 10)
    store._runs.items[run.uid] = stale  # the cache as it was before that write
    store.delete(run.uid)
    left = custom.get_namespaced_custom_object(G, V, NS, P, "fn")
    assert left["metadata"]["finalizers"] == [theirs]
    assert left["metadata"].get("deletionTimestamp")


def test_a_pods_store_keeps_only_the_runs_assigned_to_it(
    kube_api: EmulatedApi, store: KubernetesRunStore, api_client: client.ApiClient
) -> None:
    # docs/kubernetes.md, "Reads": runtimed keeps the Runs of its own pod alone, by the label
    # the assignment sets before the status names the pod; a Run moved to another pod leaves
    # the first pod's cache and enters the second's.
    plane = plane_with_pod(store, api_client)
    runtime_pod(client.CoreV1Api(api_client), "python-b", "127.0.0.10")
    wait_until(lambda: (pod := store.pod("python-b")) is not None and pod.alive(), timeout=10)
    run = plane.create_run(name="fn", runtime="python", handler="handler.handle", files=HANDLER)
    other = "python-b" if run.status.assigned_pod == "python-abc" else "python-abc"
    first = KubernetesRunStore(kube_api.client(), NS, watch_pods=False, pod=run.status.assigned_pod)
    second = KubernetesRunStore(kube_api.client(), NS, watch_pods=False, pod=other)
    try:
        assert [r.name for r in first.runs()] == ["fn"] and second.runs() == []
        moved = store.update(
            run, phase=RETRYING, assigned_pod=other, attempt=run.status.attempt + 1
        )
        assert moved is not None and moved.status.assigned_pod == other
        wait_until(lambda: [r.status.assigned_pod for r in second.runs()] == [other], timeout=10)
        wait_until(lambda: first.runs() == [], timeout=10)
    finally:
        first.close()
        second.close()


def test_the_cache_keeps_no_inline_files_and_the_files_are_read_when_needed(
    store: KubernetesRunStore, custom: client.CustomObjectsApi
) -> None:
    # docs/kubernetes.md, "Reads": a Run applied with kubectl may hold 1.5 MiB of files in
    # itself, and every component caches every Run: the cache keeps each file's name, not its
    # text, which is read from the API server when runtimed writes the files or the control
    # plane checks them.
    custom.create_namespaced_custom_object(G, V, NS, P, {
        "apiVersion": objects.API_VERSION, "kind": "Run", "metadata": {"name": "fn"},
        "spec": {"runtime": "python", "handler": "handler.handle", "files": HANDLER},
    })  # fmt: skip
    wait_until(lambda: len(store.runs()) == 1, timeout=10)
    (run,) = store.runs()
    cached = store._runs.get(run.uid)
    assert cached is not None and cached["spec"]["files"] == {"handler.py": ""}
    assert store.files(run.uid) == HANDLER
    store.delete(run.uid)
    with pytest.raises(RunNotFound):
        store.files(run.uid)
