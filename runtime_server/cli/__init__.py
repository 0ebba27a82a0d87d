"""The ``fnkernel`` console script (docs/protocol.md, "CLI"): one module per command group, each
subcommand's flags beside its handler. Exit codes: 0 ok, 1 failure, 2 usage error, 130
interrupted (Ctrl-C)."""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
from collections.abc import Sequence

from fnkernel.runtime_server.cli import daemons, krm, runs, secrets, tools
from fnkernel.runtime_server.cli.common import (
    EXIT_BROKEN_PIPE,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    UsageError,
)

GROUPS = (daemons, runs, secrets, krm, tools)


class _Command(argparse.ArgumentParser):
    """A command's parser (and its subcommands', which argparse makes of the same class): it
    marks the namespace with itself when it leaves arguments it does not know, so that they
    are refused with its usage (``fnkernel invoke …``), not the top level's."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and getattr(namespace, _REFUSED_BY, None) is None:  # the innermost first
            setattr(namespace, _REFUSED_BY, self)
        return namespace, extras


_REFUSED_BY = "_unknown_arguments_of"


@functools.cache  # built once; a prewarmed component builds it before it is needed
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fnkernel",
        description="Registered server-side functions as callable notebook cells.",
    )
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=_Command
    )
    for group in GROUPS:
        group.register(commands)
    return parser


_NEGATIVE_NUMBER = re.compile(r"-\d+(\.\d*)?([eE][+-]?\d+)?")  # a JSON payload, not a flag


def _payload_after_flags(args: argparse.Namespace, extra: str) -> bool:
    """`extra`, left over by argparse, is invoke's payload written after its flags."""
    return (
        args.command == "invoke"
        and args.payload is None
        and (
            not extra.startswith("-")
            or extra == "-"
            or _NEGATIVE_NUMBER.fullmatch(extra) is not None
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    from fnkernel.runtime_server.client.errors import (
        GatewayError,
        InvalidRequest,
        PayloadTooLarge,
        Unauthorized,
        UnsupportedMediaType,
    )
    from fnkernel.runtime_server.errors import StoreDamaged

    argv = list(sys.argv[1:] if argv is None else argv)
    pairs = None
    # For eval, `-- key=value ...` ends the command line: the pairs for the function's ConfigMap.
    if (argv[:1] == ["eval"] or argv[:2] == ["fn", "eval"]) and "--" in argv:
        cut = argv.index("--")
        argv, pairs = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if len(extras) == 1 and _payload_after_flags(args, extras[0]):
        # `invoke NAME --timeout-ms 5000 '{...}'`: argparse has matched the optional payload
        # (as absent) before the flags, so it is left over; it is the payload all the same.
        args.payload, extras = extras[0], []
    if extras:
        getattr(args, _REFUSED_BY, parser).error(f"unrecognized arguments: {' '.join(extras)}")
    if pairs is not None:
        args.pairs = pairs
    from fnkernel.runtime_server import daemon

    daemon.watch_parent()  # started by daemon.spawn(die_with_parent=True): stop with the parent
    try:
        return int(args.func(args))
    except KeyboardInterrupt:  # Ctrl-C: a call in flight is cancelled as its connection closes
        print("fnkernel: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except UsageError as exc:
        print(f"fnkernel: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # What read stdout stopped reading (`| head`): end quietly, as a pipe's tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush
        return EXIT_BROKEN_PIPE
    except StoreDamaged as exc:
        print(f"fnkernel: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except (OSError, ValueError) as exc:  # a source that cannot be read
        print(f"fnkernel: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (InvalidRequest, PayloadTooLarge, UnsupportedMediaType) as exc:  # the input, refused
        print(f"fnkernel: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except GatewayError as exc:
        print(f"fnkernel: {type(exc).__name__}: {exc}", file=sys.stderr)
        if isinstance(exc, Unauthorized):  # where the token is found (README, "Security")
            print(
                f"  the token: --token-file STATE_DIR/token of the stack, {Unauthorized.FOUND_IN}",
                file=sys.stderr,
            )
        if not getattr(args, "follow", False):  # else each line was printed as it came
            for line in exc.logs:
                print(f"  [{line.get('stream', '')}] {line.get('text', '')}", file=sys.stderr)
        return EXIT_FAILURE
