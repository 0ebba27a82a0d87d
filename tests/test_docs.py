"""What the docs list of a data structure is what the code has (docs/protocol.md)."""

from __future__ import annotations

import dataclasses
import re

from fnkernel.runtime_server.lifecycle.runs import Run
from tests.support import ROOT


def test_the_runs_fields_in_the_protocol_are_the_dataclasss() -> None:
    # docs/protocol.md, "Runs": the spec, the status and the bookkeeping, each a `{...}` list.
    text = (ROOT / "docs" / "protocol.md").read_text()
    start = text.index("A Run is what users create")
    sentence = " ".join(text[start : text.index("kept in the Run store", start)].split())
    lists = [
        [name.strip() for name in group.split(",")]
        for group in re.findall(r"`\{([^}]*)\}`", sentence)
    ]
    assert len(lists) == 3, sentence
    listed = [name for names in lists for name in names]
    assert len(listed) == len(set(listed)), listed  # each in one list only
    assert sorted(listed) == sorted(field.name for field in dataclasses.fields(Run))
