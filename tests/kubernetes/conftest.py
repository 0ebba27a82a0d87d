"""Fixtures of the Kubernetes tests: the emulated API server (``tests/kubernetes/emulator.py``,
a test double) in a process of its own, and clients of it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from kubernetes import client

from tests.support import ROOT


class EmulatedApi:
    """The emulated Kubernetes API server, as a running process and its URL."""

    def __init__(self, *args: str) -> None:
        """`args`: the emulator's own (``--history N``)."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.kubernetes.emulator", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if " at " not in line:
            self.proc.kill()
            raise RuntimeError(f"the emulated API server did not start: {line!r}")
        self.url = line.rsplit(" at ", 1)[1].strip()

    def client(self) -> client.ApiClient:
        configuration = client.Configuration()
        configuration.host = self.url
        return client.ApiClient(configuration)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def kube_api() -> Iterator[EmulatedApi]:
    api = EmulatedApi()
    try:
        yield api
    finally:
        api.stop()


@pytest.fixture
def api_client(kube_api: EmulatedApi) -> Iterator[client.ApiClient]:
    with kube_api.client() as api_client:
        yield api_client
