"""``make test-k8s``: the cluster path as a cluster runs it (docs/kubernetes.md, "What is tested,
and with which doubles"): the image built from deploy/Dockerfile (``make image``), every pod of
deploy/'s Deployments a set of podman containers of it, run as the manifests say. The API server
stays emulated. A test here never skips: what it needs missing is a failure."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import fnkernel_spec  # noqa: F401 — the kernelspec fixture, here too
from tests.kubernetes.conftest import (
    Cluster,
    image_of,
    kustomize_build,
    node_wheelhouse,  # noqa: F401 — its fixture, here too
)
from tests.support import ROOT

PODMAN_DIR = Path(os.environ.get("FNKERNEL_PODMAN_DIR", ROOT / "build" / "podman"))


@pytest.fixture(scope="session")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The image deploy/ names, as `make image` built it into PODMAN_DIR's store."""
    if shutil.which("podman") is None:
        pytest.fail("podman is needed (make test-k8s installs Debian's podman, runc, mmdebstrap)")
    os.environ["CONTAINERS_CONF"] = str(PODMAN_DIR / "containers.conf")
    os.environ["CONTAINERS_STORAGE_CONF"] = str(PODMAN_DIR / "storage.conf")
    name = image_of(kustomize_build("a-token", tmp_path_factory.mktemp("k") / "deploy"))
    found = subprocess.run(["podman", "image", "exists", name], timeout=60)
    if found.returncode != 0:
        pytest.fail(f"no image {name} in {PODMAN_DIR}: make image builds it")
    return name


@pytest.fixture
def cluster(image: str, tmp_path: Path, node_wheelhouse: Path) -> Iterator[Cluster]:  # noqa: F811
    """The cluster of containers; its Runtime Pods install requirements from the test's
    wheelhouse, mounted from the node as a team's overlay would name its index."""
    started = Cluster(tmp_path, containers=True, wheelhouse=node_wheelhouse)
    try:
        yield started
    finally:
        started.stop()
