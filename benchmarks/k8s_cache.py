"""What a component's cache of Runs costs on Kubernetes (docs/kubernetes.md, "Reads"): the
resident memory (now, and at its peak) of a process holding a ``KubernetesRunStore`` of a
namespace with many large Runs, all assigned to other pods — keeping every Run (the
controller's and the gateway's store) against keeping only its own pod's (runtimed's, by the
pod label) — beside the same process holding an empty namespace; and the bytes of a Run as each
of its watch events carries it. Runs with their files in them (applied with kubectl) against
Runs made as the gateway makes them (files in ConfigMaps), in one run against the emulated API
server.

    python -m benchmarks.k8s_cache [--runs 500] [--kib 100]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from kubernetes import client

from fnkernel.runtime_server.lifecycle.kubernetes import objects
from fnkernel.runtime_server.lifecycle.kubernetes.store import KubernetesRunStore
from fnkernel.runtime_server.lifecycle.runs import Run, RunSpec, RunStatus, files_digest
from fnkernel.runtime_server.wire import PENDING
from tests.kubernetes.conftest import EmulatedApi

_HOLD = """
import json, os, sys
from kubernetes import client
from fnkernel.runtime_server.lifecycle.kubernetes.store import KubernetesRunStore
configuration = client.Configuration()
configuration.host = sys.argv[1]
store = KubernetesRunStore(client.ApiClient(configuration), sys.argv[2], watch_pods=False,
                           pod=sys.argv[3] or None, sync_timeout=120)
held = len(store.runs())
# VmHWM, not getrusage's ru_maxrss, which a child keeps from its parent's at the fork.
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"runs": held, "rss_kib": int(status["VmRSS"].split()[0]),
                  "peak_kib": int(status["VmHWM"].split()[0])}), flush=True)
os._exit(0)  # the watch threads are daemons reading a socket: no orderly shutdown to wait for
"""


def held(url: str, namespace: str, pod: str) -> dict[str, int]:
    """Runs held and peak RSS (KiB) of a fresh process that opens the store and syncs it."""
    done = subprocess.run(
        [sys.executable, "-c", _HOLD, url, namespace, pod],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    answer: dict[str, int] = json.loads(done.stdout.splitlines()[-1])
    return answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--kib", type=int, default=100, help="each Run's files")
    args = parser.parse_args()
    files = {"h.py": "x" * (args.kib * 1024)}
    api = EmulatedApi()
    seen: dict[str, dict[str, int]] = {}
    try:
        custom = client.CustomObjectsApi(api.client())
        started = time.monotonic()
        for n in range(args.runs):  # as `kubectl apply` makes them
            custom.create_namespaced_custom_object(objects.GROUP, objects.VERSION, "inline",
                                                   objects.PLURAL, {
                "apiVersion": objects.API_VERSION, "kind": "Run",
                "metadata": {"name": f"r{n}", "labels": {objects.POD_LABEL: "elsewhere"}},
                "spec": {"runtime": "python", "handler": "h.handle", "files": files},
            })  # fmt: skip
        gateway = KubernetesRunStore(api.client(), "configmaps", watch_pods=False)
        for n in range(args.runs):  # as the gateway makes them
            spec = RunSpec("python", "h.handle", files_digest(files), idle_timeout_seconds=900)
            status = RunStatus(phase=PENDING, attempt=1, assigned_pod="elsewhere")
            gateway.insert(Run(uid="", name=f"r{n}", spec=spec, status=status), files)
        gateway.close()
        print(f"twice {args.runs} Runs of {args.kib} KiB created in "
              f"{time.monotonic() - started:.1f} s")  # fmt: skip
        seen["empty namespace"] = held(api.url, "empty", "")
        for namespace in ("inline", "configmaps"):
            listed = custom.list_namespaced_custom_object(
                objects.GROUP, objects.VERSION, namespace, objects.PLURAL
            )
            event = sum(len(json.dumps(item)) for item in listed["items"]) // args.runs
            for label, pod in (("every Run", ""), ("its pod's Runs", "mine")):
                seen[f"{namespace}: {label}"] = {**held(api.url, namespace, pod), "event": event}
    finally:
        api.stop()
    empty = seen["empty namespace"]
    for label, one in seen.items():
        print(f"{label:<28} {one['runs']:>5} Runs held   RSS {one['rss_kib'] / 1024:6.1f} MiB"
              f" ({(one['rss_kib'] - empty['rss_kib']) / 1024:+6.1f})   peak "
              f"{one['peak_kib'] / 1024:6.1f} MiB ({(one['peak_kib'] - empty['peak_kib']) / 1024:+6.1f})"
              + (f"   a Run's watch event {one['event'] / 1024:.1f} KiB" if "event" in one else ""))  # fmt: skip


if __name__ == "__main__":
    main()
