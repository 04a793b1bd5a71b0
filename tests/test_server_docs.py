"""docs/compatibility.md lists every request field the server knows, in the section of its endpoint:
a field added to a schema without a line on that page fails here."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from specfleet.server.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, StreamOptions

DOC = Path(__file__).resolve().parent.parent / "docs" / "compatibility.md"


def section(title: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def listed(text: str) -> set[str]:
    """Field names in backticks in the first column of the tables in `text`."""
    first_cells = [line.split("|")[1] for line in text.splitlines() if line.startswith("| `")]
    return {name for cell in first_cells for name in re.findall(r"`([a-z_]+)`", cell)}


@pytest.mark.parametrize("title,schemas", [
    ("`/v1/chat/completions`", [ChatCompletionRequest, ChatMessage, StreamOptions]),
    ("`/v1/completions`", [CompletionRequest]),
])
def test_every_known_field_is_documented(title, schemas):
    have = listed(section(title))
    want = set().union(*(schema.known_fields() for schema in schemas))
    assert not want - have, f"fields missing from the {title} section of {DOC.name}: {sorted(want - have)}"
    assert not have - want, f"{DOC.name} lists fields the server does not know: {sorted(have - want)}"
