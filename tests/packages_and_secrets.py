"""One end-to-end test, run the same on every backend (issue 46; docs/protocol.md,
"Requirements" and "Secrets"): a notebook executed by nbclient registers a `%%function` with
`--requirements` and `--secret`, calls it, reads it back and unregisters it. The embedded
runtime and `fnkernel up` run it in tests/kernel/test_notebook_habits.py, the emulated cluster in
tests/kubernetes/test_cluster.py, the image's containers in tests_k8s/test_containers.py.

The packages come from the wheelhouse tests/wheelhouse.py builds (never an index); the secret is
set with `fnkernel secrets set` as a user sets it, from an env file."""

from __future__ import annotations

import ast
import hashlib
import os
import subprocess
import sys
from pathlib import Path

from tests.kernel.kernels import error, execute, ok, text

SECRET = "s3cr3t-Value-8842"  # what must appear nowhere but in the handler's environment
CELLS = [
    '%%function etl --requirements "fnk-alpha==1.0" fnk-beta --secret warehouse\n'
    "import hashlib, os\n"
    "import fnk_alpha, fnk_beta\n"
    "def handler(event):\n"
    "    password = os.environ['DB_PASSWORD'].encode()\n"
    "    return {'alpha': fnk_alpha.VERSION, 'beta': fnk_beta.VERSION,\n"
    "            'password': hashlib.sha256(password).hexdigest()}\n",
    "etl()",
    "print(etl.getdoc())",
    "etl.status()",
    "%functions",
    "%%function lost --secret nowhere\ndef handler(event):\n    return 1\n",
    "etl.unregister()",
]


def set_secret(directory: Path, env: dict[str, str], *flags: str) -> None:
    """`fnkernel secrets set warehouse --from-env-file .env [flags]` with `env` (which names the
    stack, or none: this machine's store)."""
    env_file = directory / ".env"
    env_file.write_text(f"DB_PASSWORD={SECRET}\n")
    done = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "secrets", "set", "warehouse",
         "--from-env-file", str(env_file), *flags],
        capture_output=True, text=True, timeout=60, env={**os.environ, **env},
    )  # fmt: skip
    env_file.unlink()
    assert done.returncode == 0, done.stderr
    assert SECRET not in done.stdout + done.stderr


def a_function_brings_its_packages_and_a_secret(directory: Path, env: dict[str, str]) -> str:
    """Run CELLS in `directory` with the kernel's `env` (which names the stack and, for the
    embedded runtime, the package index) after `set_secret`; check what a user sees. The
    outputs' text, for a backend's own checks."""
    cells = execute(directory, CELLS, env={**os.environ, **env})
    card = ok(cells[0])
    assert "state READY" in card, card
    assert ast.literal_eval(ok(cells[1])) == {
        "alpha": "1.0", "beta": "1.0", "password": hashlib.sha256(SECRET.encode()).hexdigest(),
    }  # fmt: skip
    described = ok(cells[2])
    assert "secrets: warehouse" in described
    assert "requirements: fnk-alpha==1.0, fnk-beta" in described
    assert "etl" in ok(cells[4])
    assert "secret 'nowhere' does not exist" in error(cells[5])["evalue"]
    ok(cells[6])
    shown = "\n".join(text(outputs) for outputs in cells)
    assert SECRET not in shown
    return shown
