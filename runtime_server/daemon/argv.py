"""The one definition of each component's command line: every process that starts another builds
its argv here, and tests/lifecycle/test_daemon.py parses each with the CLI's own parser."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def serve_args(runtime: str, listen: str, workspace_root: Path, *extra: str) -> list[str]:
    """``fnkernel serve``: a Runtime Server for one runtime."""
    return [
        "serve",
        "--runtime",
        runtime,
        "--listen",
        listen,
        "--workspace-root",
        str(workspace_root),
        *extra,
    ]


def runtimed_args(
    pod: str,
    runtime: str,
    server: str,
    listen: str,
    poll_interval: float,
    state_dir: Path,
    workspace: Path,
    secrets_dir: Path | None = None,
    packages_dir: Path | None = None,
) -> list[str]:
    """``fnkernel runtimed``: the agent of one Runtime Pod, beside its server; it writes its
    Runs' files into `workspace`, and installs their requirements in `packages_dir` (default
    STATE_DIR/packages)."""
    return [
        "runtimed", "--pod", pod, "--runtime", runtime, "--server", server, "--listen", listen,
        "--poll-interval", str(poll_interval), "--state-dir", str(state_dir),
        "--workspace", str(workspace),
        *(["--secrets-dir", str(secrets_dir)] if secrets_dir is not None else []),
        *(["--packages", str(packages_dir)] if packages_dir is not None else []),
    ]  # fmt: skip


def gateway_args(
    listen: str,
    state_dir: Path,
    *,
    token_file: Path | None = None,
    no_token: bool = False,
    allow_origins: Sequence[str] = (),
    allow_hosts: Sequence[str] = (),
    secrets_dir: Path | None = None,
    spool: Path | None = None,
    max_payload_bytes: int = 0,
) -> list[str]:
    """``fnkernel gateway``: the HTTP gateway with the control plane. The token travels in a
    file, never in argv, which every local user can read."""
    args = ["gateway", "--listen", listen, "--state-dir", str(state_dir)]
    if spool is not None:
        args += ["--spool", str(spool)]
    if max_payload_bytes:
        args += ["--max-payload-bytes", str(max_payload_bytes)]
    if token_file is not None:
        args += ["--token-file", str(token_file)]
    if no_token:
        args += ["--no-token"]
    for origin in allow_origins:
        args += ["--allow-origin", origin]
    for host in allow_hosts:
        args += ["--allow-host", host]
    if secrets_dir is not None:
        args += ["--secrets-dir", str(secrets_dir)]
    return args


def wrapper_server_args(entrypoint: Sequence[str], port: int = 0) -> list[str]:
    """``fnkernel wrapper-server``: one KRM function entrypoint over FunctionEvaluator."""
    return ["wrapper-server", "--port", str(port), "--", *entrypoint]
