"""Where a Run's files live on Kubernetes (docs/kubernetes.md, "Reads"), against the emulated API
server (a test double: tests/kubernetes/emulator.py): in ConfigMaps the Run owns, not in the Run,
so that they do not travel in its watch events; read when needed; gone with the Run; a create
cut short is finished or failed by the controller."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from fnkernel.runtime_server import limits
from fnkernel.runtime_server.errors import RunFilesMissing, RunNotFound, RunTooLarge
from fnkernel.runtime_server.lifecycle.controlplane import ControlPlane
from fnkernel.runtime_server.lifecycle.kubernetes import objects
from fnkernel.runtime_server.lifecycle.kubernetes.store import KubernetesRunStore
from fnkernel.runtime_server.wire import FAILED, NEW, PENDING
from tests.kubernetes.runs import HANDLER, NS, a_run, cut_short, plane_with_pod
from tests.support import wait_until

G, V, P = objects.GROUP, objects.VERSION, objects.PLURAL
# Past what one ConfigMap (1 MiB) and one object (1.5 MiB) hold, in characters of 1 to 4 bytes:
# a part cut inside a character would not come back whole.
LARGE = {**HANDLER, "data.txt": "aé€𝄞\n" * 250_000}


def config_maps(api_client: client.ApiClient, run: str) -> list[dict[str, Any]]:
    found = client.CoreV1Api(api_client).list_namespaced_config_map(
        NS, label_selector=f"{objects.RUN_LABEL}={run}"
    )
    return [api_client.sanitize_for_serialization(item) for item in found.items]


def test_a_runs_files_live_in_config_maps_it_owns_and_not_in_the_run(
    store: KubernetesRunStore, api_client: client.ApiClient
) -> None:
    plane = plane_with_pod(store, api_client)
    run = plane.create_run(name="big", runtime="python", handler="handler.handle", files=LARGE)
    obj = client.CustomObjectsApi(api_client).get_namespaced_custom_object(G, V, NS, P, "big")
    # The Run, as every watch event carries it, holds no file: it is small.
    assert "files" not in obj["spec"]
    assert len(json.dumps(obj)) < 8 * 1024
    made = {cm["metadata"]["name"]: cm for cm in config_maps(api_client, "big")}
    assert list(made) == sorted(obj["spec"]["filesFrom"]["configMaps"]) and len(made) == 4  # 3 MB
    for cm in made.values():
        assert cm["immutable"] is True
        assert len(cm["data"][objects.FILES_KEY].encode()) <= objects.FILES_PART_BYTES
        (owner,) = cm["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("Run", "big", run.uid)
    # No cache keeps them; they are read, whole, from the ConfigMaps.
    cached = store._runs.get(run.uid)
    assert cached is not None and "files" not in cached["spec"]
    assert store.files(run.uid) == LARGE


def test_a_deleted_runs_config_maps_go_with_it(
    store: KubernetesRunStore, api_client: client.ApiClient
) -> None:
    # The API server's garbage collector deletes what a deleted object owns.
    plane = plane_with_pod(store, api_client)
    run = plane.create_run(name="fn", runtime="python", handler="handler.handle", files=HANDLER)
    assert len(config_maps(api_client, "fn")) == 1
    store.delete(run.uid)
    wait_until(lambda: config_maps(api_client, "fn") == [], timeout=10)
    with pytest.raises(RunNotFound):
        store.files(run.uid)


def test_a_config_map_that_cannot_be_made_leaves_no_run(
    store: KubernetesRunStore, api_client: client.ApiClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/kubernetes.md, "Reads": the Run and its files are written or neither is. Here the
    # API server refuses the ConfigMap (its name is taken).
    plane = plane_with_pod(store, api_client)
    monkeypatch.setattr(objects.secrets, "token_hex", lambda _: "0a1b2c3d")
    taken = {"metadata": {"name": "fn-files-0a1b2c3d-0"}, "data": {"mine": "yes"}}
    client.CoreV1Api(api_client).create_namespaced_config_map(NS, taken)
    with pytest.raises(ApiException) as refused:
        plane.create_run(name="fn", runtime="python", handler="handler.handle", files=HANDLER)
    assert refused.value.status == 409
    assert client.CustomObjectsApi(api_client).list_namespaced_custom_object(
        G, V, NS, P
    )["items"] == []  # fmt: skip
    with pytest.raises(RunNotFound):
        store.get("fn")
    kept = client.CoreV1Api(api_client).read_namespaced_config_map("fn-files-0a1b2c3d-0", NS)
    assert kept.data == {"mine": "yes"}


def test_a_create_cut_short_after_its_files_is_admitted_by_the_controller(
    store: KubernetesRunStore, api_client: client.ApiClient
) -> None:
    cut_short(api_client, NS, "whole", HANDLER)
    plane = plane_with_pod(store, api_client)
    wait_until(lambda: len(store.runs()) == 1, timeout=10)
    plane.reconcile()
    admitted = store.get("whole")
    assert (admitted.status.phase, admitted.status.attempt, admitted.status.assigned_pod) == (
        PENDING,
        1,
        "python-abc",
    )


def test_a_create_cut_short_before_its_files_is_failed_after_its_time(
    store: KubernetesRunStore, api_client: client.ApiClient
) -> None:
    made = cut_short(api_client, NS, "orphan", HANDLER, texts=[])
    (missing,) = made["spec"]["filesFrom"]["configMaps"]
    wait_until(lambda: len(store.runs()) == 1, timeout=10)
    plane_with_pod(store, api_client)
    ControlPlane(store).reconcile()  # within the time a create is given: it waits
    assert store.get("orphan").status.phase == NEW
    ControlPlane(store, create_seconds=0).reconcile()
    failed = store.get("orphan")
    assert failed.status.phase == FAILED
    assert failed.status.message == f"run 'orphan': the ConfigMap {missing} of its files is gone"


def test_files_that_are_not_what_the_run_says_fail_it(
    store: KubernetesRunStore, api_client: client.ApiClient
) -> None:
    other = json.dumps({"handler.py": "import os\nos.system('rm -rf ~')\n"})
    cut_short(api_client, NS, "swapped", HANDLER, texts=[other])
    wait_until(lambda: len(store.runs()) == 1, timeout=10)
    with pytest.raises(RunFilesMissing, match=r"do not hold what its spec\.filesFrom\.sha256 says"):
        store.files(store.get("swapped").uid)
    plane_with_pod(store, api_client)
    ControlPlane(store, create_seconds=0).reconcile()
    assert store.get("swapped").status.phase == FAILED


def test_a_run_too_large_for_the_api_server_is_refused_naming_the_limit(
    store: KubernetesRunStore,
) -> None:
    # The control plane's checks keep a Run's env far below the limit of an object; the store
    # refuses what the API server would not keep all the same, before it sends anything.
    with pytest.raises(RunTooLarge, match=f"at most {objects.MAX_OBJECT_BYTES} bytes"):
        store.insert(a_run("big", objects.MAX_OBJECT_BYTES), HANDLER)
    # docs/kubernetes.md, "How large a Run may be": what is stored counts, not what is sent — a
    # Run that the API server would take as sent but not with its status and managedFields is
    # refused at its create, never at a later status write.
    with pytest.raises(RunTooLarge, match="as the API server stores it"):
        store.insert(a_run("near", objects.MAX_OBJECT_BYTES - 2000), HANDLER)
    assert store.runs() == []


def test_the_largest_run_a_create_takes_takes_every_status_write_after(
    store: KubernetesRunStore,
) -> None:
    # docs/kubernetes.md, "How large a Run may be": the largest Run a create takes is still
    # stored after every status write, the fullest its schema allows (the emulated API server
    # counts status and managedFields, and refuses past etcd's limit as the API server does).
    room = objects.MAX_OBJECT_BYTES - objects.STATUS_RESERVE_BYTES - 4096
    run = store.insert(a_run("full", room), HANDLER)
    outputs = {f"k{n:02}": "v" * (limits.MAX_OUTPUTS_BYTES // limits.MAX_OUTPUTS - 8)
               for n in range(limits.MAX_OUTPUTS)}  # fmt: skip
    written = store.update(run, phase=FAILED, message="m" * 4096, outputs=outputs)
    assert written is not None and written.status.phase == FAILED


def test_files_past_what_their_config_maps_hold_are_refused_naming_the_limit(
    store: KubernetesRunStore, api_client: client.ApiClient
) -> None:
    # JSON writes a control character in six bytes: 3 MB of them take 18 ConfigMaps.
    plane = plane_with_pod(store, api_client)
    files = {**HANDLER, "data.bin": "\x01" * 3_000_000}
    with pytest.raises(RunTooLarge, match=f"at most {objects.MAX_FILES_PARTS} ConfigMaps"):
        plane.create_run(name="big", runtime="python", handler="handler.handle", files=files)
    with pytest.raises(RunNotFound):
        store.get("big")
    assert config_maps(api_client, "big") == []
