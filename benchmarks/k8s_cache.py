"""What a component's cache of Runs costs on Kubernetes (docs/kubernetes.md, "Reads"): the
resident memory (now, and at its peak) of a process holding a ``KubernetesRunStore`` of a namespace with many large
Runs, all assigned to other pods — keeping every Run (the controller's and the gateway's store)
against keeping only its own pod's (runtimed's, by the pod label) — beside the same process
holding an empty namespace, measured in one run against the emulated API server.

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
from tests.kubernetes.conftest import EmulatedApi

_HOLD = """
import json, os, resource, sys
from kubernetes import client
from fnkernel.runtime_server.lifecycle.kubernetes.store import KubernetesRunStore
configuration = client.Configuration()
configuration.host = sys.argv[1]
store = KubernetesRunStore(client.ApiClient(configuration), sys.argv[2], watch_pods=False,
                           pod=sys.argv[3] or None, sync_timeout=120)
held = len(store.runs())
now = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS"))
print(json.dumps({"runs": held, "rss_kib": now,
                  "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}), flush=True)
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
    api = EmulatedApi()
    try:
        custom = client.CustomObjectsApi(api.client())
        started = time.monotonic()
        for n in range(args.runs):
            custom.create_namespaced_custom_object(objects.GROUP, objects.VERSION, "big",
                                                   objects.PLURAL, {
                "apiVersion": objects.API_VERSION, "kind": "Run",
                "metadata": {"name": f"r{n}", "labels": {objects.POD_LABEL: "elsewhere"}},
                "spec": {"runtime": "python", "handler": "h.handle",
                         "files": {"h.py": "x" * (args.kib * 1024)}},
            })  # fmt: skip
        print(f"{args.runs} Runs of {args.kib} KiB created in {time.monotonic() - started:.1f} s")
        empty = held(api.url, "empty", "")
        every = held(api.url, "big", "")
        own = held(api.url, "big", "mine")
    finally:
        api.stop()
    for label, seen in (("empty namespace", empty), ("every Run (controller, gateway)", every),
                        ("its own pod's Runs (runtimed)", own)):  # fmt: skip
        print(f"{label:<34} {seen['runs']:>5} Runs held   RSS {seen['rss_kib'] / 1024:6.1f} MiB"
              f"   peak {seen['peak_kib'] / 1024:6.1f} MiB")  # fmt: skip
    for key, name in (("rss_kib", "RSS"), ("peak_kib", "peak")):
        extra_every = (every[key] - empty[key]) / 1024
        extra_own = (own[key] - empty[key]) / 1024
        print(f"{name} above an empty namespace: every Run {extra_every:+.1f} MiB, "
              f"its own pod's {extra_own:+.1f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
