"""How the function runtime tests read a refusal: the status code a call failed with, and the
message naming its field or cause (docs/protocol.md, "Errors")."""

from __future__ import annotations

import grpc
import pytest


def code_of(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def refused(call, code: grpc.StatusCode, *words: str) -> str:  # type: ignore[no-untyped-def]
    """`call` fails with `code`, its message naming each of `words` (docs/protocol.md,
    "Errors": every failure names its field or cause); returns the message."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    details = err.value.details() or ""
    assert err.value.code() == code, details
    for word in words:
        assert word in details, (word, details)
    return details


def rejected(call, field: str, *words: str) -> str:  # type: ignore[no-untyped-def]
    """INVALID_ARGUMENT whose message is ``<field>: <the rule broken>`` (docs/protocol.md,
    "Limits"), the rule naming each of `words`; returns the message."""
    details = refused(call, grpc.StatusCode.INVALID_ARGUMENT, *words)
    assert details.startswith(f"{field}: "), details
    return details
