"""docs/protocol.md, "Content types": a payload or a result travels as the bytes of its kind —
DataFrames (pandas, polars), pyarrow Tables and RecordBatches and numpy arrays as Arrow IPC,
bytes as octets, the rest as JSON — and is read back as the kind it was, with its dtypes,
nulls, timestamps, categories and index. Never pickle."""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import polars as pl
import pyarrow as pa
import pytest

from fnkernel.adapters import _dataframes
from fnkernel.runtime_server import payloads


def round_trip(value: Any) -> tuple[Any, str]:
    data, content_type = payloads.encode(value, "payload")
    return payloads.decode(data, content_type), content_type


def mixed_frame() -> pd.DataFrame:
    """A data engineer's frame: nullable ints, NaN, a time zone, categories, text with a
    missing value, and a named index that is not 0..n."""
    return pd.DataFrame(
        {
            "count": pd.array([1, None, 3], dtype="Int64"),
            "ratio": [0.5, np.nan, 2.0],
            "at": pd.to_datetime(["2024-01-01 09:30", None, "2024-03-01 18:00"]).tz_localize(
                "Europe/Paris"
            ),
            "grade": pd.Categorical(["a", "b", None], categories=["a", "b", "c"], ordered=True),
            "note": ["x", None, "z"],
        },
        index=pd.Index([10, 20, 30], name="id"),
    )


def test_a_pandas_dataframe_comes_back_as_it_went() -> None:
    frame = mixed_frame()
    back, content_type = round_trip(frame)
    assert content_type == "application/vnd.apache.arrow.stream"
    pd.testing.assert_frame_equal(back, frame)
    assert str(back["at"].dtype) == str(frame["at"].dtype)  # the zone kept
    assert list(back["grade"].cat.categories) == ["a", "b", "c"] and back["grade"].cat.ordered


def test_a_column_of_pandas_arrow_dtype_comes_back_of_it_nested_too() -> None:
    # docs/protocol.md, "Content types": a frame comes out as itself, its dtypes kept — pandas'
    # Arrow dtype too, which pyarrow cannot read back by its name when it is nested (a list,
    # a struct); a column of Python lists of the same values beside stays objects.
    ints = pa.list_(pa.int64())
    frame = pd.DataFrame({
        "tags": pd.array([[1], [2, 3], None], dtype=pd.ArrowDtype(ints)),
        "point": pd.array([{"x": 1}, None, {"x": 3}],
                          dtype=pd.ArrowDtype(pa.struct([("x", pa.int64())]))),
        "n": pd.array([1, None, 3], dtype="int64[pyarrow]"),
        "words": [["a"], ["b", "c"], []],
    })  # fmt: skip
    back, _ = round_trip(frame)
    pd.testing.assert_frame_equal(back, frame)
    plain = frame.assign(kept=[[1], [2], [3]])  # the same Arrow type as `tags`, of objects
    back, _ = round_trip(plain[["kept", "n"]])
    assert back["kept"].dtype == object
    # A Series of one (README: "A DataFrame or Series ... comes out as itself"), text too.
    text = pd.Series(["a", None], dtype=pd.ArrowDtype(pa.string()), name="t")
    for series in (frame["tags"], frame["point"], text):
        back, _ = round_trip(series)
        pd.testing.assert_series_equal(back, series)


def test_column_labels_of_mixed_types_are_refused_naming_them() -> None:
    # Arrow names a column by its label's text: 1 and "1" would be one name, and 1 beside "a"
    # would come back "1" — not the frame that went (docs/protocol.md, "Content types").
    for labels in ([1, "1"], [1, "a"]):
        with pytest.raises(payloads.NotArrow) as refused:
            payloads.encode(pd.DataFrame([[1, 2]], columns=labels), "payload")
        assert str(refused.value) == (
            "payload: this pandas.DataFrame cannot be written as Arrow: its column labels are of "
            "mixed types (int, str), and Arrow names a column by its label's text: give them "
            "one type (frame.columns.astype(str))"
        )
    back, _ = round_trip(pd.DataFrame([[1, 2]], columns=[1, 2]))
    assert back.columns.tolist() == [1, 2]  # one type: kept


def test_a_series_keeps_its_name_and_index() -> None:
    # A column of a frame with a MultiIndex of columns is a Series named by a tuple.
    columns = pd.DataFrame([[1, 2]], columns=pd.MultiIndex.from_tuples([("a", "x"), ("a", "y")]))
    for series in (
        pd.Series([1.5, None], index=["a", "b"], name="total"),
        pd.Series([1, 2]),
        columns[("a", "x")],
        pd.Series([1], name=(1, ("b", 2.5))),
    ):
        back, _ = round_trip(series)
        pd.testing.assert_series_equal(back, series)


def test_polars_and_pyarrow_kinds_come_back_as_their_kind() -> None:
    frame = pl.DataFrame({"a": [1, None], "b": ["x", "y"]})
    back, _ = round_trip(frame)
    assert isinstance(back, pl.DataFrame) and back.equals(frame)
    # docs/protocol.md, "Content types": a polars Series too, its name, dtype and nulls kept
    for series in (pl.Series("total", [1.5, None]), pl.Series([None, "x"], dtype=pl.Categorical)):
        back, media = round_trip(series)
        assert media == payloads.ARROW
        assert isinstance(back, pl.Series) and back.name == series.name
        assert back.dtype == series.dtype and back.equals(series)
    table = pa.table({"a": [1, None], "b": ["x", "y"]})
    back, _ = round_trip(table)
    assert isinstance(back, pa.Table) and back.equals(table)
    assert back.schema.metadata is None  # what fnkernel wrote to rebuild it is not left in it
    batch = table.to_batches()[0]
    back, _ = round_trip(batch)
    assert isinstance(back, pa.RecordBatch) and back.equals(batch)


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12.0).reshape(3, 4),
        np.asfortranarray(np.arange(6).reshape(2, 3)),
        np.array(["ab", "c"]),
        np.array(["2024-01-01", "NaT"], dtype="datetime64[s]"),
        np.array(7),
        np.zeros((0, 3), dtype=np.int32),
    ],
    ids=["2-d", "fortran", "text", "datetime", "0-d", "empty"],
)
def test_a_numpy_array_keeps_its_shape_dtype_and_order(array: np.ndarray) -> None:
    # docs/protocol.md, "Content types": its shape, dtype and order (C's or Fortran's).
    back, _ = round_trip(array)
    assert isinstance(back, np.ndarray)
    assert (back.shape, back.dtype) == (array.shape, array.dtype)
    np.testing.assert_array_equal(back, array)
    assert (back.flags.c_contiguous, back.flags.f_contiguous) == (
        array.flags.c_contiguous, array.flags.f_contiguous,
    )  # fmt: skip


def test_a_numpy_array_comes_back_writable_as_it_went() -> None:
    # docs/protocol.md, "Content types": the same kind. A handler writes to an array it was
    # given, and a caller to one it got back; a view of Arrow's buffer would refuse it.
    back, _ = round_trip(np.arange(6.0).reshape(2, 3))
    back[0, 0] = 42.0
    assert back[0, 0] == 42.0


def test_bytes_are_octets_and_the_rest_is_json() -> None:
    assert payloads.encode(b"\x00\xff") == (b"\x00\xff", "application/octet-stream")
    assert payloads.encode(bytearray(b"ab"))[1] == "application/octet-stream"
    assert payloads.encode({"a": [1, None]}) == (b'{"a":[1,null]}', "application/json")
    assert payloads.decode(b"", "application/json") is None
    assert payloads.decode(b'{"a":1}', "application/json; charset=utf-8") == {"a": 1}
    # a bash function's output that is not JSON
    assert payloads.decode(b"hello, ada", "text/plain; charset=utf-8") == "hello, ada"


def test_a_stream_any_arrow_writer_made_is_a_table() -> None:
    # From another client (any Arrow library): no fnkernel metadata, so a pyarrow Table.
    table = pa.table({"x": [1, 2, 3]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    back = payloads.decode(sink.getvalue().to_pybytes(), payloads.ARROW)
    assert isinstance(back, pa.Table) and back.equals(table)


# An IPC stream's first word a negative length: pyarrow refuses it with a plain OSError, not
# one of its ArrowExceptions (what a client sends by mistake, or on purpose).
NEGATIVE_LENGTH = (-5).to_bytes(4, "little", signed=True) + b"garbage!"


def test_bytes_that_are_not_their_type_are_refused_naming_what() -> None:
    for data in (b"not arrow", NEGATIVE_LENGTH):
        with pytest.raises(payloads.PayloadError, match=r"^the payload is not an Arrow IPC"):
            payloads.decode(data, payloads.ARROW, "the payload")
    with pytest.raises(payloads.PayloadError, match=r"^the result is not valid JSON"):
        payloads.decode(b"{", payloads.JSON, "the result")
    # JSON sent as Arrow (a wrong Content-Type) is said to look like JSON.
    with pytest.raises(
        payloads.PayloadError, match=r"\(it looks like JSON: send it as application/json\)$"
    ):
        payloads.decode(b' {"a": 1}', payloads.ARROW, "the payload")
    # An Arrow IPC file (Feather v2) is told apart from a stream, and how to send it is said.
    sink = pa.BufferOutputStream()
    table = pa.table({"a": [1, 2]})
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(payloads.PayloadError, match=r"^the payload is an Arrow IPC file .*stream"):
        payloads.decode(sink.getvalue().to_pybytes(), payloads.ARROW, "the payload")
    # Two streams end to end, or bytes after one: not one value, and never half of them read.
    stream, _ = payloads.encode(table)
    for extra in (stream, b"GARBAGE"):
        with pytest.raises(payloads.PayloadError, match=rf"{len(extra)} bytes after the end"):
            payloads.decode(stream + extra, payloads.ARROW, "the payload")


def test_an_array_arrow_cannot_hold_is_refused_naming_its_dtype() -> None:
    # A structured array (with the way out: a DataFrame of its fields), and
    # an object array of mixed elements.
    structured = np.zeros(3, dtype=[("x", "i4"), ("y", "f8")])
    with pytest.raises(payloads.NotArrow) as refused:
        payloads.encode(structured, "payload")
    assert str(refused.value).startswith(
        "payload: this numpy.ndarray of dtype [('x', '<i4'), ('y', '<f8')] cannot be written as"
    )
    assert str(refused.value).endswith(
        "; send pandas.DataFrame(array) instead, a column for each field"
    )
    with pytest.raises(payloads.NotArrow, match=r"^payload: this numpy.ndarray of dtype object "):
        payloads.encode(np.array(["a", 1], dtype=object), "payload")
    # A frame's column of mixed types: pyarrow's two messages, as one line, not a tuple.
    with pytest.raises(payloads.NotArrow) as refused:
        payloads.encode(pd.DataFrame({"m": ["x", 1]}), "payload")
    assert str(refused.value).endswith(
        "Arrow: Expected bytes, got a 'int' object; Conversion failed for column m with type object"
    )


def test_a_value_inside_json_is_not_arrow() -> None:
    # Only a DataFrame, table or array on its own travels as Arrow: inside a dict it is a
    # JSON value, which it cannot be — the error names where it is and what to do.
    with pytest.raises(TypeError, match=r'payload\["frame"\]: DataFrame'):
        payloads.encode({"frame": mixed_frame()}, "payload")


def test_an_arrow_tables_size_is_about_its_streams_before_it_is_written() -> None:
    # What decides whether a payload goes through the spool (docs/protocol.md, "Large
    # payloads"): the size of the table it is written from, known before a byte is written.
    # The frame is made of 33,333 pieces, as a notebook's concatenated partitions are: its text
    # is Arrow arrays of as many chunks, written as one batch, not 33,333.
    rows = 100_000
    frame = pd.concat([mixed_frame()] * (rows // 3), ignore_index=True)
    for value in (frame, frame["ratio"], frame["count"]):
        encoded = len(payloads.encode(value)[0])
        table = payloads.arrow_table(value)
        assert 0.75 * encoded <= table.nbytes <= 1.25 * encoded, value
    assert payloads.arrow_table(np.zeros((3, 4))).nbytes == 96
    assert payloads.arrow_table(b"abc") is None  # octets and JSON are sized by their bytes
    assert payloads.arrow_table({"a": 1}) is None


def small_frames() -> list[pd.DataFrame]:
    """Frames of every structure a small frame's conversion knows (docs/architecture.md,
    "DataFrames beside the peers"), and some it leaves to pyarrow."""
    n = 200
    frame = pd.DataFrame(
        {
            "count": np.arange(n),
            "ratio": np.where(np.arange(n) % 7 == 0, np.nan, 0.5),
            "at": pd.date_range("2026-01-01", periods=n, freq="min", tz="Europe/Paris"),
            "utc": pd.date_range("2026-01-01", periods=n, freq="min", tz="UTC"),
            "naive": pd.date_range("2026-01-01", periods=n, freq="min"),
            "took": pd.to_timedelta(np.arange(n), unit="s"),
            "gap": pd.Series(pd.date_range("2026-01-01", periods=n)).where(np.arange(n) % 9 > 0),
            "whole": np.arange(n) * 0.25,
            "small": np.arange(n, dtype=np.int8),
            "grade": pd.Categorical.from_codes(np.arange(n) % 3, ["a", "b", "c"], ordered=True),
            "size": pd.Categorical(np.arange(n) % 4),
            "note": np.where(np.arange(n) % 5 == 0, None, "ok"),
            "nullable": pd.array(np.where(np.arange(n) % 3 == 0, None, 1), dtype="Int64"),
            "flag": np.arange(n) % 2 == 0,
        }
    )
    stepped = frame.copy()
    stepped.index = pd.RangeIndex(100, 100 + 3 * n, 3, name="row")
    numbered = pd.DataFrame({0: np.arange(n), 1: np.arange(n) * 0.5})
    nested = pd.DataFrame({("x", "a"): np.arange(n), ("x", "b"): np.arange(n) * 0.5})
    with_attrs = frame.copy()
    with_attrs.attrs["source"] = "test"
    texts = pd.DataFrame({"o": pd.Series(["a", "b"] * (n // 2), dtype=object)})
    labelled = frame.set_index("count")
    return [frame, frame.iloc[10:50], stepped, numbered, nested, with_attrs, texts, labelled]


def test_a_frame_converts_as_pyarrow_converts_it() -> None:
    # The codec converts a small frame against the schema it found for that structure before
    # (docs/architecture.md, "DataFrames beside the peers"): what it writes must be what
    # pyarrow's from_pandas writes, schema, pandas metadata (the index's range too) and values,
    # the first time a structure is seen and the next, for a frame of another length.
    for frame in small_frames():
        for part in (frame, frame.iloc[: len(frame) // 2], frame.iloc[::2]):
            want = pa.Table.from_pandas(part, nthreads=1)
            got = payloads.arrow_table(part)
            assert got.schema.metadata[b"pandas"] == want.schema.metadata[b"pandas"]
            assert got.replace_schema_metadata(None).equals(want.replace_schema_metadata(None))
            if "o" not in part:  # text of object dtype comes back as pandas 3's str
                back = payloads.decode(*payloads.encode(part))
                pd.testing.assert_frame_equal(back, part)


def read_frames() -> list[pd.DataFrame]:
    """Frames of every kind of column a small frame's reading builds itself (docs/architecture.md,
    "DataFrames beside the peers"), with the index ranges it knows."""
    n = 200
    every = np.arange(n)
    frame = pd.DataFrame(
        {
            "count": every,
            "small": every.astype(np.int8),
            "unsigned": every.astype(np.uint32),
            "ratio": np.where(every % 7 == 0, np.nan, 0.5),
            "single": (every * 0.5).astype(np.float32),
            "flag": every % 2 == 0,
            "at": pd.date_range("2026-01-01", periods=n, freq="min", tz="Europe/Paris"),
            "utc": pd.Series(pd.date_range("2026-01-01", periods=n, tz="UTC")).where(every % 9 > 0),
            "naive": pd.Series(pd.date_range("2026-01-01", periods=n)).where(every % 9 > 0),
            "grade": pd.Categorical.from_codes(every % 3 - (every % 10 == 0), ["a", "b", "c"],
                                               ordered=True),
            "size": pd.Categorical(every % 4),
            "note": np.where(every % 5 == 0, None, "ok"),
            "twice": every * 2,  # a second column of a dtype: one block with the first
            "half": np.where(every % 3 == 0, np.nan, 0.25),
            "later": pd.Series(pd.date_range("2026-02-01", periods=n)).where(every % 4 > 0),
        }
    )  # fmt: skip
    stepped = frame.copy()
    stepped.index = pd.RangeIndex(100, 100 + 3 * n, 3, name="row")
    return [frame, stepped, frame.iloc[:0]]


def test_a_frame_of_no_rows_keeps_its_categories(tmp_path: Path) -> None:
    # docs/protocol.md, "Content types": a frame's categories are kept — a partition left
    # empty by a filter too (a stream of no batch carries no dictionary). As bytes, and as a
    # spool's file.
    for n, frame in enumerate(small_frames()):
        empty = frame.iloc[:0]
        path = str(tmp_path / f"in-{n}")
        _, content_type = payloads.encode_to_file(empty, path)
        for back in (round_trip(empty)[0], payloads.decode_file(path, content_type)):
            pd.testing.assert_frame_equal(back, empty)
            if "grade" in empty:
                assert back["grade"].cat.categories.tolist() == ["a", "b", "c"]


def test_a_small_frame_reads_as_pyarrow_reads_it() -> None:
    # Below a million cells the codec builds a frame of a common structure a column at a time
    # (docs/architecture.md, "DataFrames beside the peers"): it must be the frame pyarrow's
    # to_pandas builds — values, dtypes, index, labels — and one a handler can write to; every
    # other structure is pyarrow's own.
    for frame in read_frames() + small_frames():
        for part in (frame, frame.iloc[10:50], frame.iloc[::2]):
            table = payloads.arrow_table(part)
            want = table.to_pandas(use_threads=False, types_mapper=_dataframes.categorical)
            want = _dataframes.with_objects(want, table)  # text sent as objects, objects again
            got = _dataframes.to_frame(table)
            pd.testing.assert_frame_equal(
                got, want, check_exact=True, check_column_type=True, check_index_type=True
            )
            assert (got.columns.dtype, got.index.name) == (want.columns.dtype, want.index.name)
            assert _blocks(got) == _blocks(want)  # laid out as to_pandas lays it out
            if len(got) > 1:
                first, second = got.index[:2]
                for column in got.columns:
                    got.loc[first, column] = got.loc[second, column]
                    assert got[column].iloc[0] is got[column].iloc[1] or (
                        pd.isna(got[column].iloc[1]) or got[column].iloc[0] == got[column].iloc[1]
                    )
    # Each of read_frames() took the reading's own way, not pyarrow's.
    assert all(_dataframes._small_frame(payloads.arrow_table(f)) is not None for f in read_frames())


def _blocks(frame: pd.DataFrame) -> list[tuple[str, list[int]]]:
    """How pandas holds `frame`: each block's dtype and columns (pandas' internals, read only
    to compare two frames' layouts)."""
    return sorted((str(block.dtype), list(block.mgr_locs.as_array)) for block in frame._mgr.blocks)


def test_categories_come_back_as_pyarrow_builds_them_and_can_be_written() -> None:
    # The codec builds a dictionary column's Categorical itself, its categories' dtype kept
    # for the next frame (docs/architecture.md, "DataFrames beside the peers"): it must be the
    # Categorical pyarrow's to_pandas builds — for text, numbers and booleans, ordered or not,
    # with missing values, past the dictionaries it keeps (1,024 values), read twice — and one
    # a handler can write to.
    n = 300
    frame = pd.DataFrame(
        {
            "grade": pd.Categorical.from_codes(np.arange(n) % 3 - (np.arange(n) % 10 == 0),
                                               ["a", "b", "c"], ordered=True),
            "size": pd.Categorical(np.arange(n) % 4),
            "share": pd.Categorical(np.arange(n) * 0.5 % 2),
            "flag": pd.Categorical(np.arange(n) % 2 == 0),
            "many": pd.Categorical([f"v{i}" for i in range(n)] * 5)[:n],
            "wide": pd.Categorical.from_codes(np.arange(n) % 2, [f"w{i}" for i in range(2000)]),
        }
    )  # fmt: skip
    for _ in range(2):
        data, content_type = payloads.encode(frame)
        back = payloads.decode(data, content_type)
        pd.testing.assert_frame_equal(back, frame)
        table = pa.ipc.open_stream(data).read_all()
        pd.testing.assert_frame_equal(back, table.to_pandas())
    back.loc[1, "grade"] = "c"
    assert back["grade"].iloc[1] == "c" and frame["grade"].iloc[1] == "b"


def test_a_stream_of_batches_with_their_own_dictionaries_reads_as_one_categorical() -> None:
    # Another Arrow writer may send each record batch with a dictionary of its own: the
    # column's categories are all of them, as pyarrow's to_pandas makes them.
    first = pa.Table.from_pandas(pd.DataFrame({"g": pd.Categorical(["a", "b"])}))
    second = pa.Table.from_pandas(pd.DataFrame({"g": pd.Categorical(["c", "a"])}))
    table = pa.concat_tables([first, second])
    metadata = {**table.schema.metadata, b"fnkernel.kind": b"pandas.DataFrame"}
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema.with_metadata(metadata)) as writer:
        for batch in table.to_batches():
            writer.write_batch(batch)
    back = payloads.decode(sink.getvalue().to_pybytes(), payloads.ARROW)
    assert back["g"].tolist() == ["a", "b", "c", "a"]
    pd.testing.assert_frame_equal(back, table.to_pandas())


def test_a_large_frame_converts_as_pyarrow_converts_it_on_its_threads() -> None:
    # Past a million cells the codec converts a frame's columns on pyarrow's threads, as
    # from_pandas does: the same table — its floats' NaN and its times' NaT found a slice at a
    # time, the last slice cut short and the last row's missing.
    rows = 200_003
    every = np.arange(rows)
    last = every == rows - 1
    seconds = pd.date_range("2026-01-01", periods=rows, freq="s")
    frame = pd.DataFrame(
        {
            "count": every,
            "ratio": np.where((every % 7 == 0) | last, np.nan, 0.5),
            "whole": every * 0.25,
            "single": np.where(last, np.nan, every * 0.5).astype(np.float32),
            "at": pd.date_range("2026-01-01", periods=rows, freq="s", tz="Europe/Paris"),
            "utc": pd.Series(seconds.tz_localize("UTC")).where((every % 9 > 0) & ~last),
            "naive": pd.Series(seconds).where(every % 9 > 0),
            "took": pd.to_timedelta(every, unit="s").where(every % 4 > 0),
            "grade": pd.Categorical.from_codes(every % 3, ["a", "b", "c"]),
            "note": np.where(every % 5 == 0, None, "ok"),
        }
    )
    for part in (frame, frame.iloc[:0]):
        want = pa.Table.from_pandas(part)
        got = payloads.arrow_table(part)
        assert got.schema.metadata[b"pandas"] == want.schema.metadata[b"pandas"]
        assert got.replace_schema_metadata(None).equals(want.replace_schema_metadata(None))
    pd.testing.assert_frame_equal(payloads.decode(*payloads.encode(frame)), frame)


def test_times_and_floats_with_nothing_missing_convert_as_they_are() -> None:
    # docs/architecture.md, "DataFrames beside the peers": a large frame's times with no NaT
    # and floats with no NaN are written from their own memory, no bitmap of their nulls
    # built to be dropped (pyarrow's from_pandas built one for each, in Arrow's memory).
    rows = 2_000_003
    frame = pd.DataFrame({
        "at": pd.date_range("2026-01-01", periods=rows, freq="s", tz="Europe/Paris"),
        "whole": np.arange(rows) * 0.5,
    })  # fmt: skip
    payloads.arrow_table(frame.iloc[:10])  # its structure's schema, found once
    counted, default = pa.proxy_memory_pool(pa.default_memory_pool()), pa.default_memory_pool()
    pa.set_memory_pool(counted)
    try:
        table, peak = _converted_traced(frame)
    finally:
        pa.set_memory_pool(default)
    assert (counted.max_memory(), peak < rows // 10) == (0, True), peak
    assert table.column("at").null_count == table.column("whole").null_count == 0
    assert table.column("whole").chunk(0).buffers()[1].address == frame["whole"].values.ctypes.data


def _converted_traced(frame: pd.DataFrame) -> tuple[pa.Table, int]:
    """`frame` as Arrow, and the most Python's allocators held beside it while it converted."""
    tracemalloc.start()
    try:
        table = payloads.arrow_table(frame)
        return table, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_categories_convert_without_a_mask_of_their_codes() -> None:
    # pyarrow's from_pandas builds a mask of a Categorical's missing codes, a byte a row, before
    # converting it; the codec, for one with none missing, converts its codes as they are
    # (docs/architecture.md, "DataFrames beside the peers": what a 1 GiB frame's conversion
    # took beside it).
    rows = 2_000_000
    frame = pd.DataFrame({"grade": pd.Categorical.from_codes(np.arange(rows) % 3, ["a", "b", "c"])})
    payloads.arrow_table(frame.iloc[:10])  # its structure's schema, found once
    table, peak = _converted_traced(frame)
    assert peak < rows // 10, peak
    assert table.column("grade").to_pylist()[:4] == ["a", "b", "c", "a"]


def test_text_of_dtype_object_comes_back_of_dtype_object() -> None:
    # docs/protocol.md, "Content types": a DataFrame comes out as itself. pandas 3 reads Arrow text as
    # its str dtype; a column (or an index) the sender kept as objects is objects again, its
    # missing values None, at every size and as a Series too.
    for rows in (2, 200_000):
        index = pd.Index([f"r{n}" for n in range(rows)], dtype=object)
        frame = pd.DataFrame(
            {
                "kept": pd.Series(["a", None] * (rows // 2), index, object),
                "inferred": pd.Series(["a", None] * (rows // 2), index, "str"),
            }
        )
        back, _ = round_trip(frame)
        pd.testing.assert_frame_equal(back, frame)
        assert back["kept"].iloc[1] is None
    series = pd.Series(["a", None], dtype=object, name="note")
    pd.testing.assert_series_equal(round_trip(series)[0], series)


def test_a_package_that_fails_as_it_loads_under_a_memory_limit_is_out_of_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # adapters/_payloads.py: in a worker held to its memory, a C extension that cannot allocate
    # as it loads may fail with a SystemError (an error return without an exception set): that
    # is the limit, a MemoryError; elsewhere the SystemError is what it is.
    from fnkernel.adapters import _payloads

    def failing(name: str) -> Any:
        raise SystemError("error return without exception set")

    monkeypatch.setattr(_payloads.importlib, "import_module", failing)
    monkeypatch.setattr(_payloads, "memory_limited", lambda: True)
    with pytest.raises(MemoryError, match="importing pandas: SystemError: error return"):
        _payloads._needs("pandas.DataFrame", "pandas", "input")
    monkeypatch.setattr(_payloads, "memory_limited", lambda: False)
    with pytest.raises(SystemError):
        _payloads._needs("pandas.DataFrame", "pandas", "input")
