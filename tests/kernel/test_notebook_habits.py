"""A data engineer's habits in a notebook executed by nbclient through the fnkernel kernel
(docs/protocol.md, "Kernel", "What a handler sees", "JSON encodings", "Ownership"): code beside
the notebook, pandas results, maps that wait, secrets kept out of outputs, a function shared
between notebooks that no other notebook replaces."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.lifecycle.stack import Stack
from tests.kernel.kernels import Kernel, error, execute, ok, text, usage_error
from tests.packages_and_secrets import (
    SECRET,
    a_function_brings_its_packages_and_a_secret,
    set_secret,
)
from tests.support import fnkernel_up
from tests.wheelhouse import build_wheelhouse, offline_index

pytestmark = pytest.mark.usefixtures("fnkernel_spec")

HELPERS = "def double(x):\n    return 2 * x\n"
LOOKUP = "code,name\nA,alpha\nB,beta\n"


@pytest.fixture
def notebook_dir(tmp_path: Path) -> Path:
    """A notebook's directory: a module and a data file beside it."""
    (tmp_path / "helpers.py").write_text(HELPERS)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "lookup.csv").write_text(LOOKUP)
    return tmp_path


ETL = """\
%%function etl --include helpers.py data/lookup.csv
import csv
import helpers

def handler(event):
    with open("data/lookup.csv") as lookup:
        rows = list(csv.DictReader(lookup))
    return {"doubled": helpers.double(event["x"]), "names": [row["name"] for row in rows]}
"""


def test_code_and_data_beside_the_notebook(notebook_dir: Path) -> None:
    # docs/protocol.md, "What a handler sees": plain cells import from the notebook's
    # directory as in ipykernel; a handler's working directory is its Run's files, and
    # --include ships modules and files there at the same relative paths; what it misses
    # from beside the notebook, the error offers to ship.
    cells = execute(notebook_dir, [
        "import helpers\nhelpers.double(21)",
        ETL,
        "etl(x=4)",
        "%%function noship\nimport helpers\ndef handler(event):\n    return helpers.double(1)\n",
        '%%function reader\ndef handler(event):\n    return open("data/lookup.csv").read()\n',
        "reader()",
        "%%function twice --include helpers.py\ndef handler(event):\n    return 1\n",
        "%%function outside --include ../elsewhere.py\ndef handler(event):\n    return 1\n",
    ])  # fmt: skip
    assert ok(cells[0]) == "42"
    assert ok(cells[2]) == "{'doubled': 8, 'names': ['alpha', 'beta']}"
    failed = error(cells[3])
    assert failed["ename"] == "RegistrationFailed"
    assert "No module named 'helpers'" in text(cells[3])
    assert "hint: helpers.py is beside the notebook: ship it with --include helpers.py" in text(
        cells[3]
    )
    missing = error(cells[5])
    assert missing["ename"] == "HandlerFailedInCell"
    assert missing["traceback"][-1] == (
        "hint: data/lookup.csv is beside the notebook: ship it with --include data/lookup.csv"
    )
    assert ok(cells[6])  # a module shipped that the cell does not import: no harm
    assert "only files inside the notebook's directory" in usage_error(cells[7])


STATS = """\
%%function stats
import datetime
import numpy as np
import pandas as pd

def handler(event):
    df = pd.DataFrame({"amount": [1.5, 2.5, None], "n": [1, 2, 3]})
    return {
        "count": df.amount.count(),
        "total": df.n.sum(),
        "mean": np.float32(0.5),
        "flag": np.bool_(True),
        "values": df.n.values,
        "when": pd.Timestamp("2026-12-04 10:30", tz="UTC"),
        "missing": pd.NaT,
        "day": datetime.date(2026, 12, 4),
    }
"""


def test_what_plain_pandas_code_returns_is_json(notebook_dir: Path) -> None:
    # docs/protocol.md, "JSON encodings": numpy scalars as their Python values, arrays as
    # lists, timestamps as ISO 8601 strings; a value JSON cannot hold names its path.
    cells = execute(notebook_dir, [
        STATS,
        "stats(None)",
        "%%function odd\nimport decimal\ndef handler(event):\n"
        "    return {'stats': [1, 2, 3, decimal.Decimal('1.5')]}\n",
        "odd()",
    ])  # fmt: skip
    ok(cells[0])
    assert ok(cells[1]) == (
        "{'count': 2,\n 'total': 6,\n 'mean': 0.5,\n 'flag': True,\n 'values': [1, 2, 3],\n"
        " 'when': '2026-12-04T10:30:00+00:00',\n 'missing': None,\n 'day': '2026-12-04'}"
    )
    failed = error(cells[3])
    assert failed["ename"] == "HandlerFailedInCell"
    assert failed["traceback"][-1] == (
        'ResultNotJSONSerializable: the return value cannot be encoded as JSON: result["stats"]'
        "[3]: Decimal (convert it: float(x) or str(x)) (odd)"
    )


ENRICH = """\
%%function enrich --replicas 2
import pandas as pd

def handler(df):
    return df.assign(late=df["at"].dt.hour >= 17, kind=type(df).__name__)
"""
FRAME = """\
import pandas as pd
df = pd.DataFrame({
    "at": pd.to_datetime(["2026-12-04 09:00", "2026-12-04 18:30", None]).tz_localize("UTC"),
    "grade": pd.Categorical(["a", None, "b"]),
    "n": pd.array([1, None, 3], dtype="Int64"),
}, index=pd.Index(["x", "y", "z"], name="key"))
"""


def test_a_dataframe_in_and_a_dataframe_out(notebook_dir: Path) -> None:
    # docs/protocol.md, "Content types": a DataFrame argument reaches the handler as a
    # DataFrame (Arrow IPC, with its nulls, time zone, categories and index) and the one it
    # returns comes back as one, shown as a table; NAME.map takes one per partition; "Large
    # payloads": one past 6 MiB too.
    cells = execute(notebook_dir, [
        ENRICH,
        FRAME,
        "out = enrich(df)\nprint(type(out).__name__, out['late'].dtype)\n"
        "pd.testing.assert_frame_equal(out.drop(columns=['late', 'kind']), df)\n"
        "print(out['late'].tolist(), out['kind'].iloc[0])",
        "parts = enrich.map([df.iloc[:1], df.iloc[1:]])\n"
        "pd.testing.assert_frame_equal(pd.concat(parts), enrich(df))\nprint(len(parts))",
        "enrich.invoke(df)",
        # past one message (~10 MiB): handed over by file on the embedded runtime's machine
        "big = df.iloc[[0, 1, 2] * 200_000]\nout = enrich(big)\n"
        "pd.testing.assert_frame_equal(out.drop(columns=['late', 'kind']), big)\nlen(out)",
    ])  # fmt: skip
    ok(cells[0])
    assert ok(cells[5]) == "600000"
    shown = ok(cells[2]).splitlines()
    assert shown[0] == "DataFrame bool", shown  # the dtypes sent: assert_frame_equal above
    assert shown[1] == "[False, True, False] DataFrame"
    assert ok(cells[3]).endswith("enrich.map: 2/2 done\n2")
    html = next(o["data"]["text/html"] for o in cells[4] if "text/html" in o.get("data", {}))
    assert "<table" in html and "enrich" in html


PICKY = """\
%%function picky --replicas 2
def handler(event):
    print("item", event)
    if event == 5:
        raise KeyError("five")
    return event * 10
"""


def test_a_map_waits_for_replicas_and_names_the_item_that_failed(notebook_dir: Path) -> None:
    # docs/protocol.md, "Kernel": a map asking for more calls at once than there are
    # replicas waits for one; a failure names its item; with return_exceptions each failure
    # is the exception the raise would give; the bar's end is one line, once.
    cells = execute(notebook_dir, [
        PICKY,
        "picky.map([1, 2, 3, 4, 6, 7, 8, 9], concurrency=4)",
        "picky.map(range(8))",
        "found = picky.map(range(8), return_exceptions=True)\n"
        "[type(r).__name__ if isinstance(r, Exception) else r for r in found], "
        "isinstance(found[5], KeyError)",
        "picky.map([4, 5], concurrency=1)",
    ])  # fmt: skip
    ok(cells[0])
    waited = ok(cells[1])
    assert waited.endswith("[10, 20, 30, 40, 60, 70, 80, 90]")
    assert waited.count("picky.map: 8/8 done") == 1, waited
    for item in (1, 2, 3, 4, 6, 7, 8, 9):  # each call's line, once, marked with its item
        assert len(re.findall(rf"^\[\d\] item {item}$", waited, re.M)) == 1, waited
    failed = error(cells[2])
    assert failed["ename"] == "HandlerFailedInCell"
    assert failed["traceback"][-1] == "KeyError: 'five' (picky, index 5 of 8 items, cell line 5)"
    # docs/protocol.md, "Replicas": the item named however the failure is printed (str()).
    assert failed["evalue"] == "handler error: KeyError: 'five' (index 5 of 8 items)"
    ended = [line for line in text(cells[2]).splitlines() if line.startswith("picky.map:")]
    # what ended, then the rest cancelled, unless every call had ended by then (nothing was
    # left to cancel)
    end_line = r"picky\.map: ([1-7]/8 done, 1 failed, the rest cancelled|8/8 done, 1 failed)"
    assert len(ended) == 1 and re.fullmatch(end_line, ended[0]), ended
    assert ok(cells[3]).endswith("([0, 10, 20, 30, 40, 'HandlerFailedInCell', 60, 70], True)")
    # The last item failed, every call had ended: nothing was cancelled.
    error(cells[4])
    ended = [line for line in text(cells[4]).splitlines() if line.startswith("picky.map:")]
    assert ended == ["picky.map: 2/2 done, 1 failed"]


def test_two_maps_share_the_replicas_and_both_finish(stack_factory: Callable[..., Stack]) -> None:
    # docs/protocol.md, "Replicas": a map started while another holds every replica waits
    # for one, up to its timeout, rather than failing as busy.
    import threading

    stack = stack_factory({"python": 1})
    client = Client(stack.gateway_address)
    client.create_run("nap", runtime="python", handler="nap.handler", replicas=2, files={
        "nap.py": "import time\ndef handler(event):\n    time.sleep(0.05)\n    return event\n"
    })  # fmt: skip
    results: dict[str, list[Any]] = {}

    def run(key: str) -> None:
        results[key] = Client(stack.gateway_address).map("nap", list(range(6)))

    threads = [threading.Thread(target=run, args=(key,)) for key in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == {"a": list(range(6)), "b": list(range(6))}


def test_env_values_stay_out_of_what_a_notebook_saves(notebook_dir: Path) -> None:
    # docs/protocol.md, "What a handler sees": --env KEY passes the kernel's value without
    # writing it in the cell; NAME? and NAME.status() show keys, never values; a variable a
    # cell set but did not pass is named on the card.
    cells = execute(notebook_dir, [
        'import os\nos.environ["API_KEY"] = "sk-very-secret"\nos.environ["REGION"] = "eu"\n'
        'os.environ["_RJEM_MALLOC_CONF"] = "background_thread:true"  # as importing polars does',
        "%%function envy --env API_KEY\nimport os\n"
        "def handler(event):\n    return os.environ['API_KEY'][:3], os.environ.get('REGION')\n",
        "envy()",
        "print(envy.getdoc())",
        "envy.status()",
        "%%function envy --env NOPE\ndef handler(event):\n    return 1\n",
    ])  # fmt: skip
    card = ok(cells[1])
    assert "not passed to the handler: REGION, set in this kernel" in card  # a library's: not
    assert ok(cells[2]) == "['sk-', None]"
    shown = ok(cells[3]) + ok(cells[4]) + card
    assert "API_KEY" in shown and "sk-very-secret" not in shown
    assert "'NOPE' is not set in this kernel's environment" in usage_error(cells[5])


def test_a_function_brings_its_own_packages(notebook_dir: Path) -> None:
    # docs/protocol.md, "Requirements": --requirements and --requirements-file install a
    # cell's packages for its handler on the embedded runtime (from the test's wheelhouse,
    # never an index); a bad one is refused naming the flag, one that cannot be resolved fails
    # the registration in uv's words; the card showed the install's progress meanwhile.
    env = offline_index(build_wheelhouse(notebook_dir / "wheelhouse"))
    (notebook_dir / "requirements.txt").write_text(
        "# ours\nfnk-alpha==2.0  # the newest\nfnk-beta\n"
    )
    (notebook_dir / "typo.txt").write_text("# ours\nfnk-beta\nfnk-alpha>>2\n")
    versions = "import fnk_alpha, fnk_beta\ndef handler(event):\n    return fnk_alpha.VERSION\n"
    cells = execute(notebook_dir, [
        f'%%function pinned --requirements fnk-beta "fnk-alpha==1.0"\n{versions}',
        "pinned()",
        f"%%function listed --requirements-file requirements.txt\n{versions}",
        "listed()",
        '%%function bad --requirements "fnk-alpha>>2"\ndef handler(event):\n    return 1\n',
        '%%function unresolved --requirements "fnk-alpha>=9"\ndef handler(event):\n    return 1\n',
        "%%function typo --requirements-file typo.txt\ndef handler(event):\n    return 1\n",
    ], env=env)  # fmt: skip
    ok(cells[0])
    assert ok(cells[1]) == "'1.0'"
    ok(cells[2])
    assert ok(cells[3]) == "'2.0'"
    refused = usage_error(cells[4])
    assert "%%function bad --requirements: 'fnk-alpha>>2' is not a PEP 508 requirement" in refused
    failed = error(cells[5])
    assert failed["ename"] == "RegistrationFailed"
    assert "cannot resolve the requirements" in failed["evalue"] and "fnk-alpha" in failed["evalue"]
    # A file's line that is not a requirement is named by the file and the line.
    assert "%%function typo --requirements-file typo.txt: line 3: 'fnk-alpha>>2' is not a PEP " \
        "508 requirement" in usage_error(cells[6])  # fmt: skip


def test_a_cell_with_requirements_says_it_installs_them_from_the_start(tmp_path: Path) -> None:
    # docs/protocol.md, "Requirements": the registering card shows the install, from the start
    # — not "loading the handler" while uv resolves and installs, however fast that is.
    env = offline_index(build_wheelhouse(tmp_path / "wheelhouse"))
    kernel = Kernel(env={**env, "FNKERNEL_STATE_DIR": str(tmp_path / "state")})
    try:
        cell = kernel.run(
            '%%function pinned --requirements "fnk-alpha==1.0"\nimport fnk_alpha\n'
            "def handler(event):\n    return fnk_alpha.VERSION\n"
        )
    finally:
        kernel.shutdown()
    assert cell.ok, cell.error
    cards = [text for text in cell.texts() if text.startswith("pinned: ")]
    notes = [card for card in cards if "state registering" in card and card.endswith(")")]
    assert notes and notes[0].endswith("(installing its requirements)"), cards
    assert not any("loading the handler" in card for card in notes), cards
    assert "state ready" in cards[-1].lower(), cards


def test_a_function_with_packages_and_a_secret_on_the_embedded_runtime(
    notebook_dir: Path,
) -> None:
    # docs/protocol.md, "Requirements", "Secrets": the embedded runtime installs from the
    # index the kernel's environment names, and reads the secrets `fnkernel secrets set` keeps
    # in the user's state dir when no gateway is named.
    state = {"FNKERNEL_STATE_DIR": str(notebook_dir / "state")}
    set_secret(notebook_dir, state)
    index = offline_index(build_wheelhouse(notebook_dir / "wheelhouse"))
    a_function_brings_its_packages_and_a_secret(notebook_dir, {**state, **index})
    # The installed set is the machine's, in the user's state dir: it outlives the kernel, and
    # the next kernel's Runs take it from there instead of installing it again.
    assert list((notebook_dir / "state" / "packages" / "envs").glob("*.ready"))


def test_a_function_with_packages_and_a_secret_on_fnkernel_up(notebook_dir: Path) -> None:
    # The same on `fnkernel up`, started as a user starts it with the package index in its
    # shell's environment; the secret set through its gateway; nothing the user (or another
    # local user) can read in its state dir holds the value but the secret store.
    state = notebook_dir / "up"
    index = offline_index(build_wheelhouse(notebook_dir / "wheelhouse"))
    with fnkernel_up(state, index) as gateway:
        set_secret(notebook_dir, {}, "--gateway", gateway)
        a_function_brings_its_packages_and_a_secret(notebook_dir, {"FNKERNEL_RUNTIME": gateway})
    for path in state.rglob("*"):
        if path.is_file() and "secrets" not in path.relative_to(state).parts:
            assert SECRET.encode() not in path.read_bytes(), path


def test_small_habits(notebook_dir: Path) -> None:
    # docs/protocol.md, "Kernel": keyword arguments are the event's fields, no argument is
    # null; --help prints the flags; a refused flag is named as the cell spells it.
    cells = execute(notebook_dir, [
        "%%function echo\ndef handler(event):\n    return event\n",
        "echo(x=1, y=[2])",
        "echo()",
        "echo({'a': 1}, b=2)",
        "%%function echo --help\ndef handler(event):\n    return event\n",
        "%function --help",
        "%%function huge --memory 99999999\ndef handler(event):\n    return 1\n",
        "%function echo",
        "echo(1, timeout=5)",
        "echo({'name': 'a'}, {'name': 'b'})",
    ])  # fmt: skip
    assert ok(cells[1]) == "{'x': 1, 'y': [2]}"
    assert ok(cells[2]) == ""  # None: the handler got null
    # A call's arguments it cannot take: one line, as Python's own TypeError, none of our frames.
    assert error(cells[3])["traceback"] == [
        "TypeError: echo() takes a payload or keyword fields, not both: echo({**payload, "
        "**fields}) sends one object"
    ]
    assert error(cells[9])["traceback"] == [
        "TypeError: echo() takes one payload, got 2: send several in one list or object "
        "(echo([a, b])), or call it once per item with echo.map(items)"
    ]
    # The field a call's limit is mistaken for says where the limit goes.
    assert error(cells[8])["evalue"].endswith(
        "; a call's time limit is echo.invoke(payload, timeout=S)"
    )
    for helped in (ok(cells[4]), ok(cells[5])):
        assert "--include PATH" in helped and "--env KEY[=VALUE]" in helped
    assert "echo" not in ok(cells[4]).split("usage:")[0]  # nothing was registered
    refused = usage_error(cells[6])
    assert refused.startswith("UsageError: %%function huge --memory: must be")
    assert "memoryMb" not in refused
    assert "the handler is the cell's body" in usage_error(cells[7])


SHARED = """\
%%function shared_agg --replicas 2
def handler(event):
    return "made by A"
"""


@pytest.fixture
def shared(stack_factory: Callable[..., Stack]) -> Iterator[Stack]:
    yield stack_factory({"python": 1})


def test_no_kernel_replaces_or_deletes_a_function_it_does_not_own(
    shared: Stack, tmp_path: Path
) -> None:
    # docs/protocol.md, "Ownership": a kernel owns the functions it registered, as its
    # notebook (kept across restarts); another notebook's cell of that name is refused,
    # naming the owner and the ways out; the owner's calls still reach its own code.
    address = shared.gateway_address
    a = {"FNKERNEL_RUNTIME": address, "JPY_SESSION_NAME": "team/A.ipynb"}
    b = {"FNKERNEL_RUNTIME": address, "JPY_SESSION_NAME": "team/B.ipynb"}
    assert ok(execute(tmp_path, [SHARED], env=a)[0])
    # Whose each Run is, for whoever looks from the CLI: the owner's kernel, both replicas.
    listed = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "runs", "list", "--gateway", address],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[0].split() == [
        "NAME", "RUNTIME", "PHASE", "ATTEMPT", "POD", "OWNER", "MESSAGE",
    ]  # fmt: skip
    owners = {line.split()[0]: line for line in listed.stdout.splitlines()[1:]}
    for name in ("shared_agg", "shared_agg.1"):
        assert re.search(r"\sReady\s+1\s+\S+\s+notebook team/A\.ipynb", owners[name])
    cells = execute(tmp_path, [
        "%use shared_agg",
        "shared_agg.unregister()",
        SHARED.replace("made by A", "made by B"),
        "shared_agg(None)",
        "%functions --all",
    ], env=b)  # fmt: skip
    assert error(cells[1])["ename"] == "NotOwned"
    refused = error(cells[2])
    assert refused["ename"] == "NotOwned"
    assert "is owned by notebook team/A.ipynb (" in refused["evalue"]
    assert (
        "another name" in refused["evalue"]
        and "fnkernel runs delete shared_agg" in (refused["evalue"])
    )
    # A script's kernel (nbclient in CI) is owner as itself: how to be the same one each run.
    assert "unless it sets FNKERNEL_OWNER, the same for each run" in refused["evalue"]
    # One that set it is told who it is, not to set it.
    named = {**b, "FNKERNEL_OWNER": "carol"}
    [carol] = execute(tmp_path, [SHARED.replace("made by A", "made by C")], env=named)
    said = error(carol)["evalue"]
    assert said.endswith("This kernel is carol (FNKERNEL_OWNER)") and "unless" not in said
    assert ok(cells[3]) == "'made by A'"
    assert "used here" in ok(cells[4])
    gateway = Client(address)
    assert [r["name"] for r in gateway.status("shared_agg")["replicas"]] == [
        "shared_agg",
        "shared_agg.1",
    ]
    # A again (a restarted kernel of the same notebook): still its own, to keep or replace.
    # Bound with %use first (a restarted notebook's habit), it is named as its owner's, and
    # its cell makes it this kernel's again.
    again = execute(tmp_path, [
        "%use shared_agg", SHARED, "%functions --all", SHARED.replace("made by A", "A, edited"),
        "shared_agg(None)",
    ], env=a)  # fmt: skip
    assert "(used: made by this kernel's owner; its %%function cell makes it this kernel's)" in (
        ok(again[0])
    )
    assert "unchanged" in ok(again[1])
    row = next(line for line in ok(again[2]).splitlines() if line.startswith("shared_agg"))
    assert "2 (2 ready" in row and row.rstrip().endswith("this kernel")
    assert ok(again[4]) == "'A, edited'"
