"""A payload or a result as bytes of a content type, the one way fnkernel writes and reads them
(docs/protocol.md, "Content types"): by the kernel and the client for a payload, by the Python
worker for a result, and back again.

- A pandas or polars DataFrame or Series, a pyarrow Table or RecordBatch, or a numpy array is
  **Arrow IPC**, ``application/vnd.apache.arrow.stream``: one stream whose schema's
  metadata names the kind (``fnkernel.kind``), so the reader gets the kind that was sent, with
  its dtypes, nulls, timestamps (their time zones too), categories and index (pyarrow's own
  pandas metadata). A stream without that key (from any Arrow writer) is read as a pyarrow
  Table.
- ``bytes``, ``bytearray`` and ``memoryview`` are ``application/octet-stream``, as they are.
- Everything else is JSON (``_jsonvalues``).

A ``text/*`` output (a bash function's that is not JSON) is read as text.

Never pickle: a caller is not always the function's owner.

Standard library only at import: pyarrow, and pandas, polars or numpy, are imported when a value
of theirs is written or read. The worker loads this file by its path, as it does its siblings
_jsonvalues.py and _dataframes.py, before the handler's directory is on ``sys.path``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import mmap
import os
import re
import secrets
import time
import weakref
from collections.abc import Iterator
from typing import IO, Any

JSON = "application/json"
ARROW = "application/vnd.apache.arrow.stream"
OCTET = "application/octet-stream"
MEDIA_TYPES = (JSON, ARROW, OCTET)
# Each media type's token in the worker's frames (adapters/_python_worker.py), and back.
CODES = {JSON: b"json", ARROW: b"arrow", OCTET: b"octet"}
MEDIA_OF = {code: media for media, code in CODES.items()}
KIND_KEY = b"fnkernel.kind"  # in the Arrow schema's metadata: what the reader rebuilds
_NAME_KEY = b"fnkernel.name"  # a Series' name, as JSON
_SHAPE_KEY = b"fnkernel.shape"  # a numpy array's shape and dtype, as JSON
_DTYPE_KEY = b"fnkernel.dtype"
_ORDER_KEY = b"fnkernel.order"  # "F": its elements in Fortran (column-major) order
# A spooled payload's file, once read, is kept for the next one written into the same spool
# (``spool_file``, ``release``): at most so many such files, of so many bytes in all, each for
# so long unused.
FREE_PREFIX = "free-"
FREE_NAME = re.compile(rf"{FREE_PREFIX}(\d+)-(\d+)-[A-Za-z0-9_-]+")  # its size, when freed
KEEP_FREE_FILES = 4
KEEP_FREE_BYTES = 1 << 30
KEEP_FREE_SECONDS = 60.0
# A table whose chunks average fewer rows is combined into one before it is written (``_table``).
_BATCH_ROWS = 1 << 16
_SERIES_COLUMN = "__series__"
_FILE_MAGIC = b"ARROW1"  # how an Arrow IPC file begins (and ends); a stream never does
_ARRAY_COLUMN = "values"
# The kinds written as Arrow, by (top-level module, type name): exact types, not subclasses
# (a GeoDataFrame is not a DataFrame to Arrow).
_KINDS = {
    ("pandas", "DataFrame"): "pandas.DataFrame",
    ("pandas", "Series"): "pandas.Series",
    ("polars", "DataFrame"): "polars.DataFrame",
    ("polars", "Series"): "polars.Series",
    ("pyarrow", "Table"): "pyarrow.Table",
    ("pyarrow", "RecordBatch"): "pyarrow.RecordBatch",
    ("numpy", "ndarray"): "numpy.ndarray",
}


def _load_sibling(name: str) -> Any:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_fnkernel{name}", path)
    assert spec is not None and spec.loader is not None  # a .py file's
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __package__:  # fnkernel.adapters
    from fnkernel.adapters import _dataframes, _jsonvalues
else:  # loaded by its path (the worker): its siblings, likewise
    _dataframes = _load_sibling("_dataframes")
    _jsonvalues = _load_sibling("_jsonvalues")


class PayloadError(ValueError):
    """Bytes that are not what their content type says, or a kind this process cannot build
    (its package is not installed); the message says which."""

    def _render_traceback_(self) -> list[str]:
        """IPython shows this instead of the codec's frames: the one line that says it."""
        return [f"{type(self).__name__}: {self}"]


class NotArrow(TypeError):
    """A value of an Arrow kind that Arrow IPC cannot hold (duplicate column names, a column of
    mixed types, a structured array); the message names the value and Arrow's reason."""


def media_type(content_type: str) -> str:
    """The media type of a Content-Type, lower case without parameters; "" is JSON."""
    return content_type.split(";", 1)[0].strip().lower() or JSON


def kind_of(value: Any) -> str | None:
    """The kind of `value` written as Arrow (``pandas.DataFrame``, ...); None for the rest.
    Imports nothing: a value of a kind exists only where its package was imported."""
    cls = type(value)
    return _KINDS.get((cls.__module__.split(".", 1)[0], cls.__name__))


def arrow_table(value: Any, root: str = "value") -> Any | None:
    """`value` as the pyarrow Table its Arrow IPC stream is written from (the schema's metadata
    names its kind), if it is of an Arrow kind; None for the rest. Its ``nbytes`` is about the
    stream's size, so a caller can choose where to write it before writing it. NotArrow naming
    the value (a path from `root`) if Arrow cannot hold it; PayloadError if pyarrow is
    missing."""
    kind = kind_of(value)
    return None if kind is None else _table(value, kind, root)


def encode(value: Any, root: str = "value") -> tuple[bytes, str]:
    """`value` as bytes and their content type. TypeError naming the part JSON cannot hold (a
    path from `root`); NotArrow, PayloadError as ``arrow_table``."""
    table = arrow_table(value, root)
    if table is not None:
        return table_bytes(table), ARROW
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value), OCTET
    return _jsonvalues.dumps(value, root), JSON


def decode(data: bytes, content_type: str, what: str = "the payload") -> Any:
    """The value `data` of `content_type` holds (JSON: None for no bytes). PayloadError naming
    `what` if they are not that, or if the kind they hold cannot be built here."""
    media = media_type(content_type)
    if media == OCTET:
        return data
    if media.startswith("text/"):  # a bash function's output that is not JSON
        return bytes(data).decode("utf-8", "replace")
    if media == ARROW:
        return _from_arrow(data, what)
    if not data.strip():
        return None
    try:
        return _jsonvalues.loads(data)
    except ValueError as exc:
        raise PayloadError(f"{what} is not valid JSON: {exc}") from None


def decode_file(path: str, content_type: str, what: str = "the payload") -> Any:
    """The value the spooled payload `path` holds (docs/protocol.md, "Large payloads"), as
    ``decode`` reads bytes; an Arrow stream is mapped, not read, so a table, or a DataFrame's
    numbers, are read from the file's pages without a copy of their own. The file is gone from
    its name once read: kept for the next payload (``release``) if nothing maps it any more,
    else removed, its pages living on while the value maps them."""
    released, size = False, None
    try:
        if media_type(content_type) != ARROW:
            data = read_file(path)
            released, size = True, len(data)
            return decode(data, content_type, what)
        value, released = _from_mapped(path, what)
        return value
    finally:
        if released:
            release(path, size)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def encode_to_file(value: Any, path: str, root: str = "value") -> tuple[int, str]:
    """Write `value`'s bytes to the new payload file `path` (``spool_file``), as ``encode``
    makes them; their size and content type. An Arrow kind is written straight to the file,
    never whole in memory first."""
    table = arrow_table(value, root)
    if table is not None:
        return write_table(table, path), ARROW
    data, media = encode(value, root)
    with spool_file(path, len(data)) as out:
        out.write(data)
    return len(data), media


def table_bytes(table: Any) -> bytes:
    """The Arrow IPC stream of `table` (``arrow_table``'s)."""
    pa = _pyarrow("a table")
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        _write(pa, writer, table)
    return bytes(sink.getvalue().to_pybytes())


def write_table(table: Any, path: str) -> int:
    """Write the Arrow IPC stream of `table` (``arrow_table``'s) to the new payload file `path`
    (``spool_file``); its size."""
    pa = _pyarrow("a table")
    with spool_file(path, table.nbytes) as out:
        sink = pa.PythonFile(out, mode="w")
        with pa.ipc.new_stream(sink, table.schema) as writer:
            _write(pa, writer, table)
        return out.tell()


def _write(pa: Any, writer: Any, table: Any) -> None:
    """`table` into the stream `writer`. A table of no rows is written as one batch of none:
    a stream of no batch has no dictionary, and a Categorical of no rows would come back with
    no categories."""
    if table.num_rows or not any(pa.types.is_dictionary(kind) for kind in table.schema.types):
        writer.write_table(table)
        return
    columns = [
        column.chunk(0) if column.num_chunks else pa.array([], column.type)
        for column in table.columns
    ]
    writer.write_batch(pa.RecordBatch.from_arrays(columns, schema=table.schema))


# Spool files


@contextlib.contextmanager
def spool_file(path: str, size: int = 0) -> Iterator[IO[bytes]]:
    """The new payload file `path` (0600), open to write, cut where the writing ended. It is a
    file its spool kept (``release``) when there is one — the one freed last of those that hold
    `size` bytes (what the writer expects to write), else the largest: writing a tmpfs file's
    existing pages costs a third of allocating and zeroing new ones, and pages written last may
    still be in the CPU's caches (docs/architecture.md, "DataFrames beside the peers"). Nothing
    is left at `path` if the writing fails."""
    reused = _reuse(path, size)
    flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags) if reused else os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with open(fd, "wb", buffering=0, closefd=True) as out:
            yield out
            out.truncate(out.tell())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise


def read_file(path: str) -> bytes:
    """The bytes of the payload file `path`, read whole: its size asked once, then read (a
    buffered file object would ask the terminal, the position and the size again first)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        data = os.read(fd, size)
        if len(data) < size:  # past what one read returns (2 GiB), or a file still growing
            parts = [data]
            while chunk := os.read(fd, 1 << 30):
                parts.append(chunk)
            data = b"".join(parts)
        return data
    finally:
        os.close(fd)


def release(path: str, size: int | None = None) -> None:
    """The payload file `path` (of `size` bytes, if known) was read and nothing maps it: keep it
    for the next payload its spool is given (``spool_file``), as a free file, while the spool
    keeps fewer than KEEP_FREE_FILES of fewer than KEEP_FREE_BYTES in all; else remove it."""
    directory = os.path.dirname(path)
    try:
        if size is None:
            size = os.stat(path).st_size
        kept = _free_files(directory)
        held = sum(kept_size for kept_size, _ in kept.values())
        if len(kept) < KEEP_FREE_FILES and held + size <= KEEP_FREE_BYTES:
            os.rename(path, os.path.join(directory, _free_name(size)))
            return
        os.unlink(path)
    except FileNotFoundError:
        pass


def _free_name(size: int) -> str:
    """A free file's name: its size and when it was freed (the machine's monotonic clock, in
    ns), so that one read of its spool's directory says what each free file is and since when,
    without asking each file."""
    return f"{FREE_PREFIX}{size}-{time.monotonic_ns()}-{secrets.token_urlsafe(12)}"


def _reuse(path: str, size: int) -> bool:
    """Move a free file of `path`'s spool to `path` — the one freed last of those of at least
    `size` bytes, else the largest; whether there was one."""
    directory = os.path.dirname(path)
    free = _free_files(directory)
    holding = [name for name, (kept, _) in free.items() if kept >= size]
    rest = [name for name, (kept, _) in free.items() if kept < size]
    holding.sort(key=lambda name: free[name][1], reverse=True)  # freed last first
    rest.sort(key=lambda name: free[name][0], reverse=True)  # the largest first
    for name in holding + rest:
        try:
            os.rename(os.path.join(directory, name), path)
            return True
        except FileNotFoundError:  # another writer had it first
            continue
    return False


def expire_free_files(directory: str, unused_for: float | None = None) -> None:
    """Remove the free files of the spool `directory` unused for more than `unused_for`
    seconds (KEEP_FREE_SECONDS unless given; 0: every one): its sweep's, so that an idle spool
    does not keep them (``_free_files`` does so whenever a payload is written or read there),
    and a stopping server's."""
    _free_files(directory, unused_for)


def _free_files(directory: str, unused_for: float | None = None) -> dict[str, tuple[int, int]]:
    """The free files of the spool `directory`, each its size and when it was freed, read from
    their names; those unused for more than `unused_for` seconds (KEEP_FREE_SECONDS unless
    given) are removed, not named."""
    now = time.monotonic_ns()
    kept_ns = (KEEP_FREE_SECONDS if unused_for is None else unused_for) * 1e9
    free: dict[str, tuple[int, int]] = {}
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return free
    for name in names:
        found = FREE_NAME.fullmatch(name)
        if found is None:
            continue
        size, freed = int(found[1]), int(found[2])
        if now - freed > kept_ns:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
        else:
            free[name] = size, freed
    return free


# Arrow


# Whether this process converts payloads on Arrow's jemalloc allocator once it imports
# pyarrow here (``convert_on_jemalloc``: the Python worker). A caller's process keeps pyarrow's
# default: its allocator is the user's.
_to_jemalloc = False
# How long jemalloc keeps a freed page for reuse before it hands it back to the system (along
# a curve, most of it toward the end). At pyarrow's own setting a freed frame was back within
# 2 s, and a 482 MiB frame's call, a second after the last, took 0.45-0.55 s against 0.36-0.40
# from 10 s on (docs/architecture.md, "DataFrames beside the peers").
JEMALLOC_DECAY_MS = 10_000


def convert_on_jemalloc() -> None:
    """Convert payloads in this process on Arrow's jemalloc allocator, from the first
    conversion on, unless ``ARROW_DEFAULT_MEMORY_POOL`` names one or this pyarrow has none.
    pyarrow's default, mimalloc, kept a 964 MiB frame's pages resident in the idle worker for
    good, held 6 MiB more beside it at its peak, and took a 482 MiB frame's call in 0.3 s in
    some rounds, 0.7-1.5 s in others."""
    global _to_jemalloc
    _to_jemalloc = "ARROW_DEFAULT_MEMORY_POOL" not in os.environ


def _pyarrow(kind: str) -> Any:
    global _to_jemalloc
    pa = _imported("pyarrow", f"{kind} travels as Arrow IPC, and pyarrow is not installed here")
    if _to_jemalloc:
        _to_jemalloc = False
        if "jemalloc" in pa.supported_memory_backends():
            pa.set_memory_pool(pa.jemalloc_memory_pool())
            pa.jemalloc_set_decay_ms(JEMALLOC_DECAY_MS)
    return pa


def _table(value: Any, kind: str, root: str) -> Any:
    """`value` as a pyarrow Table whose schema's metadata says how to rebuild it."""
    pa = _pyarrow(f"a {kind}")
    extra: dict[bytes, bytes] = {}
    try:
        if kind == "pandas.DataFrame":
            table = _dataframes.to_table(pa, value)  # its index too, in pandas metadata
        elif kind == "pandas.Series":
            table = pa.Table.from_pandas(value.to_frame(name=_SERIES_COLUMN), nthreads=1)
            extra[_NAME_KEY] = json.dumps(value.name, default=str).encode()
        elif kind == "polars.DataFrame":
            table = value.to_arrow()
        elif kind == "polars.Series":  # a frame of its one column; its name beside (may be "")
            table = value.to_frame(_SERIES_COLUMN).to_arrow()
            extra[_NAME_KEY] = json.dumps(value.name).encode()
        elif kind == "pyarrow.Table":
            table = value
        elif kind == "pyarrow.RecordBatch":
            table = pa.Table.from_batches([value])
        else:  # numpy.ndarray: its elements in order, a column; its shape and dtype beside
            # Its elements in its memory's order, without a copy when that is C's or Fortran's.
            fortran = value.flags.f_contiguous and not value.flags.c_contiguous
            flat = value.ravel(order="F" if fortran else "C")
            table = pa.table({_ARRAY_COLUMN: pa.array(flat)})
            extra[_SHAPE_KEY] = json.dumps(list(value.shape)).encode()
            extra[_DTYPE_KEY] = value.dtype.str.encode()
            if fortran:
                extra[_ORDER_KEY] = b"F"
    except MemoryError:
        raise  # pyarrow's ArrowMemoryError is one too: out of memory, not a value Arrow refuses
    except (pa.ArrowException, TypeError, ValueError) as error:
        # pyarrow's conversion errors carry two messages, which str() shows as a tuple.
        exc = "; ".join(map(str, error.args)) if len(error.args) > 1 else str(error)
        what = f"this {kind}"
        if kind == "numpy.ndarray":  # its dtype is what Arrow could not take
            what += f" of dtype {value.dtype}"
            if value.dtype.names:
                exc = f"{exc}; send pandas.DataFrame(array) instead, a column for each field"
        raise NotArrow(f"{root}: {what} cannot be written as Arrow: {exc}") from None
    # A frame made by concatenating small ones (pd.concat of Arrow-backed text) has a column of
    # as many chunks, and Arrow IPC writes a record batch, with its own header, for each: one
    # of 100,000 rows from 33,333 pieces took 17 MB and 156 ms, against 6 ms to combine them.
    chunks = max((column.num_chunks for column in table.columns), default=1)
    if chunks > 1 and table.num_rows < chunks * _BATCH_ROWS:
        table = table.combine_chunks()
    metadata = {**(table.schema.metadata or {}), **extra, KIND_KEY: kind.encode()}
    return table.replace_schema_metadata(metadata)


def _from_mapped(path: str, what: str) -> tuple[Any, bool]:
    """The value of the Arrow stream in the file `path`, its arrays views of the file's mapped
    pages; and whether nothing maps them any more once it is built (a pandas value or a numpy
    array: its numbers are copied, and its text is copied out first)."""
    _pyarrow(what)  # missing: say so, before the file is mapped
    try:
        with open(path, "rb") as source:
            mapped = mmap.mmap(source.fileno(), 0, prot=mmap.PROT_READ)
    except (OSError, ValueError) as exc:  # ValueError: an empty file
        raise PayloadError(f"{what} cannot be read as Arrow: {exc}") from None
    mapping = weakref.ref(mapped)  # gone with the last array that is a view of it
    value = _from_arrow(mapped, what, mapped=True)
    del mapped
    return value, mapping() is None


def _from_arrow(data: Any, what: str, *, mapped: bool = False) -> Any:
    """The value of the Arrow stream in `data` (bytes, or a buffer of a `mapped` file: then
    every array is a view of the file's pages, read without a copy)."""
    pa = _pyarrow(what)
    if bytes(data[:6]) == _FILE_MAGIC:
        raise PayloadError(
            f"{what} is an Arrow IPC file (Feather v2), not a stream: send the stream format "
            "(pyarrow.ipc.new_stream), or the file's table (pyarrow.ipc.open_file(...).read_all())"
        )
    source = pa.BufferReader(pa.py_buffer(data))
    try:
        table = pa.ipc.open_stream(source).read_all()
    except MemoryError:
        raise  # out of memory reading it (ArrowMemoryError), not bytes that are not a stream
    except (pa.ArrowException, ValueError, OSError) as exc:  # OSError: a negative length
        looks = bytes(data[:64]).lstrip()[:1]
        hint = " (it looks like JSON: send it as application/json)" if looks in (b"{", b"[") else ""
        raise PayloadError(f"{what} is not an Arrow IPC stream: {exc}{hint}") from None
    if (after := len(data) - source.tell()) > 0:  # two streams end to end, say: not one value
        raise PayloadError(
            f"{what} has {after} bytes after the end of its Arrow IPC stream: send one stream"
        )
    metadata = dict(table.schema.metadata or {})
    kind = metadata.pop(KIND_KEY, b"pyarrow.Table").decode("utf-8", "replace")
    try:
        return _rebuilt(pa, table, kind, metadata, what, mapped)
    except (PayloadError, MemoryError):
        raise
    except (pa.ArrowException, KeyError, IndexError, TypeError, ValueError) as exc:
        # A stream whose metadata does not describe its columns (written by hand, or a
        # stream of ours cut or changed): bad input, named, not a crash of its reader.
        raise PayloadError(
            f"{what} is an Arrow stream whose {KIND_KEY.decode()} metadata ({kind}) does not match "
            f"its columns: {type(exc).__name__}: {exc}"
        ) from None


def _rebuilt(pa: Any, table: Any, kind: str, metadata: dict, what: str, mapped: bool) -> Any:
    """The value of `kind` that `table` and its schema's `metadata` (KIND_KEY taken out)
    describe, as ``_from_arrow`` returns it."""
    if kind.startswith("pandas.") and mapped:
        table = _text_copied(pa, table)
    if kind == "pandas.DataFrame":
        _needs(kind, "pandas", what)
        return _dataframes.to_frame(table)
    if kind == "pandas.Series":
        _needs(kind, "pandas", what)
        frame = table.to_pandas(use_threads=False, types_mapper=_dataframes.types_mapper(table))
        series = _dataframes.with_objects(frame, table)[_SERIES_COLUMN]
        series.name = _hashable(json.loads(metadata.get(_NAME_KEY, b"null")))
        return series
    if kind == "polars.DataFrame":
        return _needs(kind, "polars", what).from_arrow(
            table.replace_schema_metadata(metadata or None)
        )
    if kind == "polars.Series":
        frame = _needs(kind, "polars", what).from_arrow(table.replace_schema_metadata(None))
        return frame.to_series().alias(json.loads(metadata.get(_NAME_KEY, b'""')))
    if kind == "numpy.ndarray":
        _needs(kind, "numpy", what)
        shape = json.loads(metadata.get(_SHAPE_KEY, b"[-1]"))
        order = "F" if metadata.get(_ORDER_KEY) == b"F" else "C"
        flat = table.column(_ARRAY_COLUMN).to_numpy(zero_copy_only=False)
        array = flat.reshape(shape, order=order)
        dtype = metadata.get(_DTYPE_KEY, b"").decode()
        array = array.astype(dtype, copy=False) if dtype and dtype != array.dtype.str else array
        # A view of Arrow's buffer is read-only: copied, as a DataFrame's numbers are, so that
        # the array can be written to as the one sent could (and no file stays mapped for it),
        # in the order it had.
        return array if array.flags.writeable else array.copy(order="K")
    plain = table.replace_schema_metadata(metadata or None)
    if kind == "pyarrow.RecordBatch":
        batches = plain.combine_chunks().to_batches()
        return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=plain.schema)
    return plain


def _hashable(name: Any) -> Any:
    """A Series' name as JSON gave it back, its tuples (a MultiIndex column's label) tuples
    again: JSON has only lists, and a name is hashable, so never a list."""
    return tuple(map(_hashable, name)) if isinstance(name, list) else name


def _text_copied(pa: Any, table: Any) -> Any:
    """`table` with its text and categories copied out of a mapped file: pandas keeps them as
    Arrow arrays, and the file's pages can be written again only once nothing maps them."""
    types = pa.types
    for index, column in enumerate(table.columns):
        kind = column.type
        if types.is_dictionary(kind) and _dataframes.categorical(kind) is not None:
            continue  # copied as its Categorical is built
        if types.is_dictionary(kind):
            chunks = [
                pa.DictionaryArray.from_arrays(
                    pa.concat_arrays([chunk.indices]),
                    pa.concat_arrays([chunk.dictionary]),
                    ordered=kind.ordered,
                )
                for chunk in column.chunks
            ]
        elif types.is_string(kind) or types.is_large_string(kind) or types.is_binary(kind):
            chunks = [pa.concat_arrays([chunk]) for chunk in column.chunks]
        else:
            continue
        table = table.set_column(index, table.field(index), pa.chunked_array(chunks, kind))
    return table


def _needs(kind: str, package: str, what: str) -> Any:
    """`package`, imported; PayloadError saying what is missing if it is not installed."""
    return _imported(package, f"{what} is a {kind}, and {package} is not installed here")


def _imported(package: str, missing: str) -> Any:
    """`package`, imported: PayloadError(`missing`) if it cannot be (not installed here). In a
    process held to a memory limit (RLIMIT_DATA: a handler's worker), a C extension's module
    that fails to allocate as it loads can return an error without setting one: that
    SystemError is a MemoryError there, whose caller names the limit and how to give more,
    and replaces the worker, whose half-imported modules are of no use."""
    try:
        return importlib.import_module(package)
    except ImportError:
        raise PayloadError(missing) from None
    except SystemError as exc:
        if memory_limited():
            raise MemoryError(f"importing {package}: SystemError: {exc}") from exc
        raise


memory_limited = _jsonvalues.memory_limited
