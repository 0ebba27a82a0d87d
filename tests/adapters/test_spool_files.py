"""docs/protocol.md, "Pages written again": a spooled payload that was read, and that nothing
maps any more, is kept as a free file of its spool, and the next payload written there is
written into it, cut to size; at most 4 such files, of at most 1 GiB in all, each for at most a
minute unused. A value that still maps its file (a Table) leaves no free file: the file is
removed from its name, its pages living on with the value."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from fnkernel.adapters import _dataframes, _payloads
from fnkernel.runtime_server import payloads


def frame(rows: int = 50_000) -> pd.DataFrame:
    """Numbers, text with nulls, categories (of text, of numbers) and times: pandas keeps the
    text as Arrow arrays."""
    count = np.arange(rows, dtype=np.int64)
    return pd.DataFrame({
        "count": count,
        "ratio": np.where(count % 7 == 0, np.nan, count / 3),
        "note": np.where(count % 5 == 0, None, "ok"),
        "grade": pd.Categorical.from_codes(count % 3, ["a", "b", "c"]),
        "size": pd.Categorical.from_codes(count % 4, [10, 20, 30, 40]),
        "at": pd.to_datetime(count, unit="s").tz_localize("Europe/Paris"),
        "naive": pd.to_datetime(count, unit="s"),
    })  # fmt: skip


def free_files(spool: Path) -> list[Path]:
    return sorted(path for path in spool.iterdir() if path.name.startswith(payloads.FREE_PREFIX))


def test_a_dataframe_read_frees_its_file_and_the_next_payload_is_written_into_it(
    tmp_path: Path,
) -> None:
    sent = frame()
    _dataframes.categorical.dtypes.clear()  # its categories built from the file, not kept ones
    payloads.encode_to_file(sent, str(tmp_path / "in-1"))
    pd.testing.assert_frame_equal(
        payloads.decode_file(str(tmp_path / "in-1"), payloads.ARROW), sent
    )
    [free] = free_files(tmp_path)
    assert not (tmp_path / "in-1").exists()
    inode = free.stat().st_ino

    smaller = frame(1_000)
    size, _ = payloads.encode_to_file(smaller, str(tmp_path / "out-2"))
    written = tmp_path / "out-2"
    assert written.stat().st_ino == inode  # the same file, its pages written again
    assert written.stat().st_size == size  # cut to what was written
    assert written.stat().st_mode & 0o777 == 0o600
    assert free_files(tmp_path) == []
    pd.testing.assert_frame_equal(payloads.decode_file(str(written), payloads.ARROW), smaller)


def test_a_table_that_maps_its_file_leaves_no_free_file(tmp_path: Path) -> None:
    table = pa.table({"x": np.arange(100_000)})
    payloads.encode_to_file(table, str(tmp_path / "in-1"))
    read = payloads.decode_file(str(tmp_path / "in-1"), payloads.ARROW)
    assert read.equals(table)
    assert list(tmp_path.iterdir()) == []  # gone from its name, not kept: the Table maps it
    payloads.encode_to_file(table, str(tmp_path / "in-2"))
    assert read.equals(table)  # a later payload never writes over pages a value maps


def test_a_numpy_array_read_is_writable_and_frees_its_file(tmp_path: Path) -> None:
    # As a DataFrame's numbers: copied out of the mapped pages, so it can be written to, and
    # its file is free for the next payload.
    sent = np.arange(100_000, dtype=np.float64).reshape(1000, 100)
    payloads.encode_to_file(sent, str(tmp_path / "in-1"))
    read = payloads.decode_file(str(tmp_path / "in-1"), payloads.ARROW)
    read[0, 0] = -1.0
    assert read[0, 0] == -1.0 and read[1, 0] == sent[1, 0]
    assert len(free_files(tmp_path)) == 1


def test_octets_and_json_read_free_their_file(tmp_path: Path) -> None:
    for name, value in (("in-1", b"\x00" * 70_000), ("in-2", {"rows": list(range(20_000))})):
        _, media = payloads.encode_to_file(value, str(tmp_path / name))
        assert payloads.decode_file(str(tmp_path / name), media) == value
        assert [path.name for path in tmp_path.iterdir()] == [free_files(tmp_path)[0].name]


def test_a_writer_takes_the_file_freed_last_of_those_that_hold_what_it_writes(
    tmp_path: Path,
) -> None:
    # Else the largest: its pages are allocated already, and those written last may still be
    # in the CPU's caches.
    inodes = {}
    for size in (20_000, 1_000, 5_000):
        (tmp_path / f"in-{size}").write_bytes(b"x" * size)
        inodes[size] = (tmp_path / f"in-{size}").stat().st_ino
        payloads.release(str(tmp_path / f"in-{size}"))
    with payloads.spool_file(str(tmp_path / "out-1"), 3_000) as out:
        out.write(b"y" * 3_000)
    with payloads.spool_file(str(tmp_path / "out-2"), 50_000) as out:
        out.write(b"z" * 50_000)
    assert (tmp_path / "out-1").stat().st_ino == inodes[5_000]
    assert (tmp_path / "out-2").stat().st_ino == inodes[20_000]
    assert (tmp_path / "out-2").read_bytes() == b"z" * 50_000
    [left] = free_files(tmp_path)
    assert left.stat().st_ino == inodes[1_000]


def test_a_spool_keeps_few_free_files_of_bounded_size_for_a_short_while(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for n in range(_payloads.KEEP_FREE_FILES + 2):
        (tmp_path / f"in-{n}").write_bytes(b"x" * 1000)
        payloads.release(str(tmp_path / f"in-{n}"))
    assert len(free_files(tmp_path)) == _payloads.KEEP_FREE_FILES
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith("in-")] == []

    monkeypatch.setattr(_payloads, "KEEP_FREE_BYTES", 1500)
    for path in free_files(tmp_path)[1:]:
        path.unlink()
    (tmp_path / "in-big").write_bytes(b"x" * 1000)
    payloads.release(str(tmp_path / "in-big"))  # 2000 bytes kept would pass the bound
    assert len(free_files(tmp_path)) == 1 and not (tmp_path / "in-big").exists()

    [kept] = free_files(tmp_path)
    witness = tmp_path.parent / "witness"  # another name of the same file, out of the spool
    os.link(kept, witness)
    monkeypatch.setattr(_payloads, "KEEP_FREE_SECONDS", -1.0)  # so it is unused for longer
    with payloads.spool_file(str(tmp_path / "out-1")) as out:
        out.write(b"new")
    assert (tmp_path / "out-1").read_bytes() == b"new"
    # Too long unused: removed from the spool, not written into.
    assert witness.read_bytes() == b"x" * 1000 and witness.stat().st_nlink == 1
    assert free_files(tmp_path) == []


def test_a_write_that_fails_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "in-1").write_bytes(b"x" * 1000)
    payloads.release(str(tmp_path / "in-1"))
    with pytest.raises(TypeError), payloads.spool_file(str(tmp_path / "out-1")) as out:
        out.write(b"partial")
        raise TypeError("the value cannot be written")
    assert list(tmp_path.iterdir()) == []
