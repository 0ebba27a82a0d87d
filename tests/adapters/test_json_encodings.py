"""JSON as fnkernel writes and reads a payload or a result (docs/protocol.md, "JSON encodings";
``adapters/_jsonvalues.py``): what plain pandas and numpy code returns is JSON, by orjson or by
the standard library where orjson refuses, and read as the standard library reads it."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import uuid
from types import SimpleNamespace
from typing import Any

import numpy as np
import pandas as pd
import pytest

from fnkernel.adapters import _jsonvalues
from fnkernel.runtime_server import payloads


def test_nan_and_infinity_are_written_as_null_also_beside_what_only_the_standard_library_writes() -> (
    None
):
    # docs/protocol.md, "JSON encodings": NaN and ±Infinity are null — also in a value orjson
    # refuses (an integer past 64 bits), which the standard library writes: it would write
    # the literal NaN, which is no JSON (RFC 8259), and a strict reader refuses it.
    def strict(text: bytes) -> Any:
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in {text!r}"))

    nan, inf = float("nan"), float("inf")
    for big in (None, 2**70):
        value = {"nan": nan, "big": big, "floats": [inf, -inf, np.float64(nan), 1.5],
                 "array": np.array([nan, 2.0]), "nested": ({"x": np.float32(inf)},)}  # fmt: skip
        data, media = payloads.encode(value)
        assert media == payloads.JSON
        assert strict(data) == {"nan": None, "big": big, "floats": [None, None, None, 1.5],
                                "array": [None, 2.0], "nested": [{"x": None}]}  # fmt: skip
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(ValueError, match="Circular reference"):
        _jsonvalues.dumps([2**70, loop])


def test_a_large_value_is_written_in_pieces_under_a_memory_limit_into_the_same_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # docs/architecture.md, "A payload's bytes": held to a memory limit, a large list, dict or
    # string (or a value holding one among its first parts) is written a slice at a time, each by
    # orjson — into the text orjson writes whole, and refused alike where orjson refuses.
    import orjson

    stamp = datetime.datetime(2024, 5, 1, 12, tzinfo=datetime.UTC)
    record = {"id": 7, "name": "é\n\u2028", "at": stamp, "ratio": np.float32(0.1), "nan": np.nan}
    large = [
        list(range(_jsonvalues.PIECE_ITEMS * 3 + 5)),
        [record] * (_jsonvalues.PIECE_ITEMS + 1),
        {"rows": [1.5] * (_jsonvalues.PIECE_ITEMS + 1), "more": {"x": [None]}},
        {f"k{index}": [index] for index in range(_jsonvalues.PIECE_ITEMS * 2 + 1)},
        ('x"' * _jsonvalues.PIECE_CHARACTERS, [list(range(_jsonvalues.PIECE_ITEMS + 1))] * 3),
        [{"deep": {"rows": list(range(_jsonvalues.PIECE_ITEMS + 1))}}] * 2,
    ]
    whole = [orjson.dumps(value, default=_jsonvalues._default, option=_jsonvalues._OPTIONS)
             for value in large]  # fmt: skip
    written: list[int] = []
    monkeypatch.setattr(_jsonvalues, "memory_limited", lambda: True)
    monkeypatch.setattr(_jsonvalues, "_room", written.append)  # each piece asks for room
    for value, text in zip(large, whole, strict=True):
        assert _jsonvalues._large(value)
        before = len(written)
        assert _jsonvalues.dumps(value) == text
        assert len(written) - before > 2  # in pieces, not whole
    # What orjson refuses is refused alike: a key that is not a string goes to the standard
    # library, which writes it as its text; an integer past 64 bits too.
    keyed = {index: index for index in range(_jsonvalues.PIECE_ITEMS + 1)}
    assert json.loads(_jsonvalues.dumps(keyed)) == {str(key): key for key in keyed}
    assert json.loads(_jsonvalues.dumps([2**70] * (_jsonvalues.PIECE_ITEMS + 1)))[-1] == 2**70


# JSON texts a caller may send, each read as the standard library reads it. Strict JSON...
STRICT = [b"[18446744073709551616, -9223372036854775809, 123456789012345678901234567890]",
          b'{"a": 1, "a": 2.5e-5, "b": [true, null, -0.0, 1.7976931348623157e308]}',
          b'"\\u00e9 a\\u0000b"']  # fmt: skip
# ...and what only the standard library takes, or nobody does.
LENIENT = [b"[NaN, Infinity, -Infinity]", b"[1e400]", b'["\\ud800"]', b"\xef\xbb\xbf[1]"]
INVALID = [b"[1,]", b"{", b'{"a" 1}', b"[" * 100_000 + b"]" * 100_000]


def padded(text: bytes) -> bytes:
    """`text` inside a JSON array, past FAST_LOADS_FROM (a byte order mark stays first)."""
    bom = b"\xef\xbb\xbf" if text.startswith(b"\xef\xbb\xbf") else b""
    pad = b"x" * _jsonvalues.FAST_LOADS_FROM
    return bom + b"[" + text.removeprefix(bom) + b', "' + pad + b'"]'


def test_json_is_read_as_the_standard_library_reads_it_at_every_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # docs/protocol.md, "JSON encodings": integers past 64 bits stay exact; from 64 KiB msgspec
    # reads the text, and the standard library only what msgspec refuses.
    read_by_stdlib: list[bytes] = []
    loads = json.loads

    def stdlib_loads(data: bytes) -> Any:
        read_by_stdlib.append(data)
        return loads(data)

    monkeypatch.setattr(_jsonvalues, "json", SimpleNamespace(loads=stdlib_loads))
    for text in STRICT + LENIENT:
        for sized in (text, padded(text)):
            assert repr(payloads.decode(sized, payloads.JSON)) == repr(loads(sized))
    assert [text for text in STRICT + LENIENT if padded(text) in read_by_stdlib] == LENIENT
    for text in INVALID:
        for sized in (text, padded(text)):
            with pytest.raises(payloads.PayloadError, match=r"^the result is not valid JSON"):
                payloads.decode(sized, payloads.JSON, "the result")


class Grade(enum.Enum):
    A = "a"


@dataclasses.dataclass
class Reading:
    sensor: uuid.UUID
    grade: Grade


def test_what_orjson_writes_the_standard_library_writes_too_beside_what_only_it_takes() -> None:
    # docs/protocol.md, "JSON encodings": dataclasses, UUIDs and enums as an object, a string
    # and the value; pandas' missing value (pd.NA) as null, an extension array (a nullable or
    # Arrow-backed column's `.unique()`) as a list; numpy integers as keys as their digits —
    # "a value encodes if either can", so also beside an integer past 64 bits, which only the
    # standard library writes.
    sensor = uuid.UUID(int=7)
    names = pd.Series(["b", "a", "b"], dtype="string[pyarrow]")
    counts = pd.array([1, None], dtype="Int64")
    for big in (None, 2**70):
        value = {
            "reading": Reading(sensor, Grade.A), "grade": Grade.A, "id": sensor,
            "missing": counts[1], "names": names.unique(), "counts": counts,
            "by_key": dict(zip(np.arange(2), ["x", "y"], strict=True)), "big": big,
        }  # fmt: skip
        assert json.loads(_jsonvalues.dumps(value, "result")) == {
            "reading": {"sensor": str(sensor), "grade": "a"}, "grade": "a", "id": str(sensor),
            "missing": None, "names": ["b", "a"], "counts": [1, None],
            "by_key": {"0": "x", "1": "y"}, "big": big,
        }  # fmt: skip
    # What neither takes is named by its path, a numpy key's included.
    with pytest.raises(TypeError) as refused:
        _jsonvalues.dumps({np.int64(3): {1}, "big": 2**70}, "result")
    assert str(refused.value) == "result[3]: set (convert it: sorted(x) or list(x))"


def test_what_json_cannot_hold_says_how_to_convert_it_by_its_kind() -> None:
    # docs/protocol.md, "JSON encodings": a value JSON cannot hold fails naming its path "and
    # how to convert it" — for the array-like kinds a data engineer returns by mistake too.
    import polars as pl
    import pyarrow as pa

    hints = {
        "ChunkedArray": pa.chunked_array([[1]]),
        "Int64Array": pa.array([1]),
        "LazyFrame": pl.LazyFrame({"a": [1]}),
        "MaskedArray": np.ma.masked_array([1, 2], mask=[0, 1]),
    }
    said = {}
    for name, value in hints.items():
        with pytest.raises(TypeError) as refused:
            _jsonvalues.dumps({"x": value}, "result")
        said[name] = str(refused.value)
    assert said["ChunkedArray"] == (
        "result[\"x\"]: ChunkedArray (convert it: x.to_pylist(), or send pyarrow.table({'name': "
        "x}) on its own, as Arrow)"
    )
    assert said["Int64Array"].startswith('result["x"]: Int64Array (convert it: x.to_pylist()')
    assert said["LazyFrame"].endswith(
        "(convert it: x.collect(): a polars.DataFrame, sent on its own as Arrow)"
    )
    assert said["MaskedArray"].endswith(
        "(convert it: x.filled(value) or x.tolist(), its masked values None)"
    )
