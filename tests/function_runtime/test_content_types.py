"""docs/protocol.md, "Content types", at the Runtime Server: InvokeFunction's ``content_type``
says what ``input`` is. The python runtime takes JSON, Arrow IPC and octets, and its handler
gets the kind that was sent; the response's ``content_type`` says what its output is, the kind
the handler returned. The bash runtime takes JSON only. Refusals are INVALID_ARGUMENT naming
the field."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pandas as pd
import pytest

from fnkernel.runtime_server import payloads
from tests.function_runtime.statuses import refused, rejected
from tests.support import Client

KINDS = {
    "handler.py": """
        import pandas as pd

        def handle(event):
            kind = f"{type(event).__module__.split('.')[0]}.{type(event).__name__}"
            if isinstance(event, pd.DataFrame):
                return event.assign(seen=kind)
            return {"kind": kind}
    """
}
PID = {"handler.py": "import os\n\ndef handle(event):\n    return os.getpid()\n"}


def test_the_handler_gets_the_kind_sent_and_returns_its_own(python_rt: Client) -> None:
    registration = python_rt.register(KINDS).registration
    frame = pd.DataFrame({"x": [1, None]}, index=pd.Index(["a", "b"], name="key"))
    data, content_type = payloads.encode(frame)
    answer = python_rt.invoke(registration, data, content_type=content_type)
    assert answer.content_type == payloads.ARROW
    pd.testing.assert_frame_equal(
        payloads.decode(answer.output, answer.content_type),
        frame.assign(seen="pandas.DataFrame"),
    )
    for value, kind in ((np.eye(2), "numpy.ndarray"), (b"\x00raw", "builtins.bytes")):
        data, content_type = payloads.encode(value)
        answer = python_rt.invoke(registration, data, content_type=content_type)
        assert (answer.content_type, answer.output) == (
            payloads.JSON, f'{{"kind":"{kind}"}}'.encode()
        )  # fmt: skip


def test_bytes_that_are_not_their_type_are_invalid_input(python_rt: Client) -> None:
    registration = python_rt.register(KINDS).registration
    # The second, a negative length first, is refused by pyarrow with a plain OSError.
    for data in (b"not arrow", (-5).to_bytes(4, "little", signed=True) + b"garbage!"):
        with pytest.raises(grpc.RpcError) as refused:
            python_rt.invoke(registration, data, content_type=payloads.ARROW)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "input is not an Arrow IPC stream" in (refused.value.details() or "")


@pytest.mark.parametrize(
    "metadata",
    [
        {"fnkernel.kind": "numpy.ndarray"},  # no "values" column
        {"fnkernel.kind": "pandas.DataFrame", "pandas": "{not json"},
        {"fnkernel.kind": "pandas.Series"},  # two columns, none of them the series'
    ],
    ids=["array", "frame", "series"],
)
def test_a_stream_whose_kind_does_not_match_its_columns_is_invalid_input_and_the_worker_stays(
    python_rt: Client, metadata: dict[str, str]
) -> None:
    # docs/protocol.md, "Content types": bytes that are not their type are INVALID_ARGUMENT —
    # also an Arrow stream whose metadata names a kind its columns cannot be (written by hand,
    # or one of ours changed); the worker that read it serves the next call.
    import pyarrow as pa

    registration = python_rt.register(PID).registration
    first = python_rt.invoke(registration, b"{}").output
    table = pa.table({"a": [1, 2], "b": [3, 4]}).replace_schema_metadata(metadata)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    refused(
        lambda: python_rt.invoke(
            registration, sink.getvalue().to_pybytes(), content_type=payloads.ARROW
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        f"input is an Arrow stream whose fnkernel.kind metadata ({metadata['fnkernel.kind']})",
        "does not match its columns",
    )
    assert python_rt.invoke(registration, b"{}").output == first  # the same worker


def test_a_kind_whose_package_the_runtime_lacks_is_named_with_the_way_out(
    python_rt: Client, tmp_path: Path
) -> None:
    # The worker rebuilds a polars DataFrame with polars; here an installed "polars" that
    # cannot be imported stands in for a runtime without it (the Run's packages come first).
    packages = tmp_path / "packages"
    packages.mkdir()
    (packages / "polars.py").write_text("raise ImportError('no polars here')\n")
    import polars as pl

    registration = python_rt.register(KINDS, env={"FNKERNEL_PACKAGES": str(packages)}).registration
    data, content_type = payloads.encode(pl.DataFrame({"a": [1]}))
    with pytest.raises(grpc.RpcError) as refused:
        python_rt.invoke(registration, data, content_type=content_type)
    details = refused.value.details() or ""
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input is a polars.DataFrame, and polars is not installed here" in details
    assert "--requirements" in details


def test_the_bash_runtime_takes_json_only(bash_rt: Client) -> None:
    registration = bash_rt.register({"fn.sh": "handle() { printf '%s' \"$1\"; }\n"}).registration
    data, content_type = payloads.encode(pd.DataFrame({"x": [1]}))
    rejected(
        lambda: bash_rt.invoke(registration, data, content_type=content_type),
        "content_type",
        "the bash runtime takes application/json",
    )
    assert bash_rt.invoke(registration, b'{"a":1}').output == b'{"a":1}'
