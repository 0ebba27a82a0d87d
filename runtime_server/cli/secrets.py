"""``fnkernel secrets set|list|delete`` (docs/protocol.md, "Secrets"): the stack's named secrets,
through its gateway. A value is read from the command line or an env file and sent; none is
ever printed, nor quoted in an error."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fnkernel.runtime_server.cli.common import (
    EXIT_OK,
    UsageError,
    add_client_flags,
    client_of,
    print_json,
)


def env_file(text: str) -> dict[str, str]:
    """An env file's variables: ``KEY=VALUE`` lines (``export`` before one is allowed), blank
    lines and ``#`` comments skipped, one pair of matching quotes around a value taken off.
    UsageError names a line that is none of these by its number, never its text."""
    found = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.removeprefix("export ").partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--from-env-file: line {number} is not KEY=VALUE")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        found[key.strip()] = value
    return found


def _pairs(pairs: list[str]) -> dict[str, str]:
    found = {}
    for number, pair in enumerate(pairs, 1):
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"secrets set: argument {number} after the name is not KEY=VALUE")
        found[key] = value
    return found


def _set(args: argparse.Namespace) -> int:
    data: dict[str, str] = {}
    if args.from_env_file:
        try:
            data.update(env_file(Path(args.from_env_file).read_text()))
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--from-env-file: cannot read {args.from_env_file}: {exc}") from None
    data.update(_pairs(args.pairs))
    if not data:
        raise UsageError("secrets set: give KEY=VALUE pairs or --from-env-file FILE")
    print_json(client_of(args).set_secret(args.name, data))
    return EXIT_OK


def _list(args: argparse.Namespace) -> int:
    print_json(client_of(args).list_secrets())
    return EXIT_OK


def _delete(args: argparse.Namespace) -> int:
    client_of(args).delete_secret(args.name)
    return EXIT_OK


def register(commands: Any) -> None:
    """Add the subcommands of this group to `commands` (argparse subparsers)."""
    secrets = commands.add_parser(
        "secrets", help="the stack's named secrets, which Runs use by name"
    )
    actions = secrets.add_subparsers(dest="secrets_command", metavar="ACTION", required=True)
    setting = actions.add_parser("set", help="keep KEY=VALUE pairs under NAME (replacing them)")
    setting.add_argument("name")
    setting.add_argument("pairs", nargs="*", metavar="KEY=VALUE")
    setting.add_argument("--from-env-file", metavar="FILE", help="KEY=VALUE lines (a .env file)")
    setting.set_defaults(func=_set)
    listing = actions.add_parser("list", help="each secret's name, version and keys; no value")
    listing.set_defaults(func=_list)
    deleting = actions.add_parser("delete", help="remove a secret")
    deleting.add_argument("name")
    deleting.set_defaults(func=_delete)
    for parser in (setting, listing, deleting):
        add_client_flags(parser)
