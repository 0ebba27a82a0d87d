"""``fnkernel secrets set|list|delete`` (docs/protocol.md, "Secrets"): the stack's named secrets,
through the gateway ``--gateway`` or ``$FNKERNEL_RUNTIME`` names; with neither, in this machine's
store (``--state-dir``, ``--secrets-dir``), which ``fnkernel up`` and every kernel's embedded
runtime read. A value is read from the command line, the environment or an env file and sent; none is ever
printed, nor quoted in an error."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fnkernel.runtime_server.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    UsageError,
    add_client_flags,
    add_state_dir,
    client_of,
    print_json,
    print_table,
    state_dir_of,
)


def env_file(text: str) -> dict[str, str]:
    """An env file's variables as dotenv and Docker Compose read them (python-dotenv's parser):
    ``KEY=VALUE`` lines, ``export`` before one, blank lines and ``#`` comments (after an
    unquoted value too), single or double quotes (a double-quoted value's escapes, a quoted
    value over several lines: a PEM key). Nothing is interpolated: a ``$`` in a password stays
    one. UsageError names a line that is none of these by its number, never its text."""
    import io

    from dotenv.parser import parse_stream

    found: dict[str, str] = {}
    for binding in parse_stream(io.StringIO(text)):
        if binding.key is None and not binding.error:
            continue  # a blank line or a comment
        if binding.error or binding.key is None or binding.value is None:
            # The statement's text begins with the blank lines before it.
            statement = binding.original.string
            blank = statement[: len(statement) - len(statement.lstrip())].count("\n")
            line = binding.original.line + blank
            raise UsageError(f"--from-env-file: line {line} is not KEY=VALUE")
        found[binding.key] = binding.value
    return found


def _pairs(pairs: list[str], environ: Mapping[str, str]) -> dict[str, str]:
    """``KEY=VALUE`` arguments, as ``client.parse_pairs`` reads them, and ``KEY`` alone, whose
    value is this process's ``$KEY`` (as ``%%function --env KEY`` and ``docker run -e KEY``
    take one): a value given so is not in the command line other users read in ``ps``. A
    malformed argument is named by its position, never echoed: it may hold a secret's value."""
    found = {}
    for number, pair in enumerate(pairs, 1):
        key, sep, value = pair.partition("=")
        if not key:
            raise UsageError(f"secrets set: argument {number} after the name is not KEY=VALUE")
        if not sep:
            if key not in environ:
                raise UsageError(
                    f"secrets set: argument {number} after the name, {key}, is not set in this "
                    "environment (give KEY=VALUE, or export KEY first)"
                )
            value = environ[key]
        found[key] = value
    return found


class _LocalStore:
    """This machine's store of secrets, answering as the gateway's client does."""

    def __init__(self, args: argparse.Namespace) -> None:
        from fnkernel.runtime_server.lifecycle.topology import OneMachine
        from fnkernel.system.private import private_dir

        secrets_dir = Path(args.secrets_dir).expanduser() if args.secrets_dir else None
        state_dir = state_dir_of(args)
        try:  # as `fnkernel up` refuses it: one another user made or may write
            private_dir(secrets_dir or state_dir)
        except OSError as exc:
            raise UsageError(f"secrets: {exc}") from None
        self.secrets = OneMachine(state_dir, secrets_dir).open_secrets()

    def set_secret(self, name: str, data: Mapping[str, str]) -> dict[str, object]:
        return self.secrets.set(name, data).shown()

    def list_secrets(self) -> list[dict[str, object]]:
        return [secret.shown() for secret in self.secrets.list()]

    def delete_secret(self, name: str) -> None:
        self.secrets.delete(name)


def _secrets(args: argparse.Namespace) -> Any:
    if args.gateway or os.environ.get("FNKERNEL_RUNTIME"):
        return client_of(args)
    return _LocalStore(args)


def _run(args: argparse.Namespace, action: Any) -> int:
    """`action(store)`, the store the flags name; the local store's refusals answered as the
    gateway's are (a bad field is a usage error, a missing secret a failure)."""
    from fnkernel.runtime_server.errors import InvalidField, SecretNotFound

    try:
        action(_secrets(args))
    except InvalidField as exc:
        raise UsageError(str(exc)) from None
    except SecretNotFound as exc:
        print(f"fnkernel: SecretNotFound: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def _set(args: argparse.Namespace) -> int:
    data: dict[str, str] = {}
    if args.from_env_file == "-":
        data.update(env_file(sys.stdin.read()))
    elif args.from_env_file:
        try:
            data.update(env_file(Path(args.from_env_file).read_text()))
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--from-env-file: cannot read {args.from_env_file}: {exc}") from None
    data.update(_pairs(args.pairs, os.environ))
    if not data:
        raise UsageError("secrets set: give KEY=VALUE pairs, KEY, or --from-env-file FILE")
    return _run(args, lambda store: print_json(store.set_secret(args.name, data)))


def _list(args: argparse.Namespace) -> int:
    """A table of the secrets, as ``runs list`` is one of Runs: name, version, keys."""

    def listed(store: Any) -> None:
        rows = [("NAME", "VERSION", "KEYS")]
        rows += [(s["name"], str(s["version"]), ",".join(s["keys"])) for s in store.list_secrets()]
        print_table(rows)

    return _run(args, listed)


def _delete(args: argparse.Namespace) -> int:
    return _run(args, lambda store: store.delete_secret(args.name))


def register(commands: Any) -> None:
    """Add the subcommands of this group to `commands` (argparse subparsers)."""
    secrets = commands.add_parser(
        "secrets",
        help="the stack's named secrets, which Runs use by name",
        description="Through the gateway --gateway or $FNKERNEL_RUNTIME names; with neither, in "
        "this machine's store (--state-dir), which `fnkernel up` and the embedded runtime read.",
    )
    actions = secrets.add_subparsers(dest="secrets_command", metavar="ACTION", required=True)
    setting = actions.add_parser("set", help="keep KEY=VALUE pairs under NAME (replacing them)")
    setting.add_argument("name")
    setting.add_argument(
        "pairs",
        nargs="*",
        default=[],  # else argparse names it among what is required when the name is missing
        metavar="KEY[=VALUE]",
        help="KEY alone takes $KEY from this environment, kept out of the process list",
    )
    setting.add_argument(
        "--from-env-file", metavar="FILE", help="KEY=VALUE lines (a .env file; - for stdin)"
    )
    setting.set_defaults(func=_set)
    listing = actions.add_parser("list", help="each secret's name, version and keys; no value")
    listing.set_defaults(func=_list)
    deleting = actions.add_parser("delete", help="remove a secret")
    deleting.add_argument("name")
    deleting.set_defaults(func=_delete)
    for parser in (setting, listing, deleting):
        add_client_flags(parser)
        add_state_dir(parser)
