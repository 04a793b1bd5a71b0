"""Tool calling: the model's tool-call text -> OpenAI `tool_calls`.

The prompt is the model's own chat template rendered with the request's `tools` (transformers'
`apply_chat_template(tools=...)`); what the model writes back is parsed here. The one syntax known
so far is the Hermes / Qwen2.5 one, which any template that mentions `<tool_call>` teaches:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call (a block may also hold a JSON list of calls). Text before the first block is the
message's content. Small models often drop the tags (Qwen2.5-Coder-0.5B answers "weather in Paris?"
with a bare `{"name": "get_weather", "arguments": {"city": "Paris"}}`): a message that is nothing but
such a call (or a JSON list of them), naming one of the request's tools, is taken as a call too. With
`tool_choice: "auto"` what the model writes is taken as it is: a block that is not a JSON call leaves the
whole text as content. `tool_choice: "required"` or a named function are enforced by a grammar
(`forced_call_grammar`): the reply is one call block (several with parallel_tool_calls) in exactly the
syntax above, naming one of the allowed tools, with arguments that follow its `parameters` schema.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from specfleet.runtime.sample.structured import COMPACT_JSON, close_objects, lark_string
from specfleet.sampling_params import StructuredOutputsParams

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)(?:" + re.escape(TOOL_CALL_END) + r"|$)", re.S)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:  # stream deltas name their call by index
            out = {"index": index, **out}
        return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def parser_for(template: str | None) -> str | None:
    """The tool-call syntax a chat template teaches, if the server can parse it."""
    return "hermes" if template and TOOL_CALL_START in template else None


def parse_tool_calls(text: str, tool_names: frozenset[str] = frozenset()) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) from a finished message. Without a well-formed call the text is all content.
    A last block the model did not close (it stopped at EOS right after the JSON) still counts; so does
    a message that is only a bare call to one of `tool_names` (see the module docstring). A last block
    cut off before its JSON ended (max_tokens) does not undo the complete calls before it: they are
    returned, and only the cut block's text becomes content (after the text before the first call)."""
    lead, calls, tail = split_tool_calls(text, tool_names)
    if not calls:
        return text, []
    content = "\n".join(part for part in (lead, tail) if part)
    return content or None, calls


def split_tool_calls(text: str, tool_names: frozenset[str] = frozenset()) -> tuple[str, list[ToolCall], str]:
    """(the content before the first call, the complete calls, the text of a last call cut off), both texts
    stripped; no calls means the message is all content."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        bare = _bare_calls(text, tool_names)
        return ("", bare, "") if bare else (text, [], "")
    calls: list[ToolCall] = []
    blocks = list(_BLOCK.finditer(text, start))
    for k, block in enumerate(blocks):
        body = block.group(1).strip()
        closed = block.group(0).endswith(TOOL_CALL_END)
        try:
            obj = json.loads(body)
        except ValueError:
            if k == len(blocks) - 1 and not closed and calls:  # the cut tail of a reply with complete calls
                return text[:start].strip(), calls, text[block.start():].strip()
            return text, [], ""
        for call in obj if isinstance(obj, list) else [obj]:
            parsed = _call(call)
            if parsed is None:
                return text, [], ""
            calls.append(parsed)
    if not calls:
        return text, [], ""
    return text[:start].strip(), calls, ""


def _bare_calls(text: str, tool_names: frozenset[str]) -> list[ToolCall]:
    """The calls a message holds when it is nothing but a call object or a list of them, each exactly
    {"name": one of the tools, "arguments" (or "parameters"): {...}}; else none."""
    if not tool_names or text.strip()[:1] not in ("{", "["):
        return []
    try:
        obj = json.loads(text)
    except ValueError:
        return []
    calls = []
    for item in obj if isinstance(obj, list) and obj else [obj]:
        if not isinstance(item, dict) or item.get("name") not in tool_names or \
                set(item) not in ({"name", "arguments"}, {"name", "parameters"}):
            return []
        parsed = _call(item)
        if parsed is None:
            return []
        calls.append(parsed)
    return calls


def may_be_bare_call(text: str) -> bool:
    """Whether a message that begins with `text` could still turn out to be a bare call (a stream holds
    its content back until the end)."""
    return text.strip()[:1] in ("", "{", "[")


def _call(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def tool_call_prefix_len(text: str) -> int:
    """How many trailing characters of `text` could be the start of a `<tool_call>` tag (held back
    while streaming, since content that turns into a call cannot be taken back)."""
    for k in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_CALL_START[:k]):
            return k
    return 0


def forced_call_grammar(tool_defs: list[dict[str, Any]], parallel: bool,
                        literal: Callable[[str], str] = lark_string) -> StructuredOutputsParams:
    """A Lark grammar (llguidance's) for a reply that calls one of `tool_defs` (OpenAI tool objects):

        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Paris"}}
        </tool_call>

    with `parallel`, one or more such blocks, one per line, at most one per tool given. The tags are written by `literal` (the grammar
    compiler's, GrammarCompiler.literal), so a tokenizer that has them as single tokens (Qwen2.5) must
    write those tokens; the arguments follow the
    tool's `parameters` JSON schema (any object without one; no keys beyond its `properties` unless it
    allows them, runtime/grammar.close_objects), laid out as json.dumps lays it out."""
    calls = []
    rules = []
    for i, tool in enumerate(tool_defs):
        fn = tool["function"]
        schema = close_objects(fn.get("parameters") or {"type": "object"})
        schema["x-guidance"] = {**COMPACT_JSON, "lenient": True}
        head = "\n{\"name\": " + json.dumps(fn["name"], ensure_ascii=False) + ", \"arguments\": "
        calls.append(f"call_{i}")
        rules.append(f"call_{i}: {literal(TOOL_CALL_START)} {lark_string(head)} args_{i} "
                     f"{lark_string('}' + chr(10))} {literal(TOOL_CALL_END)}")
        rules.append(f"args_{i}: %json " + json.dumps(schema, ensure_ascii=False))
    call = "call: " + " | ".join(calls)
    # at most one call per tool offered (as many as were asked for), never an unbounded run of calls
    most = len(tool_defs)
    start = f"start: call (\"\\n\" call){{0,{most - 1}}}" if parallel and most > 1 else "start: call"
    return StructuredOutputsParams(grammar="\n".join([start, call, *rules]))
