"""Where a deployment keeps its Runs and who does what there (docs/architecture.md, "Seams"):
one object per kind of deployment, built in one place, that chooses the Run store, the process
that runs the control plane's loop, where runtimed writes a pod's files, and where Runtime Pods
come from. The components are written against ``RunStore`` alone; only this module (and the
store modules it opens) knows which store a deployment has; the Kubernetes one is
``lifecycle/kubernetes/topology.py``, so that one machine never imports the Kubernetes client.

- ``OneMachine``: the embedded runtime and ``fnkernel up``. SQLite in the state dir, shared by
  every process; the gateway process runs the control plane's loop; each pod's workspace is
  ``STATE_DIR/workspace/POD``, and the pods share one package cache, ``STATE_DIR/packages``;
  the stack's ``LocalProvisioner`` starts pods as processes.
- ``Kubernetes``: Run objects of the API server; the ``controller`` runs the loop and the
  gateway only creates, deletes and routes; a pod's workspace is a volume of the pod, named by
  its manifest; the Deployments of ``deploy/`` keep the pods (no component of ours starts one).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from fnkernel.runtime_server.lifecycle.runs import RunStore
from fnkernel.runtime_server.lifecycle.secrets import SECRETS_DIR, SecretFiles, Secrets

WORKSPACE_DIR = "workspace"  # one machine: STATE_DIR/WORKSPACE_DIR/POD
PACKAGES_DIR = "packages"  # one machine: STATE_DIR/PACKAGES_DIR, every pod's


class MissingWorkspace(ValueError):
    """A pod's workspace the topology cannot choose: its deployment must name it."""


class Topology(Protocol):
    #: Whether the gateway process runs the control plane's loop (else a controller does).
    control_plane_in_gateway: bool
    #: Whether clients of this machine find the gateway by its gateway file (tokens.announce).
    local_clients: bool

    def open_store(self, *, pods: bool = True, only_pod: str | None = None) -> RunStore:
        """Its Run store. `pods`: whether this component reads the Runtime Pods (runtimed does
        not); `only_pod`: where the store can, keep only the Runs assigned to that pod."""
        ...

    def workspace(self, pod: str, given: Path | None = None) -> Path:
        """Where the runtimed of `pod` writes its Runs' files: `given` if its deployment names
        one, else the topology's own place; MissingWorkspace if it has none."""
        ...

    def packages(self, given: Path | None = None) -> Path:
        """Where a runtimed keeps the node's cache of its Runs' requirements (docs/protocol.md,
        "Requirements"): `given` if its deployment names one, else the topology's own place;
        MissingWorkspace if it has none."""
        ...

    def open_secrets(self) -> Secrets:
        """Its store of named secrets (docs/protocol.md, "Secrets")."""
        ...

    def where(self) -> str:
        """Where its Runs are, as a component's announcement says it."""
        ...


def default_state_dir() -> Path:
    """The user's own state dir: $FNKERNEL_STATE_DIR, else $XDG_STATE_HOME/fnkernel, else
    ~/.local/state/fnkernel."""
    named = os.environ.get("FNKERNEL_STATE_DIR")
    if named:
        return Path(named)
    return Path(os.environ.get("XDG_STATE_HOME") or "~/.local/state").expanduser() / "fnkernel"


@dataclass(frozen=True)
class OneMachine:
    """Every component a process of this machine, sharing the state dir `state_dir`; the
    named secrets are in `secrets_dir` (default STATE_DIR/secrets; the embedded runtime's
    stack, whose state dir lives as long as its kernel, uses the user's own state dir's)."""

    state_dir: Path
    secrets_dir: Path | None = None
    control_plane_in_gateway = True
    local_clients = True

    def open_store(self, *, pods: bool = True, only_pod: str | None = None) -> RunStore:
        # Imported here: a Kubernetes deployment never loads SQLite's store, nor this its.
        from fnkernel.runtime_server.lifecycle.sqlite import STORE_FILE, SqliteRunStore
        from fnkernel.system.private import private_dir

        return SqliteRunStore(private_dir(self.state_dir) / STORE_FILE)

    @property
    def workspace_root(self) -> Path:
        """Where each pod's workspace is (``LocalProvisioner``)."""
        return self.state_dir / WORKSPACE_DIR

    def workspace(self, pod: str, given: Path | None = None) -> Path:
        return given if given is not None else self.workspace_root / pod

    def packages(self, given: Path | None = None) -> Path:
        # One cache for the machine: every pod's Runs share what they install.
        return given if given is not None else self.state_dir / PACKAGES_DIR

    def open_secrets(self) -> Secrets:
        return SecretFiles(self.secrets_dir or self.state_dir / SECRETS_DIR)

    def where(self) -> str:
        return f"state dir {self.state_dir}"
