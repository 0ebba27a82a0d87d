"""What the docs list of a data structure is what the code has (docs/protocol.md)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

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


# A citation of our docs: the file, then the section's name in quotes, which a comment may wrap
# onto its next line.
_CITATION = re.compile(r'\b(docs/\w+\.md|README\.md),?\s+"([^"\n]+(?:\n\s*#?\s*[^"\n]+)?)"')


def _sections(doc: Path) -> set[str]:
    """What a citation of `doc` may name: its headings and its paragraphs' bold run-in titles
    (``**Pages written again.** ...``)."""
    text = doc.read_text()
    names = {re.sub(r"^#+\s*", "", line) for line in text.splitlines() if line.startswith("#")}
    names |= {title.rstrip(".:") for title in re.findall(r"\*\*([^*]+)\*\*", text)}
    return {" ".join(name.split()) for name in names}


def test_every_citation_of_our_docs_names_a_section_they_have() -> None:
    # The code cites our own docs by section (`docs/protocol.md, "Batches"`): a section renamed,
    # or a sentence quoted from elsewhere, leaves the reader nowhere.
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    sections: dict[str, set[str]] = {}
    dangling = []
    for name in tracked:
        path = ROOT / name
        if name.startswith("src/") or path.is_symlink() or path.suffix in (".png", ".svg"):
            continue
        text = path.read_text()
        for found in _CITATION.finditer(text):
            doc, section = found.group(1), " ".join(re.sub(r"\n\s*#", " ", found.group(2)).split())
            if doc not in sections:
                sections[doc] = _sections(ROOT / doc) if (ROOT / doc).is_file() else set()
            if section not in sections[doc]:
                line = text.count("\n", 0, found.start()) + 1
                dangling.append(f"{name}:{line}: {doc}, {section!r}")
    assert not dangling, "\n".join(dangling)
