"""Where Runtime Pods come from: ``PodProvisioner``, in the spirit of jupyter_client's kernel
provisioners (docs/architecture.md, "Seams").

A provisioner starts and stops Runtime Pods — a Runtime Server with its runtimed beside it — and
says whether one is alive and where its runtimed listens. It does not schedule Runs: the control
plane assigns Runs to the pods the store reports (``RunStore.pods``), whoever started them. The
local one is ``stack.LocalProvisioner`` (processes of this machine, the embedded runtime and
``fnkernel up``); on Kubernetes the Deployments' own controller keeps the pods, and no component
of ours starts one (docs/kubernetes.md, "Runtime Pods").
"""

from __future__ import annotations

from typing import Protocol


class PodProvisioner(Protocol):
    def start(self, runtime: str) -> str:
        """Start one more Runtime Pod of `runtime`; its name. It is announced (its runtimed
        serves) when this returns."""
        ...

    def alive(self, pod: str) -> bool:
        """Whether the pod's processes (or containers) are running."""
        ...

    def stop(self, pod: str, timeout: float = 15.0) -> None:
        """Stop the pod, runtimed first, then its server (which drains); KeyError if unknown."""
        ...

    def address(self, pod: str) -> str:
        """Its runtimed's FunctionRuntime address: where the gateway sends the proxy hop."""
        ...

    def pods(self, runtime: str | None = None) -> list[str]:
        """The pods it started (of `runtime`, when given), in the order started."""
        ...
