"""tools/check_names.py (``make lint``): a name in backticks that points at nothing is found;
what is not one of ours is left alone."""

from __future__ import annotations

from pathlib import Path

from tools.check_names import check

WIRE = "GRPC_STATUS = {}\n\n\ndef status_name(exc):\n    return None\n"
RUNNER = (
    "class Runner:\n"
    "    limit = 1\n\n"
    "    def __init__(self):\n        self.steps = []\n\n"
    "    def run(self):\n        pass\n"
)


def tree(root: Path, doc: str) -> Path:
    (root / "runtime_server" / "krm").mkdir(parents=True)
    (root / "runtime_server" / "__init__.py").write_text("")
    (root / "runtime_server" / "wire.py").write_text(WIRE)
    (root / "runtime_server" / "krm" / "pipeline.py").write_text(RUNNER)
    (root / "docs").mkdir()
    (root / "docs" / "a.md").write_text(doc)
    return root


def test_names_that_exist_pass(tmp_path: Path) -> None:
    doc = (
        "`wire.GRPC_STATUS`, `runtime_server.wire.status_name`, `pipeline.Runner.run`,\n"
        "`Runner.steps`, `Runner.limit`, `krm/pipeline.py`, `krm/pipeline.py: Runner.run`\n"
    )
    assert check(tree(tmp_path, doc)) == []


def test_what_is_not_ours_is_left_alone(tmp_path: Path) -> None:
    doc = "`spec.runtime`, `runs.db`, `handler.py`, `kpt.dev/v1`, `config.kubernetes.io/index`\n"
    assert check(tree(tmp_path, doc)) == []


def test_each_kind_of_dangling_name_is_found(tmp_path: Path) -> None:
    doc = (
        "`wire.HTTP_TABLE`\n"
        "`Runner._exec`\n"
        "`krm/pipeline.py: write_package`\n"
        "`krm/chain.py`\n"
        "``launch.status_name``\n"
    )
    found = check(tree(tmp_path, doc))
    assert [line.split(":")[1] for line in found] == ["1", "2", "3", "4", "5"], found
    assert "defines no HTTP_TABLE" in found[0]
    assert "Runner in runtime_server/krm/pipeline.py has no _exec" in found[1]
    assert "no file krm/chain.py" in found[3]
    assert "no module launch (status_name is in runtime_server/wire.py)" in found[4]
