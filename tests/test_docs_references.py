"""Code cites the docs as `docs/<file>.md, "Section title"`; every such section must exist as a heading of that
file, or the citation sends its reader nowhere.

A citation may break across two lines of a comment or a docstring, and may name several sections
(`"Quantization" and "GGUF weight-only quantization"`). A cited title matches a heading of any level that is the
same text, markdown's backticks and links aside, or that starts with it and goes on after punctuation: "Network
policy" finds "Network policy: who may reach an engine", "Routing" does not find "Routing policies"."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CODE_TREES = ("workers", "operator", "bench", "tests")

# docs/<file>.md, then a quoted title that may break once onto the next line, then any `and "<title>"`.
CITATION = re.compile(r'docs/([a-z-]+\.md),\s*(?:#\s*)?("[^"\n]+(?:\n[^"\n]+)?")((?:\s+and\s+"[^"\n]+")*)')
QUOTED = re.compile(r'"([^"]+)"')
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
CONTINUES = set(":,;.(—–-")


def normal(text: str) -> str:
    """The words of a title: a line break with its indent and comment marker becomes a space, markdown's links
    keep their text, backticks go."""
    text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)
    text = LINK.sub(r"\1", text).replace("`", "")
    return " ".join(text.split())


def citations() -> list[tuple[str, str, str]]:
    """(where, docs file, title) for every citation in the code trees' *.py files."""
    found = []
    for tree in CODE_TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            for m in CITATION.finditer(text):
                where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
                for title in QUOTED.findall(m.group(2) + m.group(3)):
                    found.append((where, m.group(1), normal(title)))
    return found


@cache
def headings(doc: str) -> tuple[str, ...]:
    """The headings of docs/<doc>, outside fenced code blocks."""
    out, fenced = [], False
    for line in (ROOT / "docs" / doc).read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            out.append(normal(m.group(1)))
    return tuple(out)


def names(title: str, heading: str) -> bool:
    if heading == title:
        return True
    rest = heading[len(title):].lstrip() if heading.startswith(title) else ""
    return rest[:1] in CONTINUES and rest != ""


CITED = citations()


def test_the_citations_are_found() -> None:
    # A pattern that stopped matching would pass every citation by finding none.
    assert len(CITED) >= 40, CITED


@pytest.mark.parametrize(("where", "doc", "title"), CITED, ids=[f"{w} {t}" for w, _, t in CITED])
def test_a_cited_section_is_a_heading(where: str, doc: str, title: str) -> None:
    assert (ROOT / "docs" / doc).is_file(), f"{where} cites docs/{doc}, which does not exist"
    assert any(names(title, h) for h in headings(doc)), (
        f'{where} cites docs/{doc}, "{title}", and no heading there is or begins with it: {headings(doc)}')
