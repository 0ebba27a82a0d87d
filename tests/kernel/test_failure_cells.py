"""How a function's failures read in the notebook (docs/protocol.md, "Kernel"): a handler's
traceback against the cell's lines, one readable line for the stack's refusals, %fn_debug for the
whole detail, and a handler's builtin exceptions caught by their own type."""

from __future__ import annotations

import re

import pytest

from tests.kernel.cells import ETL, SLOW
from tests.kernel.kernels import Kernel

pytestmark = pytest.mark.usefixtures("fnkernel_spec")


FAILS = """%%function fails
def handler(event):
    print("about to divide")
    return event / 0
"""


def test_a_handler_error_shows_its_traceback_and_a_line_naming_the_exception_and_cell_line(
    kernel: Kernel,
) -> None:
    # docs/protocol.md, "Kernel": the handler's own traceback as IPython shows a local error —
    # its frames only, with the cell's line numbers (the %%function line is cell line 1, so
    # `return event / 0` is cell line 4) — then the exception and the cell line; what a
    # headless log (nbconvert, papermill) prints too. The handler's prints come first.
    assert kernel.run(FAILS).ok
    cell = kernel.run("fails(1)")
    assert cell.error is not None
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in cell.error["traceback"]]
    assert lines[-1] == "ZeroDivisionError: division by zero (fails, cell line 4)"
    assert not [line for line in lines if line.startswith("ZeroDivisionError:")][:-1]  # said once
    assert "Cell fails, line 4, in handler" in lines
    assert "---->  4     return event / 0" in lines
    assert not [line for line in lines if "fnkernel" in line or "_worker" in line]  # no platform
    assert cell.stdout == "about to divide\n"
    assert "Traceback" not in cell.stderr
    # Still a HandlerFailed, for code that catches one.
    assert kernel.run("from fnkernel.runtime_server.client.errors import HandlerFailed").ok
    assert kernel.value("isinstance(__import__('sys').last_value, HandlerFailed)") is True


CHAINED = """%%function chained
def handler(event):
    print("looking up", event)
    try:
        return {}[event]
    except KeyError as missing:
        if event == "from":
            raise ValueError("no such key") from missing
        raise LookupError("while looking")
"""


def test_a_chain_of_exceptions_is_told_whole_against_the_cell_and_never_as_stderr(
    kernel: Kernel,
) -> None:
    # docs/protocol.md, "Kernel": a handler error shows the handler's traceback as IPython shows
    # a local error, its own frames with the cell's lines, never the worker's — and a chain of
    # exceptions (`raise ... from`, or one raised while handling another: every pandas
    # KeyError) is one traceback, as IPython shows it; caught in the cell, nothing of it shows.
    assert kernel.run(CHAINED).ok
    caught = kernel.run("try:\n    chained('from')\nexcept ValueError:\n    print('caught')")
    assert caught.ok and caught.stdout == "looking up from\ncaught\n"
    assert caught.stderr == ""
    for event, joined, last in [
        ("from", "The above exception was the direct cause of the following exception:",
         "ValueError: no such key (chained, cell line 8)"),
        ("during", "During handling of the above exception, another exception occurred:",
         "LookupError: while looking (chained, cell line 9)"),
    ]:  # fmt: skip
        cell = kernel.run(f"chained({event!r})")
        assert cell.error is not None and cell.stderr == "", cell.stderr
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in cell.error["traceback"]]
        assert lines[-1] == last
        assert joined in lines
        headers = [line.split()[0] for line in lines if "Traceback (most recent call last)" in line]
        assert headers == ["KeyError", last.partition(":")[0]]
        assert "---->  5         return {}[event]" in lines  # the first exception's frame
        assert "KeyError: '" + event + "'" in lines
        assert not [line for line in lines if "workspace" in line or "_worker" in line]


def test_a_function_past_its_memory_limit_fails_in_one_line_naming_it(kernel: Kernel) -> None:
    # docs/protocol.md, "Limits": --memory MIB is the Run's memoryMb; past it the call fails
    # naming the limit and the function stays registered.
    hog = (
        "%%function hog --memory 100\ndef handler(event):\n    return len(bytearray(event << 20))\n"
    )
    assert kernel.run(hog).ok
    assert kernel.value("hog(10)") == 10 << 20
    cell = kernel.run("hog(400)")
    assert cell.error is not None
    [line] = cell.error["traceback"]
    assert line.startswith("MemoryLimitExceeded: the handler needed more than its 100 MiB"), line
    assert line.endswith("; give it more with %%function hog --memory MIB (hog)"), line
    assert line.count("give it more") == 1, line  # said once, in the cell's words
    assert kernel.value("hog(1)") == 1 << 20
    assert kernel.value("hog.status()['spec']['memoryMb']") == 100


def test_fn_debug_shows_the_handlers_traceback_in_cell_lines_then_the_call(
    kernel: Kernel,
) -> None:
    # docs/protocol.md, "Kernel": %fn_debug shows the traceback as IPython shows one — the
    # cell's line numbers with context — then the call's detail, without JSON escapes.
    assert kernel.run(FAILS).ok
    kernel.run("fails(2)")
    cell = kernel.run("%fn_debug")
    # Coloured as IPython colours a traceback in the terminal (text/plain); plain in HTML.
    assert "\x1b[0;31mZeroDivisionError" in cell.result
    assert "\x1b[" not in cell.htmls()[-1]
    text = re.sub(r"\x1b\[[0-9;]*m", "", cell.result)
    assert "ZeroDivisionError                         Traceback (most recent call last)" in text
    assert "Cell fails, line 4, in handler" in text
    assert "---->  4     return event / 0" in text
    assert '       3     print("about to divide")' in text
    assert text.index("Traceback (most recent") < text.index("HTTP status: 502")
    assert '\\"' not in text and "\\n" not in text
    assert '"logs"' not in text


def test_a_payload_that_is_not_json_fails_in_one_line_naming_its_type(kernel: Kernel) -> None:
    kernel.run(ETL)
    # docs/protocol.md, "JSON encodings": the error names the path inside the value.
    cell = kernel.run('etl({"rows": [1, {2, 3}]})')
    assert cell.error is not None
    assert cell.error["traceback"] == [
        'PayloadNotJSON: the payload of etl is not JSON: payload["rows"][1]: set '
        "(convert it: sorted(x) or list(x))"
    ]
    # An Arrow kind ("Content types") that Arrow cannot hold says so, not that it is not JSON.
    cell = kernel.run('import pandas\netl(pandas.DataFrame([[1, 2]], columns=["a", "a"]))')
    assert cell.error is not None
    assert cell.error["traceback"] == [
        "PayloadNotArrow: the payload of etl cannot be sent: payload: this pandas.DataFrame "
        "cannot be written as Arrow: Duplicate column names found: ['a', 'a']"
    ]


def test_a_function_whose_edited_cell_did_not_register_says_so_when_called(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel": an edited cell that fails to register leaves no version
    # registered, and calling NAME says so in cell lines, as NAME.status() does.
    assert kernel.run("%%function greet\ndef handler(event):\n    return 'hi'\n").ok
    assert not kernel.run("%%function greet\ndef handler(event)\n    return 'hi'\n").ok
    for call in ("greet()", "greet.map([1])"):
        cell = kernel.run(call)
        assert cell.error is not None and cell.error["traceback"] == [
            "RegistrationFailed: greet did not register when its cell last ran, and the version "
            "before was unregistered: UserCodeSyntaxError: cell line 2: SyntaxError: expected "
            "':'; not called (fix the cell and run it again) (Failed)"
        ], call
    status = kernel.run("greet.status()").result
    assert "state Failed" in status and "cell line 2: SyntaxError" in status, status


def test_a_busy_function_fails_with_one_readable_line(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel": errors are short, readable messages (the error class, the field, the cause).
    assert kernel.run(SLOW).ok
    cell = kernel.run(
        "import threading\n"
        "first = threading.Thread(target=slow, args=({'s': 2},))\n"
        "first.start()\n"
        "import time\n"
        "while not slow.status()['live']['inFlight']:\n"
        "    time.sleep(0.01)\n"
        "try:\n"
        "    slow({'s': 0})\n"
        "finally:\n"
        "    first.join()\n"
    )
    assert cell.error is not None
    assert cell.error["ename"] == "FunctionBusy"
    [line] = cell.error["traceback"]
    assert line.startswith('FunctionBusy: "slow" already has invocation inv_')
    assert line.endswith("in flight (RESOURCE_EXHAUSTED)")


def test_fn_debug_shows_the_full_last_error(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel": the full detail is available with %fn_debug.
    cell = kernel.run('%invoke missing {"a": 1}')
    assert cell.error is not None and cell.error["ename"] == "FunctionNotFound"
    assert cell.error["traceback"] == ["FunctionNotFound: no run named 'missing' (NOT_FOUND)"]
    text = kernel.run("%fn_debug").result
    assert text.startswith("fn_debug: last error (FunctionNotFound)")
    # The error as the cell named it, not by the module that defines it.
    assert "\nFunctionNotFound: no run named 'missing'" in text and "fnkernel." not in text
    assert "HTTP status: 404   code: NOT_FOUND" in text
    assert '"message": "no run named \'missing\'"' in text


RAISES = """%%function raises
def handler(event):
    if event == "key":
        raise KeyError("missing")
    if event == "zero":
        return 1 / 0
    if event == "os":
        raise OSError(2, "no such file")
    class Mine(Exception):
        pass
    raise Mine("its own")
"""


def test_a_handlers_builtin_exception_is_caught_by_its_own_type(kernel: Kernel) -> None:
    # README, "Errors": `except KeyError` catches a handler's KeyError, and `except
    # HandlerFailed` (from fnkernel.kernel) every handler failure (as Ray's RayTaskError).
    assert kernel.run(RAISES).ok
    setup = kernel.run(
        "from fnkernel.kernel import HandlerFailed\n"
        "def caught(payload):\n"
        "    try:\n"
        "        raises(payload)\n"
        "    except KeyError as exc:\n"
        "        return ['KeyError', isinstance(exc, HandlerFailed), str(exc)]\n"
        "    except ArithmeticError as exc:\n"
        "        return ['ArithmeticError', isinstance(exc, ZeroDivisionError), str(exc)]\n"
        "    except OSError as exc:\n"
        "        return ['OSError', isinstance(exc, FileNotFoundError), exc.error_type]\n"
        "    except HandlerFailed as exc:\n"
        "        return ['HandlerFailed', isinstance(exc, Exception), exc.error_type]\n"
    )
    assert setup.ok, setup.error
    key = kernel.value("caught('key')")
    assert key[:2] == ["KeyError", True] and not key[2].startswith('"')
    assert kernel.value("caught('zero')")[:2] == ["ArithmeticError", True]
    assert kernel.value("caught('os')") == ["OSError", True, "FileNotFoundError"]
    assert kernel.value("caught('mine')") == ["HandlerFailed", True, "Mine"]  # not ours to mix
    # Uncaught, it ends in the line naming it, as every handler failure does.
    cell = kernel.run("raises('key')")
    assert cell.error is not None and cell.error["ename"] == "HandlerFailedInCell"
    assert cell.error["traceback"][-1].startswith("KeyError: ")
    assert "(raises, cell line 4)" in cell.error["traceback"][-1]
