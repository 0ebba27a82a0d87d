"""docs/protocol.md, "Limits": one test per limit, each through a real server; violations name the field."""

from __future__ import annotations

import json
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from fnkernel.adapters.calllogs import LogLine
from fnkernel.adapters.errors import (
    InvalidInput,
    InvocationCancelled,
    InvocationTimeout,
    WorkerUnavailable,
)
from fnkernel.runtime_server import limits, wire
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server.errors import InvalidField
from fnkernel.runtime_server.pipeline import Pipeline
from fnkernel.runtime_server.rpc import logs_trailer
from tests.function_runtime.statuses import rejected
from tests.support import ECHO_PY, Client, digest

READY = pb.FUNCTION_REGISTRATION_STATE_READY


def register_with(client: Client, **fields: object) -> pb.RegisterFunctionResponse:
    request = pb.RegisterFunctionRequest(
        run_uid="limits",
        registration_attempt=1,
        working_dir=str(client.workdir(ECHO_PY)),
        handler="handler.handle",
        registration_digest=digest("x"),
    )
    for name, value in fields.items():
        if name == "env":
            request.env.update(value)  # type: ignore[arg-type]
        else:
            setattr(request, name, value)
    return client.fn.RegisterFunction(request, timeout=30)


RUN_UID_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._-]*$"


@pytest.mark.parametrize(
    ("run_uid", "rule"),
    [
        ("", "must not be empty"),
        ("-leading-dash", RUN_UID_PATTERN),
        ("has space", RUN_UID_PATTERN),
        ("slash/uid", RUN_UID_PATTERN),
        ("x" * 129, "128 bytes"),
        ("ünïcode", RUN_UID_PATTERN),
    ],
)
def test_run_uid_must_be_1_to_128_bytes_of_the_allowed_characters(
    python_rt: Client, run_uid: str, rule: str
) -> None:
    rejected(lambda: register_with(python_rt, run_uid=run_uid), "run_uid", rule)


def test_run_uid_of_128_bytes_with_dots_is_accepted(python_rt: Client) -> None:
    assert (
        register_with(python_rt, run_uid="2b5d..." + "a" * 121).state
        == pb.FUNCTION_REGISTRATION_STATE_READY
    )


@pytest.mark.parametrize("attempt", [0, -1])
def test_registration_attempt_must_be_at_least_one(python_rt: Client, attempt: int) -> None:
    rejected(
        lambda: register_with(python_rt, registration_attempt=attempt),
        "registration_attempt",
        ">= 1",
        str(attempt),
    )


def test_working_dir_must_be_absolute(python_rt: Client) -> None:
    rejected(
        lambda: register_with(python_rt, working_dir="relative/dir"), "working_dir", "absolute"
    )


def test_working_dir_must_exist(python_rt: Client) -> None:
    missing = python_rt.workspace / "missing"
    rejected(
        lambda: register_with(python_rt, working_dir=str(missing)),
        "working_dir",
        "not an existing directory",
    )


def test_working_dir_must_be_inside_the_workspace_root(python_rt: Client) -> None:
    rejected(lambda: register_with(python_rt, working_dir="/tmp"), "working_dir", "outside")


@pytest.mark.parametrize(
    "handler",
    [
        "handler",
        ".handle",
        "handler.",
        "handler.1x",
        "hand-ler.handle",
        "a b.c",
        "x" * 250 + ".handle",
    ],
)
def test_python_handler_must_be_dotted_identifiers_within_256_bytes(
    python_rt: Client, handler: str
) -> None:
    rule = "256 bytes" if len(handler) > 256 else repr(handler)
    rejected(lambda: register_with(python_rt, handler=handler), "handler", rule)


def test_env_keys_must_be_identifiers(python_rt: Client) -> None:
    rejected(lambda: register_with(python_rt, env={"1BAD": "x"}), "env", "1BAD")


def test_env_values_must_not_contain_nul(python_rt: Client) -> None:
    rejected(lambda: register_with(python_rt, env={"OK": "a\0b"}), "env", "NUL")


def test_env_has_at_most_128_entries(python_rt: Client) -> None:
    env = {f"K{i}": "v" for i in range(129)}
    rejected(lambda: register_with(python_rt, env=env), "env", "129 entries", "128")


def test_env_is_at_most_64_kib_in_all(python_rt: Client) -> None:
    env = {f"K{i}": "v" * 1024 for i in range(65)}
    rejected(lambda: register_with(python_rt, env=env), "env", str(limits.MAX_ENV_BYTES))


@pytest.mark.parametrize("seconds", [-1, 86_401])
def test_idle_timeout_is_0_to_86400_seconds(python_rt: Client, seconds: int) -> None:
    rejected(
        lambda: register_with(python_rt, idle_timeout_seconds=seconds),
        "idle_timeout_seconds",
        "86400",
        str(seconds),
    )


@pytest.mark.parametrize(
    "value", ["", "sha256:...", "sha256:" + "A" * 64, "sha1:" + "a" * 64, "sha256:" + "a" * 63]
)
def test_registration_digest_is_sha256_and_64_lowercase_hex(python_rt: Client, value: str) -> None:
    rejected(
        lambda: register_with(python_rt, registration_digest=value),
        "registration_digest",
        "64 lowercase hex digits",
    )


@pytest.fixture
def ready(python_rt: Client) -> pb.FunctionRegistration:
    return python_rt.register(ECHO_PY).registration


def test_invocation_id_over_128_bytes_is_rejected(
    python_rt: Client, ready: pb.FunctionRegistration
) -> None:
    rejected(lambda: python_rt.invoke(ready, invocation_id="i" * 129), "invocation_id", "128")


def test_invocation_id_must_be_printable_ascii(
    python_rt: Client, ready: pb.FunctionRegistration
) -> None:
    rejected(
        lambda: python_rt.invoke(ready, invocation_id="tab\there"), "invocation_id", "printable"
    )


def test_empty_invocation_id_gets_a_generated_one_and_a_supplied_one_is_echoed(
    python_rt: Client, ready: pb.FunctionRegistration
) -> None:
    # docs/protocol.md: when it is empty the server generates an opaque ID; the response always returns it.
    generated = python_rt.invoke(ready).invocation_id
    assert generated.startswith("inv_") and len(generated) == 30
    assert python_rt.invoke(ready, invocation_id="trace 01J/x").invocation_id == "trace 01J/x"


def test_input_over_6_mib_is_invalid_argument_not_a_transport_error(
    python_rt: Client, ready: pb.FunctionRegistration
) -> None:
    payload = b'"' + b"x" * limits.MAX_PAYLOAD_BYTES + b'"'
    rejected(lambda: python_rt.invoke(ready, payload), "input", str(limits.MAX_PAYLOAD_BYTES))


def test_negative_timeout_millis_is_rejected(
    python_rt: Client, ready: pb.FunctionRegistration
) -> None:
    rejected(lambda: python_rt.invoke(ready, timeout_millis=-1), "timeout_millis", "negative")


def test_timeout_millis_zero_means_the_30_s_default_and_is_capped_at_900_s() -> None:
    assert limits.effective_timeout_millis(0) == 30_000
    assert limits.effective_timeout_millis(10**9) == 900_000


def test_each_hop_waits_the_calls_own_timeout_and_10_s_for_each_hop_below() -> None:
    # docs/protocol.md, "Limits": how long a hop waits for an answer, derived from the call's.
    assert limits.wait_seconds(5_000, hops_below=1) == 15.0  # the gateway, for runtimed
    assert limits.wait_seconds(600_000, hops_below=2) == 620.0  # the client
    assert limits.wait_seconds(0, hops_below=2) == 50.0  # the 30 s default
    assert limits.wait_seconds(10**9, hops_below=0) == 900.0  # capped
    assert limits.delete_wait_seconds(0, hops_below=1) == 15.0  # the 5 s default drain
    assert limits.delete_wait_seconds(60_000, hops_below=2) == 80.0
    assert limits.status_wait_seconds(hops_below=1) == 2.5  # runtimed, from the server
    assert limits.status_wait_seconds(hops_below=2) == 5.0  # the gateway, through runtimed
    # "Registration": the server's 60 s load bound, and one hop's slack for each hop
    assert limits.register_wait_seconds(hops_below=1) == 70.0  # runtimed
    assert limits.register_wait_seconds(hops_below=2) == 80.0
    assert limits.effective_timeout_millis(250) == 250


def test_negative_drain_timeout_is_rejected(
    python_rt: Client, ready: pb.FunctionRegistration
) -> None:
    rejected(lambda: python_rt.unregister(ready, drain_millis=-5), "drain_timeout_millis", "900000")


def test_non_json_content_type_is_rejected(
    python_rt: Client, ready: pb.FunctionRegistration
) -> None:
    request = pb.InvokeFunctionRequest(registration=ready, input=b"x", content_type="text/csv")
    rejected(lambda: python_rt.fn.InvokeFunction(request, timeout=10), "content_type", "text/csv")


def test_empty_registration_id_is_rejected_at_a_runtime_server(
    python_rt: Client, ready: pb.FunctionRegistration
) -> None:
    # docs/protocol.md: a Runtime Server itself always requires a non-empty registration ID.
    ref = pb.FunctionRegistration(run_uid=ready.run_uid)
    rejected(lambda: python_rt.invoke(ref), "registration_id", "must not be empty")
    rejected(lambda: python_rt.status(ref), "registration_id", "must not be empty")


def test_outputs_bounds() -> None:
    # docs/protocol.md, "Limits" outputs row: ≤ 32 entries; key pattern; value ≤ 1,024 bytes; ≤ 16 KiB total.
    assert limits.outputs_problem({"rows": "3", "a.b-c_d": "x"}) is None
    assert limits.outputs_problem({f"k{i}": "v" for i in range(33)}) is not None
    assert limits.outputs_problem({"-bad": "v"}) is not None
    assert limits.outputs_problem({"k" * 64: "v"}) is not None
    assert limits.outputs_problem({"big": "é" * 513}) is not None
    assert limits.outputs_problem({f"k{i}": "v" * 1000 for i in range(17)}) is not None


def test_fatal_error_is_truncated_to_1024_bytes() -> None:
    assert len(limits.bounded("é" * 2000).encode()) <= 1024
    assert limits.bounded("short") == "short"


# Each limit is accepted at exactly its value (docs/protocol.md, "Limits"): a bound moved by one, or
# `>` turned into `>=`, fails one of these.


def test_env_of_exactly_128_entries_and_64_kib_is_accepted(python_rt: Client) -> None:
    assert register_with(python_rt, env={f"K{i}": "v" for i in range(128)}).state == READY
    # 64 entries of a 3-byte key and a 1,021-byte value: 65,536 bytes in all, exactly.
    exact = {f"K{i:02d}": "v" * (1024 - 3) for i in range(64)}
    assert sum(len(k) + len(v) for k, v in exact.items()) == limits.MAX_ENV_BYTES
    assert register_with(python_rt, run_uid="limits2", env=exact).state == READY
    over = dict(exact, K00="v" * (1024 - 2))
    rejected(lambda: register_with(python_rt, run_uid="limits3", env=over), "env", "65537 bytes")


@pytest.mark.parametrize("seconds", [0, 86_400])
def test_idle_timeout_of_0_and_86400_is_accepted(python_rt: Client, seconds: int) -> None:
    assert register_with(python_rt, idle_timeout_seconds=seconds).state == READY


@pytest.mark.parametrize(
    ("env", "why"),
    [({"A=B": "x"}, "key"), ({"": "x"}, "key"), ({"OK": "x\0"}, "NUL")],
)
def test_env_keys_that_would_corrupt_the_environment_are_refused(
    python_rt: Client, env: dict[str, str], why: str
) -> None:
    rejected(lambda: register_with(python_rt, env=env), "env", why)


@pytest.mark.parametrize(
    "value", ["sha256" + "a" * 64, "sha256::" + "a" * 63, " sha256:" + "a" * 64]
)
def test_a_digest_must_be_spelled_exactly(python_rt: Client, value: str) -> None:
    rejected(
        lambda: register_with(python_rt, registration_digest=value),
        "registration_digest",
        "64 lowercase hex digits",
    )


def test_an_empty_working_dir_names_the_field(python_rt: Client) -> None:
    rejected(lambda: register_with(python_rt, working_dir=""), "working_dir", "must not be empty")


def test_an_invocation_id_of_exactly_128_printable_bytes_is_accepted(
    python_rt: Client, ready: pb.FunctionRegistration
) -> None:
    exact = "~" * 128
    assert python_rt.invoke(ready, invocation_id=exact).invocation_id == exact


@pytest.mark.parametrize("invocation_id", ["del\x7f", "nul\x00", "é"])
def test_an_invocation_id_outside_printable_ascii_is_refused(
    python_rt: Client, ready: pb.FunctionRegistration, invocation_id: str
) -> None:
    rejected(lambda: python_rt.invoke(ready, invocation_id=invocation_id), "invocation_id")


@pytest.mark.parametrize(
    "content_type", ["application/json; charset=utf-8", "application/json; charset=utf-8; q=1"]
)
def test_json_with_parameters_is_json(
    python_rt: Client, ready: pb.FunctionRegistration, content_type: str
) -> None:
    # The media type is what comes before the first ";" (RFC 9110, 8.3.1).
    request = pb.InvokeFunctionRequest(
        registration=ready, input=b'{"a": 1}', content_type=content_type
    )
    assert b'"echo":{"a":1}' in python_rt.fn.InvokeFunction(request, timeout=30).output


def test_an_input_and_an_output_of_exactly_6_mib_are_accepted(python_rt: Client) -> None:
    identity = python_rt.register({"handler.py": "def handle(event):\n    return event\n"})
    payload = b'"' + b"x" * (limits.MAX_PAYLOAD_BYTES - 2) + b'"'
    assert len(payload) == limits.MAX_PAYLOAD_BYTES
    assert python_rt.invoke(identity.registration, payload).output == payload


def test_outputs_at_exactly_their_bounds_are_accepted() -> None:
    assert limits.outputs_problem({f"k{i}": "v" for i in range(32)}) is None
    assert limits.outputs_problem({"k" * 63: "v"}) is None
    assert limits.outputs_problem({"big": "x" * 1024}) is None
    assert limits.outputs_problem({"big": "x" * 1025}) is not None
    # 16 entries of a 3-byte key and a 1,021-byte value: 16 KiB in all, exactly.
    exact = {f"k{i:02d}": "v" * 1021 for i in range(16)}
    assert sum(len(k) + len(v) for k, v in exact.items()) == limits.MAX_OUTPUTS_BYTES
    assert limits.outputs_problem(exact) is None
    assert limits.outputs_problem(dict(exact, k00="v" * 1022)) is not None


def test_messages_are_bounded_to_exactly_1024_bytes() -> None:
    assert limits.bounded("x" * 1024) == "x" * 1024
    cut = limits.bounded("x" * 1025)
    assert len(cut.encode()) == 1024 and cut.endswith("...")


def test_a_long_invalid_value_gives_a_status_message_of_at_most_1_kib(bash_rt: Client) -> None:
    # docs/protocol.md, "Limits": error messages are truncated to 1 KiB, whatever they quote.
    details = rejected(lambda: register_with(bash_rt, handler="x" * 5000 + ".fn"), "handler")
    assert len(details.encode()) <= 1024


def test_an_unexpected_error_is_internal_and_names_only_its_type(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # docs/protocol.md, "Errors": no traceback and no exception text of an unexpected error
    # reaches a status message (it may hold paths or secrets); the log has the detail.
    class Broken(pb_grpc.FunctionRuntimeServicer):
        def FunctionStatus(self, request, context):  # type: ignore[no-untyped-def]
            raise RuntimeError("/secret/path token=abc")

    pipeline = Pipeline([pb.DESCRIPTOR.services_by_name["FunctionRuntime"].full_name])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=(pipeline,))
    pb_grpc.add_FunctionRuntimeServicer_to_server(Broken(), server)
    address = f"unix:{tmp_path}/broken.sock"
    server.add_insecure_port(address)
    server.start()
    try:
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as caught:
            pb_grpc.FunctionRuntimeStub(channel).FunctionStatus(
                pb.FunctionStatusRequest(), timeout=10
            )
    finally:
        server.stop(None)
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert caught.value.details() == "internal error: RuntimeError"
    # the operator's log has the detail, naming the method that failed
    assert "internal error in FunctionStatus" in caplog.text and "token=abc" in caplog.text


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (WorkerUnavailable("no worker"), "UNAVAILABLE"),  # retry or evict, never "bad input"
        (InvocationCancelled("cancelled"), "CANCELLED"),
        (InvocationTimeout("late"), "DEADLINE_EXCEEDED"),
        (InvalidInput("not JSON"), "INVALID_ARGUMENT"),
    ],
)
def test_the_adapter_failures_map_to_the_statuses_of_the_errors_table(
    error: Exception, code: str
) -> None:
    # docs/protocol.md, "Errors": one table, wire.GRPC_STATUS.
    assert wire.status_name(error) == code


def test_a_working_dir_with_a_nul_byte_names_the_field(python_rt: Client) -> None:
    wd = python_rt.workdir(ECHO_PY)
    rejected(lambda: register_with(python_rt, working_dir=f"{wd}\0x"), "working_dir", "NUL")


def test_generated_ids_are_ulids_of_the_current_millisecond() -> None:
    # docs/protocol.md, "Registration": `reg_` + a ULID — 48 bits of Unix milliseconds, then 80
    # random bits, in Crockford's base32 (no I, L, O or U), so IDs sort by creation time.
    before = time.time_ns() // 1_000_000
    ids = [limits.new_id("reg_") for _ in range(50)]
    after = time.time_ns() // 1_000_000
    crockford = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
    for generated in ids:
        digits = generated.removeprefix("reg_")
        assert generated.startswith("reg_") and len(digits) == 26
        assert set(digits) <= set(crockford), generated
        value = 0
        for digit in digits:
            value = value * 32 + crockford.index(digit)
        assert value < 2**128  # 26 digits carry 130 bits; the top two are zero
        assert before <= value >> 80 <= after
    assert len(set(ids)) == len(ids)


def test_every_random_digit_of_an_id_takes_all_32_values() -> None:
    # docs/protocol.md, "Registration": the last 16 digits are 80 random bits, 5 in each digit.
    # In 2,000 IDs a digit position that missed one of its 32 values by chance would happen
    # with a probability below 1e-25; one that carries fewer than 5 bits misses half of them.
    ids = [limits.new_id("inv_").removeprefix("inv_") for _ in range(2000)]
    for position in range(10, 26):
        assert len({generated[position] for generated in ids}) == 32, position


@pytest.mark.parametrize(
    ("text", "value"), [("0", 0), ("7", 7), ("0900000", 900_000), ("9" * 19, None)]
)
def test_a_number_written_as_text_is_ascii_digits_up_to_its_maximum(
    text: str, value: int | None
) -> None:
    # docs/protocol.md, "Limits": numbers that arrive as text are ASCII digits only.
    if value is None:  # nineteen nines is over int64's maximum
        with pytest.raises(InvalidField) as caught:
            limits.parse_count(text, "X-Timeout-Ms")
        assert str(caught.value).startswith("X-Timeout-Ms: must be an integer from 0 to ")
    else:
        assert limits.parse_count(text, "X-Timeout-Ms") == value
    assert limits.parse_count("900000", "drainTimeoutMs", 900_000) == 900_000


@pytest.mark.parametrize("text", ["", " 7", "7 ", "+7", "-1", "1_000", "²", "٣", "0x10", "9" * 20])
def test_anything_but_ascii_digits_is_refused_naming_the_field_and_the_range(text: str) -> None:
    with pytest.raises(InvalidField) as caught:
        limits.parse_count(text, "drainTimeoutMs", 900_000)
    assert caught.value.field == "drainTimeoutMs"
    assert str(caught.value) == (
        f"drainTimeoutMs: must be an integer from 0 to 900000, got {text!r}"
    )


def test_a_number_over_its_maximum_is_refused_and_a_long_one_is_shown_cut() -> None:
    with pytest.raises(InvalidField) as caught:
        limits.parse_count("900001", "drainTimeoutMs", 900_000)
    assert str(caught.value).endswith("got '900001'")
    with pytest.raises(InvalidField) as caught:
        limits.parse_count("x" * 41, "value")
    assert str(caught.value).endswith(f"got {'x' * 40 + '...'!r}")
    with pytest.raises(InvalidField) as caught:
        limits.parse_count("x" * 40, "value")
    assert str(caught.value).endswith(f"got {'x' * 40!r}")


def test_every_grpc_status_has_its_http_status_and_anything_else_is_500() -> None:
    # docs/protocol.md, "Errors": the gRPC → HTTP table.
    table = {
        "OK": 200,
        "INVALID_ARGUMENT": 400,
        "NOT_FOUND": 404,
        "ALREADY_EXISTS": 409,
        "UNAUTHENTICATED": 401,
        "PERMISSION_DENIED": 403,
        "RESOURCE_EXHAUSTED": 429,
        "FAILED_PRECONDITION": 503,
        "DEADLINE_EXCEEDED": 504,
        "UNKNOWN": 502,
        "UNIMPLEMENTED": 501,
        "UNAVAILABLE": 503,
        "CANCELLED": 503,
        "INTERNAL": 500,
    }
    assert {name: wire.http_status(name) for name in table} == table
    assert wire.http_status("DATA_LOSS") == 500


def _lines(*texts: str) -> tuple[LogLine, ...]:
    return tuple(LogLine("stderr" if i % 2 else "stdout", text) for i, text in enumerate(texts))


def test_the_logs_trailer_keeps_the_last_lines_that_fit_4_kib_oldest_first() -> None:
    # docs/protocol.md, "Errors": the call's log lines, as JSON, in fn-logs-bin — the last ones
    # that fit 4 KiB, in the order they were written, after a first line saying how many were
    # left out (`cut`: the whole log is asked for where it is kept).
    lines = _lines(*(f"line {i:03d} " + "x" * 50 for i in range(200)))
    trailer = logs_trailer(lines)
    note, *kept = json.loads(trailer)
    assert len(trailer) <= 4096
    assert kept == [{"stream": x.stream, "text": x.text} for x in lines[-len(kept) :]]
    entry = len(json.dumps(kept[0], separators=(",", ":")) + ",")
    assert len(kept) == (4096 - 160 - 1) // entry  # 160 bytes kept for the note
    assert note == {
        "stream": "stderr",
        "text": "[fnkernel: the call's log is longer than its answer carries (the last 4 KiB): "
        f"{200 - len(kept)} earlier line(s) left out]",
        "cut": True,
    }
    assert json.loads(logs_trailer(_lines("one", "two"))) == [
        {"stream": "stdout", "text": "one"},
        {"stream": "stderr", "text": "two"},
    ]
    assert logs_trailer(()) == b"[]"


def test_the_logs_trailer_uses_its_budget_to_the_byte() -> None:
    # One entry is '{"stream":"stdout","text":"…"}': 29 bytes and its text. Two lines whose
    # trailer is exactly 4,096 bytes are both kept, as they are; one byte more and the note
    # takes its room: the last line is kept cut short, marked, and the first left out.
    overhead = len('[{"stream":"stdout","text":""},{"stream":"stderr","text":""}]')
    first = "a" * 100
    exact = _lines(first, "b" * (4096 - overhead - len(first)))
    assert len(logs_trailer(exact)) == 4096
    assert len(json.loads(logs_trailer(exact))) == 2
    over = _lines(first, "b" * (4097 - overhead - len(first)))
    trailer = logs_trailer(over)
    note, last = json.loads(trailer)
    assert len(trailer) <= 4096 and note["cut"] and "1 earlier line(s) left out" in note["text"]
    assert last["text"].endswith(" […]") and over[1].text.startswith(last["text"][:-4])
    # A single line over the budget is kept cut short too, never left out whole.
    note, alone = json.loads(logs_trailer(_lines("x" * 5000)))
    assert "0 earlier line(s) left out" in note["text"] and alone["text"].startswith("xxx")
    assert alone["text"].endswith(" […]")


def test_timeline_readings_read_back_and_what_is_not_a_reading_is_skipped() -> None:
    # docs/protocol.md, "Timeline": one hop's readings travel as `name=ns,name=ns`.
    written = wire.timeline_stamps(received=12, called=34, answered=56)
    assert written == "received=12,called=34,answered=56"
    assert wire.parse_timeline_stamps(written) == {"received": 12, "called": 34, "answered": 56}
    # A reading is a name and ASCII digits; anything else in the trailer is left out.
    odd = "=5,called=,a=b=1,x=-1,y=1.5,z=\u00b2,,answered=7"
    assert wire.parse_timeline_stamps(odd) == {"answered": 7}
    assert wire.parse_timeline_stamps("") == {}
