"""The packages the pipeline's tests render — kpt's layout on disk (a Kptfile, its resources, a
subpackage), written from text — and ``fnkernel render`` run on one as a user runs it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

DEPLOY = """\
# The web tier: two replicas
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web # keep this name
  namespace: dev
spec:
  replicas: 2           # aligned comment
  template:
    spec:
      containers:
      - name: web
        image: nginx
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: dev}
"""
DB = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: db
  namespace: dev
data:
  url: postgres://db # where the data lives
"""


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        if name.endswith(".sh"):
            path.chmod(0o755)
    return root


def kptfile(name: str, mutators: str = "", validators: str = "") -> str:
    text = f"apiVersion: kpt.dev/v1\nkind: Kptfile\nmetadata:\n  name: {name}\npipeline:\n"
    if mutators:
        text += "  mutators:\n" + textwrap.indent(textwrap.dedent(mutators), "  ")
    if validators:
        text += "  validators:\n" + textwrap.indent(textwrap.dedent(validators), "  ")
    return text


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def app_package(root: Path) -> Path:
    """A package `app` with a subpackage `db`: set-namespace and set-labels as mutators, a
    set-annotations validator, and the subpackage's own set-annotations mutator."""
    return write(
        root,
        {
            "Kptfile": kptfile(
                "app",
                mutators="""\
                - image: set-namespace:v0.4.1
                  configMap: {namespace: prod}
                - image: gcr.io/kpt-fn/set-labels:v0.2
                  configMap: {app: web}
                """,
                validators="""\
                - image: set-annotations
                  configMap: {validated: "yes"}
                """,
            ),
            "deploy.yaml": DEPLOY,
            "db/Kptfile": kptfile(
                "db",
                mutators="""\
                - image: set-annotations
                  configMap: {team: data}
                """,
            ),
            "db/configmap.yaml": DB,
        },
    )


def fnkernel_render(package: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "render", str(package), *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
