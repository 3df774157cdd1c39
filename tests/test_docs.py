"""CPU tier: the README, docs/ and bench/ notes stand alone: every link they make resolves
inside the repository, and they speak to users, not of the project's tracker or machines."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT

DOCS = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("bench/*.md")])
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# Talk that means nothing to a reader of the repository alone.
FOREIGN = re.compile(r"\.\./shared/|(?-i:DESIGN\.md)|issues? #\d|#\d\b|\blent\b|\bstop \d", re.I)


def test_the_docs_exist():
    assert ROOT / "docs" / "design.md" in DOCS and len(DOCS) >= 6


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve_inside_the_repository(path):
    for target in LINK.findall(path.read_text()):
        if "://" in target:
            continue
        resolved = (path.parent / target).resolve()
        assert resolved.is_relative_to(ROOT) and resolved.exists(), f"{path.name}: {target}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_references_outside_the_repository(path):
    found = [
        f"{path.name}:{n}: {line.strip()}"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if FOREIGN.search(line)
    ]
    assert not found, "\n".join(found)
