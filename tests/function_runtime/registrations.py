"""Handlers and checks the registration tests share: functions that count, sleep or finish late,
and the status code a call was refused with."""

from __future__ import annotations

import grpc
import pytest

from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb

READY = pb.FUNCTION_REGISTRATION_STATE_READY
FAILED = pb.FUNCTION_REGISTRATION_STATE_FAILED
SLOW = {
    "handler.py": """
        import os, time
        from pathlib import Path

        def handle(event, context):
            Path("pid").write_text(str(os.getpid()))
            time.sleep(event.get("sleep", 0))
            return {"slept": event.get("sleep", 0)}
    """
}

FINISHES_LATE = {
    # A call that leaves a trace if it is allowed to finish: `finished`, after `event` seconds.
    "handler.py": """
        import os, time
        from pathlib import Path

        def handle(event):
            Path("pid").write_text(str(os.getpid()))
            time.sleep(event)
            Path("finished").touch()
    """
}


def code_of(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()
