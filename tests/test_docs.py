"""What the docs list of a data structure is what the code has (docs/protocol.md)."""

from __future__ import annotations

import dataclasses
import re

from fnkernel.runtime_server.lifecycle.runs import Run, RunSpec, RunStatus
from tests.support import ROOT


def test_the_runs_fields_in_the_protocol_are_the_dataclasss() -> None:
    # docs/protocol.md, "Runs": the identity, the spec and the status, each a `{...}` list.
    text = (ROOT / "docs" / "protocol.md").read_text()
    start = text.index("A Run is what users create")
    sentence = " ".join(text[start : text.index("kept in the Run store", start)].split())
    lists = [
        [name.strip() for name in group.split(",")]
        for group in re.findall(r"`\{([^}]*)\}`", sentence)
    ]
    assert len(lists) == 3, sentence
    identity, spec, status = lists
    parts = {"spec": RunSpec, "status": RunStatus}
    assert sorted(identity) == sorted(
        f.name for f in dataclasses.fields(Run) if f.name not in parts
    )
    assert spec == [f.name for f in dataclasses.fields(RunSpec)]
    assert status == [f.name for f in dataclasses.fields(RunStatus)]
