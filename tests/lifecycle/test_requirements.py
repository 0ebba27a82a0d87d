"""A Run brings its own packages (docs/protocol.md, "Requirements"), on a stack of real processes
(``fnkernel up``'s), installed by uv from a wheelhouse this test builds, never from an index; and
what a create takes as a Run's requirements."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from fnkernel.runtime_server import limits
from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.client.errors import InvalidRequest
from fnkernel.runtime_server.errors import InvalidField
from fnkernel.runtime_server.lifecycle.stack import Stack
from tests.wheelhouse import build_wheelhouse, offline_index

StackFactory = Callable[..., Stack]
HANDLER = {
    "handler.py": (
        "import fnk_alpha, fnk_beta\n"
        "def handle(event):\n"
        "    return {'alpha': fnk_alpha.VERSION, 'beta': fnk_beta.VERSION,\n"
        "            'from': fnk_alpha.__file__}\n"
    )
}


@pytest.fixture
def offline_stack(
    stack_factory: StackFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Client, Path]:
    """A stack whose runtimed finds packages in the test's wheelhouse only; its client and
    state dir."""
    for key, value in offline_index(build_wheelhouse(tmp_path / "wheelhouse")).items():
        monkeypatch.setenv(key, value)
    stack = stack_factory({"python": 1, "bash": 1}, state_dir=tmp_path / "state")
    return Client(stack.gateway_address), tmp_path / "state"


def test_a_handler_imports_its_requirements_at_the_versions_it_asked_for(
    offline_stack: tuple[Client, Path],
) -> None:
    client, state = offline_stack
    run = client.create_run(
        "deps",
        runtime="python",
        handler="handler.handle",
        files=HANDLER,
        requirements=["fnk-beta", "fnk-alpha==1.0"],
    )
    assert run.phase == "Ready", run.message
    assert run["spec"]["requirements"] == ["fnk-beta", "fnk-alpha==1.0"]
    answer = client.invoke("deps", {}).value()
    # fnk-alpha pinned below what fnk-beta alone would get (2.0), from the stack's cache
    assert (answer["alpha"], answer["beta"]) == ("1.0", "1.0")
    assert Path(answer["from"]).is_relative_to(state / "packages" / "envs")


def test_runs_with_the_same_set_share_one_environment(offline_stack: tuple[Client, Path]) -> None:
    client, _ = offline_stack
    made = []
    for name, requirements in (("one", ["fnk-beta", "fnk-alpha==1.0"]),
                               ("two", ["fnk-alpha==1.0", "fnk-beta"])):  # fmt: skip
        run = client.create_run(
            name, runtime="python", handler="handler.handle", files=HANDLER,
            requirements=requirements,
        )  # fmt: skip
        assert run.phase == "Ready", run.message
        made.append(client.invoke(name, {}).value()["from"])
    assert made[0] == made[1]


def test_a_run_without_requirements_has_none_of_anothers(
    offline_stack: tuple[Client, Path],
) -> None:
    client, _ = offline_stack
    with_them = client.create_run(
        "with", runtime="python", handler="handler.handle", files=HANDLER,
        requirements=["fnk-beta"],
    )  # fmt: skip
    assert with_them.phase == "Ready", with_them.message
    without = client.create_run(
        "without", runtime="python", handler="handler.handle", files=HANDLER
    )
    assert without.phase == "Failed"
    assert "No module named 'fnk_alpha'" in without.message


def test_a_set_that_cannot_be_resolved_fails_the_run_once_naming_it(
    offline_stack: tuple[Client, Path],
) -> None:
    client, _ = offline_stack
    run = client.create_run(
        "nope", runtime="python", handler="handler.handle", files=HANDLER,
        requirements=["fnk-alpha>=9"],
    )  # fmt: skip
    assert run.phase == "Failed"
    assert run.attempt == 1  # no retry: the same set fails the same way
    assert run.message.startswith("cannot resolve the requirements: ")
    assert "fnk-alpha" in run.message
    assert len(run.message.encode()) <= 1024


@pytest.mark.parametrize(
    ("runtime", "requirements", "says"),
    [
        (
            "python",
            ["fnk-alpha", "fnk-alpha>>2"],
            "requirements[1]: 'fnk-alpha>>2' is not a PEP 508",
        ),
        ("python", ["--index-url https://example.org"], "requirements[0]: '--index-url"),
        ("python", "fnk-alpha", "requirements: must be an array"),
        ("bash", ["fnk-alpha"], "requirements: the bash runtime takes no Python packages"),
    ],
)
def test_a_bad_requirement_is_refused_at_create_naming_it(
    shared_stack: Stack, runtime: str, requirements: object, says: str
) -> None:
    client = Client(shared_stack.gateway_address)
    body = {
        "name": "refused", "runtime": runtime, "handler": "handler.handle",
        "files": {"handler.py": "def handle(event):\n    return event\n"},
        "requirements": requirements,
    }  # fmt: skip
    with pytest.raises(InvalidRequest) as refused:
        client._json("POST", "/v1/runs", body)  # the HTTP API itself, past the client
    assert refused.value.message.startswith(says), refused.value.message
    assert refused.value.code == "INVALID_ARGUMENT"


# docs/protocol.md, "Requirements": what a create takes as a Run's requirements.


def test_requirements_are_pep_508_each_kept_as_given_without_its_spaces() -> None:
    asked = [" pandas>=2.2 ", "pkg[extra]==1.0", "pkg @ https://example.org/pkg-1.0.tar.gz"]
    assert limits.check_requirements(asked, "python") == (
        "pandas>=2.2", "pkg[extra]==1.0", "pkg @ https://example.org/pkg-1.0.tar.gz",
    )  # fmt: skip
    assert limits.check_requirements([], "bash") == ()  # none: any runtime


@pytest.mark.parametrize(
    ("asked", "says"),
    [
        (["ok", "pandas>>2"], "requirements[1]: 'pandas>>2' is not a PEP 508 requirement: "),
        (
            ["-r other.txt"],
            "requirements[0]: '-r other.txt' is an installer option; the index is the stack's to choose",
        ),
        (["  --index-url x"], "requirements[0]: '  --index-url x' is an installer option"),
        ([3], "requirements[0]: must be a string"),
        (["x" * 513], "requirements[0]: is longer than 512 bytes"),
        (["é" * 257], "requirements[0]: is longer than 512 bytes"),  # bytes, not characters
        (["a"] * 65, "requirements: 65 requirements; at most 64"),
    ],
)
def test_a_bad_requirement_is_refused_naming_it(asked: list[object], says: str) -> None:
    with pytest.raises(InvalidField) as refused:
        limits.check_requirements(asked, "python")
    assert str(refused.value).startswith(says), str(refused.value)
    assert "\n" not in str(refused.value)  # the parser's first line only


def test_a_requirement_that_does_not_parse_is_told_in_the_parsers_words() -> None:
    with pytest.raises(InvalidField) as refused:
        limits.check_requirements(["pandas>>2"], "python")
    reason = str(refused.value).split("is not a PEP 508 requirement: ", 1)[1]
    assert reason.startswith("Expected ")  # packaging's first line, not its caret lines


def test_the_limits_themselves_are_taken() -> None:
    assert len(limits.check_requirements(["a"] * 64, "python")) == 64
    assert limits.check_requirements(["a" * 512], "python") == ("a" * 512,)


def test_requirements_are_for_a_python_runtime_only() -> None:
    with pytest.raises(InvalidField) as refused:
        limits.check_requirements(["pandas"], "bash")
    assert str(refused.value) == "requirements: the bash runtime takes no Python packages"
    with pytest.raises(InvalidField, match=r"^packages: "):
        limits.check_requirements(["pandas"], "bash", field="packages")


def test_a_requirements_file_is_its_lines_without_comments_or_blanks() -> None:
    text = "# pinned\n\npandas>=2.2  # the newest\n  pyarrow\n#gone\n-r other.txt\nx #y #z\n"
    assert limits.requirements_in(text) == ["pandas>=2.2", "pyarrow", "-r other.txt", "x"]
    assert limits.requirements_in("a#b\n") == ["a#b"]  # a # not after a space is the line's
    assert limits.requirements_in("") == []
