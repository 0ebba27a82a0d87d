"""``fnkernel install``: the ``fnkernel`` kernelspec (docs/protocol.md, "Kernel"), written by jupyter_client."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

from fnkernel.kernel.kernel import DISPLAY_NAME, KERNEL_NAME

RESOURCES = Path(__file__).with_name("resources")
LOGOS = ("logo-32x32.png", "logo-64x64.png", "logo-svg.svg")


def kernel_json(python: str | None = None) -> dict[str, object]:
    return {
        # -P: the notebook's directory is not on sys.path while the kernel loads (a local
        # kernel.py must not shadow it); FnKernelApp adds it back for the user's code.
        "argv": [
            python or sys.executable,
            "-P",
            "-m",
            "fnkernel.kernel",
            "-f",
            "{connection_file}",
        ],
        "display_name": DISPLAY_NAME,
        "language": "python",
        # An interrupt is a message, so the kernel cancels the invocation in flight itself.
        "interrupt_mode": "message",
        # ipykernel's debugger works in FnKernel as in IPythonKernel, given debugpy.
        "metadata": {"debugger": importlib.util.find_spec("debugpy") is not None},
    }


def install(*, user: bool = False, prefix: str | None = None) -> Path:
    """Install the kernelspec for this Python: in the user's Jupyter dir, under `prefix`, or
    (neither) system-wide. Returns the installed directory."""
    from jupyter_client.kernelspec import KernelSpecManager

    with tempfile.TemporaryDirectory() as staging:
        (Path(staging) / "kernel.json").write_text(json.dumps(kernel_json(), indent=1) + "\n")
        for logo in LOGOS:  # the launcher tile and the kernel indicator
            shutil.copy(RESOURCES / logo, staging)
        return Path(
            KernelSpecManager().install_kernel_spec(
                staging, KERNEL_NAME, user=user, prefix=prefix, replace=None
            )
        )
