"""docs/architecture.md, "The hot path", and docs/protocol.md, "Adapters": how a payload's JSON
is encoded, in the client library and in the Python worker."""

from __future__ import annotations

import textwrap

import pytest

from fnkernel.runtime_server import jsoncodec
from tests.support import Client

RESULTS = {
    "handler.py": """
        import datetime, math

        def handle(event):
            if event == "past orjson":
                return {"big": 2 ** 70, 1: "an int key"}
            return {"when": datetime.date(2026, 12, 2), "nan": math.nan, "text": "é ☃"}
    """
}


def test_a_python_result_is_compact_json_from_either_library(python_rt: Client) -> None:
    reg = python_rt.register({name: textwrap.dedent(text) for name, text in RESULTS.items()})
    # What orjson refuses, the standard library encodes, as compactly.
    output = python_rt.invoke(reg.registration, b'"past orjson"').output
    assert output == b'{"big":1180591620717411303424,"1":"an int key"}'
    # What only orjson encodes; NaN, which JSON cannot hold, is null; UTF-8 as it is.
    output = python_rt.invoke(reg.registration, b'"orjson"').output
    assert output == '{"when":"2026-12-02","nan":null,"text":"é ☃"}'.encode()


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        ({"a": [1, 2.5, None, True]}, b'{"a":[1,2.5,null,true]}'),
        ({"big": -(2**70)}, b'{"big":-1180591620717411303424}'),  # the standard library's
        ({2: "x"}, b'{"2":"x"}'),  # the standard library's
        ("\ud800 lone", b'"\\ud800 lone"'),  # the standard library's, escaped
        ([[[[]]]] * 2, b"[[[[]]],[[[]]]]"),
        (float("inf"), b"null"),
    ],
)
def test_a_payload_encodes_if_either_library_can(value: object, encoded: bytes) -> None:
    assert jsoncodec.dumps(value) == encoded


def test_a_payload_neither_library_encodes_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        jsoncodec.dumps({"a": object()})
    with pytest.raises(TypeError):
        jsoncodec.dumps({(1, 2): "a tuple key"})
