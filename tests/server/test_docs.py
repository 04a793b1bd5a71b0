"""docs/compatibility.md lists every request field the server knows, in the section of its endpoint:
a field added to a schema without a line on that page fails here."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from specfleet.server.schemas import (ChatCompletionRequest, ChatMessage, CompletionRequest, FunctionCall, FunctionDef,
                                      JsonSchemaFormat, MessageToolCall, NamedFunction, NamedToolChoice, ResponseFormat,
                                      StreamOptions, StructuredOutputs, ToolDef)

DOC = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"


def section(title: str, level: int = 2) -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index(f"\n{'#' * level} {title}\n")
    after = re.search(r"\n#{1,%d} " % level, text[start + 1:])  # the next heading of this level or above
    return text[start:start + 1 + after.start() if after else len(text)]


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


def test_every_tool_schema_field_is_documented():
    have = listed(section("Tool schemas", 3))
    want = set().union(*(schema.known_fields() for schema in (ToolDef, FunctionDef, MessageToolCall, FunctionCall,
                                                             NamedToolChoice, NamedFunction)))
    assert have == want, f"{DOC.name}'s Tool schemas table: missing {sorted(want - have)}, extra {sorted(have - want)}"


def test_every_structured_output_field_is_documented():
    have = listed(section("Structured output schemas", 3))
    want = set().union(*(schema.known_fields() for schema in (ResponseFormat, JsonSchemaFormat, StructuredOutputs)))
    assert have == want, f"{DOC.name}'s Structured output schemas table: missing {sorted(want - have)}, extra " \
                         f"{sorted(have - want)}"
