"""pandas DataFrames to Arrow tables and back, as pyarrow's own conversions make them, with what
pyarrow works out afresh for each frame kept for the next of its structure (docs/architecture.md,
"DataFrames beside the peers"). Part of the payload codec (``_payloads``), loaded as it is: by
its path in the worker, importing nothing at import; pyarrow, pandas and numpy are imported
when a frame is converted.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache, partial
from typing import Any

# A pandas frame of fewer cells is converted on one thread (``threaded``).
THREADS_FROM_VALUES = 1 << 20
# A frame is converted against the schema pyarrow gave the last frame of its structure
# (``to_table``): kept for so many structures.
_FRAME_SCHEMAS_KEPT = 64
_frame_schemas: dict[tuple, tuple[Any, dict, list[str]]] = {}
_RANGE = "fnkernel: the index's range"  # where it goes in a kept schema's metadata text
# A large frame's NaN and NaT are looked for so many rows at a time (``_validity``): the mask
# of a byte a row is a slice's, not the column's.
_VALIDITY_ROWS = 1 << 16
_NAT = -(1 << 63)  # NaT, as numpy's times hold it


def _kept(kept: dict, key: Any, make: Callable[[], Any]) -> Any:
    """``kept[key]``, made by `make` the first time; `kept` holds what is worked out once per
    structure, at most _FRAME_SCHEMAS_KEPT of them (emptied when full)."""
    value = kept.get(key)
    if value is None:
        if len(kept) >= _FRAME_SCHEMAS_KEPT:
            kept.clear()
        value = kept[key] = make()
    return value


def threaded(values: int) -> bool:
    """Whether a pandas frame of `values` cells is converted to or from Arrow on pyarrow's
    threads: not below THREADS_FROM_VALUES, where starting them costs more than they save (a
    1 MiB frame: 1.2 ms on one thread, 1.5 on pyarrow's pool)."""
    return values >= THREADS_FROM_VALUES


def to_table(pa: Any, frame: Any) -> Any:
    """The pandas DataFrame `frame` as ``pa.Table.from_pandas`` makes it, its index and pandas
    metadata too (docs/architecture.md, "DataFrames beside the peers"). pyarrow works the
    schema and that metadata out afresh for each frame, in Python: most of converting a small
    frame. Both follow from the frame's structure — its labels, its dtypes, its index's name —
    but for its index's range; so a frame with a RangeIndex, no ``attrs`` and no column typed
    by its values (object) is converted a column at a time (``_column_array``; on pyarrow's
    threads from THREADS_FROM_VALUES cells, as ``from_pandas`` does) against the schema
    pyarrow gave an empty frame of its structure, the range put in. The rest go through
    ``from_pandas`` as they are. ValueError for labels of mixed types (``1`` and ``"a"``):
    Arrow names a column by its label's text, and they would come back as text, if at all
    (``1`` and ``"1"`` one name)."""
    labels = frame.columns
    if labels.nlevels == 1 and labels.inferred_type.startswith("mixed"):
        kinds = sorted({type(label).__name__ for label in labels})
        raise ValueError(
            f"its column labels are of mixed types ({', '.join(kinds)}), and Arrow names a "
            "column by its label's text: give them one type (frame.columns.astype(str))"
        )
    index = frame.index
    many = threaded(len(index) * len(frame.columns))  # frame.size, in a tenth
    # Its columns' arrays, not a Series made for each (~0.1 ms for five) where pandas has it.
    arrays = getattr(frame, "_iter_column_arrays", None)
    columns = list(arrays()) if arrays else [column.array for _, column in frame.items()]
    dtypes: tuple = (None,)  # of a frame not converted a column at a time
    if not frame.attrs and type(index).__name__ == "RangeIndex" and columns:
        dtypes = tuple(_structural(column.dtype) for column in columns)
    if None in dtypes:
        return pa.Table.from_pandas(frame, nthreads=None if many else 1)
    key = (tuple(labels), str(labels.dtype), tuple(labels.names), index.name, dtypes)

    def described() -> tuple[Any, dict, list[str]]:
        empty = pa.Table.from_pandas(frame.iloc[:0], nthreads=1)
        template = json.loads(empty.schema.metadata[b"pandas"])
        # The metadata's text around its index's range, which alone changes with the frame.
        around = json.dumps({**template, "index_columns": _RANGE}).split(json.dumps(_RANGE))
        return empty.schema, template["index_columns"][0], around

    schema, ranged, (before, after) = _kept(_frame_schemas, key, described)
    ranged = {**ranged, "start": index.start, "stop": index.stop, "step": index.step}
    pandas = f"{before}{json.dumps([ranged])}{after}".encode()
    types = [field.type for field in schema]
    convert = partial(_column_array, pa, small=not many)
    if many and len(columns) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(pa.cpu_count()) as pool:
            arrays = list(pool.map(convert, columns, types))
    else:
        arrays = [convert(column, kind) for column, kind in zip(columns, types, strict=True)]
    return pa.Table.from_arrays(arrays, schema=schema.with_metadata({b"pandas": pandas}))


def _column_array(pa: Any, values: Any, kind: Any, small: bool) -> Any:
    """A frame's column, its array `values` (numpy's, or pandas' extension array), as an Arrow
    array of type `kind`, as ``from_pandas`` makes it; a Categorical with no missing value
    without the mask of its codes pyarrow builds first (a byte a row, what a 1 GiB frame's
    conversion took beside it); and in a `small` frame, numbers and times from their numpy
    array, NaN and NaT found by numpy: pyarrow's own look for them, an element at a time, took
    5x as long on the 1 MiB frame's (a mask of a byte a row, which a large frame is not
    given). A large frame's floats and naive or zoned times are shared too, their NaN and NaT
    found a slice at a time (``_validity``): pyarrow's look built a bitmap of the times' nulls
    only to drop it (3.4 MiB beside a 1 GiB frame), and took 24 ms on the 482 MiB frame's
    times and 30 on its floats with NaN, against 6 and 16 so (docs/architecture.md,
    "DataFrames beside the peers")."""
    if type(values).__name__ == "Categorical" and len(values) and values.codes.min() >= 0:
        indices = pa.array(values.codes, type=kind.index_type)
        dictionary = pa.array(values.categories.values, type=kind.value_type)
        return pa.DictionaryArray.from_arrays(indices, dictionary, ordered=values.ordered)
    numbers = _numbers(values, values.dtype)
    if numbers is not None and not small and _shareable(pa, numbers, kind):
        return _shared(pa, numbers, kind, *_validity(numbers))
    if numbers is None or not small:
        return pa.array(values, type=kind, from_pandas=True)
    import numpy as np

    missing = None
    if numbers.dtype.kind == "f":
        missing = np.isnan(numbers)
    elif numbers.dtype.kind in "Mm":
        missing = np.isnat(numbers)
    if missing is not None and not missing.any():
        missing = None
    if (missing is not None or numbers.dtype.kind == "M") and _shareable(pa, numbers, kind):
        if missing is None:
            return _shared(pa, numbers, kind, None, 0)
        valid = np.packbits(~missing, bitorder="little")
        return _shared(pa, numbers, kind, valid, int(missing.sum()))
    return pa.array(numbers, type=kind, mask=missing)


def _validity(numbers: Any) -> tuple[Any, int]:
    """The validity bitmap of a large frame's floats or times (NaN and NaT its nulls) and how
    many nulls, without a mask of a byte a row: (None, 0) if a float's minimum is not NaN (it
    is if any is) or the least time is not NaT; else packed _VALIDITY_ROWS rows at a time."""
    import numpy as np

    floats = numbers.dtype.kind == "f"
    if not len(numbers):
        return None, 0
    if not (np.isnan(numbers.min()) if floats else numbers.view("i8").min() == _NAT):
        return None, 0
    valid = np.empty((len(numbers) + 7) // 8, np.uint8)
    nulls = 0
    for start in range(0, len(numbers), _VALIDITY_ROWS):
        missing = (np.isnan if floats else np.isnat)(numbers[start : start + _VALIDITY_ROWS])
        nulls += int(missing.sum())
        packed = np.packbits(~missing, bitorder="little")
        valid[start // 8 : start // 8 + len(packed)] = packed
    return valid, nulls


def _shareable(pa: Any, numbers: Any, kind: Any) -> bool:
    """Whether the numpy array `numbers` of floats or times is laid out as Arrow's `kind`, so
    that an Arrow array of that type can be its memory (``_shared``)."""
    import numpy as np

    values = numbers.dtype
    if numbers.ndim != 1 or not numbers.flags.c_contiguous or values.itemsize != kind.byte_width:
        return False
    if values.kind == "M" and np.datetime_data(values)[0] != getattr(kind, "unit", None):
        return False
    return values.kind in "fM" and (values.kind == "f") == pa.types.is_floating(kind)


def _shared(pa: Any, numbers: Any, kind: Any, valid: Any, nulls: int) -> Any:
    """The numpy array `numbers` as an Arrow array of type `kind` over the same memory (it is
    ``_shareable``), with `nulls` nulls where the bitmap `valid` (or none) says. ``pa.array``
    copies times and masked numbers, and looks at each element: 68 µs for the 1 MiB frame's
    time zone's column, 1.2 so; 39 µs for its floats with NaN, 25."""
    bitmap = None if valid is None else pa.py_buffer(valid)
    return pa.Array.from_buffers(
        kind, len(numbers), [bitmap, pa.py_buffer(numbers)], null_count=nulls
    )


def _numbers(values: Any, dtype: Any) -> Any:
    """The numpy array of a column of numbers, booleans or times (a time zone's: their UTC
    times), without a copy; None for any other."""
    import numpy as np

    if isinstance(dtype, np.dtype) and dtype.kind in "iufbMm":
        return np.asarray(values)
    if type(values).__name__ == "DatetimeArray":  # with a time zone
        return np.asarray(values, dtype=f"M8[{values.unit}]")
    return None


def _structural(dtype: Any) -> tuple | None:
    """What of a column's dtype its Arrow type and pandas metadata follow from: the dtype and
    its time zone's class (equal dtypes may differ there); for categories their dtype, count and
    order, not their values (hashing those took 10% of a small frame's conversion). None if
    they follow from the values: an object column, or categories of objects."""
    categories = getattr(dtype, "categories", None)
    if categories is None:
        return None if str(dtype) == "object" else (dtype, type(getattr(dtype, "tz", None)))
    inner = str(categories.dtype)
    return None if inner == "object" else ("category", inner, len(categories), dtype.ordered)


def to_frame(table: Any) -> Any:
    """The pandas DataFrame `table` (pyarrow's pandas metadata in its schema) holds, as
    ``to_pandas`` builds it: its Categoricals by ``categorical``, on pyarrow's threads from
    THREADS_FROM_VALUES cells; below that, a frame of a common structure a column at a time
    (``_small_frame``)."""
    many = threaded(table.num_rows * table.num_columns)
    if not many:
        frame = _small_frame(table)
        if frame is not None:
            return frame
    return with_objects(table.to_pandas(use_threads=many, types_mapper=types_mapper(table)), table)


def types_mapper(table: Any) -> Callable[[Any], Any]:
    """``to_pandas``'s `types_mapper` for `table`, a frame's or a Series' as sent: its
    categories (``categorical``) and its columns of pandas' Arrow dtype (``_arrow_dtyped``)."""
    return _arrow_dtyped(table) or categorical


def _arrow_dtyped(table: Any) -> Callable[[Any], Any] | None:
    """``categorical``, and pandas' Arrow dtype (``pd.ArrowDtype``) again for each Arrow type
    the frame sent had columns of that dtype of — its pandas metadata's ``numpy_type`` ends in
    ``[pyarrow]`` — and of no other: pyarrow reads the dtype back by that name, and cannot for
    a nested one (``list<item: int64>[pyarrow]``). None if the frame sent had none."""
    if b"[pyarrow]" not in (table.schema.metadata or {}).get(b"pandas", b""):
        return None
    import pandas as pd

    dtyped: dict[Any, Any] = {}
    other: set[Any] = set()  # types of columns sent of another dtype (lists of objects, say)
    kinds = {column.get("field_name"): str(column.get("numpy_type")) for column in table.schema.pandas_metadata.get("columns", [])}  # fmt: skip
    for field in table.schema:
        if kinds.get(field.name, "").endswith("[pyarrow]"):
            dtyped[field.type] = pd.ArrowDtype(field.type)
        else:
            other.add(field.type)

    def mapper(arrow_type: Any) -> Any:
        if arrow_type in dtyped and arrow_type not in other:
            return dtyped[arrow_type]
        return categorical(arrow_type)

    return mapper


def with_objects(frame: Any, table: Any) -> Any:
    """`frame`, built by ``to_pandas`` from `table`, with each column of text that was of
    dtype object when it was sent (the pandas metadata's ``numpy_type``), and an index of one
    level, of dtype object again, its missing values None: pandas 3 reads every Arrow text
    column as ``str``, where the frame sent had chosen object."""
    import pandas as pd

    raw = (table.schema.metadata or {}).get(b"pandas")
    if raw is None:
        return frame
    meta = json.loads(raw)
    indexes = {field for field in meta.get("index_columns", []) if isinstance(field, str)}
    described = meta.get("columns", [])
    columns = [column for column in described if column.get("field_name") not in indexes]
    index = [column for column in described if column.get("field_name") in indexes]

    def objects(column: dict) -> Any:  # its text as sent, or None if that was not of objects
        if (column.get("pandas_type"), column.get("numpy_type")) != ("unicode", "object"):
            return None
        return table.column(column["field_name"]).to_numpy(zero_copy_only=False)

    if len(columns) == frame.shape[1]:
        for place, column in enumerate(columns):
            if (
                str(frame.dtypes.iloc[place]) != "object"
                and (values := objects(column)) is not None
            ):
                frame.isetitem(place, pd.Series(values, frame.index, object))  # not str again
    one = index[0] if len(index) == 1 and frame.index.nlevels == 1 else None
    if (
        one is not None
        and str(frame.index.dtype) != "object"
        and (values := objects(one)) is not None
    ):
        frame.index = pd.Index(values, dtype=object, name=frame.index.name)
    return frame


def _small_frame(table: Any) -> Any:
    """The frame ``to_pandas`` builds from `table`, built a column at a time — or None where
    that is not known to be the same. ``to_pandas`` reads the pandas metadata and works each
    column's dtype out in Python, ~0.5 ms for five columns whatever their length
    (docs/architecture.md, "DataFrames beside the peers"). Here: a range index, string labels
    with one level, no ``attrs``, and columns of numbers, booleans without nulls, times, text
    (pandas 3's ``str``) or categories (``_column_block``), in blocks as ``to_pandas`` lays
    them out, handed to pandas' ``create_dataframe_from_blocks`` (made for pyarrow's
    to_pandas)."""
    import numpy as np
    import pandas as pd

    try:
        from pandas.api.internals import create_dataframe_from_blocks
    except ImportError:
        return None
    raw = (table.schema.metadata or {}).get(b"pandas")
    if raw is None:
        return None
    meta = json.loads(raw)
    index = meta.get("index_columns")
    labels = meta.get("column_indexes") or [{}]
    described = meta.get("columns", [])
    names = table.column_names
    if (
        meta.get("attributes")
        or not (isinstance(index, list) and len(index) == 1 and isinstance(index[0], dict))
        or index[0].get("kind") != "range"
        or len(labels) != 1
        or labels[0].get("name") is not None
        or labels[0].get("pandas_type") != "unicode"
        or [(column.get("name"), column.get("field_name")) for column in described]
        != [(name, name) for name in names]
        or len(set(names)) != len(names)
    ):
        return None
    step = index[0].get("step", 1)
    rows = pd.RangeIndex(index[0].get("start", 0), index[0].get("stop", 0), step or 1)
    name = index[0].get("name")
    if len(rows) != table.num_rows or not (name is None or isinstance(name, str)):
        return None
    blocks = []
    numbers: dict[Any, list[tuple[int, Any]]] = {}  # numpy's columns, by dtype
    for place, (column, description) in enumerate(zip(table.columns, described, strict=True)):
        block = _column_block(column, description.get("numpy_type"))
        if block is None:
            return None
        if isinstance(block, np.ndarray):
            numbers.setdefault(block.dtype, []).append((place, block))
        else:
            blocks.append((block, np.array([place])))
    # As to_pandas lays them out: the columns of one dtype in one block, copied there once.
    for dtype, columns in numbers.items():
        places = np.array([place for place, _ in columns])
        if len(columns) == 1:
            values = columns[0][1]
            values = values if values.flags.writeable else values.copy()  # not a view
            blocks.append((values.reshape(1, -1), places))
            continue
        block = np.empty((len(columns), table.num_rows), dtype)
        for row, (_, values) in enumerate(columns):
            block[row] = values
        blocks.append((block, places))
    rows.name = name
    # pandas 3 infers the labels' dtype, ~0.15 ms for five: once per structure.
    labels = _kept(_labels, tuple(names), lambda: pd.Index(names))
    return create_dataframe_from_blocks(blocks, rows, labels.view())


def _column_block(column: Any, numpy_type: str | None) -> Any:
    """A column as a frame's block takes it — numbers and naive times as numpy's array (a view
    of the table's when it is read-only, to be copied into a block), the rest as pandas' array,
    nothing of it referring to the table's buffers (a mapped file's pages) — or None if
    ``to_pandas`` may make it otherwise."""
    import pandas as pd
    import pyarrow as pa

    kind = column.type
    types = pa.types
    if types.is_dictionary(kind):
        return categorical.__from_arrow__(column) if categorical(kind) is not None else None
    if types.is_string(kind) or types.is_large_string(kind):
        return _text().__from_arrow__(column) if numpy_type == "str" else None
    chunk = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    if types.is_timestamp(kind):
        if numpy_type != f"datetime64[{kind.unit}]":
            return None
        if kind.tz is not None:  # the zone looked up once
            dtype = _kept(_zoned, kind, lambda: pd.DatetimeTZDtype(kind.unit, kind.tz))
            return dtype.__from_arrow__(chunk).copy()
    else:
        numeric = types.is_integer(kind) or types.is_floating(kind) or types.is_boolean(kind)
        if not numeric or (chunk.null_count and not types.is_floating(kind)):
            return None  # to_pandas: integers with nulls are floats, booleans objects
    values = chunk.to_numpy(zero_copy_only=False)  # a view of the table's, or a new array
    return values if numpy_type == values.dtype.name else None


@cache
def _text() -> Any:
    """pandas 3's ``str`` dtype, made once."""
    import numpy as np
    import pandas as pd

    return pd.StringDtype("pyarrow", na_value=np.nan)


_labels: dict[tuple, Any] = {}  # a frame's column labels (an Index), by their names
_zoned: dict[Any, Any] = {}  # a time zone's DatetimeTZDtype, by its Arrow type


class _Categorical:
    """``to_pandas``'s `types_mapper` for a dictionary column of text, numbers or booleans: a
    pandas Categorical, built as pyarrow builds it (``Categorical.from_codes`` on the
    dictionary's values, its codes checked), but with the categories' dtype made once for each
    dictionary of up to _CATEGORIES_KEPT values rather than for each frame: pyarrow's infers
    it from Python objects every time (a 1 MiB frame with one such column read in 0.83 ms, in
    0.68 so; docs/architecture.md, "DataFrames beside the peers"). Its codes are copied here,
    once (``_text_copied`` leaves them). Other dictionaries are pyarrow's."""

    def __init__(self) -> None:
        self.dtypes: dict[tuple, Any] = {}

    def __call__(self, arrow_type: Any) -> Any:
        import pyarrow as pa

        if not pa.types.is_dictionary(arrow_type):
            return None
        values = arrow_type.value_type
        types = pa.types
        known = (types.is_string, types.is_large_string, types.is_integer, types.is_floating)
        return self if any(check(values) for check in known) or types.is_boolean(values) else None

    def __from_arrow__(self, array: Any) -> Any:
        import numpy as np
        import pandas as pd
        import pyarrow as pa

        if isinstance(array, pa.ChunkedArray) and array.num_chunks == 1:
            array = array.chunk(0)
        if isinstance(array, pa.ChunkedArray):  # a dictionary for each batch, or none
            chunks = array.unify_dictionaries().chunks or [pa.array([], array.type)]
            dictionary = chunks[0].dictionary
            indices = pa.concat_arrays([chunk.indices for chunk in chunks])
        else:
            dictionary, indices = array.dictionary, array.indices
        # One copy of the codes: writable, and off a mapped file.
        if indices.null_count:
            indices = indices.fill_null(-1)
        codes = np.array(indices.to_numpy(zero_copy_only=False))
        ordered = array.type.ordered
        key = None
        if len(dictionary) <= _CATEGORIES_KEPT:
            key = (array.type, tuple(dictionary.to_pylist()))
            dtype = self.dtypes.get(key)
            if dtype is not None:
                return pd.Categorical.from_codes(codes, dtype=dtype)
        categories = dictionary.to_numpy(zero_copy_only=False)  # pandas copies them
        built = pd.Categorical.from_codes(codes, categories=categories, ordered=ordered)
        if key is not None:
            if len(self.dtypes) >= _DICTIONARIES_KEPT:
                self.dtypes.clear()
            self.dtypes[key] = built.dtype
        return built


_CATEGORIES_KEPT = 1024  # values of a dictionary whose dtype is kept
_DICTIONARIES_KEPT = 64  # dictionaries kept
categorical = _Categorical()
