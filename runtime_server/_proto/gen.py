"""Regenerate the committed protobuf/gRPC stubs from proto/ (``make proto``).

protoc sees proto/ under the virtual path ``fnkernel/runtime_server/_proto`` — where the stubs are
installed — so the generated modules import each other as ``fnkernel.runtime_server._proto.…``
and no top-level ``proto`` package ever exists (it would collide with proto-plus). They are
written to ``runtime_server/_proto`` (``REPO_DIR``), which the package maps to that name.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent  # where the committed stubs are
# The checkout: the folder above that holds proto/ (``make mutate`` runs a staged copy, whose
# folders are one level deeper).
ROOT = next((p for p in HERE.parents if (p / "proto").is_dir()), HERE.parents[1])
PROTO_DIR = ROOT / "proto"
VIRTUAL = "fnkernel/runtime_server/_proto"  # as installed, and as they import each other
REPO_DIR = "runtime_server/_proto"  # where they are in the repository
SOURCES = (
    "executor/v1/runtime.proto",
    "evaluator/v1/evaluator.proto",
    "fnkernel/v1alpha1/logs.proto",
    "fnkernel/v1alpha1/payloads.proto",
    "fnkernel/v1alpha1/batches.proto",
    "fnkernel/v1alpha1/registrations.proto",
    "fnkernel/v1alpha1/callstreams.proto",
)


def generate(out_dir: Path) -> None:
    """Write the stubs for every file in SOURCES under out_dir (a checkout root), in REPO_DIR."""
    with tempfile.TemporaryDirectory() as tmp:
        _protoc(Path(tmp))
        shutil.copytree(Path(tmp) / VIRTUAL, out_dir / REPO_DIR, dirs_exist_ok=True)


def _protoc(out_dir: Path) -> None:
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    include = Path(protoc.__file__).parent / "_proto"
    for source in SOURCES:
        args = [
            "grpc_tools.protoc",
            f"-I{VIRTUAL}={PROTO_DIR}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            f"{VIRTUAL}/{source}",
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed for {source}")
        package = out_dir / VIRTUAL
        for part in Path(source).parent.parts:
            package = package / part
            (package / "__init__.py").touch()


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
